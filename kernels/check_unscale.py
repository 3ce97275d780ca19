"""Fused non-finite check and unscale over a list of tensors, one launch per dtype group.

``check_unscale(srcs, scale, found_inf, dsts=None, adds=None, write=True)`` does, for
every tensor ``x`` in ``srcs`` and in one launch per (src, dst, addend) dtype group:

    found_inf = 1.0                    if any element of x is inf or NaN  (found_inf given)
    dst = (x * (1 / scale) [+ add])    cast to dst's dtype                (write=True)

``scale`` is a 0-d fp32 device tensor; ``1/scale`` is taken in fp64 and rounded to
fp32, as ``torch.amp.GradScaler`` does, so the unscaled values match torch's
``_amp_foreach_non_finite_check_and_unscale_`` bit for bit. ``scale=None`` copies
(casting) without scaling: the master -> model weight copy. ``dsts`` defaults to
``srcs`` (in place); ``write=False`` only checks (reads each gradient once).
"""
import torch
import triton
import triton.language as tl

from ._dispatch import elementwise_settings, use_triton
from ._multi_tensor import plan
from ._tl_utils import inv_scale, load_f32, store_cast, sweep_block


@triton.jit
def _check_unscale_sweep_kernel(
    meta_ptr,        # int64 [n_tensors, 4]: src address, dst address, addend address, numel
    blocks_ptr,      # int32 [n_blocks, 2]: tensor index, block index within that tensor
    src_proto,       # first source tensor of the group: carries the source element type
    dst_proto,       # first destination tensor: carries the destination element type
    add_proto,       # first addend tensor (or any tensor when HAS_ADD is off)
    scale_ptr,       # fp32 scalar: the loss scale the sources carry
    found_inf_ptr,   # fp32 scalar: set to 1.0 when a source holds inf or NaN
    HAS_SCALE: tl.constexpr,
    CHECK: tl.constexpr,
    WRITE: tl.constexpr,
    HAS_ADD: tl.constexpr,
    EMULATE_BF16_ROUNDING: tl.constexpr,  # interpreter only: see _tl_utils
    BLOCK: tl.constexpr,
):
    tensor, row, offs, mask = sweep_block(meta_ptr, blocks_ptr, meta_ptr, 3, False, BLOCK)
    src = tl.load(row).to(tl.pointer_type(src_proto.dtype.element_ty))
    x = load_f32(src + offs, mask, EMULATE_BF16_ROUNDING)
    if CHECK:
        bad = (x != x) | (tl.abs(x) == float("inf"))
        if tl.sum(bad.to(tl.int32), axis=0) > 0:
            # Every writer stores the same value, so the race is benign.
            tl.store(found_inf_ptr, 1.0)
    if WRITE:
        if HAS_SCALE:
            inv = inv_scale(scale_ptr)
            x = x * inv
        if HAS_ADD:
            add = tl.load(row + 2).to(tl.pointer_type(add_proto.dtype.element_ty))
            x = x + load_f32(add + offs, mask, EMULATE_BF16_ROUNDING)
        dst = tl.load(row + 1).to(tl.pointer_type(dst_proto.dtype.element_ty))
        store_cast(dst + offs, x, mask, EMULATE_BF16_ROUNDING)


def _groups(srcs, dsts, adds):
    """Indices of the tensors grouped by (device, src dtype, dst dtype, addend dtype)."""
    groups = {}
    for i, x in enumerate(srcs):
        if x.numel() == 0:
            continue
        key = (x.device, x.dtype, dsts[i].dtype, None if adds is None else adds[i].dtype)
        groups.setdefault(key, []).append(i)
    return groups


def _dense(t):
    """Non-overlapping and dense: the elements fill ``numel`` slots of storage in some
    order (contiguous, channels-last, a transpose). Elementwise sweeps can then walk the
    storage flat, provided every partner tensor is laid out the same way."""
    if t.is_contiguous():
        return True
    expected = 1
    for stride, size in sorted((st, sz) for sz, st in zip(t.shape, t.stride()) if sz != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def _same_layout(a, b):
    return a.is_contiguous() and b.is_contiguous() or all(
        sa == sb for sa, sb, n in zip(a.stride(), b.stride(), a.shape) if n != 1)


def _validate(srcs, dsts, adds):
    for name, other in (("dsts", dsts), ("adds", adds)):
        if other is not None and len(other) != len(srcs):
            raise ValueError(f"check_unscale: {name} has {len(other)} tensors but srcs has {len(srcs)}")
    for i, x in enumerate(srcs):
        ok = _dense(x)
        for other in (dsts, adds):
            if other is None:
                continue
            if other[i].shape != x.shape or other[i].device != x.device:
                raise ValueError(
                    f"check_unscale: tensor {i} has shape {tuple(x.shape)} on {x.device} but its "
                    f"partner has shape {tuple(other[i].shape)} on {other[i].device}")
            ok = ok and _same_layout(x, other[i])
        if not ok:
            raise ValueError(f"check_unscale: tensor {i} is not contiguous (nor dense in the same "
                             "layout as its partners); call .contiguous() first")


@torch.no_grad()
def check_unscale(srcs, scale=None, found_inf=None, dsts=None, adds=None, write=True):
    """Check ``srcs`` for inf/NaN into ``found_inf`` and write ``srcs * (1/scale) (+ adds)`` to ``dsts``.

    One kernel launch per dtype group on CUDA (or under the interpreter); the torch
    reference otherwise. Nothing is synchronised with the host.
    """
    srcs = list(srcs)
    dsts_l = None if dsts is None else list(dsts)
    adds_l = None if adds is None else list(adds)
    if not srcs:
        return
    _validate(srcs, dsts_l, adds_l)
    if not use_triton(srcs[0]):
        check_unscale_ref(srcs, scale, found_inf, dsts_l, adds_l, write)
        return
    out = srcs if dsts_l is None else dsts_l
    check = found_inf is not None
    for (device, _, _, _), idx in _groups(srcs, out, adds_l).items():
        block, warps = elementwise_settings(device)
        g_src = [srcs[i] for i in idx]
        g_dst = [out[i] for i in idx] if write else None
        g_add = [adds_l[i] for i in idx] if (adds_l is not None and write) else None
        p = plan(g_src, g_dst, g_add, block)
        anchor = g_src[0]
        _check_unscale_sweep_kernel[(p.n_blocks,)](
            p.meta, p.blocks, anchor,
            g_dst[0] if g_dst else anchor,
            g_add[0] if g_add else anchor,
            scale if scale is not None else anchor,
            found_inf if check else anchor,
            HAS_SCALE=scale is not None, CHECK=check, WRITE=write,
            HAS_ADD=g_add is not None, EMULATE_BF16_ROUNDING=not device.type == "cuda",
            BLOCK=block, num_warps=warps,
        )


@torch.no_grad()
def check_unscale_ref(srcs, scale=None, found_inf=None, dsts=None, adds=None, write=True):
    """Torch reference of :func:`check_unscale` (same arithmetic, same rounding)."""
    srcs = list(srcs)
    if not srcs:
        return
    out = srcs if dsts is None else list(dsts)
    inv = None if scale is None else scale.double().reciprocal().float()
    bad = None
    for i, x in enumerate(srcs):
        if x.numel() == 0:
            continue
        if found_inf is not None:
            b = ~torch.isfinite(x).all()
            bad = b if bad is None else bad | b
        if write:
            y = x.float()
            if inv is not None:
                y = y * inv
            if adds is not None:
                y = y + adds[i].float()
            out[i].copy_(y)
    if bad is not None:
        found_inf.copy_(torch.maximum(found_inf, bad.to(found_inf.dtype)))
