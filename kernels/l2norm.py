"""Multi-tensor L2 norm (Apex's ``multi_tensor_l2norm``), one launch per dtype group.

``multi_tensor_l2norm(tensors, per_tensor=False, scale=None, found_inf=None)`` returns

    total      = sqrt(sum over all tensors, all elements of (x / scale)**2)   0-d fp32
    per_tensor = [sqrt(sum over the elements of x_i of (x_i / scale)**2)]    fp32 [n] or None

in fp32 whatever the tensors' dtype, in two stages and without reading anything back
to the host: every program of the sweep (``L2NORM``, one launch per dtype group) squares
and sums one block of one tensor into a partial; then one small launch sums runs of
partials: program 0 all of them (the total, and the overflow flag), program 1 + i the
run of tensor i (the block map lays a tensor's blocks out consecutively). Both
reductions have a fixed order, so results are deterministic on the GPU.

``scale`` (a 0-d device tensor) gives the norm of ``x * (1 / scale)``: the norm of
unscaled gradients, with ``1/scale`` taken in fp64 and rounded to fp32 as
``torch.amp.GradScaler`` does; each element is unscaled before squaring, so scaled
fp32 gradients cannot overflow the square. ``found_inf`` (Apex's noop flag: any dtype,
shape ``[]`` or ``[1]``) is set to 1 when the total is not finite, that is when any
element is inf or NaN or the sum of squares overflows; it is never cleared.

A norm does not depend on the order of the elements, so any tensor is accepted: one
that is not dense (a strided view) is read through a contiguous copy. Keep the result of
:func:`multi_tensor_l2norm_prepare` while the tensors stay the same and call
:func:`multi_tensor_l2norm_launch` on it: a steady loop then uploads and rebuilds nothing.

On the CPU without the interpreter :func:`multi_tensor_l2norm_cpu` runs instead: one
``torch._foreach_norm`` per dtype group (:class:`SquareSums`), then the reference's fp32
arithmetic on the per-tensor sums (a few ops on ``n`` values).

:class:`SegmentLayout` and :func:`reduce_segments` are shared with the LAMB and NovoGrad
launchers, whose first stage also writes per-block partials; :class:`SquareSums` and
a few helpers with their production CPU paths.
"""
import functools

import torch
import triton
import triton.language as tl

from ._multi_tensor import (Column, StagedPrepared, Sweep, _dense, _upload, check_amp_args,
                            device_constants)
from .launch import kept_kernel
from ._ref_utils import sqrt_rn
from ._tl_utils import column, inv_scale, load_f32, sweep_block

# Partials summed per loop iteration of the segment stage (one program per run).
SEGMENT_BLOCK = 1024
# Each group's partials and per-tensor results start at a multiple of this many
# elements (64 bytes): the per-group pointers the kernels get keep one alignment, so
# one compiled variant serves every group.
PAD = 16

L2NORM = Sweep("multi_tensor_l2norm", [
    Column("tensors", "param",
           dtypes=(torch.float32, torch.float16, torch.bfloat16, torch.float64)),
])
_X, = (L2NORM.col(n) for n in L2NORM.names)
_ROW = L2NORM.row_width


@triton.jit
def _l2norm_partial_kernel(
    meta_ptr,        # int64 [n_tensors, 2]: tensor address, numel (L2NORM's table)
    blocks_ptr,      # int32 [n_blocks, 2]: tensor index, block index within that tensor
    counters_ptr,    # unused (the sweep has no step column)
    x_proto,         # a tensor of the group: carries the element type
    partials_ptr,    # fp32 [n_blocks]: this group's partials; program pid writes [pid]
    scale_ptr,       # fp32 scalar: the norm is of x * (1 / scale) (HAS_SCALE)
    HAS_SCALE: tl.constexpr,
    VEC: tl.constexpr,                    # > 1: 16-byte aligned, numel % VEC == 0
    EMULATE_BF16_ROUNDING: tl.constexpr,  # interpreter only: see _tl_utils
    BLOCK: tl.constexpr,
):
    tensor, row, offs, mask = sweep_block(meta_ptr, blocks_ptr, scale_ptr, _ROW, False, VEC,
                                          BLOCK)
    inv = 1.0
    if HAS_SCALE:
        inv = inv_scale(scale_ptr)
    x = load_f32(column(row, _X, offs, x_proto, VEC), mask, EMULATE_BF16_ROUNDING)
    if HAS_SCALE:
        # Unscale before squaring: a scaled fp32 gradient's square may overflow.
        x = x * inv
    # Masked lanes load 0 and add nothing; inf and NaN propagate into the partial.
    tl.store(partials_ptr + tl.program_id(0), tl.sum(x * x, axis=0))


@triton.jit
def _l2norm_segment_kernel(
    partials_ptr,      # fp32 [n_cols, partials_stride]: per-block partials
    partials_stride,   # elements between two columns of partials
    segments_ptr,      # int64 [n_segments, 2]: index of a run's first partial, its length
    out_ptr,           # fp32 [n_cols, out_stride]: out[col, segment] receives the result
    out_stride,        # elements between two columns of out
    found_ptr,         # Apex's noop flag, any dtype: set to 1 when out[0, 0] is not finite
    SQRT: tl.constexpr,       # store sqrt(sum) (a norm) rather than the sum
    MAX_NORM: tl.constexpr,   # the max of the partials (NaN kept) rather than their sum
    FLAG_FIRST: tl.constexpr, # segment 0 of column 0 sets found_ptr when not finite
    BLOCK_R: tl.constexpr,
):
    # grid (n_segments, n_cols): a fixed summation order, so the result is deterministic.
    t = tl.program_id(0).to(tl.int64)
    col = tl.program_id(1).to(tl.int64)
    start = tl.load(segments_ptr + 2 * t)
    count = tl.load(segments_ptr + 2 * t + 1)
    base = partials_ptr + col * partials_stride + start
    acc = tl.zeros([BLOCK_R], dtype=tl.float32)
    if MAX_NORM:
        # tl.max drops NaN (the GPU's max.f32 and the interpreter alike): count it apart.
        bad = tl.zeros([BLOCK_R], dtype=tl.int32)
        for off in range(0, count, BLOCK_R):
            idx = off + tl.arange(0, BLOCK_R)
            x = tl.load(base + idx, mask=idx < count, other=0.0)
            bad = bad | (x != x).to(tl.int32)
            acc = tl.maximum(acc, x)
        total = tl.where(tl.max(bad, axis=0) > 0, float("nan"), tl.max(acc, axis=0))
    else:
        for off in range(0, count, BLOCK_R):
            idx = off + tl.arange(0, BLOCK_R)
            acc += tl.load(base + idx, mask=idx < count, other=0.0)
        total = tl.sum(acc, axis=0)
    if SQRT:
        # Correctly rounded: the same value as sqrt in fp64 rounded to fp32.
        total = tl.sqrt_rn(total)
    tl.store(out_ptr + col * out_stride + t, total)
    if FLAG_FIRST:
        bad_total = (total != total) | (tl.abs(total) == float("inf"))
        tl.store(found_ptr, 1, mask=bad_total & (t == 0) & (col == 0))


def reduce_segments(partials, segments, n_segments, sqrt=True, out=None, max_norm=False,
                    found_inf=None):
    """out[c, i] = (sqrt of) the sum (or with ``max_norm`` the max) of
    partials[c, start_i : start_i + count_i]; with ``found_inf``, out[0, 0] not finite
    sets it to 1.

    ``partials`` fp32 [n_cols, n_partials] on a device where Triton runs; ``segments``
    an int64 [n_segments, 2] device table (:func:`segment_table`); one launch of
    ``n_segments * n_cols`` small programs."""
    n_cols = partials.shape[0]
    if out is None:
        out = torch.empty((n_cols, n_segments), dtype=torch.float32, device=partials.device)
    if n_segments == 0:
        return out
    # A single column's stride is never used: 0 keeps one specialisation for every size.
    consts, ckey = segment_consts(bool(sqrt), bool(max_norm), found_inf is not None)
    # (the kernel looked up at the call: a test may swap the module's kernel)
    kept_kernel(_l2norm_segment_kernel).launch((n_segments, n_cols), (
        partials, partials.stride(0) if n_cols > 1 else 0, segments, out,
        out.stride(0) if n_cols > 1 else 0, found_inf if found_inf is not None else out),
        consts, ckey)
    return out


@functools.lru_cache(maxsize=None)
def segment_consts(sqrt, max_norm, flag_first):
    """(constexprs, their key) of the segment reduction, kept per combination of flags."""
    consts = dict(SQRT=sqrt, MAX_NORM=max_norm, FLAG_FIRST=flag_first,
                  BLOCK_R=SEGMENT_BLOCK, num_warps=4)
    return consts, tuple(consts.values())


def reduced_by_row(values, rows, n, norm_reduce, op):
    """``norm_reduce`` (see lamb_launch / novograd_launch) over ``values[..., j]``, the
    norm of row ``rows[j]`` of lists of ``n`` rows: laid out one entry per row, 0 for the
    rows not among ``rows`` (a process whose shard of them is empty), so that every
    process reduces the same layout. Returns that layout, reduced (the other rows hold
    the other processes' norms)."""
    full = values.new_zeros(values.shape[:-1] + (n,))
    full[..., rows] = values
    norm_reduce(full, op)
    return full


def reduce_by_rows(values, rows, n, norm_reduce, op):
    """:func:`reduced_by_row`, in ``values``' order."""
    return reduced_by_row(values, rows, n, norm_reduce, op)[..., rows]


def segment_pairs(pairs, device):
    """int64 [n, 2] device table of (first partial, number of partials) pairs."""
    host = torch.tensor(list(pairs), dtype=torch.int64).reshape(-1, 2)
    return _upload(host, device)


def segment_table(counts, device):
    """The segment table for runs of ``counts`` partials laid end to end."""
    pairs, pos = [], 0
    for c in counts:
        pairs.append((pos, c))
        pos += c
    return segment_pairs(pairs, device)


def block_counts(numels, block):
    """Blocks per tensor in a launch plan of ``block`` elements per program."""
    return [(n + block - 1) // block for n in numels]


def _round_up(x, k):
    return (x + k - 1) // k * k


class SegmentLayout:
    """Where a prepared sweep's per-block partials and per-tensor results go.

    Group ``k`` writes its partials from index ``block_bases[k]`` of one shared buffer
    (``n_partials`` long) and finds its tensors' results from ``result_bases[k]`` of one
    results buffer (``n_results`` long); both bases are multiples of :data:`PAD`.
    ``runs[i]`` is the (first partial, count) run of row ``i`` of the prepared lists
    ((0, 0) for an empty tensor) and ``result_rows`` the results row of each run, in
    results order, padding rows included as (0, 0). Host data only: the op uploads the
    table it needs once."""
    __slots__ = ("block_bases", "result_bases", "n_partials", "n_results", "runs", "result_runs")

    def __init__(self, prepared):
        anchor = prepared.lists[prepared.sweep.columns[0].name]
        self.runs = [(0, 0)] * prepared.n
        self.block_bases, self.result_bases = [], []
        result_runs = []
        pos = 0
        for g in prepared.groups:
            pos = _round_up(pos, PAD)
            self.block_bases.append(pos)
            result_runs += [(0, 0)] * (_round_up(len(result_runs), PAD) - len(result_runs))
            self.result_bases.append(len(result_runs))
            for i in g.rows:
                count = (anchor[i].numel() + g.block - 1) // g.block
                self.runs[i] = (pos, count)
                result_runs.append((pos, count))
                pos += count
        self.n_partials = max(PAD, _round_up(pos, PAD))
        self.n_results = max(PAD, _round_up(len(result_runs), PAD))
        self.result_runs = result_runs + [(0, 0)] * (self.n_results - len(result_runs))



class L2NormPrepared(StagedPrepared):
    """A prepared :data:`L2NORM` sweep with its segment table and partials buffer.

    ``partials`` is allocated once and zeroed once: the padding between groups is never
    written, so the total (program 0 of the segment stage) can sum the whole buffer."""
    __slots__ = ("partials", "group_partials", "segments", "cpu")

    def __init__(self, prepared):
        super().__init__(prepared)
        self.partials = self.group_partials = self.segments = None
        self.cpu = {}  # the CPU path's _L2NormCpuPlan per exactness, built on first use
        if not self.triton:
            return
        layout = SegmentLayout(prepared)
        self.partials = torch.zeros((1, layout.n_partials), dtype=torch.float32,
                                    device=self.device)
        self.group_partials = [(self.partials[0, b:],) for b in layout.block_bases]
        # Row 0: every partial (the total); row 1 + i: tensor i's run, in the caller's order.
        pairs = [(0, layout.n_partials)] + layout.runs
        self.segments = segment_pairs(pairs, self.device)


    def rebind(self, name, tensors, addresses=None):
        """The same validated norm over new tensors (see :meth:`Prepared.rebind`); the CPU
        plans hold views of the old ones and are made again at the next launch."""
        self.cpu = {}
        return self.prepared.rebind(name, tensors, addresses=addresses)

    def release(self, name):
        self.prepared.release(name)
        self.cpu = {}


def multi_tensor_l2norm_prepare(tensors):
    """Validate and plan the norm of ``tensors`` (one device; fp32/fp16/bf16/fp64; any
    layout: a tensor that is not dense is read through a contiguous copy, refreshed at
    every launch). Keep the result while the tensors stay the same."""
    tensors = list(tensors)
    staged = []
    for i, t in enumerate(tensors):
        if isinstance(t, torch.Tensor) and not _dense(t):
            tensors[i] = t.contiguous()
            staged.append((t, tensors[i]))
    prepared = L2NORM.prepare(dict(tensors=tensors))
    prepared.staged.extend(staged)  # refreshed at every launch: a kept plan reads today's values
    return L2NormPrepared(prepared)


def multi_tensor_l2norm_launch(prepared, per_tensor=False, scale=None, found_inf=None):
    """(total norm 0-d fp32, per-tensor norms fp32 [n] or None) of a prepared list: one
    launch per dtype group and one small launch for the totals. No host sync."""
    if prepared.n:  # (an empty list has no device, and nothing is read)
        check_amp_args(prepared.device, scale=scale, found_inf=found_inf)
    if not prepared.triton:
        return multi_tensor_l2norm_cpu(prepared, per_tensor, scale, found_inf)
    prepared.prepared.launch(_l2norm_partial_kernel,
                             (scale if scale is not None else prepared.partials,),
                             dict(HAS_SCALE=scale is not None),
                             group_args=prepared.group_partials)
    n_out = prepared.n + 1 if per_tensor else 1
    out = torch.empty((1, n_out), dtype=torch.float32, device=prepared.device)
    reduce_segments(prepared.partials, prepared.segments, n_out, sqrt=True, out=out,
                    found_inf=found_inf)
    return out[0, 0], (out[0, 1:] if per_tensor else None)


@torch.no_grad()
def multi_tensor_l2norm(tensors, per_tensor=False, scale=None, found_inf=None):
    """(total norm 0-d fp32, per-tensor norms fp32 [n] or None): see the module docstring.

    One launch per dtype group and one small launch for the totals. All tensors on one
    device. No host sync."""
    return multi_tensor_l2norm_launch(multi_tensor_l2norm_prepare(tensors), per_tensor, scale,
                                      found_inf)


# --- the production CPU path -------------------------------------------------------------

# fp32 tensors longer than this are normed in pieces of this many elements.
FP32_PIECE = 32768
# Other dtypes are normed in fp64 in pieces of this many elements.
FP64_PIECE = 16384


def _flat(t):
    """``t``'s elements as one 1-D view (``t`` dense: its storage span is its elements)."""
    if t.is_contiguous():
        return t.view(-1)
    return t.as_strided((t.numel(),), (1,), t.storage_offset())


class SquareSums:
    """Per-tensor sums of squares, fp64 [n], of a fixed list of dense tensors of one
    dtype: one ``torch._foreach_norm`` over the tensors (long ones in pieces, views
    built once) and a few ops on the results, whatever the number of tensors.

    Why pieces. torch's fp32 CPU norm kernel accumulates a tensor in one vector
    register, so its relative error grows with the length: 1e-6 at 256K elements, 1e-4
    at 4M. Normed in pieces of :data:`FP32_PIECE` elements whose squares are added in
    fp64, fp32 tensors come within ~5e-7 of the exact sum (measured on normal data); on
    values with few significant bits (half values held in fp32) that kernel's rounding
    is biased and the error reaches ~6e-6. As in the oracle's fp32 sum, squares beyond
    the fp32 range give inf. Other dtypes, and fp32 with ``exact=True``, are normed in
    fp64: exactly, and without overflow (torch converts each piece of
    :data:`FP64_PIECE` elements to a 128 KB fp64 temporary; a model-sized temporary per
    tensor would cost page faults on every step); ~3x the fp32 norm's time."""
    __slots__ = ("n", "parts", "index", "dtype", "device")

    def __init__(self, tensors, exact=False):
        tensors = list(tensors)
        self.n = len(tensors)
        self.device = tensors[0].device
        fp32 = tensors[0].dtype == torch.float32 and not exact
        self.dtype = None if fp32 else torch.float64
        piece = FP32_PIECE if fp32 else FP64_PIECE
        limit = 2 * piece if fp32 else piece
        self.parts, self.index = tensors, None
        if any(t.numel() > limit for t in tensors):
            pieces = [_flat(t).split(piece) if t.numel() > limit else (t,) for t in tensors]
            self.parts = [x for ps in pieces for x in ps]
            counts = torch.tensor([len(ps) for ps in pieces])
            self.index = torch.repeat_interleave(torch.arange(self.n), counts).to(self.device)

    def __call__(self):
        sq = torch.stack(torch._foreach_norm(self.parts, 2, dtype=self.dtype)).double().square()
        if self.index is None:
            return sq
        return torch.zeros(self.n, dtype=torch.float64, device=self.device).index_add_(
            0, self.index, sq)


class _L2NormCpuPlan:
    """Per CPU group its :class:`SquareSums`, and the permutation from the groups' order
    back to the caller's (None: the same)."""
    __slots__ = ("sums", "order")

    def __init__(self, prepared, exact):
        groups = prepared.prepared.cpu_groups
        self.sums = [SquareSums(g["tensors"], exact) for g in groups]
        rows = [i for g in groups for i in g.rows]
        self.order = None
        if rows != list(range(len(rows))):
            order = torch.empty(len(rows), dtype=torch.int64)
            order[torch.tensor(rows)] = torch.arange(len(rows))
            self.order = order.to(prepared.device)


def multi_tensor_l2norm_cpu(prepared, per_tensor=False, scale=None, found_inf=None):
    """The production CPU path of :func:`multi_tensor_l2norm_launch`: the reference's
    results from one ``torch._foreach_norm`` per dtype group.

    The reference sums each tensor's squares in fp32 and takes fp64 square roots of
    fp32 sums. Here each tensor's sum comes from :class:`SquareSums` (fp64, or fp32
    pieces added in fp64), is rounded once to fp32 (inf where an fp32 sum overflows) and
    from there the reference's own ops run on the ``n`` sums: the total is the fp32 sum
    of the per-tensor fp32 sums, ``found_inf`` is set when it is not finite (an inf or
    NaN element, or squares beyond the fp32 range). With ``scale`` the tensors are
    normed exactly (fp64) and the sums multiplied by ``inv**2`` (exact in fp64): the norm
    of the unscaled elements, whose squares overflow only where the reference's do
    (raw fp32 squares of scaled gradients could overflow where those do not). Nothing
    is read back to the host."""
    n = prepared.n
    if n == 0:
        total = torch.zeros((), dtype=torch.float32)
        return total, (torch.zeros(0, dtype=torch.float32) if per_tensor else None)
    exact = scale is not None
    plan = prepared.cpu.get(exact)
    if plan is None:
        plan = prepared.cpu[exact] = _L2NormCpuPlan(prepared, exact)
    sums = []
    prepared.prepared.run_cpu(lambda g: sums.append(plan.sums[g.index]()))
    sq = sums[0] if len(sums) == 1 else torch.cat(sums)
    if plan.order is not None:
        sq = sq[plan.order]
    if scale is not None:
        inv = scale.double().reciprocal().float().double().reshape(())
        sq = sq * (inv * inv)  # inv has 24 significant bits: inv * inv is exact in fp64
    sq = sq.float()
    total = sqrt_rn(sq.sum())
    _flag(found_inf, total)
    return total, (sqrt_rn(sq) if per_tensor else None)


# --- shared with the LAMB and NovoGrad CPU paths ------------------------------------------

def scalar_views(tensors):
    """One-element views of one-element tensors (``[]`` or ``[1]``): ``torch.cat`` of
    them is the vector of their current values, and ``torch._foreach_copy_`` into them
    from ``vector.split(1)`` writes it back. Built once per prepared sweep."""
    return [t.view(1) for t in tensors]


def bias_correction_terms(steps, beta):
    """``1 - beta**(step + 1)`` per step count (fp64 [n]; ``steps`` fp32 [n]), with the
    reference's ops (an fp64 power through exp2 and log2)."""
    b = device_constants(steps.device, (beta,))
    return 1.0 - torch.exp2((steps.double() + 1.0) * torch.log2(b[0]))


def _flag(found_inf, total):
    if found_inf is not None:
        found_inf.masked_fill_(~torch.isfinite(total).reshape(()), 1)


@torch.no_grad()
def multi_tensor_l2norm_ref(tensors, per_tensor=False, scale=None, found_inf=None):
    """Torch reference of :func:`multi_tensor_l2norm` (fp32 sums of squares)."""
    tensors = list(tensors)
    device = tensors[0].device if tensors else torch.device("cpu")
    inv = None if scale is None else scale.double().reciprocal().float().reshape(())
    sums = []
    for t in tensors:
        x = t.detach().float().reshape(-1)
        if inv is not None:
            x = x * inv
        sums.append((x * x).sum())
    sq = torch.stack(sums) if sums else torch.zeros(0, dtype=torch.float32, device=device)
    total = sq.sum().double().sqrt().float()
    _flag(found_inf, total)
    return total, (sq.double().sqrt().float() if per_tensor else None)
