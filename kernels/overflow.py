"""Which tensors overflowed: per-tensor counts of non-finite values, on skipped steps only.

``count_nonfinite(srcs, counts, found_inf, index=None)`` adds to ``counts[index[i]]``
(int32; ``index[i] = i`` by default, one count per tensor) the number of inf and NaN
elements of ``srcs[i]`` **when ``found_inf`` is non-zero**, and does nothing otherwise. The flag is read on the device: every program
of the launch reads it first and returns at once on a clean step, so a training loop
launches this once per step and it reads no gradient unless the step is being skipped
(the second pass over the gradients that names what overflowed happens on skipped steps
only). Counts accumulate (atomic adds of whole integers: exact, in any order) until the
caller reads and zeroes them; nothing is read back to the host here.

The sweep is declared once (``COUNT_NONFINITE``) and goes through the multi-tensor
engine; sources must be dense (every gradient of a dense parameter is): a non-dense one
is refused before anything is written. Keep :func:`count_nonfinite_prepare`'s result
while the tensors stay the same and call :func:`count_nonfinite_launch` on it.

On a CPU without the interpreter, :func:`count_nonfinite_cpu` reads the flag from host
memory (a CPU tensor: no device to wait for) and counts with torch ops only when it is
set.
"""
import torch
import triton
import triton.language as tl

from ._multi_tensor import Column, Sweep, _dense, check_amp_args
from ._tl_utils import column, load_f32, sweep_block
from .check_unscale import LayoutPrepared, Layouts, check_lists

COUNT_NONFINITE = Sweep("count_nonfinite", [Column("srcs", "param")])
_S = COUNT_NONFINITE.col("srcs")
_ROW = COUNT_NONFINITE.row_width


@triton.jit
def _count_nonfinite_kernel(
    meta_ptr,        # int64 [n_tensors, 2]: the source's address, then numel
    blocks_ptr,      # int32 [n_blocks, 2]: tensor index, block index within that tensor
    counters_ptr,    # unused (the sweep has no step column)
    src_proto,       # a source tensor of the group: carries the element type
    rows_ptr,        # int32 [n_tensors]: each tensor's position in counts
    counts_ptr,      # int32: non-finite elements, accumulated
    found_inf_ptr,   # fp32 scalar: count only when non-zero (a skipped step)
    VEC: tl.constexpr,             # > 1: every address 16-byte aligned, numel % VEC == 0
    EMULATE_BF16_ROUNDING: tl.constexpr,  # interpreter only: see _tl_utils
    BLOCK: tl.constexpr,
):
    if tl.load(found_inf_ptr) != 0.0:
        tensor, row, offs, mask = sweep_block(meta_ptr, blocks_ptr, found_inf_ptr, _ROW, False,
                                              VEC, BLOCK)
        x = load_f32(column(row, _S, offs, src_proto, VEC), mask, EMULATE_BF16_ROUNDING)
        bad = mask & ((x != x) | (tl.abs(x) == float("inf")))
        n = tl.sum(bad.to(tl.int32), axis=0)
        if n > 0:
            tl.atomic_add(counts_ptr + tl.load(rows_ptr + tensor), n)


def count_nonfinite_prepare(srcs, index=None):
    """Validate and plan a count over ``srcs`` (dense fp32/fp16/bf16 tensors on one
    device) into ``counts[index[i]]`` (default ``index[i] = i``): keep the result while
    the tensors stay the same. Bad lists raise before anything is written."""
    srcs = list(srcs)
    op = COUNT_NONFINITE.name
    check_lists(op, [("srcs", srcs)])
    for i, t in enumerate(srcs):
        if not _dense(t):
            raise ValueError(f"{op}: srcs[{i}] of shape {tuple(t.shape)} has strides "
                             f"{t.stride()}, not a dense layout; pass a dense tensor "
                             f"(srcs[{i}].contiguous())")
    default = index is None
    index = _check_index(index, len(srcs))
    prepared = COUNT_NONFINITE.prepare(dict(srcs=srcs))
    rows = [torch.tensor([index[r] for r in g.rows], dtype=torch.int32).to(prepared.device)
            for g in prepared.groups]
    return LayoutPrepared(prepared, dict(srcs=srcs), Layouts(),
                          dict(rows=rows, index=index, default=default))


def _check_index(index, n):
    if index is None:
        return list(range(n))
    index = list(index)
    if len(index) != n or any(isinstance(i, bool) or not isinstance(i, int) or i < 0
                              for i in index):
        raise ValueError(f"count_nonfinite: index must hold one int >= 0 per source ({n}), "
                         f"got {index!r}; pass each source's position in counts")
    return index


def _check_counts(counts, index, device, default):
    """``counts``: contiguous int32 on ``device``, one entry per source (``default``: no
    index was given) or at least ``max(index) + 1`` (an index given: the positions of a
    caller's sources in a longer ``counts``, the first ones of it say, when a backward
    reached only the leading parameters of an optimizer)."""
    n = len(index)
    need = max(index, default=-1) + 1
    ok = (isinstance(counts, torch.Tensor) and counts.dtype == torch.int32
          and counts.dim() == 1 and device in (None, counts.device) and counts.is_contiguous()
          and (counts.shape == (n,) if default else counts.numel() >= need))
    if not ok:
        got = (f"{counts.dtype} {tuple(counts.shape)} on {counts.device}"
               if isinstance(counts, torch.Tensor) else type(counts).__name__)
        size = f"of shape ({n},)" if default else f"of at least {need} entries"
        raise ValueError(f"count_nonfinite: counts must be a contiguous int32 tensor {size} "
                         f"on {device} (one count per source), got {got}; pass "
                         f"torch.zeros({n if default else need}, dtype=torch.int32, "
                         "device=...)")


def count_nonfinite_launch(prepared, counts, found_inf):
    """One count over a prepared sweep (see the module docstring): one launch per dtype
    group on the Triton path; nothing synchronised with the host."""
    _check_counts(counts, prepared.options["index"], prepared.device,
                  prepared.options["default"])
    if not isinstance(found_inf, torch.Tensor):
        raise TypeError("count_nonfinite: found_inf must be a one-element tensor (the "
                        f"overflow flag the counts are kept for), got {type(found_inf).__name__}")
    if prepared.n == 0:  # (no sources, so no device to check the flag against)
        check_amp_args(found_inf.device, found_inf=found_inf)
        return
    check_amp_args(prepared.device, found_inf=found_inf)
    if not prepared.triton:
        count_nonfinite_cpu(prepared, counts, found_inf)
        return
    prepared.launch(_count_nonfinite_kernel, (counts, found_inf), None,
                    group_args=[(r,) for r in prepared.options["rows"]])


@torch.no_grad()
def count_nonfinite_cpu(prepared, counts, found_inf):
    """The production CPU path: the flag read from host memory (no device to wait for),
    then, on a skipped step only, one count per tensor."""
    # (any one-element shape and dtype: numpy reads neither a (1,) array as a float nor bf16)
    if float(found_inf.detach().reshape(()).float().numpy()) == 0.0:
        return
    srcs = prepared.lists["srcs"]
    n = torch.stack([(~torch.isfinite(x)).sum() for x in srcs]).to(torch.int32)
    counts.index_add_(0, torch.tensor(prepared.options["index"]), n)


def count_nonfinite(srcs, counts, found_inf, index=None):
    """Add the number of inf/NaN elements of each ``srcs[i]`` to ``counts[index[i]]``
    (int32; ``index`` defaults to ``i``) when ``found_inf`` is non-zero (see the module
    docstring)."""
    count_nonfinite_launch(count_nonfinite_prepare(srcs, index), counts, found_inf)


@torch.no_grad()
def count_nonfinite_ref(srcs, counts, found_inf, index=None):
    """Torch reference of :func:`count_nonfinite`."""
    srcs = list(srcs)
    if not srcs:
        return
    index = _check_index(index, len(srcs))
    n = torch.stack([(~torch.isfinite(x)).sum() for x in srcs]).to(torch.int32)
    n = torch.where(found_inf != 0, n, torch.zeros_like(n))
    counts.index_add_(0, torch.tensor(index, device=counts.device), n)
