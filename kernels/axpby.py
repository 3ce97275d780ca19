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

Both go through one sweep (``AXPBY``; scale is axpby without y). The output is each
row's layout anchor; an input laid out otherwise (column-major, expanded) is read
through a dense copy in the output's layout, refreshed at every launch; an output that
is a strided view is written through a dense copy and copied back; one that overlaps
itself is refused. :func:`multi_tensor_scale_prepare` / :func:`multi_tensor_axpby_prepare`
validate and plan once; keep the result while the tensors stay the same and call the
``*_launch`` functions on it.

On the CPU without the interpreter the production path (:func:`multi_tensor_scale_cpu`,
:func:`multi_tensor_axpby_cpu`) runs torch's multi-tensor CPU ops per dtype group with the
reference's arithmetic, so the outputs are bitwise the reference's: each product in fp32
(``torch._amp_foreach_non_finite_check_and_unscale_`` with the coefficient as its factor:
it multiplies in fp32 whatever the tensor's dtype, rounds once, and flags a non-finite
input element, before the multiply), the sum in fp32, one rounding to the output dtype.
"""
import torch
import triton
import triton.language as tl

from ._multi_tensor import Column, Sweep, device_constants, refuse_shared_rows, scalar_arg
from ._tl_utils import column, load_f32, store_cast, sweep_block
from .check_unscale import LayoutPrepared, Layouts, _same_view, check_lists

AXPBY = Sweep("multi_tensor_axpby", [
    Column("outs", "param"),           # the written tensor: the row's layout anchor
    Column("xs", "grad"),
    Column("ys", "grad", optional=True),   # absent: out = a * x (multi_tensor_scale)
])
_O, _X, _Y = (AXPBY.col(n) for n in AXPBY.names)
_ROW = AXPBY.row_width


@triton.jit
def _axpby_sweep_kernel(
    meta_ptr,        # int64 [n_tensors, 4]: the AXPBY columns' addresses, then numel
    blocks_ptr,      # int32 [n_blocks, 2]: tensor index, block index within that tensor
    counters_ptr,    # unused (the sweep has no step column)
    out_proto,       # an output tensor of the group: carries the output element type
    x_proto,         # an x tensor: carries the x element type
    y_proto,         # a y tensor (any tensor without HAS_YS): carries the y type
    a,               # coefficient of x: a float, or a 0-d tensor when A_IS_TENSOR
    b,               # coefficient of y: a float, or a 0-d tensor when B_IS_TENSOR
    flag_ptr,        # int or float scalar: set to 1 when a checked input is inf or NaN
    A_IS_TENSOR: tl.constexpr,
    B_IS_TENSOR: tl.constexpr,
    CHECK_X: tl.constexpr,
    CHECK_Y: tl.constexpr,
    HAS_YS: tl.constexpr,          # off: out = a * x (multi_tensor_scale)
    VEC: tl.constexpr,             # > 1: every address 16-byte aligned, numel % VEC == 0
    EMULATE_BF16_ROUNDING: tl.constexpr,  # interpreter only: see _tl_utils
    BLOCK: tl.constexpr,
):
    tensor, row, offs, mask = sweep_block(meta_ptr, blocks_ptr, flag_ptr, _ROW, False, VEC,
                                          BLOCK)
    # The coefficients first: they are live across the element loads otherwise.
    if A_IS_TENSOR:
        a_v = tl.load(a).to(tl.float32)
    else:
        a_v = a
    if HAS_YS:
        if B_IS_TENSOR:
            b_v = tl.load(b).to(tl.float32)
        else:
            b_v = b
    x = load_f32(column(row, _X, offs, x_proto, VEC), mask, EMULATE_BF16_ROUNDING)
    out = a_v * x
    bad = offs < 0  # all false
    if CHECK_X:
        bad = bad | (x != x) | (tl.abs(x) == float("inf"))
    if HAS_YS:
        y = load_f32(column(row, _Y, offs, y_proto, VEC), mask, EMULATE_BF16_ROUNDING)
        out = out + b_v * y
        if CHECK_Y:
            bad = bad | (y != y) | (tl.abs(y) == float("inf"))
    if CHECK_X or CHECK_Y:
        if tl.max(bad.to(tl.int32), axis=0) > 0:
            # Every writer stores the same value, so the race is benign (as in Apex).
            tl.store(flag_ptr, 1)
    store_cast(column(row, _O, offs, out_proto, VEC), out, mask, EMULATE_BF16_ROUNDING)


def _prepare(op, inputs, outs_name, outs):
    """Validate ``inputs`` ([(name, list or None)]: x first) against ``outs`` and plan
    the sweep (see the module docstring for layouts)."""
    n = check_lists(op, inputs[:1] + [(outs_name, outs)] + inputs[1:])
    if n > 1:  # (the caller's tensors: what is swept below may be stand-ins)
        refuse_shared_rows(op, [(outs_name, outs, True)]
                           + [(name, col, False) for name, col in inputs])
    layouts = Layouts()
    cols = {"outs": [], "xs": [], "ys": None if len(inputs) < 2 else []}
    for i in range(n):
        w = outs[i]
        reads = [col[i] for _, col in inputs]
        in_place = any(_same_view(w, t) for t in reads)
        anchor = layouts.anchor(op, outs_name, i, w, in_place)
        cols["outs"].append(anchor)
        cols["xs"].append(layouts.source(reads[0], w, anchor))
        if cols["ys"] is not None:
            cols["ys"].append(layouts.source(reads[1], w, anchor))
    prepared = AXPBY.prepare(cols)
    prepared.written = frozenset(("outs",))  # (what a rebind must keep apart)
    lists = {name: col for name, col in inputs}
    lists[outs_name] = outs
    return LayoutPrepared(prepared, lists, layouts, dict(op=op, has_y=len(inputs) > 1))


def _check_flag(op, noop_flag, device):
    if noop_flag is None:
        return
    if not isinstance(noop_flag, torch.Tensor) or noop_flag.numel() != 1 \
            or noop_flag.device != device:
        raise ValueError(f"{op}: noop_flag must be a one-element tensor on {device} (Apex "
                         "passes torch.zeros(1, dtype=torch.int, device=...))")
    if noop_flag.is_complex():
        raise ValueError(f"{op}: noop_flag must be an int or float tensor")


def _launch(prepared, a, b, noop_flag, check_x, check_y):
    device = prepared.device
    op = prepared.options["op"]
    a = scalar_arg(a, "a" if op.endswith("axpby") else "scale", device)
    b = scalar_arg(b, "b", device)
    _check_flag(op, noop_flag, device)
    if not prepared.triton:
        return False
    anchor = prepared.anchor
    has_y = prepared.options["has_y"]
    check_x = check_x and noop_flag is not None
    check_y = check_y and noop_flag is not None and has_y
    prepared.launch(_axpby_sweep_kernel, (
        a, b, noop_flag if noop_flag is not None else anchor), dict(
        A_IS_TENSOR=isinstance(a, torch.Tensor), B_IS_TENSOR=isinstance(b, torch.Tensor),
        CHECK_X=check_x, CHECK_Y=check_y))
    return True


def multi_tensor_scale_prepare(srcs, dsts):
    """Validate and plan ``dst = src * scale`` over these lists (see the module
    docstring); pass the result to :func:`multi_tensor_scale_launch`."""
    return _prepare("multi_tensor_scale", [("srcs", list(srcs))], "dsts", list(dsts))


def multi_tensor_scale_launch(prepared, scale, noop_flag=None):
    """``dst = src * scale`` over a prepared sweep: one launch per dtype group."""
    if prepared.n == 0:
        return
    if not _launch(prepared, scale, 0.0, noop_flag, True, False):
        multi_tensor_scale_cpu(prepared, scale, noop_flag)


@torch.no_grad()
def multi_tensor_scale(srcs, dsts, scale, noop_flag):
    """``dst = src * scale`` for every pair; ``noop_flag`` set to 1 if a source is non-finite.

    One launch per (src dtype, dst dtype) group on CUDA or under the interpreter, the
    torch reference otherwise. ``noop_flag`` may be None (no check)."""
    multi_tensor_scale_launch(multi_tensor_scale_prepare(srcs, dsts), scale, noop_flag)


def _arg_to_check(arg_to_check):
    if arg_to_check not in (-1, 0, 1):
        raise ValueError(f"multi_tensor_axpby: arg_to_check must be -1 (both), 0 (x) or 1 (y), "
                         f"got {arg_to_check}")


def multi_tensor_axpby_prepare(xs, ys, outs):
    """Validate and plan ``out = a * x + b * y`` over these lists (see the module
    docstring); pass the result to :func:`multi_tensor_axpby_launch`."""
    return _prepare("multi_tensor_axpby", [("xs", list(xs)), ("ys", list(ys))], "outs",
                    list(outs))


def multi_tensor_axpby_launch(prepared, a, b, noop_flag=None, arg_to_check=-1):
    """``out = a * x + b * y`` over a prepared sweep: one launch per dtype group."""
    _arg_to_check(arg_to_check)
    if prepared.n == 0:
        return
    if not _launch(prepared, a, b, noop_flag, arg_to_check in (-1, 0), arg_to_check in (-1, 1)):
        multi_tensor_axpby_cpu(prepared, a, b, noop_flag, arg_to_check)


@torch.no_grad()
def multi_tensor_axpby(xs, ys, outs, a, b, noop_flag, arg_to_check=-1):
    """``out = a * x + b * y`` for every triple; ``noop_flag`` set to 1 if a checked input
    (x for 0, y for 1, both for -1) is non-finite. One launch per dtype group."""
    _arg_to_check(arg_to_check)
    multi_tensor_axpby_launch(multi_tensor_axpby_prepare(xs, ys, outs), a, b, noop_flag,
                              arg_to_check)


# --- the production CPU path -------------------------------------------------------------

def _factor(c, device):
    """A coefficient as the one-element fp32 tensor the reference multiplies by."""
    if isinstance(c, torch.Tensor):
        return c.reshape(1).float()
    return device_constants(device, (c,), torch.float32)


class _Flags:
    """Where the CPU path's checks write: ``noop_flag`` itself when it is what torch's
    check takes (a one-element fp32 tensor; set to 1, never cleared), else a fresh fp32
    flag merged into it afterwards. ``ignored`` takes the flag of an unchecked input."""
    __slots__ = ("noop", "checked", "ignored")

    def __init__(self, noop_flag):
        self.noop = noop_flag
        self.ignored = None
        if noop_flag is None:
            self.checked = None
        elif noop_flag.dtype == torch.float32 and noop_flag.is_contiguous():
            self.checked = noop_flag
        else:
            self.checked = torch.zeros(1, dtype=torch.float32, device=noop_flag.device)

    def for_input(self, checked):
        if checked and self.checked is not None:
            return self.checked
        if self.ignored is None:
            self.ignored = torch.zeros(1, dtype=torch.float32, device=(
                self.noop.device if self.noop is not None else None))
        return self.ignored

    def merge(self):
        if self.checked is not None and self.checked is not self.noop:
            self.noop.masked_fill_(self.checked.reshape(()) != 0, 1)


def _scaled(dsts, srcs, factor, flag):
    """dst = fp32(src * factor) rounded once to dst's dtype (dst is src's dtype or fp32,
    so copying src into it is exact); src's inf/NaN set ``flag``."""
    torch._foreach_copy_(dsts, srcs)  # a tensor copied onto itself is left alone
    torch._amp_foreach_non_finite_check_and_unscale_(dsts, flag, factor)


def _exact_into(dst_dtype, src_dtype):
    return dst_dtype == src_dtype or dst_dtype == torch.float32


def multi_tensor_scale_cpu(prepared, scale, noop_flag=None):
    """The production CPU path of :func:`multi_tensor_scale_launch` (see the module
    docstring): per dtype group a copy into the output (or an fp32 scratch where the
    output's dtype cannot hold the source exactly) and one check-and-multiply."""
    s = _factor(scale, prepared.device)
    flags = _Flags(noop_flag)
    flag = flags.for_input(True)
    engine = prepared.prepared

    def group(g):
        outs, xs = g["outs"], g["xs"]
        if _exact_into(outs[0].dtype, xs[0].dtype):
            _scaled(outs, xs, s, flag)
            return
        work = engine.buffers(g, "w", outs)
        _scaled(work, xs, s, flag)
        torch._foreach_copy_(outs, work)

    prepared.layouts.before()
    engine.run_cpu(group)
    prepared.layouts.after()
    flags.merge()


def multi_tensor_axpby_cpu(prepared, a, b, noop_flag=None, arg_to_check=-1):
    """The production CPU path of :func:`multi_tensor_axpby_launch` (see the module
    docstring): per dtype group ``b * y`` into an fp32 scratch (first: the output may be
    ``y``), ``a * x`` into the output when it is fp32 (else an fp32 scratch), one fp32
    add, and a copy to a half output. Unchecked inputs are multiplied all the same."""
    device = prepared.device
    fa, fb = _factor(a, device), _factor(b, device)
    flags = _Flags(noop_flag)
    flag_x = flags.for_input(arg_to_check in (-1, 0))
    flag_y = flags.for_input(arg_to_check in (-1, 1))
    engine = prepared.prepared

    def group(g):
        outs, xs, ys = g["outs"], g["xs"], g["ys"]
        by = engine.buffers(g, "by", outs)
        _scaled(by, ys, fb, flag_y)
        work = outs if outs[0].dtype == torch.float32 else engine.buffers(g, "w", outs)
        _scaled(work, xs, fa, flag_x)
        torch._foreach_add_(work, by)
        if work is not outs:
            torch._foreach_copy_(outs, work)

    prepared.layouts.before()
    engine.run_cpu(group)
    prepared.layouts.after()
    flags.merge()


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
