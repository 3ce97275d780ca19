"""Batch-norm statistics, normalisation and gradients for SyncBatchNorm.

Every launcher takes the input in one of two canonical views, both contiguous:

    [M, C]      channels last: C contiguous channels per row (Apex's ``channel_last``,
                torch's ``channels_last`` memory format, 2-D input)
    [N, C, B]   channels first: B contiguous elements per (sample, channel) plane

and reduces, per channel, over everything but C. The stages:

``syncbn_stats(x) -> (rows, shift)``
    fp32 rows ``[P, 2C + 1]`` of per-program partial statistics ``(mean[C], m2[C], count)``,
    ``m2 = sum((x - mean)^2)``. The reduced dimension is split over many programs per
    channel block (grid: channel blocks x chunks). Each program runs Welford's update in
    every lane of its tile over its tiles (the loop only loads and updates registers) and
    merges the lanes once, after the loop, with Chan's parallel formula, all relative to
    ``shift`` (the input's first value per channel, the same in every program), so
    nothing computes E[x^2] - E[x]^2 (which loses every digit when the mean is large
    against the spread) and merged means keep their digits.
``syncbn_combine(rows, shift) -> row``
    one row ``[2C + 1]`` of absolute statistics: what the ranks exchange (one all_gather of
    ``world x (2C + 1)`` values).
``syncbn_finalize(rows, eps, running_mean, running_var, momentum, num_batches_tracked,
shift) -> (mean, invstd, count)``
    merges rows (a rank's partials or every rank's row; counts may differ and may be 0)
    into ``mean``, ``invstd = 1 / sqrt(var + eps)`` and the total count, and updates the
    running statistics in the same launch: ``r = f * stat + (1 - f) * r`` with the
    unbiased variance and ``f = momentum``, or ``1 / num_batches_tracked`` read on the
    device (no host sync for the cumulative average). Every lane of a program's tile
    merges its own rows (Chan's formula) in the loop; the lanes are merged after it.
``syncbn_forward(x, mean, invstd, weight, bias, z, relu) -> y``
    ``y = (x - mean) * (invstd * weight) + bias (+ z)``, ReLU optional, in x's dtype.
``syncbn_backward_reduce(dy, x, ...) -> (sums, grad_weight, grad_bias)``
    local ``sum_dy`` and ``sum_dy_xmu = sum(dy * (x - mean))`` (one packed fp32 ``[2C]``
    tensor, the one all_reduce of the backward) with the local ``grad_weight`` and
    ``grad_bias``; with a fused ReLU, ``dy`` is masked where the recomputed output is <= 0.
    Each lane of a program's tile keeps a Kahan-compensated running sum over the
    program's tiles, reduced once after the loop; the chunks are added in fp64 (a
    running sum per lane of the merge's tile, summed after its loop).
``syncbn_backward_input(dy, x, ..., sums, count) -> (dx, dz)``
    ``dx = (dy - sum_dy / n - (x - mean) * invstd^2 * sum_dy_xmu / n) * invstd * weight``
    (``sums=None``: running statistics were used, ``dx = dy * invstd * weight``), and the
    residual's gradient (the masked ``dy``) when asked.

Inputs may be fp32, fp16 or bf16 with parameters and running statistics of any of those
dtypes; arithmetic is fp32, statistics are fp32, outputs take the input's dtype and
parameter gradients the parameter's. Reductions run in a fixed order: no atomics, so
results do not depend on scheduling. Divisions and square roots are IEEE-rounded.
"""

import torch
import triton
import triton.language as tl

from ._dispatch import cdiv, gpu_code_path, next_power_of_2, sm_count, use_triton
from .launch import kept_kernel
from ._tl_utils import load_f32, store_cast
from ._multi_tensor import host_number


# -- kernels -------------------------------------------------------------------------------
@triton.jit
def _syncbn_tile(seg, c0, col_mask, M, C, B, NBB, CHANNELS_LAST: tl.constexpr,
                 BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """Offsets, mask and element count per channel of tile ``seg``: the BLOCK_C channels
    from ``c0`` x BLOCK_R reduced elements (rows of [M, C], or a run of one plane of
    [N, C, B]).

    The reduced axis is axis 1 in both layouts (the interpreter then sums pairwise, as
    numpy does along the last axis, rather than row after row). An input, and one sample
    of it, may hold more than 2**31 elements (``seg`` and ``c0`` are int64): ``base`` is
    int64, the start of each channel's run (a [BLOCK_C, 1] column) in channels-first
    order or of the tile (a scalar) in channels-last order. ``offs`` is int32: it spans
    one run (below BLOCK_R) or one tile (below BLOCK_R * C, which _Geometry keeps under
    2**31), and int32 per element costs fewer registers than int64."""
    r = tl.arange(0, BLOCK_R)
    lc = tl.arange(0, BLOCK_C)
    if CHANNELS_LAST:
        start = seg * BLOCK_R
        base = start * C + c0
        offs = lc[:, None] + r[None, :] * C
        rmask = r < M - start
        k = tl.minimum(M - start, BLOCK_R)
    else:
        n = seg // NBB
        start = (seg - n * NBB) * BLOCK_R
        base = n * C * B + start + (c0 + lc)[:, None] * B
        offs = r[None, :]
        rmask = r < B - start
        k = tl.minimum(B - start, BLOCK_R)
    return base, offs, col_mask[:, None] & rmask[None, :], k


@triton.jit
def _merge_lanes(n, mean, m2, k, AXIS: tl.constexpr):
    """Chan's merge of a tile's lanes along ``AXIS``: ``n`` their counts (broadcast
    against ``mean``), ``mean`` / ``m2`` theirs, ``k`` the total count (at least 1).
    The mean is taken in two steps, the counts' weighted mean corrected by the weighted
    mean of the lanes' deviations from it (the first sum rounds at the means' magnitude,
    the second at the spread's; an infinite mean stays infinite, its deviations would be
    inf - inf); then m2 from the lanes' m2 and their means' deviations. Returns
    ``(mean, m2)``."""
    approx = tl.div_rn(tl.sum(n * mean, axis=AXIS), k)
    corr = tl.div_rn(tl.sum(n * (mean - tl.expand_dims(approx, AXIS)), axis=AXIS), k)
    merged = approx + tl.where(approx - approx == 0.0, corr, 0.0)
    d = mean - tl.expand_dims(merged, AXIS)
    return merged, tl.sum(m2, axis=AXIS) + tl.sum(n * d * d, axis=AXIS)


@triton.jit
def _syncbn_stats_kernel(
    x_ptr,           # input, [M, C] (CHANNELS_LAST) or [N, C, B], contiguous
    part_ptr,        # fp32 [n_chunks, 2C + 1] rows, row_stride apart: this program's
                     # (mean - shift, m2, count) row
    shift_ptr,       # fp32 [C]: the pivot the partial means are relative to
    M, C, B_UNITS,   # rows (CHANNELS_LAST) / samples, channels, plane size / B_VEC
    NBB,             # tiles per plane (channels first)
    n_segs,          # tiles along the reduced dimension
    segs_per_chunk,  # tiles each program merges
    row_stride,      # elements between partial rows: 2C + 1 rounded up to 16 (aligned rows)
    CHANNELS_LAST: tl.constexpr,
    B_VEC: tl.constexpr,  # a power of two dividing the plane size (see _Geometry)
    EMULATE_BF16_ROUNDING: tl.constexpr,  # interpreter only: see _tl_utils
    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
):
    B = B_UNITS * B_VEC  # (the compiler then knows B's alignment: wide loads)
    pid_c = tl.program_id(0)
    chunk = tl.program_id(1).to(tl.int64)
    c0 = pid_c.to(tl.int64) * BLOCK_C
    cols = c0 + tl.arange(0, BLOCK_C)
    col_mask = cols < C
    first = chunk * segs_per_chunk
    last = tl.minimum(first + segs_per_chunk, n_segs)
    # Work relative to a pivot, the input's first value per channel (the same in every
    # program): deviations are of the order of the spread, so the means merged here and in
    # the merge kernel keep their digits when |mean| >> std.
    if CHANNELS_LAST:
        pivot = load_f32(x_ptr + cols, col_mask, EMULATE_BF16_ROUNDING)
    else:
        pivot = load_f32(x_ptr + cols * B, col_mask, EMULATE_BF16_ROUNDING)  # (int64)
    if chunk == 0:
        tl.store(shift_ptr + cols, pivot, mask=col_mask)
    # Welford's update in every lane of the tile (a running mean and m2 per lane): the
    # loop only loads and updates registers; the lanes are merged once, after it. Every
    # tile but a ragged one is full, and every ragged tile holds the same first k_rag
    # positions (the plane's last run, or the input's last rows), so a lane has seen
    # n_full tiles, plus n_rag when its position is below k_rag: two counts, inverted
    # once per tile, stand for the 2-D count.
    # (in int64: M may pass 2**31 while n_segs fits int32, whose product would wrap)
    zero64 = tl.zeros([], dtype=tl.int64)
    if CHANNELS_LAST:
        k_rag = M - (zero64 + n_segs - 1) * BLOCK_R
    else:
        k_rag = B - (zero64 + NBB - 1) * BLOCK_R
    in_rag = tl.arange(0, BLOCK_R) < k_rag
    one = tl.full([], 1.0, tl.float32)
    n_full = one * 0.0
    n_rag = one * 0.0
    lane_mean = tl.zeros([BLOCK_C, BLOCK_R], dtype=tl.float32)
    lane_m2 = tl.zeros([BLOCK_C, BLOCK_R], dtype=tl.float32)
    for seg in range(first, last):
        base, offs, mask, k = _syncbn_tile(seg, c0, col_mask, M, C, B, NBB, CHANNELS_LAST,
                                           BLOCK_R, BLOCK_C)
        x = load_f32(x_ptr + base + offs, mask, EMULATE_BF16_ROUNDING)
        x = tl.where(mask, x - pivot[:, None], 0.0)
        if k == BLOCK_R:
            n_full += 1.0
        else:
            n_rag += 1.0
        inv_n = tl.where(in_rag, tl.div_rn(one, tl.maximum(n_full + n_rag, 1.0)),
                         tl.div_rn(one, tl.maximum(n_full, 1.0)))
        delta = x - lane_mean
        lane_mean += tl.where(mask, delta * inv_n[None, :], 0.0)
        lane_m2 += tl.where(mask, delta * (x - lane_mean), 0.0)
    # The lanes' merge (Chan's formula over all of them at once).
    lane_n = tl.where(in_rag, n_full + n_rag, n_full)
    acc_n = n_full * BLOCK_R + n_rag * k_rag.to(tl.float32)
    k = tl.zeros([BLOCK_C], dtype=tl.float32) + tl.maximum(acc_n, 1.0)
    acc_mean, acc_m2 = _merge_lanes(lane_n[None, :], lane_mean, lane_m2, k, 1)
    row = part_ptr + chunk * row_stride  # (chunk is int64: the offset may pass 2**31)
    tl.store(row + cols, acc_mean, mask=col_mask)
    tl.store(row + C + cols, acc_m2, mask=col_mask)
    if pid_c == 0:
        tl.store(row + C + C, acc_n)


@triton.jit
def _syncbn_merge_kernel(
    rows_ptr,        # fp32 [P, 2C + 1]: (mean[C], m2[C], count) rows to merge, row_stride
    shift_ptr,       # fp32 [C]: the rows' means are relative to it (HAS_SHIFT)    apart
    P, C, row_stride,
    out_ptr,         # fp32 [2C + 1]: the merged row (not FINAL)
    mean_ptr,        # fp32 [C]: merged mean (FINAL)
    invstd_ptr,      # fp32 [C]: 1 / sqrt(m2 / count + eps) (FINAL)
    count_ptr,       # fp32 [1]: total count (FINAL)
    rmean_ptr,       # [C] running mean, updated in place (UPDATE_RUNNING)
    rvar_ptr,        # [C] running variance (unbiased), updated in place (UPDATE_RUNNING)
    nbt_ptr,         # int64 [1] num_batches_tracked: factor 1 / nbt (MOMENTUM_FROM_COUNT)
    eps, momentum,
    HAS_SHIFT: tl.constexpr, FINAL: tl.constexpr, UPDATE_RUNNING: tl.constexpr,
    MOMENTUM_FROM_COUNT: tl.constexpr,
    EMULATE_BF16_ROUNDING: tl.constexpr,
    BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr,
):
    pid_c = tl.program_id(0)
    cols = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    col_mask = cols < C
    # Means relative to a pivot (see the stats kernel): the weighted sums stay small.
    # Partials of one input share a shift; rows of different ranks use row 0's mean.
    if HAS_SHIFT:
        pivot = tl.load(shift_ptr + cols, mask=col_mask, other=0.0)
        rel = tl.zeros([BLOCK_C], dtype=tl.float32)
    else:
        pivot = tl.load(rows_ptr + cols, mask=col_mask, other=0.0)
        rel = pivot
    # Chan's merge in every lane of the [BLOCK_P, BLOCK_C] tile: lane (i, c) takes rows
    # i, i + BLOCK_P, ... of channel c, so the loop only loads and updates registers (no
    # reduction across threads, no barrier, per iteration); the lanes are merged once,
    # after it. A row's count is the same for every channel: one count per lane row.
    # Rows of count 0 (empty ranks, padding) add nothing.
    lane_n = tl.zeros([BLOCK_P], dtype=tl.float32)
    lane_mean = tl.zeros([BLOCK_P, BLOCK_C], dtype=tl.float32)
    lane_m2 = tl.zeros([BLOCK_P, BLOCK_C], dtype=tl.float32)
    for p0 in range(0, P, BLOCK_P):
        p = p0 + tl.arange(0, BLOCK_P)
        p_mask = p < P
        # (int64 row offsets: the rows may pass 2**31 elements)
        row = rows_ptr + p.to(tl.int64)[:, None] * row_stride
        mask = p_mask[:, None] & col_mask[None, :]
        cnt = tl.load(rows_ptr + p.to(tl.int64) * row_stride + C + C, mask=p_mask, other=0.0)
        mean_i = tl.load(row + cols[None, :], mask=mask, other=0.0) - rel[None, :]
        m2_i = tl.load(row + C + cols[None, :], mask=mask, other=0.0)
        n = lane_n + cnt
        w = tl.div_rn(cnt, tl.maximum(n, 1.0))
        delta = mean_i - lane_mean
        lane_mean += delta * w[:, None]
        lane_m2 += m2_i + delta * delta * (lane_n * w)[:, None]
        lane_n = n
    # The lanes merged (as the statistics kernel merges its lanes).
    acc_n = tl.sum(lane_n, axis=0)
    k = tl.zeros([BLOCK_C], dtype=tl.float32) + tl.maximum(acc_n, 1.0)
    acc_mean, acc_m2 = _merge_lanes(lane_n[:, None], lane_mean, lane_m2, k, 0)
    acc_mean = pivot + acc_mean
    if FINAL:
        n_vec = tl.zeros([BLOCK_C], dtype=tl.float32) + acc_n
        var = tl.div_rn(acc_m2, tl.maximum(n_vec, 1.0))
        # (lanes past C divide by 1, not by sqrt(eps), which may be 0)
        invstd = tl.div_rn(tl.zeros([BLOCK_C], dtype=tl.float32) + 1.0,
                           tl.sqrt_rn(tl.where(col_mask, var + eps, 1.0)))
        tl.store(mean_ptr + cols, acc_mean, mask=col_mask)
        tl.store(invstd_ptr + cols, invstd, mask=col_mask)
        if pid_c == 0:
            tl.store(count_ptr, acc_n)
        if UPDATE_RUNNING:
            if MOMENTUM_FROM_COUNT:
                f = tl.div_rn(1.0, tl.load(nbt_ptr).to(tl.float32))
            else:
                f = momentum
            # Unbiased variance; a single value (n = 1) gives inf, as torch's kernels do.
            # No value at all (every rank's batch empty): the running statistics stay.
            var_u = tl.div_rn(acc_m2, n_vec - 1.0)
            rm = load_f32(rmean_ptr + cols, col_mask, EMULATE_BF16_ROUNDING)
            rv = load_f32(rvar_ptr + cols, col_mask, EMULATE_BF16_ROUNDING)
            seen = col_mask & (n_vec > 0.0)
            store_cast(rmean_ptr + cols, f * acc_mean + (1.0 - f) * rm, seen,
                       EMULATE_BF16_ROUNDING)
            store_cast(rvar_ptr + cols, f * var_u + (1.0 - f) * rv, seen,
                       EMULATE_BF16_ROUNDING)
    else:
        tl.store(out_ptr + cols, acc_mean, mask=col_mask)
        tl.store(out_ptr + C + cols, acc_m2, mask=col_mask)
        if pid_c == 0:
            tl.store(out_ptr + C + C, acc_n)


@triton.jit
def _syncbn_affine(x, z, cols, col_mask, mean_ptr, invstd_ptr, w_ptr, b_ptr,
                   HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_Z: tl.constexpr,
                   EMULATE_BF16_ROUNDING: tl.constexpr):
    """(x - mean) * (invstd * w) + b (+ z) for a [BLOCK_R, BLOCK_C] tile, before any ReLU.
    Centring first keeps large means exact; forward and backward share this arithmetic,
    so the backward's ReLU mask is the forward's."""
    mean = tl.load(mean_ptr + cols, mask=col_mask, other=0.0)
    scale = tl.load(invstd_ptr + cols, mask=col_mask, other=0.0)
    if HAS_WEIGHT:
        scale = scale * load_f32(w_ptr + cols, col_mask, EMULATE_BF16_ROUNDING)
    y = (x - mean[:, None]) * scale[:, None]
    if HAS_BIAS:
        y = y + load_f32(b_ptr + cols, col_mask, EMULATE_BF16_ROUNDING)[:, None]
    if HAS_Z:
        y = y + z
    return y


@triton.jit
def _syncbn_forward_kernel(
    x_ptr,           # input, canonical view (see _syncbn_tile)
    z_ptr,           # residual added before the ReLU, same layout and dtype as x (HAS_Z)
    y_ptr,           # output, same layout and dtype as x
    mean_ptr, invstd_ptr,   # fp32 [C] statistics
    w_ptr, b_ptr,    # [C] affine parameters (HAS_WEIGHT / HAS_BIAS)
    M, C, B_UNITS, NBB,
    CHANNELS_LAST: tl.constexpr, B_VEC: tl.constexpr, HAS_WEIGHT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_Z: tl.constexpr, RELU: tl.constexpr, EMULATE_BF16_ROUNDING: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
):
    B = B_UNITS * B_VEC  # (the compiler then knows B's alignment: wide loads)
    seg = tl.program_id(0).to(tl.int64)
    c0 = tl.program_id(1).to(tl.int64) * BLOCK_C
    cols = c0 + tl.arange(0, BLOCK_C)
    col_mask = cols < C
    base, offs, mask, k = _syncbn_tile(seg, c0, col_mask, M, C, B, NBB, CHANNELS_LAST,
                                       BLOCK_R, BLOCK_C)
    x = load_f32(x_ptr + base + offs, mask, EMULATE_BF16_ROUNDING)
    z = x
    if HAS_Z:
        z = load_f32(z_ptr + base + offs, mask, EMULATE_BF16_ROUNDING)
    y = _syncbn_affine(x, z, cols, col_mask, mean_ptr, invstd_ptr, w_ptr, b_ptr, HAS_WEIGHT,
                       HAS_BIAS, HAS_Z, EMULATE_BF16_ROUNDING)
    if RELU:
        y = tl.where(y < 0.0, 0.0, y)  # NaN stays NaN, as torch.relu
    store_cast(y_ptr + base + offs, y, mask, EMULATE_BF16_ROUNDING)


@triton.jit
def _syncbn_load_dy_x(dy_ptr, x_ptr, z_ptr, base, offs, mask, cols, col_mask, mean_ptr,
                      invstd_ptr, w_ptr, b_ptr, HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr,
                      HAS_Z: tl.constexpr, RELU: tl.constexpr,
                      EMULATE_BF16_ROUNDING: tl.constexpr):
    """A tile's output gradient and input, the gradient zeroed where the fused ReLU cut
    (the forward's output is recomputed: nothing but the statistics is saved)."""
    dy = load_f32(dy_ptr + base + offs, mask, EMULATE_BF16_ROUNDING)
    x = load_f32(x_ptr + base + offs, mask, EMULATE_BF16_ROUNDING)
    if RELU:
        z = x
        if HAS_Z:
            z = load_f32(z_ptr + base + offs, mask, EMULATE_BF16_ROUNDING)
        y = _syncbn_affine(x, z, cols, col_mask, mean_ptr, invstd_ptr, w_ptr, b_ptr,
                           HAS_WEIGHT, HAS_BIAS, HAS_Z, EMULATE_BF16_ROUNDING)
        dy = tl.where(y <= 0.0, 0.0, dy)  # (torch.relu's backward: NaN passes dy)
    return dy, x


_FLT_MAX = tl.constexpr(3.4028234663852886e38)


@triton.jit
def _compensation(new, old, t):
    """Kahan's compensation of ``new = old + t``, 0 where it or ``new`` is not finite."""
    c = (new - old) - t
    return tl.where((tl.abs(new) <= _FLT_MAX) & (tl.abs(c) <= _FLT_MAX), c, 0.0)


@triton.jit
def _syncbn_backward_reduce_kernel(
    dy_ptr,          # output gradient, same layout as x
    x_ptr,           # forward input, canonical view
    z_ptr,           # forward residual (RELU and HAS_Z)
    part_ptr,        # fp32 [n_chunks, 2C]: this program's (sum_dy, sum_dy_xmu) row
    mean_ptr, invstd_ptr, w_ptr, b_ptr,
    M, C, B_UNITS, NBB, n_segs, segs_per_chunk,
    CHANNELS_LAST: tl.constexpr, B_VEC: tl.constexpr, HAS_WEIGHT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_Z: tl.constexpr, RELU: tl.constexpr, EMULATE_BF16_ROUNDING: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
):
    B = B_UNITS * B_VEC  # (the compiler then knows B's alignment: wide loads)
    c0 = tl.program_id(0).to(tl.int64) * BLOCK_C
    chunk = tl.program_id(1).to(tl.int64)
    cols = c0 + tl.arange(0, BLOCK_C)
    col_mask = cols < C
    mean = tl.load(mean_ptr + cols, mask=col_mask, other=0.0)
    # 2-D running sums, one per lane of the tile, merged once after the loop (the loop only
    # loads and adds), each with Kahan's compensation: a lane adds up a value from every
    # tile of the chunk.
    lane_dy = tl.zeros([BLOCK_C, BLOCK_R], dtype=tl.float32)
    lane_xmu = tl.zeros([BLOCK_C, BLOCK_R], dtype=tl.float32)
    c_dy = tl.zeros([BLOCK_C, BLOCK_R], dtype=tl.float32)
    c_xmu = tl.zeros([BLOCK_C, BLOCK_R], dtype=tl.float32)
    first = chunk * segs_per_chunk
    last = tl.minimum(first + segs_per_chunk, n_segs)
    for seg in range(first, last):
        base, offs, mask, k = _syncbn_tile(seg, c0, col_mask, M, C, B, NBB, CHANNELS_LAST,
                                           BLOCK_R, BLOCK_C)
        dy, x = _syncbn_load_dy_x(dy_ptr, x_ptr, z_ptr, base, offs, mask, cols, col_mask,
                                  mean_ptr, invstd_ptr, w_ptr, b_ptr, HAS_WEIGHT, HAS_BIAS,
                                  HAS_Z, RELU, EMULATE_BF16_ROUNDING)
        # (a lane whose sum or compensation is not finite keeps no compensation: inf - inf
        # would make an overflowed sum NaN, where torch's sum is +-inf)
        t = dy - c_dy
        new = lane_dy + t
        c_dy = _compensation(new, lane_dy, t)
        lane_dy = new
        t = tl.where(mask, dy * (x - mean[:, None]), 0.0) - c_xmu
        new = lane_xmu + t
        c_xmu = _compensation(new, lane_xmu, t)
        lane_xmu = new
    sum_dy = tl.sum(lane_dy - c_dy, axis=1)
    sum_dy_xmu = tl.sum(lane_xmu - c_xmu, axis=1)
    row = part_ptr + chunk * 2 * C
    tl.store(row + cols, sum_dy, mask=col_mask)
    tl.store(row + C + cols, sum_dy_xmu, mask=col_mask)


@triton.jit
def _syncbn_reduce_merge_kernel(
    part_ptr,        # fp32 [P, 2C]: per-chunk (sum_dy, sum_dy_xmu) rows
    P, C,
    sums_ptr,        # fp32 [2C]: (sum_dy, sum_dy_xmu), the backward's all_reduce buffer
    invstd_ptr,      # fp32 [C]
    gw_ptr,          # [C] grad_weight = sum_dy_xmu * invstd, weight's dtype (HAS_GW)
    gb_ptr,          # [C] grad_bias = sum_dy, bias's dtype (HAS_GB)
    HAS_GW: tl.constexpr, HAS_GB: tl.constexpr, EMULATE_BF16_ROUNDING: tl.constexpr,
    BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr,
):
    cols = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    col_mask = cols < C
    # fp64 over the partial rows, the result rounded to fp32 once; a running sum in every
    # lane of the [BLOCK_P, BLOCK_C] tile (lane (i, c): rows i, i + BLOCK_P, ... of channel
    # c), so the loop only loads and adds in registers; the lanes are summed after it.
    s_dy = tl.zeros([BLOCK_P, BLOCK_C], dtype=tl.float64)
    s_xmu = tl.zeros([BLOCK_P, BLOCK_C], dtype=tl.float64)
    for p0 in range(0, P, BLOCK_P):
        p = p0 + tl.arange(0, BLOCK_P)
        row = (part_ptr + p.to(tl.int64) * 2 * C)[:, None]
        mask = (p < P)[:, None] & col_mask[None, :]
        s_dy += tl.load(row + cols[None, :], mask=mask, other=0.0).to(tl.float64)
        s_xmu += tl.load(row + C + cols[None, :], mask=mask, other=0.0).to(tl.float64)
    s_dy = tl.sum(s_dy, axis=0).to(tl.float32)
    s_xmu = tl.sum(s_xmu, axis=0).to(tl.float32)
    tl.store(sums_ptr + cols, s_dy, mask=col_mask)
    tl.store(sums_ptr + C + cols, s_xmu, mask=col_mask)
    if HAS_GW:
        invstd = tl.load(invstd_ptr + cols, mask=col_mask, other=0.0)
        store_cast(gw_ptr + cols, s_xmu * invstd, col_mask, EMULATE_BF16_ROUNDING)
    if HAS_GB:
        store_cast(gb_ptr + cols, s_dy, col_mask, EMULATE_BF16_ROUNDING)


@triton.jit
def _syncbn_backward_input_kernel(
    dy_ptr, x_ptr, z_ptr,
    dx_ptr,          # input gradient, layout and dtype of x
    dz_ptr,          # residual gradient, layout and dtype of z (HAS_DZ)
    mean_ptr, invstd_ptr, w_ptr, b_ptr,
    sums_ptr,        # fp32 [2C]: global (sum_dy, sum_dy_xmu) (HAS_SUMS)
    count_ptr,       # fp32 [1]: global count of elements per channel (HAS_SUMS)
    M, C, B_UNITS, NBB,
    CHANNELS_LAST: tl.constexpr, B_VEC: tl.constexpr, HAS_WEIGHT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_Z: tl.constexpr, RELU: tl.constexpr, HAS_DZ: tl.constexpr, HAS_SUMS: tl.constexpr,
    EMULATE_BF16_ROUNDING: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
):
    B = B_UNITS * B_VEC  # (the compiler then knows B's alignment: wide loads)
    seg = tl.program_id(0).to(tl.int64)
    c0 = tl.program_id(1).to(tl.int64) * BLOCK_C
    cols = c0 + tl.arange(0, BLOCK_C)
    col_mask = cols < C
    base, offs, mask, k = _syncbn_tile(seg, c0, col_mask, M, C, B, NBB, CHANNELS_LAST,
                                       BLOCK_R, BLOCK_C)
    dy, x = _syncbn_load_dy_x(dy_ptr, x_ptr, z_ptr, base, offs, mask, cols, col_mask, mean_ptr,
                              invstd_ptr, w_ptr, b_ptr, HAS_WEIGHT, HAS_BIAS, HAS_Z, RELU,
                              EMULATE_BF16_ROUNDING)
    if HAS_DZ:
        store_cast(dz_ptr + base + offs, dy, mask, EMULATE_BF16_ROUNDING)
    invstd = tl.load(invstd_ptr + cols, mask=col_mask, other=0.0)
    scale = invstd
    if HAS_WEIGHT:
        scale = invstd * load_f32(w_ptr + cols, col_mask, EMULATE_BF16_ROUNDING)
    if HAS_SUMS:
        n = tl.zeros([BLOCK_C], dtype=tl.float32) + tl.load(count_ptr)
        mean_dy = tl.div_rn(tl.load(sums_ptr + cols, mask=col_mask, other=0.0), n)
        mean_dy_xmu = tl.div_rn(tl.load(sums_ptr + C + cols, mask=col_mask, other=0.0), n)
        mean = tl.load(mean_ptr + cols, mask=col_mask, other=0.0)
        proj = invstd * invstd * mean_dy_xmu
        dx = (dy - mean_dy[:, None] - (x - mean[:, None]) * proj[:, None]) * scale[:, None]
    else:
        dx = dy * scale[:, None]
    store_cast(dx_ptr + base + offs, dx, mask, EMULATE_BF16_ROUNDING)


# -- launch geometry ---------------------------------------------------------------------------
def _target_programs(device):
    """Programs a reduction should spread over: a few waves on the GPU; few, large ones in
    the interpreter (each program costs ~30 us there whatever its size)."""
    if gpu_code_path(device):
        return 8 * sm_count(device)
    return 4


# Limits the geometry keeps to: element offsets within a tile fit in int32 (see
# _syncbn_tile), and the channel blocks, on grid axis 1 of the forward and backward_input
# launches, fit in CUDA's 65535 programs there.
_INT32_MAX = 2**31 - 1
_GRID_Y_MAX = 65535


class _Geometry:
    """Tiles of one canonical view: BLOCK_R reduced elements x BLOCK_C channels.

    Computed from the view's shape alone (``gpu``: the GPU's tile sizes, else the
    interpreter's), so what a launch would compute for any shape can be checked without
    the tensor. :meth:`of` takes the tensor."""

    def __init__(self, shape, gpu):
        self.channels_last = len(shape) == 2
        tile = 2048 if gpu else 16384
        if self.channels_last:
            self.M, self.C = shape
            self.B = 1
            self.BLOCK_C = min(next_power_of_2(max(self.C, 1)), 64 if gpu else 256)
            self.BLOCK_C = max(self.BLOCK_C, next_power_of_2(
                cdiv(self.C, _GRID_Y_MAX)))
            self.BLOCK_R = max(1, min(tile // self.BLOCK_C, next_power_of_2(max(self.M, 1))))
            # A tile's element offsets reach (BLOCK_R - 1) * C + BLOCK_C - 1: int32.
            while self.BLOCK_R > 1 and (self.BLOCK_R - 1) * self.C + self.BLOCK_C > _INT32_MAX:
                self.BLOCK_R //= 2
            self.NBB = 1
            self.n_segs = cdiv(self.M, self.BLOCK_R)
        else:
            self.M, self.C, self.B = shape
            self.BLOCK_R = min(next_power_of_2(max(self.B, 1)), tile)
            self.BLOCK_C = max(1, min(next_power_of_2(max(self.C, 1)), tile // self.BLOCK_R))
            if gpu and self.BLOCK_R <= 64:
                # short planes (7x7): each channel's run holds its own int64 base and the
                # per-channel vectors; half the tile keeps the backward within 80 registers
                self.BLOCK_C = min(self.BLOCK_C, tile // 2 // self.BLOCK_R)
            need_c = next_power_of_2(cdiv(self.C, _GRID_Y_MAX))
            if self.BLOCK_C < need_c:  # many channels of large planes: wider, shorter tiles
                self.BLOCK_C = need_c
                self.BLOCK_R = max(1, min(self.BLOCK_R, tile // need_c))
            self.NBB = cdiv(self.B, self.BLOCK_R)
            self.n_segs = self.M * self.NBB
        # The plane size's largest power-of-two factor (up to 16), a constexpr: the kernels
        # take B / B_VEC and multiply back, so the compiler knows every plane starts at a
        # multiple of B_VEC elements and issues loads that wide (14x14 = 4 x 49: 8-byte
        # fp16 / 16-byte fp32 loads; 7x7: one element, all its alignment allows).
        self.B_VEC = min(16, self.B & -self.B) if self.B > 0 else 1
        self.n_cblocks = cdiv(self.C, self.BLOCK_C)
        self.warps = 8 if gpu and self.BLOCK_R * self.BLOCK_C >= 1024 else 4
        self.emulate = not gpu
        self._args = (self.M, self.C, self.B // self.B_VEC, self.NBB)
        self._consts = {}
        self._chunks = {}

    @classmethod
    def of(cls, x):
        """The geometry of view ``x``, kept per (shape, path): a model's layers see the same
        few shapes every step."""
        if x.dim() not in (2, 3) or not x.is_contiguous():
            raise ValueError("syncbn kernels take a contiguous [M, C] (channels last) or "
                             f"[N, C, B] (channels first) view; got shape {tuple(x.shape)} with "
                             f"strides {x.stride()}")
        key = (x.shape, gpu_code_path(x.device))
        geo = _GEOMETRIES.get(key)
        if geo is None:
            if len(_GEOMETRIES) > 4096:  # (varying batch sizes: keep it bounded)
                _GEOMETRIES.clear()
            geo = _GEOMETRIES[key] = cls(tuple(x.shape), key[1])
        return geo

    def launch(self, kernel, grid, tensors, ints, **flags):
        """``kernel``'s kept launch over this geometry's tiles: runtime arguments
        ``(*tensors, *ints)``, constexprs ``flags`` and the geometry's (kept per kernel
        and flags), keyed by the tensors' dtypes and the ints themselves when every
        tensor is 16-byte aligned."""
        key = (id(kernel), *flags.values())  # (a kernel's id: kept_kernel holds it)
        found = self._consts.get(key)
        if found is None:
            consts = dict(flags, **self.consts(), num_warps=self.warps)
            found = self._consts[key] = (kept_kernel(kernel), consts, tuple(consts.values()))
        kept, consts, ckey = found
        kept.launch_aligned(grid, (*tensors, *ints), tensors, consts, ckey, ints)

    def chunks(self, device):
        """(number of chunks, tiles per chunk) splitting the reduced dimension, kept per
        device."""
        found = self._chunks.get(device)
        if found is None:
            found = self._chunks[device] = self._split(device)
        return found

    def _split(self, device):
        want = max(1, cdiv(_target_programs(device), self.n_cblocks))
        chunks = max(1, min(want, self.n_segs))
        per = cdiv(self.n_segs, chunks)
        return cdiv(self.n_segs, per) if self.n_segs else 1, per

    def args(self):
        """The kernels' shape arguments ``(M, C, B / B_VEC, NBB)`` (one tuple, kept)."""
        return self._args

    def consts(self):
        return dict(CHANNELS_LAST=self.channels_last, B_VEC=self.B_VEC,
                    EMULATE_BF16_ROUNDING=self.emulate,
                    BLOCK_R=self.BLOCK_R, BLOCK_C=self.BLOCK_C)


def _channels(x):
    return x.shape[-1] if x.dim() == 2 else x.shape[1]


def _check_partner(name, t, x):
    if t is not None and (t.shape != x.shape or t.device != x.device or not t.is_contiguous()):
        raise ValueError(f"syncbn: {name} must be contiguous with the input's shape "
                         f"{tuple(x.shape)} on {x.device}; got {tuple(t.shape)} on {t.device}")


def _check_vector(name, t, c, device):
    if t is not None and (t.dim() != 1 or t.numel() != c or t.device != device
                          or not t.is_contiguous()):
        raise ValueError(f"syncbn: {name} must be a contiguous vector of {c} channels on "
                         f"{device}; got shape {tuple(t.shape)} on {t.device}")


def _check_one(name, t, device, dtypes, op):
    """``t`` one element of one of ``dtypes`` on ``device`` (a count the kernels read at
    its first element and the CPU path used whole)."""
    if not isinstance(t, torch.Tensor) or t.numel() != 1 or t.device != device \
            or t.dtype not in dtypes:
        got = (f"{t.dtype} of shape {tuple(t.shape)} on {t.device}"
               if isinstance(t, torch.Tensor) else type(t).__name__)
        raise ValueError(f"{op}: {name} must be one element of "
                         f"{'/'.join(str(d).replace('torch.', '') for d in dtypes)} on "
                         f"{device}; got {got}")


def _merge_settings(p, c, device):
    """(BLOCK_P, BLOCK_C, warps) of a merge over ``p`` rows of ``c`` channels."""
    gpu = gpu_code_path(device)
    block_c = min(next_power_of_2(max(c, 1)), 128 if gpu else 1024)
    if gpu:
        # A tile of _MERGE_TILE lanes whatever P (masked past it: one variant per channel
        # block). One program per channel block walks every row, a load's latency per
        # iteration (1056 rows at C = 64 channels last: 33 iterations, not 132 of 8).
        return _MERGE_TILE // block_c, block_c, 8
    return min(next_power_of_2(max(p, 1)), 256), block_c, 4


_MERGE_TILE = 2048  # lanes of a merge's tile on the GPU (8 per thread at 8 warps)


_MERGES = {}


def _merge_launch(kernel, p, c, device, **flags):
    """(kept kernel, constexprs, their key, grid) of a merge launch over ``p`` rows of
    ``c`` channels with ``flags``, kept per configuration."""
    gpu = gpu_code_path(device)
    key = (id(kernel), p, c, gpu, *flags.values())  # (a kernel's id: kept_kernel holds it)
    found = _MERGES.get(key)
    if found is None:
        if len(_MERGES) > 4096:  # (varying batch sizes: keep it bounded)
            _MERGES.clear()
        block_p, block_c, warps = _merge_settings(p, c, device)
        consts = dict(flags, EMULATE_BF16_ROUNDING=not gpu, BLOCK_P=block_p,
                      BLOCK_C=block_c, num_warps=warps)
        found = _MERGES[key] = (kept_kernel(kernel), consts, tuple(consts.values()),
                                (cdiv(c, block_c),))
    return found


# -- launchers ------------------------------------------------------------------------------------
# Kept launches (launch.py): after a variant's first call, no Triton binding per call. The
# kernels are looked up at each call (kept_kernel), so a test may swap a module's kernel.
_GEOMETRIES = {}


def syncbn_stats(x):
    """Per-chunk partial statistics of ``x``: ``(rows, shift)`` with fp32 rows
    ``[P, 2C + 1]`` of ``(mean[C] - shift, m2[C], count)`` and ``shift`` fp32 ``[C]`` (or
    None: absolute means). Merge them with :func:`syncbn_combine` or
    :func:`syncbn_finalize`, passing ``shift`` along."""
    geo = _Geometry.of(x)
    if not use_triton(x):
        return syncbn_stats_cpu(x)
    if x.numel() == 0:
        return torch.zeros(1, 2 * geo.C + 1, dtype=torch.float32, device=x.device), None
    chunks, per = geo.chunks(x.device)
    width = 2 * geo.C + 1
    stride = -(-width // 16) * 16  # padded: every row starts 64-byte aligned
    part = torch.empty(chunks, stride, dtype=torch.float32, device=x.device)
    shift = torch.empty(geo.C, dtype=torch.float32, device=x.device)
    geo.launch(_syncbn_stats_kernel, (geo.n_cblocks, chunks), (x, part, shift),
               (*geo.args(), geo.n_segs, per, stride))
    return part[:, :width], shift


def _check_rows(rows, shift):
    """(P, C, row stride) of statistics rows: fp32 [P, 2C + 1] with unit column stride,
    rows apart by at least their width (syncbn_stats pads them; gathered rows are
    contiguous)."""
    if rows.dim() != 2 or rows.dtype != torch.float32 or rows.shape[1] % 2 != 1 \
            or rows.stride(1) != 1 or (rows.shape[0] > 1 and rows.stride(0) < rows.shape[1]):
        raise ValueError("syncbn: statistics rows must be an fp32 [P, 2C + 1] tensor of "
                         "contiguous rows (from syncbn_stats / syncbn_combine); got "
                         f"{rows.dtype} {tuple(rows.shape)} with strides {rows.stride()}")
    c = rows.shape[1] // 2
    _check_vector("shift", shift, c, rows.device)
    return rows.shape[0], c, rows.stride(0) if rows.shape[0] > 1 else rows.shape[1]


def syncbn_combine(rows, shift=None):
    """Merge statistics rows ``[P, 2C + 1]`` (means relative to ``shift`` when given) into
    one row ``[2C + 1]`` of absolute ``(mean, m2, count)`` (Chan's formula)."""
    p, c, stride = _check_rows(rows, shift)
    if not use_triton(rows):
        # The reference is already the production CPU path: a few vectorised ops on the
        # [P, 2C + 1] rows (P = 1 or the world size), no Python loop.
        return syncbn_combine_ref(rows, shift)
    out = torch.empty(2 * c + 1, dtype=torch.float32, device=rows.device)
    kept, consts, ckey, grid = _merge_launch(
        _syncbn_merge_kernel, p, c, rows.device, HAS_SHIFT=shift is not None, FINAL=False,
        UPDATE_RUNNING=False, MOMENTUM_FROM_COUNT=False)
    shift = shift if shift is not None else out
    kept.launch_aligned(grid, (rows, shift, p, c, stride, out, out, out, out, out, out, out,
                               0.0, 0.0), (rows, shift, out), consts, ckey, (p, c, stride))
    return out


def syncbn_finalize(rows, eps, running_mean=None, running_var=None, momentum=0.1,
                    num_batches_tracked=None, shift=None):
    """Merge statistics rows (means relative to ``shift`` when given) into
    ``(mean, invstd, count)`` (fp32 ``[C]``, ``[C]``, ``[1]``)
    and, when ``running_mean`` / ``running_var`` are given, update them in place with
    factor ``momentum`` (``None``: ``1 / num_batches_tracked``, read on the device)."""
    p, c, stride = _check_rows(rows, shift)
    # read once as floats on both paths (the CPU path broadcast a tensor of several
    # elements over the channels; the kernels took its float())
    eps = host_number(eps, "eps", "syncbn_finalize")
    if momentum is not None:
        momentum = host_number(momentum, "momentum", "syncbn_finalize")
    update = running_mean is not None
    if update:
        if running_var is None:
            raise ValueError("syncbn_finalize: running_mean and running_var go together")
        _check_vector("running_mean", running_mean, c, rows.device)
        _check_vector("running_var", running_var, c, rows.device)
        if momentum is None and num_batches_tracked is None:
            raise ValueError("syncbn_finalize: momentum=None (cumulative average) needs "
                             "num_batches_tracked")
        if momentum is None:
            _check_one("num_batches_tracked", num_batches_tracked, rows.device,
                       (torch.int64, torch.int32, torch.float32), "syncbn_finalize")
    if not use_triton(rows):
        # The reference is the production CPU path too (vectorised ops on the small rows).
        return syncbn_finalize_ref(rows, eps, running_mean, running_var, momentum,
                                   num_batches_tracked, shift)
    mean = torch.empty(c, dtype=torch.float32, device=rows.device)
    invstd = torch.empty_like(mean)
    count = torch.empty(1, dtype=torch.float32, device=rows.device)
    from_count = update and momentum is None
    kept, consts, ckey, grid = _merge_launch(
        _syncbn_merge_kernel, p, c, rows.device, HAS_SHIFT=shift is not None, FINAL=True,
        UPDATE_RUNNING=update, MOMENTUM_FROM_COUNT=from_count)
    shift = shift if shift is not None else mean
    rm, rv = (running_mean, running_var) if update else (mean, mean)
    nbt = num_batches_tracked if from_count else count
    # (eps and momentum are floats whatever their values: their type is fixed)
    kept.launch_aligned(grid, (rows, shift, p, c, stride, mean, mean, invstd, count, rm, rv,
                               nbt, eps, 0.0 if momentum is None else momentum),
                        (rows, shift, mean, invstd, count, rm, rv, nbt), consts, ckey,
                        (p, c, stride))
    return mean, invstd, count


def _params(x, c, mean, invstd, weight, bias):
    for name, t in (("mean", mean), ("invstd", invstd), ("weight", weight), ("bias", bias)):
        _check_vector(name, t, c, x.device)
    for name, t in (("mean", mean), ("invstd", invstd)):
        if t.dtype != torch.float32:
            raise ValueError(f"syncbn: {name} must be fp32 (from syncbn_finalize); got {t.dtype}")


def syncbn_forward(x, mean, invstd, weight=None, bias=None, z=None, relu=False, out=None):
    """``y = (x - mean) * invstd * weight + bias (+ z)``, ReLU when ``relu``; x's dtype.
    ``out`` (optional, shaped and typed like ``x``, contiguous) receives the result."""
    c = _channels(x)
    _params(x, c, mean, invstd, weight, bias)
    _check_partner("z", z, x)
    _check_partner("out", out, x)
    if out is not None and out.dtype != x.dtype:
        raise ValueError(f"syncbn_forward: out must be {x.dtype}, got {out.dtype}")
    geo = _Geometry.of(x)  # a canonical view on every path (the CPU path's too)
    if not use_triton(x):
        return syncbn_forward_cpu(x, mean, invstd, weight, bias, z, relu, out)
    y = torch.empty_like(x) if out is None else out
    if x.numel() == 0:
        return y
    w = weight if weight is not None else mean
    b = bias if bias is not None else mean
    geo.launch(_syncbn_forward_kernel, (geo.n_segs, geo.n_cblocks),
               (x, z if z is not None else x, y, mean, invstd, w, b), geo.args(),
               HAS_WEIGHT=weight is not None, HAS_BIAS=bias is not None, HAS_Z=z is not None,
               RELU=relu)
    return y


def syncbn_backward_reduce(dy, x, mean, invstd, weight=None, bias=None, z=None, relu=False,
                           need_weight_grad=True, need_bias_grad=True):
    """Local reductions of the backward: ``(sums, grad_weight, grad_bias)`` with ``sums``
    the fp32 ``[2C]`` tensor ``(sum_dy, sum_dy_xmu)``. ``bias`` and ``z`` are needed only
    to recompute the ReLU mask (``relu``)."""
    _Geometry.of(x)  # a canonical view on every path (the CPU path's too)
    c = _channels(x)
    _params(x, c, mean, invstd, weight, bias)
    _check_partner("dy", dy, x)
    _check_partner("z", z, x)
    return syncbn_backward_reduce_prechecked(dy, x, mean, invstd, weight, bias, z, relu,
                                             need_weight_grad, need_bias_grad)


def syncbn_backward_reduce_prechecked(dy, x, mean, invstd, weight=None, bias=None, z=None,
                                      relu=False, need_weight_grad=True, need_bias_grad=True):
    """:func:`syncbn_backward_reduce` without its checks, for a caller that made them
    (SyncBatchNorm's backward: its forward checked ``x``, ``z``, the parameters and made
    ``mean`` / ``invstd``; autograd gives ``dy`` the output's shape, dtype and device)."""
    if not use_triton(x):
        return syncbn_backward_reduce_cpu(dy, x, mean, invstd, weight, bias, z, relu,
                                          need_weight_grad, need_bias_grad)
    geo = _Geometry.of(x)
    c = geo.C
    has_gw = weight is not None and need_weight_grad
    has_gb = weight is not None and need_bias_grad
    gw = torch.empty_like(weight) if has_gw else None
    gb = torch.empty(c, dtype=(bias if bias is not None else weight).dtype,
                     device=x.device) if has_gb else None
    sums = torch.empty(2 * c, dtype=torch.float32, device=x.device)
    if x.numel() == 0:
        part = torch.zeros(1, 2 * c, dtype=torch.float32, device=x.device)
    else:
        chunks, per = geo.chunks(x.device)
        part = torch.empty(chunks, 2 * c, dtype=torch.float32, device=x.device)
        geo.launch(_syncbn_backward_reduce_kernel, (geo.n_cblocks, chunks), (
            dy, x, z if z is not None else x, part, mean, invstd,
            weight if weight is not None else mean, bias if bias is not None else mean),
            (*geo.args(), geo.n_segs, per), HAS_WEIGHT=weight is not None,
            HAS_BIAS=bias is not None, HAS_Z=z is not None, RELU=relu)
    p = part.shape[0]
    kept, consts, ckey, grid = _merge_launch(_syncbn_reduce_merge_kernel, p, c, x.device,
                                             HAS_GW=has_gw, HAS_GB=has_gb)
    gw_arg = gw if has_gw else sums
    gb_arg = gb if has_gb else sums
    kept.launch_aligned(grid, (part, p, c, sums, invstd, gw_arg, gb_arg),
                        (part, sums, invstd, gw_arg, gb_arg), consts, ckey, (p, c))
    return sums, gw, gb


def syncbn_backward_input(dy, x, mean, invstd, weight=None, sums=None, count=None, bias=None,
                          z=None, relu=False, need_dz=False):
    """``(dx, dz)``: the input gradient (``sums`` / ``count`` global, from the all_reduce
    and :func:`syncbn_finalize`; ``sums=None`` when running statistics normalised) and,
    when ``need_dz``, the residual's gradient (the ReLU-masked ``dy``), else None."""
    _Geometry.of(x)  # a canonical view on every path (the CPU path's too)
    c = _channels(x)
    _params(x, c, mean, invstd, weight, bias)
    _check_partner("dy", dy, x)
    _check_partner("z", z, x)
    if sums is not None and (sums.shape != (2 * c,) or sums.dtype != torch.float32
                             or sums.device != x.device or not sums.is_contiguous()
                             or count is None):
        raise ValueError(f"syncbn_backward_input: sums must be a contiguous fp32 [{2 * c}] "
                         f"on {x.device} with a count (syncbn_backward_reduce's); got "
                         f"{sums.dtype} of shape {tuple(sums.shape)} on {sums.device}"
                         f"{'' if sums.is_contiguous() else ', not contiguous'}, count "
                         f"{'None' if count is None else 'given'}")
    if sums is not None:
        _check_one("count", count, x.device, (torch.float32,), "syncbn_backward_input")
    return syncbn_backward_input_prechecked(dy, x, mean, invstd, weight, sums, count, bias,
                                            z, relu, need_dz)


def syncbn_backward_input_prechecked(dy, x, mean, invstd, weight=None, sums=None, count=None,
                                     bias=None, z=None, relu=False, need_dz=False):
    """:func:`syncbn_backward_input` without its checks, for a caller that made them
    (SyncBatchNorm's backward; ``sums`` from :func:`syncbn_backward_reduce_prechecked`,
    ``count`` from :func:`syncbn_finalize`)."""
    if not use_triton(x):
        return syncbn_backward_input_cpu(dy, x, mean, invstd, weight, sums, count, bias, z,
                                         relu, need_dz)
    geo = _Geometry.of(x)
    dx = torch.empty_like(x)
    dz = torch.empty_like(z if z is not None else x) if need_dz else None
    if x.numel() == 0:
        return dx, dz
    geo.launch(_syncbn_backward_input_kernel, (geo.n_segs, geo.n_cblocks), (
        dy, x, z if z is not None else x, dx, dz if need_dz else dx, mean, invstd,
        weight if weight is not None else mean, bias if bias is not None else mean,
        sums if sums is not None else mean, count if sums is not None else mean),
        geo.args(), HAS_WEIGHT=weight is not None, HAS_BIAS=bias is not None,
        HAS_Z=z is not None, RELU=relu, HAS_DZ=need_dz, HAS_SUMS=sums is not None)
    return dx, dz


# -- the production CPU path ---------------------------------------------------------------------
# Vectorised torch code over the canonical view, written so that every full-size pass is
# one of torch's fast CPU loops: element-wise ops on one dtype (half operands are widened
# once with .float(): a mixed-dtype element-wise op runs a casting loop ~30x slower),
# temporaries reused in place, and no boolean masks (torch.where over a mask is ~40x slower
# than an arithmetic pass on a CPU; the ReLU mask is torch's threshold_backward).
# The forward, the ReLU mask and both backward launchers follow the reference's arithmetic
# step for step (the same results, bit for bit); the statistics are the same sums taken
# another way (two passes instead of torch.var_mean's Welford loop, ~25x slower here).


def _widened(t):
    """``(t as fp32, owned)``: ``owned`` when the fp32 tensor is a new one (may be written)."""
    return (t, False) if t.dtype == torch.float32 else (t.float(), True)


def _centred(x, mean):
    """``x - mean`` (per channel) in a new fp32 tensor."""
    xf, owned = _widened(x)
    m = _per_channel(mean, x)
    return xf.sub_(m) if owned else torch.sub(xf, m)


def _affine_cpu(x, mean, invstd, weight, bias, z, out=None):
    """The reference's ``(x - mean) * (invstd * weight) + bias (+ z)`` before any ReLU, in
    fp32, in ``out`` (fp32, shaped like ``x``) or a new tensor."""
    m = _per_channel(mean, x)
    if out is not None:
        y = torch.sub(x, m, out=out)
    else:
        y = _centred(x, mean)
    scale = invstd if weight is None else invstd * weight.float()
    y.mul_(_per_channel(scale, x))
    if bias is not None:
        y.add_(_per_channel(bias.float(), x))
    if z is not None:
        y.add_(z.float())
    return y


def _masked_dy_cpu(dy, x, mean, invstd, weight, bias, z, relu):
    """``(dy, owned)``: the output gradient in fp32, zeroed where the recomputed output is
    <= 0 when ``relu`` (torch.relu's backward: a NaN output passes the gradient);
    ``owned`` when it is a new tensor."""
    dyf, owned = _widened(dy)
    if not relu:
        return dyf, owned
    y = _affine_cpu(x, mean, invstd, weight, bias, z)
    return torch.ops.aten.threshold_backward.grad_input(dyf, y, 0.0, grad_input=y), True


@torch.no_grad()
def syncbn_stats_cpu(x):
    """The production CPU path of :func:`syncbn_stats`: one row of absolute statistics
    (P = 1, no shift), the mean from one sum and m2 from a second pass over the centred
    values (no E[x^2] - E[x]^2)."""
    c = _channels(x)
    n = x.numel() // c if c else 0
    if not n:
        return torch.zeros(1, 2 * c + 1, dtype=torch.float32, device=x.device), None
    dims = _reduce_dims(x)
    xf, owned = _widened(x)
    mean = xf.sum(dims).div_(n)
    m = _per_channel(mean, x)
    xc = xf.sub_(m) if owned else torch.sub(xf, m)
    m2 = xc.mul_(xc).sum(dims)
    return torch.cat([mean, m2, mean.new_full((1,), n)]).view(1, -1), None


@torch.no_grad()
def syncbn_forward_cpu(x, mean, invstd, weight=None, bias=None, z=None, relu=False, out=None):
    """The production CPU path of :func:`syncbn_forward` (the reference's arithmetic, in
    place; written straight into an fp32 ``out``)."""
    direct = out is not None and x.dtype == torch.float32
    y = _affine_cpu(x, mean, invstd, weight, bias, z, out=out if direct else None)
    if relu:
        y.relu_()
    if direct:
        return out
    if out is not None:
        return out.copy_(y)
    return y.to(x.dtype)


@torch.no_grad()
def syncbn_backward_reduce_cpu(dy, x, mean, invstd, weight=None, bias=None, z=None, relu=False,
                               need_weight_grad=True, need_bias_grad=True):
    """The production CPU path of :func:`syncbn_backward_reduce`: the reference's sums of
    the same fp32 products (``sum(dy)``, ``sum(dy * (x - mean))``), formed in place."""
    dyf, _ = _masked_dy_cpu(dy, x, mean, invstd, weight, bias, z, relu)
    dims = _reduce_dims(x)
    sum_dy = dyf.sum(dims)
    sum_dy_xmu = _centred(x, mean).mul_(dyf).sum(dims)
    gw = (sum_dy_xmu * invstd).to(weight.dtype) if weight is not None and need_weight_grad \
        else None
    gb = sum_dy.to((bias if bias is not None else weight).dtype) \
        if weight is not None and need_bias_grad else None
    return torch.cat([sum_dy, sum_dy_xmu]), gw, gb


@torch.no_grad()
def syncbn_backward_input_cpu(dy, x, mean, invstd, weight=None, sums=None, count=None,
                              bias=None, z=None, relu=False, need_dz=False):
    """The production CPU path of :func:`syncbn_backward_input` (the reference's arithmetic,
    in place)."""
    dyf, owned = _masked_dy_cpu(dy, x, mean, invstd, weight, bias, z, relu)
    dz = dyf.to((z if z is not None else x).dtype) if need_dz else None
    if dz is dyf:
        owned = False
    scale = _per_channel(invstd if weight is None else invstd * weight.float(), x)
    if sums is None:
        dx = dyf.mul_(scale) if owned else torch.mul(dyf, scale)
        return dx.to(x.dtype), dz
    c = _channels(x)
    mean_dy = _per_channel(sums[:c] / count, x)
    proj = _per_channel(invstd * invstd * (sums[c:] / count), x)
    # (dy - mean_dy - (x - mean) * proj) * scale, in the reference's order
    xmu_proj = _centred(x, mean).mul_(proj)
    dx = dyf.sub_(mean_dy) if owned else torch.sub(dyf, mean_dy)
    return dx.sub_(xmu_proj).mul_(scale).to(x.dtype), dz


# -- torch references (the oracles of the kernels and of the CPU path) ---------------------------
def _reduce_dims(x):
    return (0,) if x.dim() == 2 else (0, 2)


def _per_channel(v, x):
    """A [C] vector shaped to broadcast against the canonical view ``x``."""
    return v.view(1, -1) if x.dim() == 2 else v.view(1, -1, 1)


@torch.no_grad()
def syncbn_stats_ref(x):
    """Reference of :func:`syncbn_stats`: one row of absolute statistics for the whole
    input (P = 1, no shift)."""
    c = _channels(x)
    n = x.numel() // c if c else 0
    row = torch.zeros(1, 2 * c + 1, dtype=torch.float32, device=x.device)
    if n:
        var, mean = torch.var_mean(x.float(), dim=_reduce_dims(x), correction=0)
        row[0, :c] = mean
        row[0, c:2 * c] = var * n
        row[0, 2 * c] = n
    return row, None


def _merge_ref(rows, shift):
    c = rows.shape[1] // 2
    cnt = rows[:, 2 * c:]
    n = cnt.sum(0)  # ([1]: a tensor of its own, not a view, as the count is returned)
    rel = rows[0, :c] if shift is None else torch.zeros_like(rows[0, :c])
    means = rows[:, :c] - rel
    mean = (cnt * means).sum(0) / n.clamp(min=1)
    m2 = rows[:, c:2 * c].sum(0) + (cnt * (means - mean) ** 2).sum(0)
    return n, mean + (rel if shift is None else shift), m2


@torch.no_grad()
def syncbn_combine_ref(rows, shift=None):
    n, mean, m2 = _merge_ref(rows, shift)
    return torch.cat([mean, m2, n])


@torch.no_grad()
def syncbn_finalize_ref(rows, eps, running_mean=None, running_var=None, momentum=0.1,
                        num_batches_tracked=None, shift=None):
    n, mean, m2 = _merge_ref(rows, shift)
    invstd = (m2 / n.clamp(min=1) + eps).sqrt().reciprocal()
    if running_mean is not None:
        f = momentum if momentum is not None else \
            num_batches_tracked.to(torch.float32).reciprocal()
        var_u = m2 / (n - 1)
        seen = n > 0  # no value at all (every rank's batch empty): the running ones stay
        running_mean.copy_(torch.where(seen, f * mean + (1 - f) * running_mean.float(),
                                       running_mean.float()))
        running_var.copy_(torch.where(seen, f * var_u + (1 - f) * running_var.float(),
                                      running_var.float()))
    return mean, invstd, n


def _affine_ref(x, mean, invstd, weight, bias, z):
    scale = invstd if weight is None else invstd * weight.float()
    y = (x.float() - _per_channel(mean, x)) * _per_channel(scale, x)
    if bias is not None:
        y = y + _per_channel(bias.float(), x)
    if z is not None:
        y = y + z.float()
    return y


@torch.no_grad()
def syncbn_forward_ref(x, mean, invstd, weight=None, bias=None, z=None, relu=False):
    y = _affine_ref(x, mean, invstd, weight, bias, z)
    if relu:
        y = torch.relu(y)
    return y.to(x.dtype)


def _masked_dy(dy, x, mean, invstd, weight, bias, z, relu):
    dy = dy.float()
    if relu:
        dy = torch.where(_affine_ref(x, mean, invstd, weight, bias, z) <= 0, 0.0, dy)
    return dy


@torch.no_grad()
def syncbn_backward_reduce_ref(dy, x, mean, invstd, weight=None, bias=None, z=None, relu=False,
                               need_weight_grad=True, need_bias_grad=True):
    dyf = _masked_dy(dy, x, mean, invstd, weight, bias, z, relu)
    dims = _reduce_dims(x)
    sum_dy = dyf.sum(dims)
    sum_dy_xmu = (dyf * (x.float() - _per_channel(mean, x))).sum(dims)
    gw = (sum_dy_xmu * invstd).to(weight.dtype) if weight is not None and need_weight_grad \
        else None
    gb = sum_dy.to((bias if bias is not None else weight).dtype) \
        if weight is not None and need_bias_grad else None
    return torch.cat([sum_dy, sum_dy_xmu]), gw, gb


@torch.no_grad()
def syncbn_backward_input_ref(dy, x, mean, invstd, weight=None, sums=None, count=None,
                              bias=None, z=None, relu=False, need_dz=False):
    dyf = _masked_dy(dy, x, mean, invstd, weight, bias, z, relu)
    dz = dyf.to((z if z is not None else x).dtype) if need_dz else None
    scale = invstd if weight is None else invstd * weight.float()
    if sums is None:
        return (dyf * _per_channel(scale, x)).to(x.dtype), dz
    c = _channels(x)
    mean_dy = sums[:c] / count
    mean_dy_xmu = sums[c:] / count
    proj = invstd * invstd * mean_dy_xmu
    dx = (dyf - _per_channel(mean_dy, x) - (x.float() - _per_channel(mean, x))
          * _per_channel(proj, x)) * _per_channel(scale, x)
    return dx.to(x.dtype), dz
