"""Apex's multi-tensor scale and axpby, one launch per dtype group.

    multi_tensor_scale(srcs, dsts, scale, noop_flag)            dst = src * scale
    multi_tensor_axpby(xs, ys, outs, a, b, noop_flag, arg)      out = a * x + b * y

in fp32 whatever the tensors' dtypes, rounded once to the destination dtype. Apex's
overflow-flag contract: ``noop_flag`` (an int or float device tensor) is set to 1 when a
checked input holds inf or NaN and is never cleared; the outputs are written anyway, so
non-finite values propagate (Apex's kernels do not read the flag either). ``scale``, ``a``
and ``b`` are floats or 0-d device tensors (read on the device: no host sync).
``arg_to_check`` picks what axpby checks: x (0), y (1) or both (-1). As in Apex, only
the inputs are checked: a finite input that overflows once scaled does not set the flag.
"""
import torch
import triton
import triton.language as tl

from ._dispatch import elementwise_settings, use_triton
from ._multi_tensor import plan_columns
from ._tl_utils import load_f32, store_cast, sweep_block
from .check_unscale import _dense, _same_layout


@triton.jit
def _axpby_sweep_kernel(
    meta_ptr,        # int64 [n_tensors, 4]: x, y, out addresses; numel
    blocks_ptr,      # int32 [n_blocks, 2]: tensor index, block index within that tensor
    x_proto,         # first x tensor of the group: carries the x element type
    y_proto,         # first y tensor (any tensor when HAS_Y is off): carries the y type
    out_proto,       # first output tensor: carries the output element type
    a,               # coefficient of x: a float, or a 0-d tensor when A_IS_TENSOR
    b,               # coefficient of y: a float, or a 0-d tensor when B_IS_TENSOR
    flag_ptr,        # int or float scalar: set to 1 when a checked input is inf or NaN
    A_IS_TENSOR: tl.constexpr,
    B_IS_TENSOR: tl.constexpr,
    HAS_Y: tl.constexpr,           # off: out = a * x (multi_tensor_scale)
    CHECK_X: tl.constexpr,
    CHECK_Y: tl.constexpr,
    EMULATE_BF16_ROUNDING: tl.constexpr,  # interpreter only: see _tl_utils
    BLOCK: tl.constexpr,
):
    tensor, row, offs, mask = sweep_block(meta_ptr, blocks_ptr, meta_ptr, 3, False, BLOCK)
    x_ptr = tl.load(row + 0).to(tl.pointer_type(x_proto.dtype.element_ty))
    x = load_f32(x_ptr + offs, mask, EMULATE_BF16_ROUNDING)
    if A_IS_TENSOR:
        a_v = tl.load(a).to(tl.float32)
    else:
        a_v = a
    out = a_v * x
    bad = offs < 0  # all false
    if CHECK_X:
        bad = bad | (x != x) | (tl.abs(x) == float("inf"))
    if HAS_Y:
        y_ptr = tl.load(row + 1).to(tl.pointer_type(y_proto.dtype.element_ty))
        y = load_f32(y_ptr + offs, mask, EMULATE_BF16_ROUNDING)
        if B_IS_TENSOR:
            b_v = tl.load(b).to(tl.float32)
        else:
            b_v = b
        out = out + b_v * y
        if CHECK_Y:
            bad = bad | (y != y) | (tl.abs(y) == float("inf"))
    if CHECK_X or CHECK_Y:
        if tl.sum(bad.to(tl.int32), axis=0) > 0:
            # Every writer stores the same value, so the race is benign (as in Apex).
            tl.store(flag_ptr, 1)
    o_ptr = tl.load(row + 2).to(tl.pointer_type(out_proto.dtype.element_ty))
    store_cast(o_ptr + offs, out, mask, EMULATE_BF16_ROUNDING)


def _validate(name, columns):
    first = columns[0]
    for col in columns[1:]:
        if len(col) != len(first):
            raise ValueError(f"{name}: the tensor lists have lengths "
                             f"{[len(c) for c in columns]}; they must be equal")
    for i, x in enumerate(first):
        ok = _dense(x)
        for col in columns[1:]:
            if col[i].shape != x.shape or col[i].device != x.device:
                raise ValueError(
                    f"{name}: tensor {i} has shape {tuple(x.shape)} on {x.device} but its "
                    f"partner has shape {tuple(col[i].shape)} on {col[i].device}")
            ok = ok and _same_layout(x, col[i])
        if not ok:
            raise ValueError(f"{name}: tensor {i} is not contiguous (nor dense in the same "
                             "layout as its partners); call .contiguous() first")


def _coef(c, name, device):
    if isinstance(c, torch.Tensor):
        if c.numel() != 1:
            raise ValueError(f"{name} must be a float or a one-element tensor, got shape "
                             f"{tuple(c.shape)}")
        if c.device != device:
            raise ValueError(f"{name} is on {c.device} but the tensors are on {device}; "
                             f"pass a float or a tensor on {device}")
        return c.reshape(())
    return float(c)  # an int would be specialised (and a 1 made constexpr) by Triton


def _check_flag(name, noop_flag, device):
    if noop_flag is None:
        return
    if not isinstance(noop_flag, torch.Tensor) or noop_flag.numel() != 1 \
            or noop_flag.device != device:
        raise ValueError(f"{name}: noop_flag must be a one-element tensor on {device} (Apex "
                         "passes torch.zeros(1, dtype=torch.int, device=...))")
    if noop_flag.is_complex():
        raise ValueError(f"{name}: noop_flag must be an int or float tensor")


def _launch(xs, ys, outs, a, b, noop_flag, check_x, check_y):
    groups = {}
    for i, x in enumerate(xs):
        if x.numel() == 0:
            continue
        key = (x.device, x.dtype, None if ys is None else ys[i].dtype, outs[i].dtype)
        groups.setdefault(key, []).append(i)
    a_t, b_t = isinstance(a, torch.Tensor), isinstance(b, torch.Tensor)
    check_x = check_x and noop_flag is not None
    check_y = check_y and noop_flag is not None and ys is not None
    for (device, _, _, _), idx in groups.items():
        block, warps = elementwise_settings(device)
        cols = [[xs[i] for i in idx], None if ys is None else [ys[i] for i in idx],
                [outs[i] for i in idx]]
        pl = plan_columns(cols, block)
        anchor = cols[0][0]
        _axpby_sweep_kernel[(pl.n_blocks,)](
            pl.meta, pl.blocks, anchor, cols[1][0] if cols[1] else anchor, cols[2][0],
            a, b, noop_flag if noop_flag is not None else anchor,
            A_IS_TENSOR=a_t, B_IS_TENSOR=b_t, HAS_Y=ys is not None, CHECK_X=check_x,
            CHECK_Y=check_y, EMULATE_BF16_ROUNDING=device.type != "cuda", BLOCK=block,
            num_warps=warps)


@torch.no_grad()
def multi_tensor_scale(srcs, dsts, scale, noop_flag):
    """``dst = src * scale`` for every pair; ``noop_flag`` set to 1 if a source is non-finite.

    One launch per (device, src dtype, dst dtype) group on CUDA or under the interpreter,
    the torch reference otherwise. ``noop_flag`` may be None (no check)."""
    srcs, dsts = list(srcs), list(dsts)
    if not srcs:
        return
    _validate("multi_tensor_scale", [srcs, dsts])
    scale = _coef(scale, "scale", srcs[0].device)
    _check_flag("multi_tensor_scale", noop_flag, srcs[0].device)
    if not use_triton(srcs[0]):
        multi_tensor_scale_ref(srcs, dsts, scale, noop_flag)
        return
    _launch(srcs, None, dsts, scale, 0.0, noop_flag, True, False)


@torch.no_grad()
def multi_tensor_axpby(xs, ys, outs, a, b, noop_flag, arg_to_check=-1):
    """``out = a * x + b * y`` for every triple; ``noop_flag`` set to 1 if a checked input
    (x for 0, y for 1, both for -1) is non-finite. One launch per dtype group."""
    xs, ys, outs = list(xs), list(ys), list(outs)
    if arg_to_check not in (-1, 0, 1):
        raise ValueError(f"multi_tensor_axpby: arg_to_check must be -1 (both), 0 (x) or 1 (y), "
                         f"got {arg_to_check}")
    if not xs:
        return
    _validate("multi_tensor_axpby", [xs, ys, outs])
    a, b = _coef(a, "a", xs[0].device), _coef(b, "b", xs[0].device)
    _check_flag("multi_tensor_axpby", noop_flag, xs[0].device)
    if not use_triton(xs[0]):
        multi_tensor_axpby_ref(xs, ys, outs, a, b, noop_flag, arg_to_check)
        return
    _launch(xs, ys, outs, a, b, noop_flag, arg_to_check in (-1, 0), arg_to_check in (-1, 1))


def _as_f32(c):
    if isinstance(c, torch.Tensor):
        return c.reshape(()).float()
    return torch.tensor(float(c), dtype=torch.float32)


def _flag(noop_flag, bad):
    if noop_flag is not None and bad is not None:
        noop_flag.masked_fill_(bad.to(noop_flag.device), 1)


def _nonfinite(t):
    return ~torch.isfinite(t).all()


@torch.no_grad()
def multi_tensor_scale_ref(srcs, dsts, scale, noop_flag):
    """Torch reference of :func:`multi_tensor_scale` (fp32 multiply, one rounding)."""
    s = _as_f32(scale)
    bad = None
    for x, out in zip(srcs, dsts):
        if x.numel() == 0:
            continue
        b = _nonfinite(x)
        bad = b if bad is None else bad | b
        out.copy_(s * x.float())
    _flag(noop_flag, bad)


@torch.no_grad()
def multi_tensor_axpby_ref(xs, ys, outs, a, b, noop_flag, arg_to_check=-1):
    """Torch reference of :func:`multi_tensor_axpby` (fp32 arithmetic, one rounding)."""
    a, b = _as_f32(a), _as_f32(b)
    bad = None
    for x, y, out in zip(xs, ys, outs):
        if x.numel() == 0:
            continue
        checks = [t for t, k in ((x, 0), (y, 1)) if arg_to_check in (-1, k)]
        for t in checks:
            nb = _nonfinite(t)
            bad = nb if bad is None else bad | nb
        out.copy_(a * x.float() + b * y.float())
    _flag(noop_flag, bad)
