"""Model conversion and process groups for SyncBatchNorm (Apex's helpers)."""
import torch
import torch.distributed as dist
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.instancenorm import _InstanceNorm

from .sync_batchnorm import SyncBatchNorm


def convert_syncbn_model(module, process_group=None, channel_last=False):
    """Replace every ``torch.nn.modules.batchnorm._BatchNorm`` in ``module`` (the module
    itself included) with :class:`SyncBatchNorm`, and return the result.

    Weights and biases are copied (same values, device, dtype and ``requires_grad``); the
    running statistics and ``num_batches_tracked`` are the same tensors; the training flag
    is kept. ``torch.nn.SyncBatchNorm`` layers are converted too; instance norms are left.

    Example::

        model = tritamp.parallel.convert_syncbn_model(model)
    """
    mod = module
    if isinstance(module, _InstanceNorm):
        return module
    if isinstance(module, _BatchNorm):
        mod = SyncBatchNorm(module.num_features, module.eps, module.momentum, module.affine,
                            module.track_running_stats, process_group,
                            channel_last=channel_last)
        if module.affine:
            with torch.no_grad():
                mod.weight = torch.nn.Parameter(module.weight.detach().clone(),
                                                requires_grad=module.weight.requires_grad)
                mod.bias = torch.nn.Parameter(module.bias.detach().clone(),
                                              requires_grad=module.bias.requires_grad)
        mod.running_mean = module.running_mean
        mod.running_var = module.running_var
        mod.num_batches_tracked = module.num_batches_tracked
        mod.train(module.training)
        if hasattr(module, "qconfig"):
            mod.qconfig = module.qconfig
    for name, child in module.named_children():
        mod.add_module(name, convert_syncbn_model(child, process_group=process_group,
                                                  channel_last=channel_last))
    return mod


def create_syncbn_process_group(group_size):
    """Split the world into consecutive groups of ``group_size`` ranks for SyncBatchNorm
    and return the group this rank belongs to (``group_size=0``: ``None``, the whole world).

    Every rank must call it (creating a group is collective). ``group_size`` must divide
    the world size; a group of 1 makes SyncBatchNorm a local BatchNorm.
    """
    if group_size == 0:
        return None
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("create_syncbn_process_group needs torch.distributed initialised: "
                           "call torch.distributed.init_process_group first")
    world_size = dist.get_world_size()
    if group_size < 0 or group_size > world_size or world_size % group_size:
        raise ValueError(f"create_syncbn_process_group: group_size {group_size} must divide the "
                         f"world size {world_size} (or be 0 for the whole world)")
    rank = dist.get_rank()
    group = None
    for first in range(0, world_size, group_size):
        # Every rank creates every group, in the same order: new_group is collective.
        g = dist.new_group(ranks=list(range(first, first + group_size)))
        if first <= rank < first + group_size:
            group = g
    return group
