"""Fused non-finite check and unscale over a list of tensors, one launch per dtype group.

``check_unscale(srcs, scale, found_inf, dsts=None, adds=None, write=True)`` does, for
every tensor ``x`` in ``srcs`` and in one launch per (dst, src, addend) dtype group:

    found_inf = 1.0                    if any element of x (or of add, when written
                                       with adds, unless check_adds=False) is inf or NaN
    dst = (x * (1 / scale) [+ add])    cast to dst's dtype                (write=True)

``scale`` is a 0-d fp32 device tensor; ``1/scale`` is taken in fp64 and rounded to
fp32, as ``torch.amp.GradScaler`` does, so the unscaled values match torch's
``_amp_foreach_non_finite_check_and_unscale_`` bit for bit. ``scale=None`` copies
(casting) without scaling: the master -> model weight copy. ``dsts`` defaults to
``srcs`` (in place); ``write=False`` only checks (reads each gradient once).

The sweep is declared once (``CHECK_UNSCALE``) and goes through the multi-tensor engine.
Layouts, per row:

- the written tensor (the dst, or the src itself in place) is the row's layout anchor;
  a source or addend laid out otherwise (column-major against contiguous, expanded) is
  read through a dense copy in the anchor's layout, refreshed at every launch;
- a check-only sweep (``write=False``) reads a non-dense source (an expanded tensor)
  through a dense copy;
- a written tensor that is not dense but does not overlap itself (a strided view) is
  swept through a dense copy and the result copied back; one that overlaps itself (an
  expanded tensor unscaled in place) is refused with a ``ValueError`` before anything
  is written.

Keep the result of :func:`check_unscale_prepare` while the tensors stay the same (same
addresses, strides, sizes and dtypes) and call :func:`check_unscale_launch` on it: the steady state
uploads and re-derives nothing.

On a CPU without the interpreter, :func:`check_unscale_cpu` runs the same sweep (over the
same dense stand-ins) on torch's multi-tensor CPU ops: one
``torch._amp_foreach_non_finite_check_and_unscale_`` per dtype group checks and unscales,
in the sources' dtype when that is exact or in fp32 otherwise, and ``torch._foreach_copy_``
/ ``torch._foreach_add_`` cast and add. The results equal :func:`check_unscale_ref` bit for
bit; a check-only sweep writes the sources' own values back (NaN payloads of fp16/bf16
values aside: a NaN stays a NaN).
"""
import operator

import torch
import triton
import triton.language as tl

from ._multi_tensor import (HALF_OR_FLOAT, Column, Sweep, _dense, _same_view, check_amp_args,
                            device_constants, refuse_shared_rows, same_layout, shares_memory,
                            sparse_error)
from ._tl_utils import column, inv_scale, load_f32, store_cast, sweep_block

CHECK_UNSCALE = Sweep("check_unscale", [
    Column("dsts", "param"),            # the written tensor: the dst, or the src in place
    Column("srcs", "grad"),             # (the src itself in a check-only sweep)
    Column("adds", "grad", optional=True),
])
_D, _S, _A = (CHECK_UNSCALE.col(n) for n in CHECK_UNSCALE.names)
_ROW = CHECK_UNSCALE.row_width

# fp16util decides with these which pairs it copies through the sweep.
_same_layout = same_layout


@triton.jit
def _check_unscale_sweep_kernel(
    meta_ptr,        # int64 [n_tensors, 4]: the CHECK_UNSCALE columns' addresses, then numel
    blocks_ptr,      # int32 [n_blocks, 2]: tensor index, block index within that tensor
    counters_ptr,    # unused (the sweep has no step column)
    dst_proto,       # a destination tensor of the group: carries the destination type
    src_proto,       # a source tensor: carries the source element type
    add_proto,       # an addend tensor (any tensor without HAS_ADDS): the addend type
    scale_ptr,       # fp32 scalar: the loss scale the sources carry (HAS_SCALE)
    found_inf_ptr,   # fp32 scalar: set to 1.0 when a source holds inf or NaN (CHECK)
    HAS_SCALE: tl.constexpr,
    CHECK: tl.constexpr,
    WRITE: tl.constexpr,
    HAS_ADDS: tl.constexpr,
    CHECK_ADDS: tl.constexpr,      # the addends are checked too (CHECK and HAS_ADDS)
    VEC: tl.constexpr,             # > 1: every address 16-byte aligned, numel % VEC == 0
    EMULATE_BF16_ROUNDING: tl.constexpr,  # interpreter only: see _tl_utils
    BLOCK: tl.constexpr,
):
    tensor, row, offs, mask = sweep_block(meta_ptr, blocks_ptr, found_inf_ptr, _ROW, False,
                                          VEC, BLOCK)
    # The per-tensor scalar first: it is live across the element loads otherwise.
    inv = 1.0
    if WRITE:
        if HAS_SCALE:
            inv = inv_scale(scale_ptr)
    x = load_f32(column(row, _S, offs, src_proto, VEC), mask, EMULATE_BF16_ROUNDING)
    if HAS_ADDS:  # (a sweep that writes)
        a = load_f32(column(row, _A, offs, add_proto, VEC), mask, EMULATE_BF16_ROUNDING)
    if CHECK:
        bad = (x != x) | (tl.abs(x) == float("inf"))
        if CHECK_ADDS:
            # the addend too, in the same reduction (what the step will read is the sum):
            # an inf/NaN left in an earlier gradient must not pass as this backward's clean
            bad = bad | (a != a) | (tl.abs(a) == float("inf"))
        if tl.max(bad.to(tl.int32), axis=0) > 0:
            # Every writer stores the same value, so the race is benign.
            tl.store(found_inf_ptr, 1.0)
    if WRITE:
        if HAS_SCALE:
            x = x * inv
        if HAS_ADDS:
            x = x + a
        store_cast(column(row, _D, offs, dst_proto, VEC), x, mask, EMULATE_BF16_ROUNDING)


# --- layouts: what a flat sweep can walk, and dense stand-ins for the rest -------------

def _non_overlapping(t):
    """No two elements of ``t`` share a storage slot (sufficient test: each stride, in
    increasing order, clears the extent of the dimensions below it)."""
    extent = 1
    for stride, size in sorted((st, sz) for sz, st in zip(t.shape, t.stride()) if sz != 1):
        if stride < extent:
            return False
        extent += stride * (size - 1)
    return True


def check_lists(op, lists, dtypes=HALF_OR_FLOAT):
    """Validate parallel tensor lists before anything is touched: ``lists`` is
    [(name, list or None)], the first one the reference. Equal lengths, tensors, one
    device, fp32/fp16/bf16, and per row every partner with the reference's shape.
    ValueError (TypeError for types and dtypes) naming the list and the index."""
    first, ref = lists[0]
    n = len(ref)
    for name, col in lists[1:]:
        if col is not None and len(col) != n:
            raise ValueError(f"{op}: {name} has {len(col)} tensors but {first} has {n}; the "
                             "lists need equal lengths, one tensor per row")
    device = None
    for name, col in lists:
        if col is None:
            continue
        for i, t in enumerate(col):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{op}: {name}[{i}] is a {type(t).__name__}, expected a tensor")
            if t.layout != torch.strided:
                raise sparse_error(op, f"{name}[{i}]", t)
            if t.dtype not in dtypes:
                raise TypeError(f"{op}: {name}[{i}] is {str(t.dtype).replace('torch.', '')}, "
                                "expected float32, float16 or bfloat16: the check computes in "
                                "float32; convert it (.float()) or keep the model in float32")
            if t.is_meta:
                raise ValueError(f"{op}: {name}[{i}] (shape {tuple(t.shape)}) is on the meta "
                                 "device, which holds no data; materialise the model first "
                                 "(e.g. module.to_empty(device=...), then initialise it)")
            if device is None:
                device = t.device
            elif t.device != device:
                raise ValueError(f"{op}: {name}[{i}] is on {t.device} but {first}[0] is on "
                                 f"{device}; call it once per device")
            if col is not ref and t.shape != ref[i].shape:
                raise ValueError(
                    f"{op}: {first}[{i}] has shape {tuple(ref[i].shape)} but {name}[{i}] has shape "
                    f"{tuple(t.shape)}; each {name} entry must have its {first} entry's shape")
    return n


class Layouts:
    """Dense stand-ins for the tensors a flat sweep cannot walk as they are.

    ``reads``: (original, stand-in) copied original -> stand-in before every launch;
    ``writeback``: (original, stand-in) copied back after it."""
    __slots__ = ("reads", "writeback")

    def __init__(self):
        self.reads = []
        self.writeback = []

    def _read_copy(self, original, buf):
        if not any(o is original and b is buf for o, b in self.reads):
            self.reads.append((original, buf))
        return buf

    def anchor(self, op, name, i, w, in_place):
        """The tensor the sweep writes for ``w`` (``name[i]``): ``w`` itself when dense,
        else a dense stand-in copied back after the launch (and refreshed before it
        when the sweep also reads ``w``). Refuses a ``w`` that overlaps itself."""
        if _dense(w):
            return w
        if not _non_overlapping(w):
            how = "in place " if in_place else ""
            raise ValueError(
                f"{op}: {name}[{i}] of shape {tuple(w.shape)} has strides {w.stride()}: it "
                f"overlaps itself (an expanded tensor), so writing it {how}would store several "
                "results in one element. Nothing was written. Pass a dense tensor "
                f"({name}[{i}].contiguous()) or write into a separate dense destination "
                "(torch.empty_like(src))")
        buf = torch.empty_like(w)  # dense: w's dimension order, contiguous otherwise
        self.writeback.append((w, buf))
        if in_place:
            self._read_copy(w, buf)
        return buf

    def source(self, t, w, anchor):
        """What the sweep reads for ``t`` in a row written through ``anchor`` (the stand-in
        of ``w``, or ``w``): ``t`` when laid out as ``anchor``, else a dense copy in its
        layout, refreshed before every launch. A ``t`` that shares memory with the ``w``
        written in place without being the same view (``w = buf[1:5]``, ``t = buf[:4]``)
        is read through such a copy too: the row reads the values the call was given,
        as the reference does (the kernel's blocks would otherwise read elements another
        block already wrote)."""
        if t is None:
            return None
        if same_layout(t, anchor):
            if anchor is not w or _same_view(t, w) or not shares_memory(t, w):
                return t
            buf = torch.empty_like(anchor, dtype=t.dtype, memory_format=torch.preserve_format)
            return self._read_copy(t, buf)
        if w is not None and _same_view(t, w):
            return self._read_copy(w, anchor)
        buf = torch.empty_like(anchor, dtype=t.dtype, memory_format=torch.preserve_format)
        return self._read_copy(t, buf)

    def checked(self, t):
        """A source of a read-only sweep: ``t`` when dense, else a dense copy."""
        if _dense(t):
            return t
        buf = torch.empty(t.shape, dtype=t.dtype, device=t.device)
        return self._read_copy(t, buf)

    def before(self):
        for original, buf in self.reads:
            buf.copy_(original)

    def after(self):
        for original, buf in self.writeback:
            original.copy_(buf)


class LayoutPrepared:
    """A validated, planned sweep (:class:`~._multi_tensor.Prepared`) with the dense
    stand-ins it reads and writes through. ``lists`` holds the caller's validated lists
    (what the torch reference runs on); ``options`` what the launcher needs to know of
    the lists (check_unscale: whether it writes)."""
    __slots__ = ("prepared", "lists", "layouts", "options", "n", "triton", "device",
                 "cpu_plans")

    def __init__(self, prepared, lists, layouts, options=None):
        self.prepared = prepared
        self.lists = lists
        self.layouts = layouts
        self.options = options or {}
        self.n = prepared.n
        self.triton = prepared.triton
        self.device = prepared.device
        self.cpu_plans = {}  # the CPU path's per-group plans (by group index), made once

    def launch(self, kernel, args, constexprs, group_args=None):
        """Refresh the read copies, launch once per dtype group, copy results back."""
        self.layouts.before()
        self.prepared.launch(kernel, args, constexprs, group_args)
        self.layouts.after()

    @property
    def rebindable(self):
        """A read-only check over the sources themselves (no stand-in):
        :meth:`rebind_sources` may give it another step's gradients."""
        return (not self.options["write"] and self.prepared.rebindable
                and not self.layouts.reads and not self.layouts.writeback)

    def rebind_sources(self, srcs, addresses=None):
        """The same checked sweep over ``srcs`` (this step's gradients: the caller's key
        says they have the kept ones' strides, shapes and dtypes), read only or unscaled
        in place (:attr:`rebindable` / :attr:`rebindable_in_place`); returns whether it
        could (see :meth:`~._multi_tensor.Prepared.rebind`: the Triton path refuses
        addresses that break its alignment, and keeps no reference to the sources)."""
        srcs = list(srcs)
        if not self.prepared.rebind("srcs", srcs, "dsts", addresses=addresses):
            return False
        self.lists["srcs"] = None if self.triton else srcs
        return True

    @property
    def rebindable_in_place(self):
        """A check/unscale that writes each source in place (prepared without
        destinations or addends), with no stand-in: :meth:`rebind_sources` may give it
        another step's sources, which are then its destinations too."""
        return (self.options["write"] and self.options.get("in_place", False)
                and self.prepared.rebindable and not self.layouts.reads
                and not self.layouts.writeback)

    @property
    def rebindable_writes(self):
        """A check/unscale that writes, with no stand-in: :meth:`rebind_lists` may give
        it another step's sources and destinations (and addends, if it has them)."""
        return (self.options["write"] and self.prepared.rebindable
                and not self.layouts.reads and not self.layouts.writeback)

    def rebind_lists(self, srcs, dsts, addresses=None, adds=None):
        """The same validated sweep over ``srcs``, ``dsts`` and ``adds`` (this step's: the
        caller's key says they have the kept ones' strides, shapes and dtypes, and that
        the same rows alias: a destination at its source's address, an addend at its
        destination's or source's); returns whether it could, changing nothing when not
        (see :meth:`~._multi_tensor.Prepared.rebind_columns`). ``adds`` must be given
        exactly when the sweep was prepared with addends. ``addresses``: those of the
        sources, then of the destinations, then of the addends."""
        srcs, dsts = list(srcs), list(dsts)
        if (adds is not None) != self.options.get("adds", False):
            return False
        n, m = len(srcs), len(dsts)
        at = [None, None, None] if addresses is None else \
            [addresses[:n], addresses[n:n + m], addresses[n + m:]]
        columns = [(("srcs",), srcs, at[0]), (("dsts",), dsts, at[1])]
        if adds is not None:
            columns.append((("adds",), list(adds), at[2]))
        if not self.prepared.rebind_columns(columns):
            return False
        # (read by nothing: no reference kept)
        self.lists["srcs"] = self.lists["dsts"] = self.lists["adds"] = None
        if adds is not None:
            # the CPU path's plan writes into the destinations only while no addend
            # shares their storage, which the caller's key (per row) does not say
            self.cpu_plans.clear()
        return True

    def release(self):
        """Drop the references to this step's lists (sources, destinations, addends)
        until the next :meth:`rebind_sources` / :meth:`rebind_lists`."""
        self.lists["srcs"] = self.lists["adds"] = None
        self.prepared.release("srcs")
        self.prepared.release("dsts")
        if self.options.get("adds"):
            self.prepared.release("adds")

    def run_cpu(self, fn):
        """The production CPU path's :meth:`launch`: ``fn(group)`` once per
        :class:`~._multi_tensor.CpuGroup` of the stand-in lists, the read copies refreshed
        before and the results copied back after."""
        self.layouts.before()
        self.prepared.run_cpu(fn)
        self.layouts.after()

    @property
    def anchor(self):
        """A device tensor to pass for pointer arguments a variant does not read."""
        groups = self.prepared.groups
        return groups[0].meta if groups else None


def check_unscale_prepare(srcs, dsts=None, adds=None, write=True):
    """Validate and plan a check/unscale sweep over these lists: keep the result and pass
    it to :func:`check_unscale_launch` while the tensors stay the same. Bad lists raise
    (ValueError; TypeError for dtypes) before anything is written."""
    srcs = list(srcs)
    dsts = None if dsts is None else list(dsts)
    adds = None if adds is None else list(adds)
    op = CHECK_UNSCALE.name
    n = check_lists(op, [("srcs", srcs), ("dsts", dsts), ("adds", adds)])
    write = bool(write)
    if write and n > 1:  # (the caller's tensors: what is swept below may be stand-ins)
        written = [("srcs", srcs, True)] if dsts is None else \
            [("dsts", dsts, True), ("srcs", srcs, False)]
        refuse_shared_rows(op, written + [("adds", adds, False)])
    layouts = Layouts()
    if not write:
        swept = [layouts.checked(s) for s in srcs]
        cols = dict(dsts=swept, srcs=swept, adds=None)
    else:
        cols = dict(dsts=[], srcs=[], adds=None if adds is None else [])
        for i in range(n):
            s = srcs[i]
            w = s if dsts is None else dsts[i]
            in_place = _same_view(w, s)
            a = layouts.anchor(op, "srcs" if dsts is None else "dsts", i, w, in_place)
            cols["dsts"].append(a)
            cols["srcs"].append(a if in_place else layouts.source(s, w, a))
            if adds is not None:
                cols["adds"].append(layouts.source(adds[i], w, a))
    prepared = CHECK_UNSCALE.prepare(cols)
    if write:  # (what a rebind must keep apart from row to row)
        prepared.written = frozenset(("dsts",))
    lists = dict(srcs=srcs, dsts=dsts, adds=adds if write else None, write=write)
    return LayoutPrepared(prepared, lists, layouts,
                          dict(write=write, adds=write and adds is not None,
                               in_place=write and dsts is None and adds is None))


def check_unscale_launch(prepared, scale=None, found_inf=None, check_adds=True):
    """One check/unscale over a prepared sweep: one launch per dtype group (none when
    there is nothing to do). On a device where Triton does not run, the torch reference.
    Nothing is synchronised with the host. ``check_adds=False``: the addends are not
    checked (a caller whose addends an earlier check already judged)."""
    write = prepared.options["write"]
    if prepared.n == 0 or (not write and found_inf is None):
        return
    # (one value each on the sweep's device, whichever path runs: one on another device
    # was read as no scale, or refused by torch in words that named nothing)
    check_amp_args(prepared.device, scale=scale, found_inf=found_inf)
    if not prepared.triton:
        check_unscale_cpu(prepared, scale, found_inf, check_adds)
        return
    anchor = prepared.anchor
    has_scale = write and scale is not None
    prepared.launch(_check_unscale_sweep_kernel, (
        scale if has_scale else anchor,
        found_inf if found_inf is not None else anchor), dict(
        HAS_SCALE=has_scale, CHECK=found_inf is not None, WRITE=write,
        CHECK_ADDS=bool(check_adds) and found_inf is not None
        and bool(prepared.options.get("adds", False))))


# --- the production CPU path ---------------------------------------------------------------

_flags = {}


def _spare_flag(device):
    """An fp32 flag for torch's check-and-unscale when the caller checks nothing (torch's op
    always checks; its verdict is dropped here)."""
    t = _flags.get(device)
    if t is None:
        t = _flags[device] = torch.zeros((), dtype=torch.float32, device=device)
    return t


def _storage_ptrs(tensors):
    return set(map(torch.UntypedStorage.data_ptr, map(torch.Tensor.untyped_storage, tensors)))


class _CpuPlan:
    """How one dtype group of a check/unscale sweep runs on torch's CPU ops, decided once
    per prepared sweep.

    ``work`` is where the unscaled values are formed before the cast to the destination:
    ``"dsts"`` when the destination can hold them exactly (fp32, or the sources' own dtype
    without an addend: torch's op then rounds once, as the reference does), ``"scratch"``
    (persistent fp32 buffers) otherwise: a narrower destination is written only from the
    finished fp32 result, so a finite fp32 source that overflows the destination's dtype
    is not an overflow (the reference checks the sources), and an addend that aliases its
    destination is read before the destination is written."""
    __slots__ = ("in_place", "work", "add_into_dsts")

    def __init__(self, g):
        srcs, dsts, adds = g["srcs"], g["dsts"], g["adds"]
        d_dtype, s_dtype = dsts[0].dtype, srcs[0].dtype
        self.in_place = all(map(operator.is_, srcs, dsts))
        # y = x * inv + add accumulated into the destination itself (a second backward
        # into the same fp32 gradient): add the unscaled scratch to it (IEEE addition
        # commutes, so add + y is y + add bit for bit).
        self.add_into_dsts = (adds is not None and d_dtype == torch.float32
                              and all(map(_same_view, adds, dsts)))
        if adds is None:
            exact_in_dst = d_dtype == s_dtype or d_dtype == torch.float32
        else:
            # (an addend read after some destination is written must not live there)
            exact_in_dst = (d_dtype == torch.float32 and not self.add_into_dsts
                            and _storage_ptrs(dsts).isdisjoint(_storage_ptrs(adds)))
        self.work = "dsts" if exact_in_dst else "scratch"


def check_unscale_cpu(prepared, scale=None, found_inf=None, check_adds=True):
    """The production CPU path of :func:`check_unscale_launch` over a prepared sweep (a
    :class:`LayoutPrepared` whose sweep runs on the CPU): per dtype group, a few of torch's
    multi-tensor CPU ops, no Python loop over the tensors, nothing read on the host.

    ``1 / scale`` is taken in fp64 and rounded to fp32 once per call (the reference's
    rounding); torch's ``_amp_foreach_non_finite_check_and_unscale_`` then checks the
    sources (or their exact fp32 copies) and multiplies in fp32, and the casts round once,
    so the results equal :func:`check_unscale_ref` bit for bit."""
    write = prepared.options["write"]
    if prepared.n == 0 or (not write and found_inf is None):
        return
    device = prepared.device
    one = device_constants(device, (1.0,), torch.float32)
    if not write:
        # Multiplying by 1.0 writes every source's own value back (torch's op skips the
        # multiply for 1.0): a read-only check at the cost of one write, ~20x faster than
        # torch's other multi-tensor way to see a non-finite value (_foreach_norm, inf).
        prepared.run_cpu(lambda g: torch._amp_foreach_non_finite_check_and_unscale_(
            g["srcs"], found_inf, one))
        return
    inv = None if scale is None else scale.double().reciprocal().float()
    flag = found_inf
    if flag is None and inv is not None:
        flag = _spare_flag(device)
    plans = prepared.cpu_plans

    def run(g):
        plan = plans.get(g.index)
        if plan is None:
            plan = plans[g.index] = _CpuPlan(g)
        srcs, dsts, adds = g["srcs"], g["dsts"], g["adds"]
        if inv is None and flag is None and adds is None:
            if not plan.in_place:
                torch._foreach_copy_(dsts, srcs)  # a cast: one rounding, as the reference
            return
        if plan.work == "dsts":
            work = dsts
            if not plan.in_place:
                torch._foreach_copy_(work, srcs)
        else:
            work = prepared.prepared.buffers(g, "work", dsts)
            torch._foreach_copy_(work, srcs)
        if flag is not None:
            torch._amp_foreach_non_finite_check_and_unscale_(
                work, flag, one if inv is None else inv)
        if adds is not None:
            if plan.add_into_dsts:
                if found_inf is not None and check_adds:  # the addends too (the kernel's)
                    torch._amp_foreach_non_finite_check_and_unscale_(dsts, found_inf, one)
                torch._foreach_add_(dsts, work)
                return
            if adds[0].dtype != torch.float32:
                # Widened first (exact): torch's add of mixed dtypes runs a slow casting loop.
                widened = prepared.prepared.buffers(g, "adds", adds)
                torch._foreach_copy_(widened, adds)
                adds = widened
            if found_inf is not None and check_adds:  # the addends too (a multiply by
                # 1.0 writes their own values back)
                torch._amp_foreach_non_finite_check_and_unscale_(adds, found_inf, one)
            torch._foreach_add_(work, adds)
        if work is not dsts:
            torch._foreach_copy_(dsts, work)

    prepared.run_cpu(run)


@torch.no_grad()
def check_unscale(srcs, scale=None, found_inf=None, dsts=None, adds=None, write=True,
                  check_adds=True):
    """Check ``srcs`` for inf/NaN into ``found_inf`` and write ``srcs * (1/scale) (+ adds)`` to ``dsts``.

    One kernel launch per dtype group on CUDA (or under the interpreter); the torch
    reference otherwise. Bad lists raise before anything is written. Nothing is
    synchronised with the host.
    """
    check_unscale_launch(check_unscale_prepare(srcs, dsts=dsts, adds=adds, write=write),
                         scale=scale, found_inf=found_inf, check_adds=check_adds)


@torch.no_grad()
def check_unscale_ref(srcs, scale=None, found_inf=None, dsts=None, adds=None, write=True,
                      check_adds=True):
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
            if write and adds is not None and check_adds:  # the addend too
                b = b | ~torch.isfinite(adds[i]).all()
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
