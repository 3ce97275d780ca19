"""Model conversion and process groups for SyncBatchNorm (Apex's helpers)."""
import torch
import torch.distributed as dist
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.instancenorm import _InstanceNorm

from .sync_batchnorm import SyncBatchNorm


def convert_syncbn_model(module, process_group=None, channel_last=False):
    """Replace every ``torch.nn.modules.batchnorm._BatchNorm`` in ``module`` (the module
    itself included) with :class:`SyncBatchNorm`, and return the result.

    Weights and biases are copied (same values, device, dtype and ``requires_grad``; a
    BatchNorm built with ``bias=False`` keeps no bias); the running statistics and
    ``num_batches_tracked`` are the same tensors; the training flag is kept.
    ``torch.nn.SyncBatchNorm`` layers are converted too, keeping their own process group
    when ``process_group`` is None; instance norms are left. A layer used in several
    places becomes one SyncBatchNorm in all of them. A layer
    that already is tritamp's :class:`SyncBatchNorm` stays as it is, with its
    ``fuse_relu`` and ``channel_last`` (its process group becomes ``process_group`` when
    one is given). Every replacement is built before the first is put in place: a call
    that fails leaves ``module`` as it was.

    Example::

        model = tritamp.parallel.convert_syncbn_model(model)
    """
    swaps, kept = [], []
    out = _converted(module, process_group, channel_last, swaps, kept, {})
    for parent, name, child in swaps:
        parent.add_module(name, child)
    if process_group is not None:
        for layer in kept:
            layer.process_group = process_group
    return out


def _converted(module, process_group, channel_last, swaps, kept, done):
    """``module``'s replacement (or ``module``). The replacements of its descendants are
    appended to ``swaps`` as ``(parent, name, new child)`` and the SyncBatchNorm layers
    left as they are to ``kept``, for the caller to apply once everything is built.
    ``done`` maps each module already seen (by id) to its replacement: a layer used in
    several places (twice in one Sequential, say) becomes one SyncBatchNorm, and each of
    its places gets it."""
    if id(module) in done:
        return done[id(module)]
    if isinstance(module, _InstanceNorm):
        done[id(module)] = module
        return module
    mod = module
    if isinstance(module, SyncBatchNorm):
        kept.append(module)
    elif isinstance(module, _BatchNorm):
        group = process_group
        if group is None and isinstance(module, torch.nn.SyncBatchNorm):
            group = module.process_group  # (a torch SyncBatchNorm keeps its own group)
        mod = SyncBatchNorm(module.num_features, module.eps, module.momentum, module.affine,
                            module.track_running_stats, group,
                            channel_last=channel_last,
                            bias=not module.affine or module.bias is not None)
        if module.affine:
            mod.weight = _copied(module.weight)
            if module.bias is not None:
                mod.bias = _copied(module.bias)
        mod.running_mean = module.running_mean
        mod.running_var = module.running_var
        mod.num_batches_tracked = module.num_batches_tracked
        mod.train(module.training)
        if hasattr(module, "qconfig"):
            mod.qconfig = module.qconfig
    done[id(module)] = mod
    # every name, not named_children(): it yields a module listed twice under one parent
    # once, and the second place kept the unconverted BatchNorm
    for name, child in list(module._modules.items()):
        if child is None:
            continue
        new = _converted(child, process_group, channel_last, swaps, kept, done)
        if new is not child or mod is not module:
            swaps.append((mod, name, new))
    return mod


def _copied(param):
    with torch.no_grad():
        return torch.nn.Parameter(param.detach().clone(), requires_grad=param.requires_grad)


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
