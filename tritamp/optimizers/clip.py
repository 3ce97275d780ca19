"""Gradient clipping over many tensors without a host sync."""
import collections
import operator

import torch

from tritamp.kernels import use_triton
from tritamp.kernels.axpby import multi_tensor_scale_launch, multi_tensor_scale_prepare
from tritamp.kernels.engine import borrowed, layout_key
from tritamp.kernels.l2norm import multi_tensor_l2norm_launch, multi_tensor_l2norm_prepare
from tritamp.sharding import ShardReduce, locals_of

_KEPT_MAX = 4  # gradient lists whose sweeps are kept (most recently clipped first out last)
_kept = collections.OrderedDict()  # layout -> [addresses, norm sweep, scale sweep]
_shape = operator.attrgetter("shape")
_dtype = operator.attrgetter("dtype")


def _rebound(sweep, grads, addresses):
    """The scale sweep (``grads * coef`` into ``grads``) over this call's gradients."""
    engine = sweep.prepared
    return (engine.rebindable and not sweep.layouts.reads and not sweep.layouts.writeback
            and engine.rebind("outs", grads, "xs", addresses=addresses))


def _sweeps(grads):
    """The norm and scale sweeps over ``grads``, prepared once per list layout and kept
    (borrowed: no gradient kept alive between calls). When only the addresses changed
    (new gradient tensors each step: on a CPU always, on a GPU whose allocator hands out
    other blocks), the kept sweeps take the new ones instead of being validated and
    planned again."""
    addresses, strides = layout_key(grads, op="clip_grad_norm_")
    # (which path runs them is part of it: a test may force the CPU path)
    layout = (strides, tuple(map(_shape, grads)), tuple(map(_dtype, grads)),
              grads[0].device, use_triton(grads[0]))
    kept = _kept.get(layout)
    if kept is not None:
        _kept.move_to_end(layout)
        norm, scale = kept[1], kept[2]
        if kept[0] == addresses and norm.triton:
            return norm, scale  # (the tables hold these addresses)
        if norm.rebindable and norm.rebind("tensors", grads, addresses=addresses) \
                and _rebound(scale, grads, addresses):
            kept[0] = addresses
            return norm, scale
    lent = borrowed(grads)
    norm, scale = multi_tensor_l2norm_prepare(lent), multi_tensor_scale_prepare(lent, lent)
    _kept[layout] = [addresses, norm, scale]
    _kept.move_to_end(layout)
    while len(_kept) > _KEPT_MAX:
        _kept.popitem(last=False)
    return norm, scale


def _release(norm, scale):
    """The CPU path's sweeps drop this call's gradients (the Triton path's hold none)."""
    if not norm.triton:
        norm.release("tensors")
        scale.prepared.release("outs")
        scale.prepared.release("xs")


@torch.no_grad()
def clip_grad_norm_(parameters, max_norm, norm_type=2.0, error_if_nonfinite=False):
    """``torch.nn.utils.clip_grad_norm_`` for the L2 norm on tritamp's multi-tensor kernels.

    One l2-norm launch and one scale launch per dtype group, the clip coefficient
    ``min(1, max_norm / (norm + 1e-6))`` computed and applied on the device: nothing is
    read back to the host. Returns the total norm as a 0-d device tensor. Use it on
    ``amp.master_params(optimizer)`` after ``scale_loss`` exits. Other norm types, and
    ``error_if_nonfinite=True`` (which must read the norm), go to torch's implementation.

    Sharded gradients (DTensors, FSDP2's ``fully_shard``): each rank's shards are
    clipped by the norm of the whole gradients, their local norms summed over the shard
    group (one all-reduce, no host sync); every gradient must then be a DTensor on one
    mesh.
    """
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    grads = [p.grad for p in parameters if p.grad is not None]
    if float(norm_type) != 2.0 or error_if_nonfinite:
        return torch.nn.utils.clip_grad_norm_(parameters, max_norm, norm_type,
                                              error_if_nonfinite=error_if_nonfinite)
    if not grads:
        return torch.tensor(0.0)
    if len({g.device for g in grads}) > 1:
        raise ValueError("clip_grad_norm_: gradients on several devices; clip each device's "
                         "parameters separately, or use torch.nn.utils.clip_grad_norm_")
    reduce = ShardReduce.for_params(grads, "clip_grad_norm_")  # None: nothing to reduce
    grads = locals_of(grads)  # (a DTensor's local tensor: in place, its shard is clipped)
    norm, scale = _sweeps(grads)
    try:
        total, _ = multi_tensor_l2norm_launch(norm)
        if reduce is not None:
            total = reduce.norm(total)
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        multi_tensor_scale_launch(scale, coef, None)
    finally:
        _release(norm, scale)
    return total
