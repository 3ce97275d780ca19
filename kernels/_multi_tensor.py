"""The multi-tensor engine: every kernel that sweeps a list of tensors goes through here.

A sweep is declared once (:class:`Sweep`): its name, for errors, and its table columns,
each with a role that says what it may hold. :meth:`Sweep.prepare` then does, once for
a given set of tensors:

1. **validation before anything is written** (Triton and reference path alike): one
   tensor per row in every list; one device; per row the parameter's shape for every
   partner; dtypes by role; a dense, non-overlapping parameter; state and copies in the
   parameter's memory layout. A gradient laid out otherwise gets a dense copy in its
   parameter's layout (copied back after the step where the sweep writes it). Bad input
   raises ``ValueError`` (lengths, shapes, strides, devices) or ``TypeError`` (dtypes)
   naming the list, the index, what was found, what was expected and the fix.
2. **grouping** of the rows by the dtypes of their typed columns and by which optional
   columns they have: one launch per group;
3. **tables**: per group an int64 device table, one row per tensor with the address of
   each column then the numel, and the block -> (tensor, block in tensor) map, as in
   Triton's grouped-GEMM tutorial; plus an int32 completion counter per tensor for
   sweeps that advance a per-tensor step count inside the kernel;
4. **alignment**: a group whose every address is 16-byte aligned and every numel a
   multiple of the vector width (16 bytes of the narrowest dtype) launches the kernel
   with ``VEC`` > 1: the kernel then states the alignment (``tl.multiple_of`` /
   ``tl.max_contiguous``) and the compiler issues 16-byte loads and stores. Other groups
   run the same kernel with ``VEC = 1`` (scalar, masked). The mask keeps both in bounds.

The result, a :class:`Prepared`, is what a caller (an optimizer's parameter group, a
scaler) keeps and reuses while its tensors stay the same: launching it uploads and
re-derives nothing. Kernels read columns by name through :meth:`Sweep.col`.
"""
import bisect
import collections
import contextlib
import contextvars
import functools
import itertools
import operator

import numpy as np
import torch
import triton.language as tl

from ._dispatch import kernel_settings, use_triton
from .launch import kept_kernel
from ._ref_utils import advance_steps

HALF_OR_FLOAT = (torch.float32, torch.float16, torch.bfloat16)
_data_ptr = torch.Tensor.data_ptr
_stride = torch.Tensor.stride
_size = torch.Tensor.size
_is_none = functools.partial(operator.is_, None)
VECTOR_BYTES = 16


def _dtype_name(dt):
    return str(dt).replace("torch.", "")


class Column:
    """One column of a sweep's table.

    ``role`` decides the checks: ``"param"`` (the row's anchor: dense, fp32/fp16/bf16),
    ``"grad"`` (same shape; fp32/fp16/bf16; other strides get a dense copy), ``"state"``
    (same shape and layout; fp32 unless ``dtypes`` says otherwise), ``"copy"`` (same shape
    and layout; fp32/fp16/bf16), ``"scalar"`` (a one-element fp32 tensor per row: a step
    count). ``optional`` columns may be None (the whole list) or hold None per row;
    ``typed`` columns pass their element type to the kernel (one proto tensor each).
    ``rehome`` (scalar columns): the production CPU path may move the column's tensors
    into one buffer of its own (see :func:`_share_storage`); off for a column whose
    tensors are views the caller writes through (their memory must stay theirs)."""
    __slots__ = ("name", "role", "optional", "typed", "dtypes", "written", "rehome")

    def __init__(self, name, role, optional=False, typed=None, dtypes=None, written=False,
                 rehome=True):
        self.name = name
        self.role = role
        self.optional = optional
        self.typed = role in ("param", "grad", "copy") if typed is None else typed
        if dtypes is None:
            dtypes = (torch.float32,) if role in ("state", "scalar") else HALF_OR_FLOAT
        self.dtypes = tuple(dtypes)
        self.written = written
        self.rehome = rehome


class Sweep:
    """The declaration of a multi-tensor sweep: a name and its table columns, and
    optionally ``check(sweep, lists)``, rules across columns that the per-column checks
    cannot say, run with them before anything is written."""

    def __init__(self, name, columns, check=None, writes=()):
        self.name = name
        self.check = check
        self.columns = tuple(columns)
        self.names = tuple(c.name for c in self.columns)
        if self.columns[0].role != "param":
            raise ValueError("the first column of a sweep is its anchor (role 'param')")
        self.ncols = len(self.columns)
        unknown = [w for w in writes if w not in self.names]
        if unknown:
            raise ValueError(f"{name}: writes names {unknown}, which are not columns")
        # the tensor columns the kernel writes: no two rows may share memory where one of
        # them is written (see refuse_shared_rows; scalar columns are the sweep's own)
        self.writes = frozenset(writes)

    def col(self, name):
        """The table column index of ``name``, as a constexpr for the kernel."""
        return tl.constexpr(self.names.index(name))

    @property
    def row_width(self):
        return tl.constexpr(self.ncols + 1)

    def prepare(self, lists):
        """Validate ``lists`` (column name -> list of tensors, or None for an absent
        optional column) and build the launch plans. Raises before anything is written.
        A sweep declared with ``writes`` also refuses rows that share memory where one
        of them is written (:func:`refuse_shared_rows`); a sweep whose caller sweeps
        stand-ins for its own tensors (check_unscale, axpby) checks the caller's."""
        rows = _validate(self, lists)
        return Prepared(self, lists, rows)


def _dense(t):
    """Non-overlapping and dense: the elements fill ``numel`` consecutive slots of
    storage in some order (contiguous, channels-last, a transpose)."""
    if t.is_contiguous():
        return True
    expected = 1
    for stride, size in sorted((st, sz) for sz, st in zip(t.shape, t.stride()) if sz != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def same_layout(a, b):
    """``a`` and ``b`` (same shape) put every element at the same storage offset."""
    return all(sa == sb for sa, sb, n in zip(a.stride(), b.stride(), a.shape) if n != 1)


def restride_like(t, param, dtype=None):
    """``t``'s values in a new tensor laid out as ``param`` (dense; ``param``'s strides),
    with ``dtype`` (default ``t``'s). How optimizer state is re-strided when created or
    loaded, and how a gradient with other strides becomes sweepable."""
    out = torch.empty_like(param, dtype=t.dtype if dtype is None else dtype,
                           memory_format=torch.preserve_format)
    out.copy_(t)
    return out


def _err(sweep, kind, msg):
    return kind(f"{sweep.name}: {msg}")


_ROW_LABELS = contextvars.ContextVar("tritamp_row_labels", default=None)


@contextlib.contextmanager
def row_labels(labels):
    """Within the block, a sweep prepared names its row ``i`` in its refusals also as
    ``labels[i]`` (any sequence; read only on a refusal): the caller's own name for it
    (``param_groups[1]['params'][2]``), where the sweep's index counts only the rows the
    caller passed (parameters with a gradient, say). The prepared sweep keeps the labels
    for the refusals of later steps."""
    token = _ROW_LABELS.set(labels)
    try:
        yield
    finally:
        _ROW_LABELS.reset(token)


def labelled(message, labels, i):
    """``message`` led by the caller's name of row ``i``, where ``labels`` has it."""
    if labels is None or not 0 <= i < len(labels):
        return message
    return f"{labels[i]} (index {i} below): {message}"


def sparse_error(op, where, t):
    """The error for a sparse tensor (any layout but torch.strided) in a list: no sweep can
    walk one, and amp never scaled one (Apex's neither). A RuntimeError, as torch's
    optimizers raise for sparse gradients."""
    layout = str(t.layout).replace("torch.", "")
    return RuntimeError(
        f"{op} does not support sparse gradients: {where} is a {layout} "
        f"tensor of shape {tuple(t.shape)}. tritamp's loss scaling and fused optimizers take "
        "dense gradients only (Apex's amp never supported sparse ones); please use dense "
        "gradients, e.g. nn.Embedding(..., sparse=False)")


def _validate(sweep, lists):
    """The checks of the module docstring. Returns the row count; replaces gradients that
    need it by dense copies in ``lists`` (recording write-backs in ``lists['_writeback']``)."""
    anchor = sweep.columns[0]
    params = lists.get(anchor.name)
    if params is None:
        raise _err(sweep, ValueError, f"{anchor.name} is required")
    params = lists[anchor.name] = list(params)
    n = len(params)
    for c in sweep.columns[1:]:
        col = lists.get(c.name)
        if col is None:
            if not c.optional:
                raise _err(sweep, ValueError, f"{c.name} is required ({n} tensors, one per "
                           f"{anchor.name})")
            continue
        col = lists[c.name] = list(col)
        if len(col) != n:
            raise _err(sweep, ValueError,
                       f"{c.name} has {len(col)} tensors but {anchor.name} has {n}; every list "
                       f"needs one tensor per {anchor.name}")
    for key in lists:
        if key not in sweep.names:
            raise _err(sweep, ValueError, f"unknown list {key!r}; expected {sweep.names}")
    if sweep.check is not None:
        sweep.check(sweep, lists)
    if n == 0:
        return 0
    lists["_writeback"], lists["_staged"] = [], []
    if _all_plain(sweep, lists, params):
        if sweep.writes:
            _refuse_shared_columns(sweep, lists)
        return n
    # (the caller's tensors, before any is replaced by a dense copy below)
    originals = {name: lists[name] and list(lists[name]) for name in sweep.names
                 if name in lists} if sweep.writes else None
    writeback, staged = [], []
    for i, p in enumerate(params):
        try:
            _validate_row(sweep, lists, params, i, p, writeback, staged)
        except (TypeError, ValueError, RuntimeError) as e:
            labels = _ROW_LABELS.get()
            if labels is None:
                raise
            raise type(e)(labelled(str(e), labels, i)) from None
    lists["_writeback"] = writeback
    lists["_staged"] = staged
    if originals is not None:
        _refuse_shared_columns(sweep, originals)
    return n


def _refuse_shared_columns(sweep, lists):
    """:func:`refuse_shared_rows` over a sweep's tensor columns and the scalar columns it
    writes (a step count shared by two rows would be advanced by both)."""
    refuse_shared_rows(sweep.name, [(c.name, lists.get(c.name), c.name in sweep.writes)
                                    for c in sweep.columns
                                    if c.role != "scalar" or c.name in sweep.writes],
                       within_rows=True)


def _span(t):
    """The bytes ``[first, end)`` that ``t``'s elements lie in: exactly its own for a dense
    tensor (torch's strides are never negative, so ``data_ptr`` is the lowest)."""
    start = t.data_ptr()
    if _dense(t):
        return start, start + t.numel() * t.element_size()
    last = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()) if size > 1)
    return start, start + (last + 1) * t.element_size()


_EXACT_LIMIT = 1 << 24  # elements a strided view may have for the element-by-element test


def _lattice_meet(a, b):
    """For ``a`` and ``b`` of one dtype, shape and strides (column chunks of one matrix,
    say), neither overlapping itself: whether they share an element, in time linear in
    the number of dimensions. ``b``'s first element lies ``d`` elements from ``a``'s; they
    share one exactly when ``d = sum(i_k * stride_k)`` with ``|i_k| < size_k``, and as
    every stride exceeds the extent of the smaller ones, only the two nearest multiples
    of each stride can lead there. None where that does not apply."""
    diff = b.data_ptr() - a.data_ptr()
    size = a.element_size()
    if diff % size:
        return None
    dims = sorted((st, n) for n, st in zip(a.shape, a.stride()) if n > 1)
    extent = 0
    for st, n in dims:
        if st <= extent:
            return None  # (overlapping itself, or a stride of 0)
        extent += st * (n - 1)
    dims.reverse()

    def meet(r, k):
        if k == len(dims):
            return r == 0
        st, n = dims[k]
        q = r // st
        return any(-n < i < n and meet(r - i * st, k + 1) for i in (q, q + 1))

    return meet(diff // size, 0)


def _starts(t, base):
    """The sorted byte offsets from ``base`` at which ``t``'s elements start."""
    offs = torch.zeros((), dtype=torch.int64)
    for size, stride in zip(t.shape, t.stride()):
        offs = offs.unsqueeze(-1) + torch.arange(size, dtype=torch.int64) * stride
    return (offs.reshape(-1) * t.element_size() + (t.data_ptr() - base)).unique()


def _elements_meet(a, b):
    """Whether ``a`` and ``b``, whose spans overlap and one of which is a strided view,
    have a byte in common: by the lattice of their strides when they share a layout
    (:func:`_lattice_meet`), else by their elements' sorted start bytes (each element of
    ``b`` against the last element of ``a`` that starts before it ends); conservatively
    True for views of more than 2**24 elements in another layout."""
    if a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride():
        met = _lattice_meet(a, b)
        if met is not None:
            return met
    if a.numel() > _EXACT_LIMIT or b.numel() > _EXACT_LIMIT:
        return True
    base = min(a.data_ptr(), b.data_ptr())
    sa, sb = _starts(a, base), _starts(b, base)
    i = torch.searchsorted(sa, sb + b.element_size()) - 1
    return bool(((i >= 0) & (sa[i.clamp(min=0)] + a.element_size() > sb)).any())


def shares_memory(a, b):
    """Whether tensors ``a`` and ``b`` have a byte of memory in common (dense ones by their
    byte ranges; strided views element by element)."""
    a_start, a_end = _span(a)
    b_start, b_end = _span(b)
    if a_start >= b_end or b_start >= a_end or not a.numel() or not b.numel():
        return False
    return (_dense(a) and _dense(b)) or _elements_meet(a, b)


def refuse_shared_rows(op, columns, within_rows=False):
    """Refuse, with a ``ValueError`` naming both tensors and the fix, two tensors of
    different rows that share memory where either is written: a sweep's rows run
    concurrently on a GPU, so the result would depend on their order (and the paths
    would disagree). ``columns``: ``[(name, tensors or None, written)]``, ``tensors``
    one per row (None entries skipped); rows are named also by the caller's labels
    (:func:`row_labels`). Tensors of one row may share memory (an in-place update, an
    addend accumulated into its destination): a sweep that reads such a tensor through
    a copy says so; with ``within_rows`` (the optimizers' and LARC's sweeps, which read
    every tensor where it is) a row's two tensors that share memory are refused as well
    when one is written, unless they are the same view and only one of them is written
    (a gradient that is its parameter: each element is read, then written). Only spans
    that overlap are examined further, so the usual lists (distinct allocations, or
    disjoint views of one flat buffer) cost one sort."""
    if not any(written for _, tensors, written in columns if tensors):
        return
    entries = []
    for k, (name, tensors, written) in enumerate(columns):
        if not tensors:
            continue
        for i, t in enumerate(tensors):
            if t is not None and t.numel():
                start, end = _span(t)
                entries.append((start, end, i, k, t))
    entries.sort(key=operator.itemgetter(0))
    open_ = []  # entries whose span reaches past the current start
    for e in entries:
        start = e[0]
        open_ = [o for o in open_ if o[1] > start]
        for o in open_:
            written = (columns[o[3]][2], columns[e[3]][2])
            if not (written[0] or written[1]):
                continue
            a, b = o[4], e[4]
            if o[2] == e[2]:
                if not within_rows or (_same_view(a, b) and not (written[0] and written[1])):
                    continue
            if shares_memory(a, b):
                _shared_error(op, columns, _ROW_LABELS.get(), o, e)
        open_.append(e)


def _same_view(a, b):
    """``a`` and ``b`` are the same elements (one tensor, or two views of it)."""
    return a is b or (a.data_ptr() == b.data_ptr() and a.dtype == b.dtype
                      and a.shape == b.shape and a.stride() == b.stride())


class SharedMemoryError(ValueError):
    """Two rows of a sweep share memory where one of them is written
    (:func:`refuse_shared_rows`): a ``ValueError``, which callers may name in their own
    words."""


def _shared_error(op, columns, labels, a, b):
    if (a[2], a[3]) > (b[2], b[3]):
        a, b = b, a
    names = []
    for _, _, i, k, _ in (a, b):
        where = f"{columns[k][0]}[{i}]"
        if labels is not None and 0 <= i < len(labels):
            where = f"{where} ({labels[i]})"
        names.append(where)
    written = [names[j] for j, e in enumerate((a, b)) if columns[e[3]][2]]
    raise SharedMemoryError(
        f"{op}: {names[0]} and {names[1]} share memory, and the sweep writes "
        f"{' and '.join(written)}: its blocks run concurrently on a GPU, so the result "
        "would depend on their order. Nothing was written. Pass tensors that do not share "
        f"memory (for example {columns[b[3]][0]}[{b[2]}].clone())")


def _validate_row(sweep, lists, params, i, p, writeback, staged):
    anchor = sweep.columns[0]
    device = params[0].device  # (the first row's: every row must be on it)
    if not isinstance(p, torch.Tensor):
        raise _err(sweep, TypeError, f"{anchor.name}[{i}] is a {type(p).__name__}, expected "
                   "a tensor")
    if p.layout != torch.strided:
        raise sparse_error(sweep.name, f"{anchor.name}[{i}]", p)
    if p.is_meta:
        raise _err(sweep, ValueError,
                   f"{anchor.name}[{i}] (shape {tuple(p.shape)}) is on the meta device, "
                   "which holds no data to update; materialise it first (e.g. "
                   "module.to_empty(device=...), then initialise the parameters)")
    if p.device != device:
        raise _err(sweep, ValueError, f"{anchor.name}[{i}] is on {p.device} but "
                   f"{anchor.name}[0] is on {device}; call it once per device")
    if p.dtype not in anchor.dtypes:
        raise _err(sweep, TypeError, f"{anchor.name}[{i}] is {_dtype_name(p.dtype)}, expected "
                   f"one of {[_dtype_name(d) for d in anchor.dtypes]}: the kernels compute "
                   "in float32; convert it (.float())"
                   + (", or use torch.optim's optimizer to compute in float64"
                      if p.dtype == torch.float64 else ""))
    if not _dense(p):
        raise _err(sweep, ValueError,
                   f"{anchor.name}[{i}] of shape {tuple(p.shape)} has strides {p.stride()}: "
                   "not dense (a strided view or an expanded tensor), so a flat sweep would "
                   "touch memory outside it. Give the optimizer dense parameters, for "
                   "example p.data = p.data.contiguous() before building it")
    for c in sweep.columns[1:]:
        col = lists.get(c.name)
        if col is None:
            continue
        t = col[i]
        where = f"{c.name}[{i}]"
        if t is None:
            if not c.optional:
                raise _err(sweep, ValueError, f"{where} is None; every {anchor.name} needs one")
            continue
        if not isinstance(t, torch.Tensor):
            raise _err(sweep, TypeError, f"{where} is a {type(t).__name__}, expected a tensor")
        if t.layout != torch.strided:
            raise sparse_error(sweep.name, f"{where} (for {anchor.name}[{i}])", t)
        if t.device != device:
            raise _err(sweep, ValueError, f"{where} is on {t.device} but {anchor.name}[{i}] is "
                       f"on {device}; move it to {device}")
        if t.dtype not in c.dtypes:
            raise _err(sweep, TypeError,
                       f"{where} is {_dtype_name(t.dtype)}, expected "
                       f"{' or '.join(_dtype_name(d) for d in c.dtypes)}"
                       + (("; optimizer state is kept in float32: convert it with "
                           ".float()" if c.dtypes == (torch.float32,) else
                           f"; convert it with .to(torch.{_dtype_name(c.dtypes[0])})")
                          if c.role in ("state", "scalar") else ""))
        if c.role == "scalar":
            if t.numel() != 1:
                raise _err(sweep, ValueError, f"{where} has shape {tuple(t.shape)}, expected "
                           "a one-element tensor")
            continue
        if t.shape != p.shape:
            raise _err(sweep, ValueError,
                       f"{where} has shape {tuple(t.shape)} but {anchor.name}[{i}] has shape "
                       f"{tuple(p.shape)}; each {c.name} must have its {anchor.name}'s shape"
                       + ("; a parameter given data of another shape keeps its old gradient: "
                          "clear it first (p.grad = None, or zero_grad(set_to_none=True))"
                          if (anchor.name, c.name) == ("params", "grads") else ""))
        if same_layout(t, p):
            continue
        if c.role == "grad":
            if c.written and not _dense(t):
                raise _err(sweep, ValueError,
                           f"{where} of shape {tuple(t.shape)} has strides {t.stride()}: it "
                           "overlaps itself or is not dense, and this sweep writes it; pass a "
                           "dense tensor (.contiguous())")
            dense = restride_like(t, p)
            staged.append((t, dense))
            if c.written:
                writeback.append((t, dense))
            col[i] = dense
            continue
        raise _err(sweep, ValueError,
                   f"{where} has strides {t.stride()} but {anchor.name}[{i}] has strides "
                   f"{p.stride()}; it must have its {anchor.name}'s memory layout. "
                   "tritamp's optimizers re-stride their state when it is created or "
                   "loaded; elsewhere use torch.empty_like(param) and copy into it")


_device_of = operator.attrgetter("device")
_get_device = torch.Tensor.get_device
_numel = torch.Tensor.numel
_dtype_of = operator.attrgetter("dtype")
_shape_of = operator.attrgetter("shape")
_is_none = functools.partial(operator.is_, None)


def _all_plain(sweep, lists, params):
    """The common case in one pass per column (C-level maps, no per-row Python): every
    tensor present, on one device, of an accepted dtype, contiguous parameters, every
    partner with its parameter's shape and strides. False sends the lists through the
    row-by-row checks, which raise the precise error or handle the layout."""
    try:
        device = params[0].device
        if device.type == "meta" or set(map(_device_of, params)) != {device} \
                or not set(map(_dtype_of, params)) <= set(sweep.columns[0].dtypes) \
                or not all(map(torch.Tensor.is_contiguous, params)):
            return False
        shapes = list(map(_shape_of, params))
        strides = list(map(_stride, params))
        for c in sweep.columns[1:]:
            col = lists.get(c.name)
            if col is None:
                continue
            want_shapes, want_strides = shapes, strides
            if any(map(_is_none, col)):
                if not c.optional:
                    return False
                rows = [i for i, t in enumerate(col) if t is not None]
                col = [col[i] for i in rows]
                want_shapes = [shapes[i] for i in rows]
                want_strides = [strides[i] for i in rows]
                if not col:
                    continue
            if set(map(_device_of, col)) != {device} \
                    or not set(map(_dtype_of, col)) <= set(c.dtypes):
                return False
            if c.role == "scalar":
                if list(map(torch.Tensor.numel, col)).count(1) != len(col):
                    return False
            elif list(map(_shape_of, col)) != want_shapes \
                    or list(map(_stride, col)) != want_strides:
                return False
    except (AttributeError, TypeError):  # something that is not a tensor: the slow path says
        return False
    return True


def _upload(array: torch.Tensor, device: torch.device) -> torch.Tensor:
    if device.type == "cuda":
        return array.pin_memory().to(device, non_blocking=True)
    return array.to(device)


_STAND_INS = {}


def _stand_in(dtype, device):
    """A small tensor of ``dtype`` on ``device``, kept for the process: what a kernel is
    given for a typed column whose own tensors change every step (its dtype is what
    matters; it is never read)."""
    t = _STAND_INS.get((dtype, device))
    if t is None:
        t = _STAND_INS[(dtype, device)] = torch.zeros(16, dtype=dtype, device=device)
    return t


class GroupPlan:
    """One launch: the rows of one dtype group, their device tables and constexprs."""
    __slots__ = ("rows", "meta", "blocks", "n_blocks", "counters", "protos", "constexprs",
                 "block", "warps", "launch_key", "host_meta", "present", "proto_cols",
                 "with_extra")

    def __init__(self, sweep, lists, rows, device, block, warps, emulate):
        self.rows = rows
        n = len(rows)
        cols = []
        present = {}
        for c in sweep.columns:
            col = lists.get(c.name)
            present[c.name] = col is not None and col[rows[0]] is not None
            cols.append([col[i] for i in rows] if present[c.name] else None)
        params = cols[0]
        meta = np.zeros((n, sweep.ncols + 1), dtype=np.int64)
        data_columns = []
        min_size = 16
        for j, col in enumerate(cols):
            if col is None:
                continue
            meta[:, j] = list(map(_data_ptr, col))
            if sweep.columns[j].role != "scalar":
                data_columns.append(j)
                min_size = min(min_size, col[0].element_size())
        meta[:, -1] = list(map(torch.Tensor.numel, params))
        vec = VECTOR_BYTES // min_size
        # Decided here, once: every data address 16-byte aligned, every numel a multiple
        # of the vector width (the kernel is then told so and issues 16-byte accesses).
        aligned = bool((meta[:, data_columns] % VECTOR_BYTES == 0).all()
                       and (meta[:, -1] % vec == 0).all())
        per_tensor = (meta[:, -1] + block - 1) // block
        total = int(per_tensor.sum())
        starts = np.cumsum(per_tensor) - per_tensor
        tensor_idx = np.repeat(np.arange(n, dtype=np.int32), per_tensor)
        block_idx = (np.arange(total, dtype=np.int64) - np.repeat(starts, per_tensor)).astype(np.int32)
        blocks = np.ascontiguousarray(np.stack([tensor_idx, block_idx], axis=1))
        self.meta = _upload(torch.from_numpy(meta), device)
        self.host_meta = meta  # the table as uploaded, for new_addresses / set_many
        self.present = [col is not None for col in cols]
        self.blocks = _upload(torch.from_numpy(blocks), device)
        self.n_blocks = total
        has_scalar = any(c.role == "scalar" and present[c.name] for c in sweep.columns)
        self.counters = (torch.zeros(n, dtype=torch.int32, device=device) if has_scalar
                         else self.meta)
        # An absent column's proto: a stand-in of the first column's dtype, owned by this
        # module. The first column's own tensor may be borrowed (a gradient, see
        # borrowed()) and no rebind replaces an absent column's proto: once that memory
        # was handed back to the device (torch.cuda.empty_cache()), Triton's launcher
        # refused the dangling pointer ("Pointer argument ... cannot be accessed").
        fallback = _stand_in(params[0].dtype, params[0].device)
        self.protos = tuple((col[0] if col is not None else fallback)
                            for c, col in zip(sweep.columns, cols) if c.typed)
        # the column of each proto (a typed column's first tensor: its dtype is what the
        # kernel is specialised on, its memory is never read)
        self.proto_cols = [j for j, c in enumerate(sweep.columns) if c.typed]
        cx = {f"HAS_{c.name.upper()}": present[c.name] for c in sweep.columns if c.optional}
        cx.update(VEC=vec if aligned else 1, EMULATE_BF16_ROUNDING=emulate, BLOCK=block)
        self.constexprs = cx
        self.block = block
        self.warps = warps
        cx["num_warps"] = warps
        self.launch_key = tuple(cx.items())  # the kept-launch key of these constexprs
        self.with_extra = {}  # a launch's own constexprs -> (merged constexprs, key), kept

    def new_addresses(self, addresses):
        """This group's rows of ``addresses`` (an int64 array: the addresses of a full
        column of tensors laid out as the ones planned), or None when the kernels'
        alignment (``VEC``) would not hold for them."""
        ptrs = addresses if len(self.rows) == len(addresses) else addresses[self.rows]
        if self.constexprs["VEC"] > 1 and np.bitwise_and(ptrs, VECTOR_BYTES - 1).any():
            return None
        return ptrs

    def set_many(self, pairs):
        """For each ``(columns, ptrs)`` pair, write ``ptrs`` as the addresses of the
        columns ``columns`` (indices; those absent from this group are skipped) into the
        device table: one host-to-device copy for all of them, ordered on the stream after
        the launches that read the old ones; none when the addresses are those already
        there. The protos of those columns become stand-ins of their dtype: the tensors
        they were may be freed, and a launch must not pass a freed tensor (Triton's
        interpreter copies every tensor argument's memory)."""
        pairs = [([j for j in columns if self.present[j]], ptrs) for columns, ptrs in pairs]
        stale = [j for columns, _ in pairs for j in columns if j in self.proto_cols]
        if stale:
            protos = list(self.protos)
            for j in stale:
                k = self.proto_cols.index(j)
                protos[k] = _stand_in(protos[k].dtype, protos[k].device)
            self.protos = tuple(protos)
        if all(np.array_equal(self.host_meta[:, j], ptrs)
               for columns, ptrs in pairs for j in columns):
            return
        for columns, ptrs in pairs:
            for j in columns:
                self.host_meta[:, j] = ptrs
        host = torch.from_numpy(self.host_meta)
        if self.meta.device.type == "cuda":
            # a fresh pinned block: an earlier copy may still be reading the last one
            host = host.pin_memory()
        self.meta.copy_(host, non_blocking=True)


_APART = object()  # (Prepared._rebind_cache's key for the addresses last found apart)


class Prepared:
    """A validated sweep, grouped and planned: launch it any number of times.

    ``lists`` holds the validated lists (the reference path runs on them). A gradient
    that was laid out unlike its parameter is swept through a dense copy in the
    parameter's layout: every launch (and every read of ``lists``) first refreshes that
    copy from the gradient, so a prepared sweep kept across steps never reads a stale
    value, and a sweep that writes the gradient copies the result back after the launch.
    ``groups`` is empty on a device where the kernels do not run (the torch reference
    handles it)."""
    __slots__ = ("sweep", "_lists", "n", "groups", "writeback", "staged", "triton", "device",
                 "empty_rows", "cpu_groups", "scratch", "_planned", "labels", "written",
                 "_rebind_cache")

    def __init__(self, sweep, lists, n):
        self.sweep = sweep
        # the columns the kernel writes (a caller sweeping stand-ins of its own tensors
        # sets them: check_unscale, axpby): a rebind that gives one of them new tensors
        # checks that no two rows share memory
        self.written = sweep.writes
        # per column its bytes and dtypes per row; per rebind its kept spans; _APART
        self._rebind_cache = {}
        self.writeback = lists.pop("_writeback", [])
        self.staged = lists.pop("_staged", [])
        self._lists = lists
        self.n = n
        self.groups = []
        self.cpu_groups = []
        self.scratch = Scratch()
        self.device = None
        self.triton = False
        self.empty_rows = []  # rows with no element: no program of any group covers them
        self.labels = _ROW_LABELS.get()  # the caller's names of the rows (row_labels)
        # per column, the dtypes and sizes the plan was made for: a rebind takes only
        # tensors that have them (see rebind_columns)
        self._planned = {}
        if n == 0:
            return
        for name, col in lists.items():
            if col is not None:
                self._planned[name] = (tuple(None if t is None else t.dtype for t in col),
                                       tuple(None if t is None else t.numel() for t in col))
        params = lists[sweep.columns[0].name]
        self.device = params[0].device
        self.triton = use_triton(params[0])
        # Group key per row: the dtype of each typed or optional column (None if absent),
        # one map per column rather than a Python loop over columns per row.
        keys = []
        for c in sweep.columns:
            if not (c.typed or c.optional):
                continue
            col = lists.get(c.name)
            if col is not None:
                keys.append([None if t is None else t.dtype for t in col])
        groups = {}
        if not self.triton:
            # The production CPU path: torch's multi-tensor ops take empty tensors too.
            for i, key in enumerate(zip(*keys)):
                groups.setdefault(key, []).append(i)
            scalars = [c.name for c in sweep.columns if c.role == "scalar"]
            rehomed = [c.name for c in sweep.columns if c.role == "scalar" and c.rehome]
            self.cpu_groups = [CpuGroup(k, lists, rows, scalars, rehomed)
                               for k, rows in enumerate(groups.values())]
            return
        block, warps, emulate = kernel_settings(self.device)
        for i, (numel, key) in enumerate(zip(map(torch.Tensor.numel, params), zip(*keys))):
            if numel == 0:
                self.empty_rows.append(i)
                continue
            groups.setdefault(key, []).append(i)
        self.groups = [GroupPlan(sweep, lists, rows, self.device, block, warps, emulate)
                       for rows in groups.values()]

    def stage(self):
        """Refresh the dense copies of gradients laid out unlike their parameters."""
        for original, dense in self.staged:
            dense.copy_(original)

    @property
    def lists(self):
        """The validated lists, dense copies refreshed (what the reference path reads)."""
        self.stage()
        return self._lists

    def launch(self, kernel, args, constexprs=None, group_args=None):
        """Launch ``kernel`` once per group as
        ``kernel[(n_blocks,)](meta, blocks, counters, *protos, *group_args[k], *args, **cx)``;
        ``group_args`` (optional) gives group ``k`` leading arguments of its own (its slice
        of a shared buffer of partial results)."""
        self.stage()
        kept = kept_kernel(kernel)
        extra = None if constexprs is None else tuple(constexprs.items())
        for k, g in enumerate(self.groups):
            if extra is None:
                cx, key = g.constexprs, g.launch_key
            else:
                found = g.with_extra.get(extra)
                if found is None:
                    found = g.with_extra[extra] = ({**g.constexprs, **constexprs},
                                                   (g.launch_key, extra))
                cx, key = found
            lead = () if group_args is None else group_args[k]
            kept.launch((g.n_blocks,), (g.meta, g.blocks, g.counters, *g.protos, *lead, *args),
                        cx, key)
        self.finish()

    def finish(self):
        """Copy results back into gradients that were swept through dense copies."""
        for original, dense in self.writeback:
            original.copy_(dense)

    def run_cpu(self, fn):
        """The production CPU path: ``fn(group)`` once per :class:`CpuGroup` (dense copies
        refreshed before, written ones copied back after), with autograd off (a no-op
        check inside an optimizer's step, which already runs without it)."""
        if torch.is_grad_enabled():
            with torch.no_grad():
                return self.run_cpu(fn)
        self.stage()
        for g in self.cpu_groups:
            fn(g)
        self.finish()

    @property
    def rebindable(self):
        """Nothing staged (every tensor swept as it is): :meth:`rebind` may swap a column's
        tensors."""
        return not self.staged and not self.writeback

    def rebind(self, name, tensors, *same_as, addresses=None):
        """The same validated sweep over new tensors in column ``name`` (and in the
        columns ``same_as``, given the same tensors): this step's gradients, at new
        addresses, when the caller's key says that nothing else changed (same strides,
        hence same shapes, dtypes and layouts: torch keeps a ``.grad``'s dtype and shape
        its parameter's). Returns whether it did.

        The production CPU path holds no device tables: its lists take the tensors. The
        Triton path writes their addresses into its device tables (one small
        host-to-device copy per group, only for addresses that changed) and keeps no
        reference to them (the column's list is dropped: nothing on that path reads it);
        it refuses, changing nothing, tensors whose addresses break the 16-byte alignment
        its kernels were specialised for, or that are not all on its device: the caller
        then prepares the sweep again (which validates them).
        ``addresses`` (optional): the tensors' addresses, when the caller has them (its
        cache key holds them)."""
        return self.rebind_columns([((name,) + same_as, tensors, addresses)])

    def rebind_columns(self, columns):
        """:meth:`rebind` of several columns at once: ``columns`` is a list of
        ``(names, tensors, addresses)`` (the columns ``names`` all take ``tensors``;
        ``addresses`` may be None). All or nothing: on the Triton path every group's new
        addresses are checked for every column before any is written, and each group's
        table is written in one host-to-device copy."""
        cols = [(tuple(names), list(tensors), addresses) for names, tensors, addresses in columns]
        for names, col, _ in cols:
            if not self._as_planned(names, col):
                # another dtype or size than the plan's (a gradient assigned with another
                # dtype, or through .data): the caller prepares, and validates, again
                return False
        if self.written and not self._rebound_apart(cols):
            # two rows' tensors share memory where one is written: preparing again
            # refuses them by name (refuse_shared_rows)
            return False
        if self.triton:
            for _, col, _ in cols:
                if not self._on_device(col):
                    # another device's addresses in this device's tables would be read by
                    # this device's kernel: the caller prepares (and validates) again
                    return False
            planned = []
            for names, col, addresses in cols:
                index = [j for j, c in enumerate(self.sweep.columns) if c.name in names]
                if addresses is None:
                    addresses = list(map(_data_ptr, col))
                addresses = np.array(addresses, dtype=np.int64)
                found = [g.new_addresses(addresses) for g in self.groups]
                if any(ptrs is None for ptrs in found):
                    return False
                planned.append((index, found))
            for k, g in enumerate(self.groups):
                g.set_many([(index, found[k]) for index, found in planned])
            for names, _, _ in cols:
                for n in names:
                    self._lists[n] = None
            return True
        for names, col, _ in cols:
            for n in names:
                self._lists[n] = col
                for g in self.cpu_groups:
                    g.lists[n] = g.pick(col)
        return True

    def _rebound_apart(self, cols):
        """Whether the tensors of rebound columns (checked as planned) lie apart, as
        :func:`refuse_shared_rows` asks, from the other rows' and from the tensors the
        sweep keeps: a rebound column that is written against every other tensor, one
        that is only read against the written ones. Byte spans (a rebindable sweep's
        tensors are dense) in plain Python, a few tenths of a microsecond a row: a tensor
        given to two columns of its row (same address, size and dtype) counted once; an
        overlap of any kind answers False (the caller then prepares again, whose check is
        exact and names the tensors)."""
        at = []
        for names_, col, addresses in cols:
            if addresses is None or len(addresses) != len(col):
                addresses = [0 if t is None else t.data_ptr() for t in col]
            at.append((names_, tuple(addresses)))
        at = tuple(at)
        if at == self._rebind_cache.get(_APART):
            return True  # (the addresses last found apart)
        names = frozenset(n for names, _, _ in cols for n in names)
        writes = not names.isdisjoint(self.written)
        kept = self._kept_spans(names, writes)
        if not writes and kept is None:
            return True
        spans = []
        firsts = []
        for names_, addresses in at:
            sizes, dtypes = self._row_bytes(names_[0])
            if not firsts:
                spans.extend(zip(addresses, sizes))
            else:
                # (the same row's tensor given to two columns: counted once)
                spans.extend((a, n) for j, (a, n, d) in enumerate(zip(addresses, sizes, dtypes))
                             if not any(f[0][j] == a and f[1][j] == n and f[2][j] == d
                                        for f in firsts))
            firsts.append((addresses, sizes, dtypes))
        if writes and len(spans) > 1:
            spans.sort()
            end = 0
            for a, n in spans:
                if n:
                    if a < end:
                        return False
                    end = a + n
        if kept is not None:
            kept_starts, kept_reach = kept
            for a, n in spans:
                i = bisect.bisect_left(kept_starts, a + n) - 1
                if n and i >= 0 and kept_reach[i] > a:
                    return False
        self._rebind_cache[_APART] = at
        return True

    def _row_bytes(self, name):
        """Column ``name``'s planned bytes per row (0 where absent) and dtypes."""
        got = self._rebind_cache.get(name)
        if got is None:
            dtypes, numels = self._planned[name]
            got = self._rebind_cache[name] = (
                [0 if k is None else k * d.itemsize for d, k in zip(dtypes, numels)], dtypes)
        return got

    def _kept_spans(self, rebound, writes):
        """The byte spans of the tensors a rebind of the columns ``rebound`` leaves in
        place (every one when the rebind writes, else the written ones; scalar columns
        aside), sorted by start with each one's furthest reach so far: None if none."""
        key = (rebound, writes)
        if key in self._rebind_cache:
            return self._rebind_cache[key]
        spans = []
        for c in self.sweep.columns:
            col = self._lists.get(c.name)
            if c.name in rebound or c.role == "scalar" or not col \
                    or not (writes or c.name in self.written):
                continue
            spans.extend(_span(t) for t in col if t is not None and t.numel())
        kept = None
        if spans:
            spans.sort()
            kept = ([a for a, _ in spans], list(itertools.accumulate((b for _, b in spans),
                                                                     max)))
        self._rebind_cache[key] = kept
        return kept

    def _as_planned(self, names, col):
        """``col`` has the dtypes and sizes every column of ``names`` was planned for
        (None entries, addresses without their tensors from a sweep rebound before,
        aside). The tensors are read once, whatever the number of columns."""
        plans = [self._planned.get(name) for name in names]
        if any(p is None or len(col) != len(p[0]) for p in plans):
            return False
        try:
            have = (tuple(map(_dtype_of, col)), tuple(map(_numel, col)))
        except (AttributeError, TypeError):  # a None among them
            return all(t is None or (t.dtype == d and t.numel() == k)
                       for plan in plans for t, d, k in zip(col, *plan))
        return all(have == plan for plan in plans)

    def _on_device(self, col):
        """Every tensor of ``col`` (None entries, addresses without their tensors from a
        sweep rebound before, aside) is on this sweep's device. On CUDA by device index
        (``get_device``: a third of the cost of comparing ``torch.device`` objects, paid
        at every rebind)."""
        device = self.device
        if device.type == "cuda":
            try:
                return set(map(_get_device, col)) <= {device.index}
            except TypeError:  # a None among them
                return {t.get_device() for t in col if t is not None} <= {device.index}
        return all(t is None or t.device == device for t in col)

    def release(self, name):
        """Drop the references to column ``name``'s tensors until the next :meth:`rebind`
        (a kept CPU sweep must not keep a step's gradients alive)."""
        self._lists[name] = None
        for g in self.cpu_groups:
            g.lists[name] = None

    def buffers(self, group, name, like, dtype=torch.float32):
        """Persistent CPU-path buffers shaped and laid out as ``like`` (see :class:`Scratch`);
        for a :class:`GroupChunk`, views into buffers its group's ranges share."""
        if type(group) is GroupChunk:
            return self.scratch.shared((group.index, name, "ranges"), group.chunk,
                                       group.span, like, dtype)
        return self.scratch.like((group.index, name), like, dtype)

    def advance_empty_steps(self, found_inf, column="steps"):
        """Step counts of empty tensors advance here (no program runs for them; torch's
        count their steps too): +1, or +0 when ``found_inf`` is non-zero."""
        steps = self._lists.get(column) if self.empty_rows else None
        if steps is not None:
            rows = [steps[i] for i in self.empty_rows if steps[i] is not None]
            if rows:
                advance_steps(rows, found_inf)


class CpuGroup:
    """The rows of one dtype group on the production CPU path: ``lists`` maps every column
    to this group's tensors (None for an optional column absent from the group), in row
    order; ``dtypes`` is the group key (the dtype of each typed or optional column)."""
    __slots__ = ("index", "dtypes", "rows", "lists", "_pick", "_counts", "_scalars", "_chunks")

    def __init__(self, index, lists, rows, scalars=(), rehomed=None):
        self.index = index
        self.rows = rows
        self._pick = operator.itemgetter(*rows) if len(rows) > 1 else None
        self._counts = {}
        self._scalars = tuple(scalars)
        self._chunks = None
        self.lists = {}
        for name, col in lists.items():
            if col is None:
                self.lists[name] = None
                continue
            picked = [col[i] for i in rows]
            self.lists[name] = None if all(map(_is_none, picked)) else picked
        self.dtypes = tuple(None if v is None else v[0].dtype for v in self.lists.values())
        for name in (scalars if rehomed is None else rehomed):
            counts = _share_storage(self.lists.get(name))
            if counts is not None:
                self._counts[name] = [counts]

    def counted(self, name):
        """Column ``name``'s one-element tensors as a list to update with one foreach op:
        ``[buffer]`` when they were re-homed into one buffer (see :func:`_share_storage`),
        else the tensors themselves."""
        return self._counts.get(name) or self.lists[name]

    def __getitem__(self, name):
        return self.lists[name]

    def pick(self, col):
        """This group's rows of a full column, in row order."""
        if self._pick is None:
            return [col[self.rows[0]]]
        return list(self._pick(col))

    def chunks(self, limit):
        """``(ranges, span)``: the group's rows cut, in order, into ranges ``(a, b)`` of at
        most ``limit`` elements each (a larger tensor is a range of its own), and the most
        elements any range holds; ``([(0, n)], None)`` when the group fits in one range
        or a tensor of it is not dense (see :class:`GroupChunk`). Planned once per group:
        its tensors keep their shapes and strides (a rebind brings gradients laid out as
        the ones it replaces)."""
        if self._chunks is not None and self._chunks[0] == limit:
            return self._chunks[1]
        params = self.lists["params"]
        sizes = [t.numel() for t in params]
        ranges, span = [(0, len(params))], None
        dense = all(_dense(t) for name, col in self.lists.items()
                    if col is not None and name not in self._scalars
                    for t in col if t is not None)
        if sum(sizes) > limit and dense:
            ranges, a, n = [], 0, 0
            for i, size in enumerate(sizes):
                if i > a and n + size > limit:
                    ranges.append((a, i))
                    a, n = i, 0
                n += size
            ranges.append((a, len(sizes)))
            span = max(sum(sizes[a:b]) for a, b in ranges)
        self._chunks = (limit, (ranges, span))
        return ranges, span


class GroupChunk:
    """Rows ``[a, b)`` of a :class:`CpuGroup`, for a CPU step that runs a big group one
    range after another: its fp32 scratch (:meth:`Prepared.buffers`) is a set of views
    into buffers of ``span`` elements shared by every range of the group, so what one
    range writes there is still in cache when it is read back, and the scratch takes
    the memory of one range instead of the group's. Looks like a group to the steps:
    ``index``, ``lists`` (the rows' slices) and :meth:`counted`."""
    __slots__ = ("index", "lists", "chunk", "span", "_counts")

    def __init__(self, group, chunk, a, b, span):
        self.index = group.index
        self.chunk = chunk
        self.span = span
        self.lists = {name: None if col is None else col[a:b]
                      for name, col in group.lists.items()}
        # re-homed counts (one buffer, a slot per row in row order): the range's slots
        self._counts = {name: [counts[0][a:b]] for name, counts in group._counts.items()}

    def counted(self, name):
        return self._counts.get(name) or self.lists[name]


def _share_storage(tensors):
    """Re-home distinct one-element fp32 tensors (per-parameter step counts) into one
    contiguous buffer, each becoming a view of its slot (same tensor objects, same
    values, same shapes), and return the buffer: one in-place op then advances every
    count, where a foreach op over n tiny tensors costs a dispatch per tensor on a CPU.
    None (nothing changed) for fewer than two tensors or repeated ones."""
    if tensors is None or len(tensors) < 2 or any(map(_is_none, tensors)) \
            or len(set(map(id, tensors))) != len(tensors):
        return None
    buf = torch.cat([t.detach().reshape(1) for t in tensors])
    storage = buf.untyped_storage()
    try:
        with torch.no_grad():
            for i, t in enumerate(tensors):
                t.set_(storage, i, t.shape, t.stride())
    except RuntimeError:  # a tensor torch will not re-home (made by .detach()): the
        return None       # list is advanced as it is; moved ones keep their values
    return buf


def flat_views(flat, tensors):
    """Views of the 1-D buffer ``flat``, one per tensor of ``tensors`` (dense ones), laid
    out as it and placed one after another: the first ``sum(numel)`` elements."""
    views, offset = [], 0
    for t in tensors:
        views.append(flat.as_strided(t.shape, t.stride(), flat.storage_offset() + offset))
        offset += t.numel()
    return views


class Scratch:
    """Buffers the production CPU path keeps across steps (fp32 working copies of half
    parameters, fp32 gradients of fp32 masters). Whoever keeps a prepared sweep keeps its
    scratch across rebuilds (:class:`SweepCache`): on the CPU a gradient's address changes
    from step to step, so the sweep is re-prepared, but its buffers are not re-made.
    A buffer set is reused while the tensors it mirrors keep their shapes and strides."""
    __slots__ = ("_bufs",)

    def __init__(self):
        self._bufs = {}

    def like(self, key, tensors, dtype=torch.float32):
        sig = (dtype, tuple(map(_size, tensors)), tuple(map(_stride, tensors)))
        return self.kept(key, sig, lambda: [
            torch.empty_like(t, dtype=dtype, memory_format=torch.preserve_format)
            for t in tensors])

    def shared(self, key, chunk, span, tensors, dtype=torch.float32):
        """Views laid out as ``tensors`` (dense ones) into one buffer of ``span`` elements
        kept under ``key``: range ``chunk`` of a group whose ranges take turns in it."""
        flat = self.kept(key, (dtype, span),
                         lambda: torch.empty(span, dtype=dtype, device=tensors[0].device))
        sig = (flat.data_ptr(), tuple(map(_size, tensors)), tuple(map(_stride, tensors)))
        return self.kept(key + (chunk,), sig, lambda: flat_views(flat, tensors))

    def kept(self, key, sig=None, make=None):
        """What ``make()`` built under ``key``, kept while ``sig`` stays the same (made
        again when it changes). Without ``sig``: what is kept under ``key``, as it is
        (a caller that checked it earlier in the same step)."""
        hit = self._bufs.get(key)
        if sig is None:
            return hit[1]
        if hit is not None and hit[0] == sig:
            return hit[1]
        made = make()
        self._bufs[key] = (sig, made)
        return made


class StagedPrepared:
    """Base of a multi-stage op's prepared object (LAMB, NovoGrad, the l2-norm): the
    engine's :class:`Prepared` and what every stage reads of it; subclasses add the
    buffers and tables their stages share."""
    __slots__ = ("prepared", "n", "triton", "device")

    def __init__(self, prepared):
        self.prepared = prepared
        self.n = prepared.n
        self.triton = prepared.triton
        self.device = prepared.device

    @property
    def lists(self):
        """The validated lists, dense copies refreshed (what the reference path reads)."""
        return self.prepared.lists

    @property
    def rebindable(self):
        return self.prepared.rebindable

    def rebind(self, name, tensors, *same_as, addresses=None):
        return self.prepared.rebind(name, tensors, *same_as, addresses=addresses)

    def release(self, name):
        self.prepared.release(name)


def layout_key(tensors, op="tritamp", name="gradient"):
    """(addresses, layout) of ``tensors`` (None entries allowed): the cheap key under
    which a caller keeps a prepared sweep. ``layout`` is the tensors' strides, element
    counts and dtypes: with its address, what a kept sweep read or wrote of a tensor.
    Each can change at the same address: a parameter narrowed through ``.data``
    (``p.data = p.data[:k]``, an embedding cut down) keeps its address and strides, and
    a gradient of another dtype (``grad_dtype=None``) may land in a freed one's block.
    (A dense tensor's strides and element count give its shape; the rest of a shape, a
    non-dense view made with ``as_strided`` over the same address, strides and count, is
    not in the key.)
    A sparse tensor (no address) raises :func:`sparse_error`, naming ``name`` and its
    index (``op`` says who refuses it)."""
    try:
        return tuple(map(_data_ptr, tensors)), (tuple(map(_stride, tensors)),
                                                tuple(map(_numel, tensors)),
                                                tuple(map(_dtype_of, tensors)))
    except TypeError:  # a None among them
        pass
    except RuntimeError:  # a tensor without storage: sparse, said below
        pass
    for i, t in enumerate(tensors):
        if t is not None and t.layout != torch.strided:
            raise sparse_error(op, f"{name} {i}", t)
    return (tuple([0 if t is None else t.data_ptr() for t in tensors]),
            (tuple([None if t is None else t.stride() for t in tensors]),
             tuple([0 if t is None else t.numel() for t in tensors]),
             tuple([None if t is None else t.dtype for t in tensors])))


def borrowed(tensors):
    """Tensors that alias ``tensors``' memory without keeping it alive (None stays None).

    What a caller gives :meth:`Sweep.prepare` for gradients when it keeps the prepared
    sweep across steps: holding the gradients themselves would keep each step's
    gradients allocated after ``zero_grad(set_to_none=True)``, so the next backward's
    would land elsewhere and every step would miss the cache (and hold two sets of
    gradients). A borrowed tensor is only read through while the caller's key (addresses
    and strides) says the memory is the current gradient's; the same tensor object is
    borrowed once, so identity between lists is kept."""
    made = {}
    out = []
    for t in tensors:
        if t is None:
            out.append(None)
            continue
        alias = made.get(id(t))
        if alias is None:
            alias = made[id(t)] = _borrow(t)
        out.append(alias)
    return out


def _borrow(t):
    construct = getattr(torch._C, "_construct_storage_from_data_pointer", None)
    if construct is None or t.layout != torch.strided or t.is_meta:
        # no non-owning storage in this torch, or no plain memory to alias (a sparse or
        # meta tensor, which the sweep's checks then refuse by name): hold it
        return t
    storage = t.untyped_storage()
    return t.new_empty(0).set_(construct(storage.data_ptr(), t.device, storage.nbytes()),
                               t.storage_offset(), t.shape, t.stride())


class SweepCache:
    """What a caller keeps between steps: the key its tensors had, the prepared sweep, and
    the CPU path's scratch buffers (kept across rebuilds).

    ``get(key)`` returns the prepared sweep when ``key`` is the one it was built for.
    ``states`` (the caller's): ``(tensors, addresses)`` of the state the sweep holds, for
    a caller whose key does not cover them."""
    __slots__ = ("key", "prepared", "builds", "scratch", "states")

    def __init__(self):
        self.key = None
        self.prepared = None
        self.builds = 0
        self.scratch = Scratch()
        self.states = None

    def get(self, key):
        if self.prepared is not None and key == self.key:
            return self.prepared
        return None

    def put(self, key, prepared):
        self.key = key
        self.prepared = prepared
        self.builds += 1
        _give_scratch(prepared, self.scratch)
        return prepared


def list_layout(tensors, op="tritamp", name="gradient"):
    """``(addresses, layout, triton)`` of a list of tensors: their addresses; what a
    sweep prepared over them depends on besides (strides, shapes, dtypes, device, and
    whether the Triton path runs it); that path. The key of :class:`KeptByLayout`.
    (``name``: what a refusal of a sparse one calls the tensors, see :func:`layout_key`.)"""
    addresses, layout = layout_key(tensors, op=op, name=name)
    triton = use_triton(tensors[0])
    return addresses, (layout, tuple(map(_size, tensors)), tensors[0].device, triton), triton


class KeptByLayout:
    """Sweeps kept per list layout (:func:`list_layout`), the ``size`` most recently
    used, each with the addresses its device tables hold: for a caller handed new lists
    at every call (``clip_grad_norm_``, fp16_utils' per-step helpers), which would
    otherwise validate, plan and upload at every call. What it keeps must not hold the
    tensors (prepare over :func:`borrowed` ones)."""
    __slots__ = ("size", "entries")

    def __init__(self, size):
        self.size = size
        self.entries = collections.OrderedDict()  # layout -> [addresses, kept]

    def get(self, addresses, layout, triton, prepare, rebind):
        """The kept sweep(s) of ``layout``: as they are when the Triton path's tables
        hold ``addresses``; else ``rebind(kept, addresses)`` gives them this call's
        tensors (returns whether it could); else ``prepare()`` makes new ones."""
        entry = self.entries.get(layout)
        if entry is not None:
            self.entries.move_to_end(layout)
            if (entry[0] == addresses and triton) or rebind(entry[1], addresses):
                entry[0] = addresses
                return entry[1]
        made = prepare()
        self.entries[layout] = [addresses, made]
        self.entries.move_to_end(layout)
        while len(self.entries) > self.size:
            self.entries.popitem(last=False)
        return made


def _give_scratch(prepared, scratch):
    """Point ``prepared`` (an engine Prepared, or an op's wrapper of one) at ``scratch``."""
    inner = prepared
    while not isinstance(inner, Prepared):
        inner = getattr(inner, "prepared", None)
        if inner is None:
            return
    inner.scratch = scratch


def zero_grads_(grads):
    """Zero gradients in place as ``Optimizer.zero_grad(set_to_none=False)`` does (each
    detached from any graph first), with one foreach launch per (device, dtype, tensor
    type): DTensor gradients (FSDP2) apart from plain ones, which a foreach op refuses
    to mix."""
    by_kind = {}
    for g in grads:
        if g.grad_fn is not None:
            g.detach_()
        else:
            g.requires_grad_(False)
        by_kind.setdefault((g.device, g.dtype, type(g)), []).append(g)
    for same in by_kind.values():
        torch._foreach_zero_(same)


_constants = {}


def device_constants(device, values, dtype=torch.float64):
    """A small device tensor of ``values`` (betas, factors), uploaded once per distinct
    tuple and device: a steady training loop uploads nothing."""
    key = (device, dtype, tuple(float(v) for v in values))
    t = _constants.get(key)
    if t is None:
        t = _upload(torch.tensor(key[2], dtype=dtype), device)
        if len(_constants) > 256:
            _constants.clear()
        _constants[key] = t
    return t


_AMP_ARGS = {"grad_scale": "the loss scale", "scale": "the loss scale",
             "found_inf": "the overflow flag",
             "global_grad_norm": "the gradients' total norm"}


def check_amp_args(device, **tensors):
    """Refuse (``ValueError``) an amp tensor given to an optimizer step (``grad_scale``,
    ``found_inf``, ``global_grad_norm``) that is not one element on ``device``: the
    kernels and torch's fused CPU ops read one value there, and one on another device or
    of another size was read wrongly or refused by torch after part of the step was
    written. None (not given) is accepted."""
    for name, x in tensors.items():
        if x is None:
            continue
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a one-element tensor or None, got "
                            f"{type(x).__name__}")
        if x.numel() != 1:
            raise ValueError(f"{name} must be a one-element tensor, got shape "
                             f"{tuple(x.shape)}; pass {_AMP_ARGS.get(name, 'it')} as one "
                             "value")
        if x.device != device:
            raise ValueError(f"{name} is on {x.device} but the tensors are on {device}; pass "
                             f"a tensor on {device}")


def host_number(x, name, where):
    """A real number given as a Python number or a one-element real tensor (read on the
    host), as a float: what a kernel takes as a launch argument. Anything else is refused
    in words naming ``where`` (the function) and ``name`` (the argument)."""
    if isinstance(x, torch.Tensor):
        if x.numel() != 1 or x.is_meta or x.is_complex() or x.dtype == torch.bool:
            raise ValueError(f"{where}: {name} must be a real number (or a one-element real "
                             f"tensor holding one), got a {x.dtype} tensor of shape "
                             f"{tuple(x.shape)} on {x.device}")
        return float(x)
    if isinstance(x, bool) or not isinstance(x, (int, float, np.integer, np.floating)):
        raise TypeError(f"{where}: {name} must be a real number, got {type(x).__name__} {x!r}")
    return float(x)


def scalar_arg(x, name, device):
    """A float hyperparameter or a one-element device tensor on ``device`` (read there)."""
    if isinstance(x, torch.Tensor):
        if x.numel() != 1:
            raise ValueError(f"{name} must be a float or a one-element tensor, got shape "
                             f"{tuple(x.shape)}")
        if x.is_complex():  # (the CPU path dropped the imaginary part; the kernels failed)
            raise ValueError(f"{name} must be real, got a {x.dtype} tensor")
        if x.device != device:
            raise ValueError(f"{name} is on {x.device} but the tensors are on {device}; pass a "
                             f"float or a tensor on {device}")
        return x.reshape(())
    return float(x)
