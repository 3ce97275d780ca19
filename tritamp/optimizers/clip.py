"""Gradient clipping over many tensors without a host sync."""
import math
import operator
import types
import warnings

import torch

from tritamp.kernels.axpby import multi_tensor_scale_launch, multi_tensor_scale_prepare
from tritamp.kernels.engine import (KeptByLayout, SharedMemoryError, borrowed, list_layout,
                                    refuse_shared_rows, row_labels)
from tritamp.kernels.l2norm import multi_tensor_l2norm_launch, multi_tensor_l2norm_prepare
from tritamp.sharding import ShardReduce, any_dtensor, locals_of

_SWEPT = {torch.float32, torch.float16, torch.bfloat16}
_dtype_of = operator.attrgetter("dtype")

# The norm and scale sweeps of the last gradient lists clipped, by layout (the path that
# runs them included: a test may force the CPU path).
_KEPT = KeptByLayout(4)


def _refuse_shared_grads(parameters, grads):
    """Refuse gradients that share memory (one gradient given to two parameters, say):
    each would be scaled once per parameter, and counted twice in the norm. The
    parameters are named by their place in ``parameters``."""
    labels = [f"parameters[{i}]" for i, p in enumerate(parameters) if p.grad is not None]
    # (no memory to share: sparse gradients, which torch's clipping takes, and meta ones)
    grads = [g if g.layout == torch.strided and not g.is_meta else None for g in grads]
    with row_labels(labels):
        refuse_shared_rows("clip_grad_norm_", [("gradients", grads, True)])


def _sweeps(parameters, grads):
    """The norm and scale sweeps over ``grads``, prepared once per list layout and kept
    (borrowed: no gradient kept alive between calls). When only the addresses changed
    (new gradient tensors each step: on a CPU always, on a GPU whose allocator hands out
    other blocks), the kept sweeps take the new ones instead of being validated and
    planned again (a rebind to gradients that share memory prepares again, and is
    refused here)."""
    addresses, layout, triton = list_layout(grads, op="clip_grad_norm_")

    def prepare():
        lent = borrowed(grads)
        try:
            return multi_tensor_l2norm_prepare(lent), multi_tensor_scale_prepare(lent, lent)
        except SharedMemoryError:
            _refuse_shared_grads(parameters, grads)  # (the refusal in the caller's names)
            raise

    def rebind(kept, addresses):
        norm, scale = kept  # (scale: grads * coef into grads)
        engine = scale.prepared
        return (norm.rebindable and norm.rebind("tensors", grads, addresses=addresses)
                and engine.rebindable and not scale.layouts.reads
                and not scale.layouts.writeback
                and engine.rebind("outs", grads, "xs", addresses=addresses))

    return _KEPT.get(addresses, layout, triton, prepare, rebind)


def _release(norm, scale):
    """The CPU path's sweeps drop this call's gradients (the Triton path's hold none)."""
    if not norm.triton:
        norm.release("tensors")
        scale.prepared.release("outs")
        scale.prepared.release("xs")


def _check_max_norm(max_norm, device):
    if isinstance(max_norm, torch.Tensor) and (
            max_norm.numel() != 1 or max_norm.is_complex() or max_norm.device != device):
        raise ValueError(f"clip_grad_norm_: max_norm is a {max_norm.dtype} tensor of shape "
                         f"{tuple(max_norm.shape)} on {max_norm.device}; give a number, or "
                         f"one real element on the gradients' device ({device})")


def _clip_sharded(parameters, grads, max_norm, norm_type, error_if_nonfinite):
    """A p-norm (p > 0, or inf) clip of sharded gradients, ``error_if_nonfinite`` as torch
    checks it: each rank's shards give a local sum of p-th powers (a maximum for inf),
    reduced over the shard groups, so a rank whose shards are empty contributes nothing
    (torch's foreach norm refused an empty shard on that rank alone, and the other ranks
    waited in their all-reduce for ever). The norm is computed in float32 (float64 when a
    gradient is), as the L2 sweeps compute; the clip coefficient is torch's."""
    reduce = ShardReduce.for_params(grads, "clip_grad_norm_")
    shards = locals_of(grads)
    _refuse_shared_grads(parameters, shards)
    wide = torch.float64 if any(g.dtype == torch.float64 for g in shards) else torch.float32
    device = shards[0].device
    _check_max_norm(max_norm, device)
    held = [g for g in shards if g.numel()]
    norms = [n.to(wide) for n in torch._foreach_norm(held, norm_type)] if held else []
    local = torch.zeros((1,), dtype=wide, device=device)
    if norm_type == math.inf:
        if norms:
            local = torch.stack(norms).max().reshape(1)
        total = (reduce.reduce_(local, "max") if reduce is not None else local).reshape(())
    else:
        if norms:
            local = torch.stack(norms).pow(norm_type).sum().reshape(1)
        total = (reduce.reduce_(local, "sum") if reduce is not None else local)
        total = total.reshape(()).pow(1.0 / norm_type)
    if error_if_nonfinite and (total.isnan() or total.isinf()):  # (one read, as torch's)
        raise RuntimeError(
            f"The total norm of order {norm_type} for gradients from `parameters` is "
            "non-finite, so it cannot be clipped. To disable this error and scale the "
            "gradients by the non-finite norm anyway, set `error_if_nonfinite=False`")
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    by_dtype = {}
    for g in held:
        by_dtype.setdefault(g.dtype, []).append(g)
    for same in by_dtype.values():  # (the coefficient in the norm's dtype, as torch's)
        torch._foreach_mul_(same, coef)
    return total


@torch.no_grad()
def clip_grad_norm_(parameters, max_norm, norm_type=2.0, error_if_nonfinite=False,
                    foreach=None):
    """``torch.nn.utils.clip_grad_norm_`` for the L2 norm on tritamp's multi-tensor kernels.

    One l2-norm launch and one scale launch per dtype group, the clip coefficient
    ``min(1, max_norm / (norm + 1e-6))`` computed and applied on the device: nothing is
    read back to the host. Returns the total norm as a 0-d device tensor. Use it on
    ``amp.master_params(optimizer)`` after ``scale_loss`` exits. ``parameters`` may be
    any iterable (a generator is read once). Other norm types, ``error_if_nonfinite=True``
    (which must read the norm) and float64 gradients go to torch's implementation, with
    ``foreach``; the kernels' sweeps are multi-tensor whatever ``foreach`` says (sharded
    gradients excepted: see below).

    Sharded gradients (DTensors, FSDP2's ``fully_shard``): each rank's shards are
    clipped by the norm of the whole gradients, their local norms summed over the shard
    group (one all-reduce, no host sync); every gradient must then be a DTensor on one
    mesh. Other p-norms (p > 0, inf) and ``error_if_nonfinite`` are reduced the same way
    (:func:`_clip_sharded`), not by torch's implementation, which fails on a rank whose
    shard is empty while the others wait.
    """
    # (a list: a generator such as amp.master_params(...) is read here and may still
    # have to be handed to torch's implementation below)
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    else:
        generator = isinstance(parameters, types.GeneratorType)
        parameters = list(parameters)
        if generator and not parameters:  # (torch's warning)
            warnings.warn("`parameters` is an empty generator, no gradient clipping will "
                          "occur.", stacklevel=2)
    if not isinstance(max_norm, torch.Tensor):
        max_norm = float(max_norm)  # as torch's (a string of a number; None refused)
    grads = [p.grad for p in parameters if p.grad is not None]
    if float(norm_type) != 2.0 or error_if_nonfinite \
            or not set(map(_dtype_of, grads)) <= _SWEPT:
        p = float(norm_type)
        if any_dtensor(grads) and (p > 0 or p == math.inf):
            return _clip_sharded(parameters, grads, max_norm, p, error_if_nonfinite)
        # (float64 gradients: the sweeps compute in float32.) torch's would scale a
        # gradient shared by two parameters twice: refused as the sweeps refuse it.
        _refuse_shared_grads(parameters, locals_of(grads))
        return torch.nn.utils.clip_grad_norm_(parameters, max_norm, norm_type,
                                              error_if_nonfinite=error_if_nonfinite,
                                              foreach=foreach)
    if not grads:
        return torch.tensor(0.0)
    if len({g.device for g in grads}) > 1:
        raise ValueError("clip_grad_norm_: gradients on several devices; clip each device's "
                         "parameters separately, or use torch.nn.utils.clip_grad_norm_")
    _check_max_norm(max_norm, grads[0].device)
    reduce = ShardReduce.for_params(grads, "clip_grad_norm_")  # None: nothing to reduce
    grads = locals_of(grads)  # (a DTensor's local tensor: in place, its shard is clipped)
    norm, scale = _sweeps(parameters, grads)
    try:
        total, _ = multi_tensor_l2norm_launch(norm)
        if reduce is not None:
            total = reduce.norm(total)
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        multi_tensor_scale_launch(scale, coef, None)
    finally:
        _release(norm, scale)
    return total
