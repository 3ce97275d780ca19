"""Multi-tensor L2 norm (Apex's ``multi_tensor_l2norm``), one launch per dtype group.

``multi_tensor_l2norm(tensors, per_tensor=False, scale=None, found_inf=None)`` returns

    total      = sqrt(sum over all tensors, all elements of (x / scale)**2)   0-d fp32
    per_tensor = [sqrt(sum over the elements of x_i of (x_i / scale)**2)]    fp32 [n] or None

in fp32 whatever the tensors' dtype, in two stages and without reading anything back
to the host: every program squares and sums one block of one tensor into a partial
(one launch per dtype group into one buffer of partials); the total is torch's sum of
all partials, and per-tensor norms come from a second small launch that sums each
tensor's run of partials (the block map lays a tensor's blocks out consecutively). Both
reductions have a fixed order, so results are deterministic on the GPU.

``scale`` (a 0-d device tensor) gives the norm of ``x * (1 / scale)``: the norm of
unscaled gradients, with ``1/scale`` taken in fp64 and rounded to fp32 as
``torch.amp.GradScaler`` does; each element is unscaled before squaring, so scaled
fp32 gradients cannot overflow the square. ``found_inf`` (Apex's noop flag: any dtype,
shape ``[]`` or ``[1]``) is set to 1 when the total is not finite, that is when any
element is inf or NaN or the sum of squares overflows; it is never cleared.

The helpers :func:`segment_table` and :func:`reduce_segments` are shared with the LAMB
and NovoGrad launchers, which produce per-block partials of their own.
"""
import torch
import triton
import triton.language as tl

from ._dispatch import elementwise_settings, use_triton
from ._multi_tensor import _upload, plan_columns
from ._tl_utils import inv_scale, load_f32, sweep_block
from .check_unscale import _dense

# Partials summed per loop iteration of the segment stage (one program per tensor).
SEGMENT_BLOCK = 1024


@triton.jit
def _l2norm_partial_kernel(
    meta_ptr,        # int64 [n_tensors, 2]: tensor address, numel
    blocks_ptr,      # int32 [n_blocks, 2]: tensor index, block index within that tensor
    x_proto,         # a tensor of the group: carries the element type
    partials_ptr,    # fp32 [n_blocks]: this program's sum of squares goes to partials[pid]
    scale_ptr,       # fp32 scalar: the norm is of x * (1 / scale) (HAS_SCALE)
    HAS_SCALE: tl.constexpr,
    EMULATE_BF16_ROUNDING: tl.constexpr,  # interpreter only: see _tl_utils
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    tensor, row, offs, mask = sweep_block(meta_ptr, blocks_ptr, meta_ptr, 1, False, BLOCK)
    x_ptr = tl.load(row).to(tl.pointer_type(x_proto.dtype.element_ty))
    x = load_f32(x_ptr + offs, mask, EMULATE_BF16_ROUNDING)
    if HAS_SCALE:
        # Unscale before squaring: a scaled fp32 gradient's square may overflow.
        x = x * inv_scale(scale_ptr)
    # Masked lanes load 0 and add nothing; inf and NaN propagate into the partial.
    tl.store(partials_ptr + pid, tl.sum(x * x, axis=0))


@triton.jit
def _l2norm_segment_kernel(
    partials_ptr,      # fp32 [n_cols, partials_stride]: per-block partial sums
    partials_stride,   # elements between two columns of partials
    segments_ptr,      # int64 [n_tensors, 2]: index of a tensor's first partial, their count
    out_ptr,           # fp32 [n_cols, out_stride]: out[col, tensor] receives the result
    out_stride,        # elements between two columns of out
    SQRT: tl.constexpr,      # store sqrt(sum) (a norm) rather than the sum of squares
    BLOCK_R: tl.constexpr,
):
    # grid (n_tensors, n_cols): a fixed summation order, so the result is deterministic.
    t = tl.program_id(0).to(tl.int64)
    col = tl.program_id(1).to(tl.int64)
    start = tl.load(segments_ptr + 2 * t)
    count = tl.load(segments_ptr + 2 * t + 1)
    base = partials_ptr + col * partials_stride + start
    acc = tl.zeros([BLOCK_R], dtype=tl.float32)
    for off in range(0, count, BLOCK_R):
        idx = off + tl.arange(0, BLOCK_R)
        acc += tl.load(base + idx, mask=idx < count, other=0.0)
    total = tl.sum(acc, axis=0)
    if SQRT:
        total = tl.sqrt_rn(total)
    tl.store(out_ptr + col * out_stride + t, total)


_tables = {}
_TABLE_CACHE_SIZE = 64


def segment_pairs(pairs, device):
    """Cached int64 [n, 2] device table of (first partial, number of partials) pairs,
    uploaded once per distinct list: a steady training loop uploads nothing."""
    key = (device, tuple(pairs))
    table = _tables.get(key)
    if table is None:
        host = torch.tensor(key[1], dtype=torch.int64).reshape(-1, 2)
        table = _upload(host, device)
        if len(_tables) >= _TABLE_CACHE_SIZE:
            _tables.pop(next(iter(_tables)))
        _tables[key] = table
    return table


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


def reduce_segments(partials, segments, n_tensors, sqrt=True, out=None):
    """out[c, i] = (sqrt of) the sum of partials[c, start_i : start_i + count_i].

    ``partials`` fp32 [n_cols, n_partials] on a device where :func:`use_triton` holds;
    one launch of ``n_tensors * n_cols`` small programs."""
    n_cols = partials.shape[0]
    if out is None:
        out = torch.empty((n_cols, n_tensors), dtype=torch.float32, device=partials.device)
    if n_tensors == 0:
        return out
    _l2norm_segment_kernel[(n_tensors, n_cols)](
        partials, partials.stride(0), segments, out, out.stride(0), SQRT=sqrt,
        BLOCK_R=SEGMENT_BLOCK, num_warps=4)
    return out


def _flat(t):
    """A tensor whose storage holds exactly its elements (any order suits a norm)."""
    return t if _dense(t) else t.contiguous()


def _flag(found_inf, total):
    if found_inf is not None:
        found_inf.masked_fill_(~torch.isfinite(total).reshape(()), 1)


@torch.no_grad()
def multi_tensor_l2norm(tensors, per_tensor=False, scale=None, found_inf=None):
    """(total norm 0-d fp32, per-tensor norms fp32 [n] or None): see the module docstring.

    One launch per dtype group, a torch sum, and with ``per_tensor`` one more small
    launch. All tensors on one device. No host sync."""
    tensors = [_flat(t) for t in tensors]
    if not tensors or not use_triton(tensors[0]):
        return multi_tensor_l2norm_ref(tensors, per_tensor, scale, found_inf)
    device = tensors[0].device
    for t in tensors:
        if t.device != device:
            raise ValueError(f"multi_tensor_l2norm: tensors on {device} and {t.device}; "
                             "call it once per device")
    block, warps = elementwise_settings(device)
    groups = {}
    for i, t in enumerate(tensors):
        if t.numel() > 0:
            groups.setdefault(t.dtype, []).append(i)
    counts = block_counts([t.numel() for t in tensors], block)
    # Partials in group order; each tensor's blocks are consecutive within its group.
    order = [i for idx in groups.values() for i in idx]
    partials = torch.empty((1, max(1, sum(counts))), dtype=torch.float32, device=device)
    if not order:
        partials.zero_()
    base = 0
    for idx in groups.values():
        members = [tensors[i] for i in idx]
        pl = plan_columns([members], block)
        _l2norm_partial_kernel[(pl.n_blocks,)](
            pl.meta, pl.blocks, members[0], partials[0, base:],
            scale if scale is not None else partials,
            HAS_SCALE=scale is not None, EMULATE_BF16_ROUNDING=device.type != "cuda",
            BLOCK=block, num_warps=warps)
        base += pl.n_blocks
    total = partials.sum().double().sqrt().float()
    _flag(found_inf, total)
    if not per_tensor:
        return total, None
    # Segments in the caller's order, pointing into the group-ordered partials.
    start = {}
    pos = 0
    for i in order:
        start[i] = pos
        pos += counts[i]
    key = tuple((start.get(i, 0), counts[i] if i in start else 0) for i in range(len(tensors)))
    table = segment_pairs(key, device)
    norms = reduce_segments(partials, table, len(tensors), sqrt=True)
    return total, norms[0]


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
