"""Row-wise LayerNorm and RMSNorm, forward and backward.

``layer_norm_fwd(x, n, weight, bias, eps, rms, out_dtype)`` normalises every row of ``n``
trailing elements of ``x``::

    LayerNorm   y = (x - mean) * rstd * weight + bias     rstd = 1 / sqrt(var + eps)
    RMSNorm     y = x * rstd * weight                     rstd = 1 / sqrt(mean(x^2) + eps)

and returns ``y`` (in ``out_dtype``) with the fp32 statistics ``mean`` (LayerNorm only)
and ``rstd``, one per row. ``layer_norm_bwd`` takes ``dy`` and either the input with
those statistics or, when the forward kept only its output (``memory_efficient``), the
output, from which ``xhat = (y - bias) / weight`` is recomputed (each weight's magnitude
raised to at least ``eps``, as Apex does: a zero weight still gives finite gradients). It
returns ``dx`` and the
weight and bias gradients, reduced in two stages: each program sums ``dy * xhat`` and
``dy`` over its own run of rows into an fp32 partial row, and a second kernel sums the
partial rows per column. No atomics, so the result does not depend on scheduling.

Everything accumulates in fp32 whatever the input, weight and output dtypes (fp32, fp16,
bf16, mixed). Rows wider than one block are swept in chunks (three passes over the row in
the forward, two in the backward); rows that fit stay in registers and are read once.
"""

import torch
import triton
import triton.language as tl

from ._dispatch import cdiv, gpu_code_path, next_power_of_2, sm_count, use_triton
from .launch import KeptKernel
from ._tl_utils import load_f32, store_cast

_MAX_BLOCK = 16384     # widest row the GPU forward holds in registers at once
_MAX_BLOCK_BWD = 4096  # ... and the backward (six row-sized values per element)
_CHUNK_FWD = 4096      # the chunk of a wider row on the GPU, forward
_CHUNK_BWD = 2048      # ... and backward
_MAX_BLOCK_CPU = 4096  # the interpreter's block (and chunk)


@triton.jit
def _add_pairs(a0, a1, b0, b1):
    """The combine of a joint sum of two tensors (``tl.reduce`` over a pair)."""
    return a0 + b0, a1 + b1


@triton.jit
def _layer_norm_fwd_kernel(
    x_ptr,          # [M, N] input rows: row stride x_stride, unit column stride
    y_ptr,          # [M, N] output, contiguous, in the output dtype
    w_ptr,          # [N] weight (read when HAS_WEIGHT)
    b_ptr,          # [N] bias (read when HAS_BIAS)
    mean_ptr,       # [M] fp32: row means (written unless IS_RMS)
    rstd_ptr,       # [M] fp32: 1 / sqrt(var + eps)
    x_stride, N, eps,
    IS_RMS: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr,
    ONE_PASS: tl.constexpr,                # the row fits in one BLOCK: read it once
    EMULATE_BF16_ROUNDING: tl.constexpr,   # interpreter only: see _tl_utils
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * x_stride
    y_row = y_ptr + row * N
    n = N.to(tl.float32)
    if ONE_PASS:
        cols = tl.arange(0, BLOCK)
        mask = cols < N
        x = load_f32(x_row + cols, mask, EMULATE_BF16_ROUNDING)
        if IS_RMS:
            xc = x
        else:
            mean = tl.div_rn(tl.sum(x, axis=0), n)
            # Centre before squaring: E[x^2] - E[x]^2 cancels catastrophically. The mean
            # is refined once by the mean of the deviations from it (the rounding of the
            # sum made it a few ulps off: on a constant row x - mean was noise, which rstd
            # near 1 / sqrt(eps) scaled to O(1)); the refined mean of a constant row is
            # its value, exactly.
            # The deviations' sum and sum of squares come from one joint reduction (one
            # exchange between warps, not two); the variance about the refined mean is
            # their mean square less the square of the correction (not below 0), as in
            # the chunked branch.
            d = tl.where(mask, x - mean, 0.0)
            if EMULATE_BF16_ROUNDING:
                # (Triton's interpreter: the same two sums, but a reduction with a combine
                # function of its own runs there element by element in Python, 20x slower)
                d_sum = tl.sum(d, axis=0)
                dd_sum = tl.sum(d * d, axis=0)
            else:
                d_sum, dd_sum = tl.reduce((d, d * d), 0, _add_pairs)
            corr = tl.div_rn(d_sum, n)
            var = tl.maximum(tl.div_rn(dd_sum, n) - corr * corr, 0.0)
            mean = mean + corr
            xc = tl.where(mask, d - corr, 0.0)
            tl.store(mean_ptr + row, mean)
        if IS_RMS:
            var = tl.div_rn(tl.sum(xc * xc, axis=0), n)
        rstd = tl.div_rn(1.0, tl.sqrt_rn(var + eps))
        tl.store(rstd_ptr + row, rstd)
        y = xc * rstd
        if HAS_WEIGHT:
            y = y * load_f32(w_ptr + cols, mask, EMULATE_BF16_ROUNDING)
        if HAS_BIAS:
            y = y + load_f32(b_ptr + cols, mask, EMULATE_BF16_ROUNDING)
        store_cast(y_row + cols, y, mask, EMULATE_BF16_ROUNDING)
    else:
        mean = 0.0
        acc1 = tl.zeros([BLOCK], dtype=tl.float32)
        if not IS_RMS:
            acc = tl.zeros([BLOCK], dtype=tl.float32)
            for start in range(0, N, BLOCK):
                cols = start + tl.arange(0, BLOCK)
                acc += load_f32(x_row + cols, cols < N, EMULATE_BF16_ROUNDING)
            mean = tl.div_rn(tl.sum(acc, axis=0), n)
        acc2 = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, N, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            mask = cols < N
            xc = tl.where(mask, load_f32(x_row + cols, mask, EMULATE_BF16_ROUNDING) - mean, 0.0)
            if not IS_RMS:
                acc1 += xc
            acc2 += xc * xc
        corr = 0.0
        if IS_RMS:
            var = tl.div_rn(tl.sum(acc2, axis=0), n)
        else:
            # the one-pass branch's refined mean; the variance about it is the mean square
            # deviation less the square of the correction (not below 0)
            corr = tl.div_rn(tl.sum(acc1, axis=0), n)
            var = tl.maximum(tl.div_rn(tl.sum(acc2, axis=0), n) - corr * corr, 0.0)
            tl.store(mean_ptr + row, mean + corr)
        rstd = tl.div_rn(1.0, tl.sqrt_rn(var + eps))
        tl.store(rstd_ptr + row, rstd)
        for start in range(0, N, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            mask = cols < N
            # (x - mean) - corr as the one-pass branch: the refined mean in two parts,
            # finer than their rounded sum
            y = (load_f32(x_row + cols, mask, EMULATE_BF16_ROUNDING) - mean - corr) * rstd
            if HAS_WEIGHT:
                y = y * load_f32(w_ptr + cols, mask, EMULATE_BF16_ROUNDING)
            if HAS_BIAS:
                y = y + load_f32(b_ptr + cols, mask, EMULATE_BF16_ROUNDING)
            store_cast(y_row + cols, y, mask, EMULATE_BF16_ROUNDING)


@triton.jit
def _xhat(v_row, w_ptr, b_ptr, cols, mask, mean, rstd, min_w, IS_RMS: tl.constexpr,
          HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr, FROM_OUTPUT: tl.constexpr,
          EMULATE_BF16_ROUNDING: tl.constexpr):
    """The normalised row, from the input and its statistics or from the output, and
    (from the output) ``y - bias``, which is ``weight * xhat`` without the division. From
    the output the weight divides with its magnitude raised to at least ``min_w`` (Apex's
    clamp: a zero weight counts as +min_w; NaN stays NaN)."""
    v = load_f32(v_row + cols, mask, EMULATE_BF16_ROUNDING)
    scaled = v
    if FROM_OUTPUT:
        if HAS_WEIGHT:
            w = load_f32(w_ptr + cols, mask, EMULATE_BF16_ROUNDING)
        if HAS_BIAS:
            v = v - load_f32(b_ptr + cols, mask, EMULATE_BF16_ROUNDING)
            if HAS_WEIGHT:
                # weight * xhat is exactly 0 where the weight is: a half output there is
                # the bias rounded, whose rounding error is not the row's deviation
                v = tl.where(w == 0.0, 0.0, v)
        scaled = tl.where(mask, v, 0.0)
        if HAS_WEIGHT:
            w = tl.where(w >= 0.0, tl.where(w < min_w, min_w, w),
                         tl.where(w > -min_w, -min_w, w))
            v = tl.div_rn(v, tl.where(mask, w, 1.0))
        xhat = v
    else:
        if IS_RMS:
            xhat = v * rstd
        else:
            xhat = (v - mean) * rstd
    # Zero the tail: 0 / 0 there would poison the row sums.
    return tl.where(mask, xhat, 0.0), scaled


@triton.jit
def _c1_term(xhat, scaled, dy, wdy, HAS_WEIGHT: tl.constexpr, FROM_OUTPUT: tl.constexpr):
    """The summand of ``c1 = mean(xhat * w * dy)``: from the output with a weight,
    ``(y - bias) * dy``, which needs no division (as Apex's kernel forms it), so a weight
    raised to ``min_w`` touches only its own column's terms, not every column's dx."""
    if FROM_OUTPUT and HAS_WEIGHT:
        return scaled * dy
    else:
        return xhat * wdy


@triton.jit
def _row_terms(row, v_ptr, v_stride, dy_ptr, w, w_ptr, b_ptr, mean_ptr, rstd_ptr, cols, mask,
               N, min_w, IS_RMS: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr,
               FROM_OUTPUT: tl.constexpr, EMULATE_BF16_ROUNDING: tl.constexpr):
    """One row's chunk ``cols`` in the backward: (xhat, dy, w * dy, rstd, the summand of
    ``c1``), ``w`` the chunk's weight already loaded (when HAS_WEIGHT)."""
    rstd = tl.load(rstd_ptr + row)
    mean = 0.0
    if not IS_RMS and not FROM_OUTPUT:
        mean = tl.load(mean_ptr + row)
    xhat, scaled = _xhat(v_ptr + row * v_stride, w_ptr, b_ptr, cols, mask, mean, rstd, min_w,
                         IS_RMS, HAS_WEIGHT, HAS_BIAS, FROM_OUTPUT, EMULATE_BF16_ROUNDING)
    dy = load_f32(dy_ptr + row * N + cols, mask, EMULATE_BF16_ROUNDING)
    wdy = dy
    if HAS_WEIGHT:
        wdy = dy * w
    return xhat, dy, wdy, rstd, _c1_term(xhat, scaled, dy, wdy, HAS_WEIGHT, FROM_OUTPUT)


@triton.jit
def _dx(wdy, xhat, c1, c2, rstd, IS_RMS: tl.constexpr):
    """dx of one row's chunk from its two row means ``c1 = mean(xhat * w * dy)`` (see
    :func:`_c1_term`) and
    ``c2 = mean(w * dy)`` (LayerNorm only)."""
    if IS_RMS:
        return (wdy - xhat * c1) * rstd
    else:
        return (wdy - (xhat * c1 + c2)) * rstd


@triton.jit
def _layer_norm_bwd_kernel(
    dy_ptr,         # [M, N] output gradient, contiguous
    v_ptr,          # [M, N] the input (or the output when FROM_OUTPUT), row stride v_stride
    w_ptr,          # [N] weight (read when HAS_WEIGHT)
    b_ptr,          # [N] bias (read when FROM_OUTPUT and HAS_BIAS)
    mean_ptr,       # [M] fp32 row means (read unless IS_RMS or FROM_OUTPUT)
    rstd_ptr,       # [M] fp32 1 / sqrt(var + eps)
    dx_ptr,         # [M, N] input gradient, contiguous, in the input dtype
    dw_part_ptr,    # [G, N] fp32: this program's sum of dy * xhat over its rows
    db_part_ptr,    # [G, N] fp32: this program's sum of dy over its rows
    stats_ptr,      # [M, 2] fp32 scratch of the chunked path: each row's two sums for dx
    v_stride, M, N, rows_per_program,
    min_w,          # fp32: FROM_OUTPUT's least weight magnitude (the norm's eps)
    IS_RMS: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr,
    FROM_OUTPUT: tl.constexpr, ONE_PASS: tl.constexpr,
    EMULATE_BF16_ROUNDING: tl.constexpr, BLOCK: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    row_start = pid * rows_per_program
    row_end = tl.minimum(row_start + rows_per_program, M)
    n = N.to(tl.float32)
    dw_part = dw_part_ptr + pid * N
    db_part = db_part_ptr + pid * N
    if ONE_PASS:
        cols = tl.arange(0, BLOCK)
        mask = cols < N
        w = 1.0
        if HAS_WEIGHT:
            w = load_f32(w_ptr + cols, mask, EMULATE_BF16_ROUNDING)
        dw_acc = tl.zeros([BLOCK], dtype=tl.float32)
        db_acc = tl.zeros([BLOCK], dtype=tl.float32)
        for row in range(row_start, row_end):
            xhat, dy, wdy, rstd, c1_term = _row_terms(row, v_ptr, v_stride, dy_ptr, w, w_ptr,
                                                      b_ptr, mean_ptr, rstd_ptr, cols, mask, N,
                                                      min_w, IS_RMS, HAS_WEIGHT, HAS_BIAS,
                                                      FROM_OUTPUT, EMULATE_BF16_ROUNDING)
            c1 = tl.div_rn(tl.sum(c1_term, axis=0), n)
            c2 = 0.0
            if not IS_RMS:
                c2 = tl.div_rn(tl.sum(wdy, axis=0), n)
            dx = _dx(wdy, xhat, c1, c2, rstd, IS_RMS)
            store_cast(dx_ptr + row * N + cols, dx, mask, EMULATE_BF16_ROUNDING)
            dw_acc += dy * xhat
            db_acc += dy
        if HAS_WEIGHT:
            tl.store(dw_part + cols, dw_acc, mask=mask)
        if HAS_BIAS:
            tl.store(db_part + cols, db_acc, mask=mask)
    else:
        # Pass 1, row by row: the two row sums dx needs, from running [BLOCK] sums
        # reduced once per row, kept in this program's rows of the stats scratch.
        for row in range(row_start, row_end):
            rstd = tl.load(rstd_ptr + row)
            mean = 0.0
            if not IS_RMS and not FROM_OUTPUT:
                mean = tl.load(mean_ptr + row)
            v_row = v_ptr + row * v_stride
            c1_acc = tl.zeros([BLOCK], dtype=tl.float32)
            c2_acc = tl.zeros([BLOCK], dtype=tl.float32)
            for start in range(0, N, BLOCK):
                cols = start + tl.arange(0, BLOCK)
                mask = cols < N
                xhat, scaled = _xhat(v_row, w_ptr, b_ptr, cols, mask, mean, rstd, min_w,
                                     IS_RMS, HAS_WEIGHT, HAS_BIAS, FROM_OUTPUT,
                                     EMULATE_BF16_ROUNDING)
                dy = load_f32(dy_ptr + row * N + cols, mask, EMULATE_BF16_ROUNDING)
                wdy = dy
                if HAS_WEIGHT:
                    wdy = dy * load_f32(w_ptr + cols, mask, EMULATE_BF16_ROUNDING)
                c1_acc += _c1_term(xhat, scaled, dy, wdy, HAS_WEIGHT, FROM_OUTPUT)
                if not IS_RMS:
                    c2_acc += wdy
            tl.store(stats_ptr + 2 * row, tl.div_rn(tl.sum(c1_acc, axis=0), n))
            if not IS_RMS:
                tl.store(stats_ptr + (2 * row + 1), tl.div_rn(tl.sum(c2_acc, axis=0), n))
        tl.debug_barrier()  # the stats this program stored, visible to all its threads
        # Pass 2, chunk by chunk: dx of every row of the program, and the chunk's weight
        # and bias partial sums in registers, stored once per chunk.
        for start in range(0, N, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            mask = cols < N
            w = 1.0
            if HAS_WEIGHT:
                w = load_f32(w_ptr + cols, mask, EMULATE_BF16_ROUNDING)
            dw_acc = tl.zeros([BLOCK], dtype=tl.float32)
            db_acc = tl.zeros([BLOCK], dtype=tl.float32)
            for row in range(row_start, row_end):
                xhat, dy, wdy, rstd, _ = _row_terms(row, v_ptr, v_stride, dy_ptr, w, w_ptr,
                                                    b_ptr, mean_ptr, rstd_ptr, cols, mask, N,
                                                    min_w, IS_RMS, HAS_WEIGHT, HAS_BIAS,
                                                    FROM_OUTPUT, EMULATE_BF16_ROUNDING)
                c1 = tl.load(stats_ptr + 2 * row)
                c2 = 0.0
                if not IS_RMS:
                    c2 = tl.load(stats_ptr + (2 * row + 1))
                dx = _dx(wdy, xhat, c1, c2, rstd, IS_RMS)
                store_cast(dx_ptr + row * N + cols, dx, mask, EMULATE_BF16_ROUNDING)
                dw_acc += dy * xhat
                db_acc += dy
            if HAS_WEIGHT:
                tl.store(dw_part + cols, dw_acc, mask=mask)
            if HAS_BIAS:
                tl.store(db_part + cols, db_acc, mask=mask)


@triton.jit
def _layer_norm_bwd_reduce_kernel(
    dw_part_ptr,    # [G, N] fp32 partial weight gradients
    db_part_ptr,    # [G, N] fp32 partial bias gradients
    dw_ptr,         # [S, N] sums of rows_per_split partial rows each (the weight gradient
    db_ptr,         # in its dtype when S == 1, fp32 partials for a final pass otherwise)
    G, N, rows_per_split,
    HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr,
    EMULATE_BF16_ROUNDING: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr,
):
    pid_n = tl.program_id(0)
    split = tl.program_id(1).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    first = split * rows_per_split
    last = tl.minimum(first + rows_per_split, G)
    # 2-D running sums, reduced across rows once after the loop
    dw = tl.zeros([BLOCK_G, BLOCK_N], dtype=tl.float32)
    db = tl.zeros([BLOCK_G, BLOCK_N], dtype=tl.float32)
    for start in range(first, last, BLOCK_G):
        rows = start + tl.arange(0, BLOCK_G)
        offs = rows[:, None] * N + cols[None, :]
        mask = (rows[:, None] < last) & col_mask[None, :]
        if HAS_WEIGHT:
            dw += tl.load(dw_part_ptr + offs, mask=mask, other=0.0)
        if HAS_BIAS:
            db += tl.load(db_part_ptr + offs, mask=mask, other=0.0)
    out = split * N + cols
    if HAS_WEIGHT:
        store_cast(dw_ptr + out, tl.sum(dw, axis=0), col_mask, EMULATE_BF16_ROUNDING)
    if HAS_BIAS:
        store_cast(db_ptr + out, tl.sum(db, axis=0), col_mask, EMULATE_BF16_ROUNDING)


_SETTINGS = {}


def norm_settings(n, device, max_block=None, backward=False):
    """:func:`_norm_settings`, kept per (width, device, path, max_block, direction)."""
    key = (n, device, gpu_code_path(device), max_block, backward)
    found = _SETTINGS.get(key)
    if found is None:
        found = _SETTINGS[key] = _norm_settings(n, device, max_block, backward)
    return found


def _norm_settings(n, device, max_block=None, backward=False):
    """(BLOCK, num_warps, one_pass) for rows of ``n`` elements: one heuristic, no autotuning.

    On the GPU a row that fits one block is read once and held in registers: up to
    16384 elements in the forward (8 per thread, 16 at the widest), up to 4096 in the
    backward, which holds six row-sized values per element (4 per thread). Wider rows are
    swept in chunks of 4096 (forward, 8 per thread) or 2048 (backward, 4 per thread).
    Warps follow the block. The interpreter takes blocks up to 4096 (it pays per program,
    not per element). ``max_block`` (tests) forces the chunked path for narrow rows."""
    if gpu_code_path(device):
        per_thread = 4 if backward else 8
        cap = _MAX_BLOCK_BWD if backward else _MAX_BLOCK
        chunk = _CHUNK_BWD if backward else _CHUNK_FWD
    else:
        per_thread, cap, chunk = 8, _MAX_BLOCK_CPU, _MAX_BLOCK_CPU
    if max_block:
        cap = chunk = min(cap, next_power_of_2(max_block))
    full = next_power_of_2(max(n, 1))
    block = full if full <= cap else chunk
    warps = max(1, min(32, block // (32 * per_thread)))
    return block, warps, full <= cap


def _rows(x, n):
    """``x`` viewed as [M, n] rows with a unit column stride, and its row stride."""
    if x.is_contiguous():  # the kernels take the data pointer: no view needed
        return x, n
    x2 = x.reshape(-1, n)
    if x2.stride(-1) != 1 or (x2.shape[0] > 1 and x2.stride(0) < n):
        x2 = x2.contiguous()
    return x2, (x2.stride(0) if x2.shape[0] > 1 else n)


def _check(x, n, weight, bias):
    if n <= 0 or x.numel() % n:
        raise ValueError(f"layer_norm: the input's {x.numel()} elements are not whole rows of {n}")
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None and (t.numel() != n or t.device != x.device):
            raise ValueError(f"layer_norm: {name} has {t.numel()} elements on {t.device}; expected "
                             f"{n} (the normalized shape) on {x.device}")


_FWD = KeptKernel(_layer_norm_fwd_kernel)
_ROW_MAJOR = torch.contiguous_format
_FWD_PLANS = {}


def _fwd_plan(n, device, max_block, rms, has_w, has_b):
    """The forward's launch settings for one configuration, kept: (constexprs, key)."""
    key = (n, device, gpu_code_path(device), max_block, rms, has_w, has_b)
    plan = _FWD_PLANS.get(key)
    if plan is None:
        block, warps, one_pass = norm_settings(n, device, max_block)
        constexprs = dict(IS_RMS=rms, HAS_WEIGHT=has_w, HAS_BIAS=has_b, ONE_PASS=one_pass,
                          EMULATE_BF16_ROUNDING=not key[2], BLOCK=block, num_warps=warps)
        plan = _FWD_PLANS[key] = (constexprs, tuple(constexprs.values()))
    return plan


def layer_norm_fwd(x, n, weight=None, bias=None, eps=1e-5, rms=False, out_dtype=None,
                   max_block=None):
    """Normalise rows of ``n`` trailing elements of ``x``. Returns ``(y, mean, rstd)``:
    ``y`` shaped like ``x`` in ``out_dtype`` (default ``x.dtype``), ``mean`` (None for
    RMSNorm) and ``rstd`` fp32 with one value per row."""
    _check(x, n, weight, bias)
    if not use_triton(x):
        return layer_norm_fwd_cpu(x, n, weight, bias, eps, rms, out_dtype)
    device = x.device
    x2, stride = _rows(x, n)
    m = x.numel() // n
    # (empty_like with an explicit format: a row-major output, at half the cost of
    # torch.empty(x.shape, ...))
    y = torch.empty_like(x, dtype=out_dtype or x.dtype, memory_format=_ROW_MAJOR)
    rstd = torch.empty(m, dtype=torch.float32, device=device)
    mean = None if rms else torch.empty(m, dtype=torch.float32, device=device)
    if m == 0:
        return y, mean, rstd
    if weight is not None and not weight.is_contiguous():
        weight = weight.contiguous()
    if bias is not None and not bias.is_contiguous():
        bias = bias.contiguous()
    constexprs, ckey = _fwd_plan(n, device, max_block, rms, weight is not None,
                                 bias is not None)
    w = x2 if weight is None else weight
    b = x2 if bias is None else bias
    mean_or_rstd = rstd if mean is None else mean
    args = (x2, y, w, b, mean_or_rstd, rstd, stride, n, eps)
    if (x2.data_ptr() | y.data_ptr() | w.data_ptr() | b.data_ptr() | mean_or_rstd.data_ptr()
            | rstd.data_ptr()) & 15 or eps.__class__ is not float:
        _FWD.launch((m,), args, constexprs, ckey)
    else:  # every pointer aligned: the dtypes and the two ints say the rest
        _FWD.launch_keyed((m,), args, constexprs,
                          (ckey, x2.dtype, y.dtype, w.dtype, b.dtype, mean_or_rstd.dtype,
                           rstd.dtype, stride, n))
    return y, mean, rstd


def reduce_splits(programs, n, device):
    """(BLOCK_G, BLOCK_N, splits, rows_per_split) of the weight-gradient reduction over
    ``programs`` partial rows of ``n`` columns: on the GPU its main pass runs at least
    2 x SM programs (column blocks x row splits) where the partial rows allow it, and a
    final pass sums the ``splits`` rows it leaves."""
    if gpu_code_path(device):
        block_g, block_n, target = 8, 128, 2 * sm_count(device)
    else:
        block_g, block_n, target = 32, 1024, 1
    col_blocks = cdiv(n, block_n)
    # col_blocks * splits >= target: rows_per_split rounds down, splits up
    rows_per_split = max(1, programs * col_blocks // target)
    if rows_per_split < 4:  # few partial rows: one pass sums them (no second launch)
        return block_g, block_n, 1, programs
    return block_g, block_n, cdiv(programs, rows_per_split), rows_per_split


def backward_programs(m, warps, device):
    """Programs of the backward row kernel: each owns a run of rows and one partial row
    of the weight gradients. On the GPU as many per SM as can be resident at ``warps``
    warps (64 warps per SM), at least 2 and at most 8 (more would lengthen the
    reduction over partial rows); 4 in the interpreter."""
    if gpu_code_path(device):
        per_sm = max(2, min(8, 64 // warps))
        return min(m, per_sm * sm_count(device))
    return min(m, 4)


_BWD = KeptKernel(_layer_norm_bwd_kernel)
_REDUCE = KeptKernel(_layer_norm_bwd_reduce_kernel)
_BWD_PLANS = {}


class _BwdPlan:
    """The backward's launch settings for one configuration and row count, kept."""
    __slots__ = ("programs", "rows_per_program", "one_pass", "constexprs", "ckey",
                 "col_blocks", "splits", "rows_per_split", "reduce", "reduce_key")

    def __init__(self, n, m, device, max_block, rms, has_w, has_b, from_output):
        gpu = gpu_code_path(device)
        block, warps, one_pass = norm_settings(n, device, max_block, backward=True)
        programs = backward_programs(m, warps, device)
        self.rows_per_program = cdiv(m, programs)
        # Every program has rows and stores its whole partial row.
        self.programs = cdiv(m, self.rows_per_program)
        self.one_pass = one_pass
        self.constexprs = dict(IS_RMS=rms, HAS_WEIGHT=has_w, HAS_BIAS=has_b,
                               FROM_OUTPUT=from_output, ONE_PASS=one_pass,
                               EMULATE_BF16_ROUNDING=not gpu, BLOCK=block, num_warps=warps)
        self.ckey = tuple(self.constexprs.values())
        block_g, block_n, self.splits, self.rows_per_split = reduce_splits(self.programs, n,
                                                                           device)
        self.col_blocks = cdiv(n, block_n)
        self.reduce = dict(HAS_WEIGHT=has_w, HAS_BIAS=has_b, EMULATE_BF16_ROUNDING=not gpu,
                           BLOCK_G=block_g, BLOCK_N=block_n, num_warps=4)
        self.reduce_key = tuple(self.reduce.values())


def _bwd_plan(n, m, device, max_block, rms, has_w, has_b, from_output):
    key = (n, m, device, gpu_code_path(device), max_block, rms, has_w, has_b, from_output)
    plan = _BWD_PLANS.get(key)
    if plan is None:
        if len(_BWD_PLANS) > 4096:  # row counts vary (sequence lengths): keep it bounded
            _BWD_PLANS.clear()
        plan = _BWD_PLANS[key] = _BwdPlan(n, m, device, max_block, rms, has_w, has_b,
                                          from_output)
    return plan


def min_weight(eps, dtype):
    """The least weight magnitude the backward divides by when it rebuilds the normalised
    input from the output: ``eps`` rounded to the weight's dtype (Apex's
    ``clamp_by_magnitude``: fp16's 1e-5 is the subnormal 1.0014e-5), and at least that
    dtype's smallest positive (subnormal) number (an eps such as 1e-8 rounds to 0 in
    fp16, where Apex then divides 0 by 0), as a Python float; kept per (eps, dtype)."""
    key = (eps, dtype)
    found = _MIN_WEIGHT.get(key)
    if found is None:
        if len(_MIN_WEIGHT) > 256:
            _MIN_WEIGHT.clear()
        info = torch.finfo(dtype)
        found = _MIN_WEIGHT[key] = max(float(torch.tensor(eps, dtype=dtype)),
                                       info.tiny * info.eps)  # (the least subnormal)
    return found


_MIN_WEIGHT = {}


def _clamped_weight(w32, min_w):
    """``w32`` with each magnitude under ``min_w`` raised to it, keeping the sign (zero
    counts as positive, NaN stays NaN): the divisor of ``(y - bias) / weight``."""
    return torch.where(w32 >= 0, torch.where(w32 < min_w, min_w, w32),
                       torch.where(w32 > -min_w, -min_w, w32))


def layer_norm_bwd(dy, saved, n, weight=None, bias=None, mean=None, rstd=None, rms=False,
                   from_output=False, x_dtype=None, max_block=None, eps=1e-5):
    """Gradients of :func:`layer_norm_fwd`. ``saved`` is the input, or the output when
    ``from_output`` (then ``mean`` is not needed, and the normalised input is rebuilt as
    ``(y - bias) / weight`` with each weight's magnitude at least ``eps`` rounded to the
    weight's dtype, as Apex's memory-efficient backward: a zero weight gives finite
    gradients, 0 for its own weight gradient). Returns ``(dx, dweight, dbias)``: ``dx`` in
    ``x_dtype`` (default ``saved.dtype``), the others in the parameters' dtypes (None where
    there is no parameter)."""
    _check(saved, n, weight, bias)
    _check_bwd(dy, saved, n, mean, rstd, not (rms or from_output))
    return layer_norm_bwd_prechecked(dy, saved, n, weight, bias, mean, rstd, rms, from_output,
                                     x_dtype, max_block, eps)


_GRAD_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _check_bwd(dy, saved, n, mean, rstd, needs_mean):
    """The backward's own inputs: ``dy`` shaped as ``saved`` on its device, and the
    forward's statistics (``rstd``, and ``mean`` for LayerNorm from the input) as it gave
    them: contiguous fp32, one value per row. (The kernels and torch's CPU backward read
    them by row without bounds: a shorter one was read past its end.)"""
    if not isinstance(dy, torch.Tensor) or dy.shape != saved.shape \
            or dy.device != saved.device or dy.dtype not in _GRAD_DTYPES:
        got = (f"{dy.dtype} of shape {tuple(dy.shape)} on {dy.device}"
               if isinstance(dy, torch.Tensor) else type(dy).__name__)
        raise ValueError(f"layer_norm_bwd: dy is {got}; expected a float32/bfloat16/float16 "
                         f"tensor of the saved tensor's shape {tuple(saved.shape)} on "
                         f"{saved.device}")
    m = saved.numel() // n
    for name, t in (("rstd", rstd),) + ((("mean", mean),) if needs_mean else ()):
        if not isinstance(t, torch.Tensor) or t.dtype != torch.float32 or t.shape != (m,) \
                or t.device != saved.device or not t.is_contiguous():
            got = (f"{t.dtype} of shape {tuple(t.shape)} on {t.device}"
                   f"{'' if t.is_contiguous() else ', not contiguous'}"
                   if isinstance(t, torch.Tensor) else repr(t))
            raise ValueError(f"layer_norm_bwd: {name} is {got}; pass the forward's {name}: "
                             f"a contiguous float32 tensor of shape ({m},) (one value per "
                             f"row) on {saved.device}")


def layer_norm_bwd_prechecked(dy, saved, n, weight=None, bias=None, mean=None, rstd=None,
                              rms=False, from_output=False, x_dtype=None, max_block=None,
                              eps=1e-5):
    """:func:`layer_norm_bwd` without its check of ``saved``, ``weight`` and ``bias``: for
    the norms' autograd, whose forward checked the same tensors (and autograd gives ``dy``
    the output's shape, dtype and device)."""
    if not use_triton(dy):
        return layer_norm_bwd_cpu(dy, saved, n, weight, bias, mean, rstd, rms, from_output,
                                  x_dtype, eps)
    device = dy.device
    v2, stride = _rows(saved, n)
    if not dy.is_contiguous():
        dy = dy.contiguous()
    m = saved.numel() // n
    dx = torch.empty_like(saved, dtype=x_dtype or saved.dtype, memory_format=_ROW_MAJOR)
    has_w, has_b = weight is not None, bias is not None and not rms
    dw = torch.empty_like(weight, memory_format=_ROW_MAJOR) if has_w else None
    db = torch.empty_like(bias, memory_format=_ROW_MAJOR) if has_b else None
    if m == 0:
        for g in (dw, db):
            if g is not None:
                g.zero_()
        return dx, dw, db
    if has_w and not weight.is_contiguous():
        weight = weight.contiguous()
    if has_b and not bias.is_contiguous():
        bias = bias.contiguous()
    plan = _bwd_plan(n, m, device, max_block, rms, has_w, has_b, from_output)
    programs = plan.programs
    # partial rows [programs, n], flat (the kernels index them as pid * n + column)
    dw_part = torch.empty(programs * n, dtype=torch.float32, device=device) if has_w else None
    db_part = torch.empty(programs * n, dtype=torch.float32, device=device) if has_b else None
    stats = rstd if plan.one_pass else torch.empty((m, 2), dtype=torch.float32, device=device)
    any_part = dw_part if has_w else (db_part if has_b else rstd)
    w = weight if has_w else v2
    b = bias if has_b else v2
    mean_or_rstd = rstd if mean is None else mean
    wp = dw_part if has_w else any_part
    bp = db_part if has_b else any_part
    args = (dy, v2, w, b, mean_or_rstd, rstd, dx, wp, bp, stats, stride, m, n,
            plan.rows_per_program,
            min_weight(eps, weight.dtype) if from_output and has_w else 0.0)
    if (dy.data_ptr() | v2.data_ptr() | w.data_ptr() | b.data_ptr() | mean_or_rstd.data_ptr()
            | rstd.data_ptr() | dx.data_ptr() | wp.data_ptr() | bp.data_ptr()
            | stats.data_ptr()) & 15:
        _BWD.launch((programs,), args, plan.constexprs, plan.ckey)
    else:  # every pointer aligned: the dtypes and the ints say the rest
        _BWD.launch_keyed((programs,), args, plan.constexprs,
                          (plan.ckey, dy.dtype, v2.dtype, w.dtype, b.dtype, mean_or_rstd.dtype,
                           rstd.dtype, dx.dtype, wp.dtype, bp.dtype, stats.dtype, stride, m,
                           n, plan.rows_per_program))
    if has_w or has_b:
        src_w, src_b, rows = dw_part, db_part, programs
        if plan.splits > 1:  # main pass into fp32 partial sums, then a small final pass
            splits = plan.splits
            mid_w = torch.empty((splits, n), dtype=torch.float32, device=device) if has_w \
                else None
            mid_b = torch.empty((splits, n), dtype=torch.float32, device=device) if has_b \
                else None
            mid_any = mid_w if has_w else mid_b
            _reduce((plan.col_blocks, splits), (
                src_w if has_w else src_b, src_b if has_b else src_w,
                mid_w if has_w else mid_any, mid_b if has_b else mid_any,
                rows, n, plan.rows_per_split), plan)
            src_w, src_b, rows = mid_w, mid_b, splits
        out_any = dw if has_w else db
        _reduce((plan.col_blocks, 1), (
            src_w if has_w else src_b, src_b if has_b else src_w,
            dw if has_w else out_any, db if has_b else out_any,
            rows, n, rows), plan)
    return dx, dw, db


def _reduce(grid, args, plan):
    """One launch of the weight-gradient reduction, keyed by its tensors' dtypes and its
    three ints when every pointer is aligned."""
    a, b, c, d, rows, n, per_split = args
    if (a.data_ptr() | b.data_ptr() | c.data_ptr() | d.data_ptr()) & 15:
        _REDUCE.launch(grid, args, plan.reduce, plan.reduce_key)
    else:
        _REDUCE.launch_keyed(grid, args, plan.reduce, (plan.reduce_key, a.dtype, b.dtype,
                                                       c.dtype, d.dtype, rows, n, per_split))


# --- the production CPU path ---------------------------------------------------------------

_ones = {}


def _f32(t):
    return None if t is None else t.reshape(-1).float()


def _ones_f32(n, device):
    """fp32 ones of length ``n``, made once: the weight handed to torch's mixed-dtype
    kernel for a half input without one, so that its statistics come back in fp32."""
    key = (n, device)
    t = _ones.get(key)
    if t is None:
        if len(_ones) > 64:
            _ones.clear()
        t = _ones[key] = torch.ones(n, dtype=torch.float32, device=device)
    return t


def layer_norm_fwd_cpu(x, n, weight=None, bias=None, eps=1e-5, rms=False, out_dtype=None):
    """The production CPU path of :func:`layer_norm_fwd`: torch's own CPU kernels.

    LayerNorm: ``torch.native_layer_norm``, straight on a half input when the output keeps
    the input's dtype (torch's mixed-dtype kernel computes in fp32 and rounds once; handed
    fp32 parameters, it returns fp32 statistics), else on the fp32 input with one cast of
    the result. RMSNorm: ``torch._fused_rms_norm`` (fp32 statistics; the reference's
    arithmetic, bit for bit)."""
    _check(x, n, weight, bias)
    if rms and bias is not None:
        # (an RMSNorm with a bias: no module makes one; torch's kernel has no bias)
        return layer_norm_fwd_ref(x, n, weight, bias, eps, rms, out_dtype)
    out_dtype = out_dtype or x.dtype
    x2 = x.reshape(-1, n)
    direct = out_dtype == x.dtype
    if not direct:
        x2 = x2.float()
    if rms:
        y, rstd = torch._fused_rms_norm(x2, [n], None if weight is None else weight.reshape(-1),
                                        eps)
        mean = None
    else:
        w32 = _f32(weight)
        if w32 is None and x2.dtype != torch.float32:
            w32 = _ones_f32(n, x.device)
        y, mean, rstd = torch.native_layer_norm(x2, [n], w32, _f32(bias), eps)
        mean = mean.reshape(-1)
    if not direct:
        y = y.to(out_dtype)
    return _reshaped(y, x.shape), mean, rstd.reshape(-1)


def _reshaped(y, shape):
    """``y`` (contiguous) with ``shape``, as a tensor of its own rather than a view: the
    output of the norms' autograd Function, which a caller may modify in place (autograd
    refuses in-place changes to a view a Function returns)."""
    v = y.reshape(shape)
    return y.new_empty(0).set_(y.untyped_storage(), v.storage_offset(), v.shape, v.stride())


def layer_norm_bwd_cpu(dy, saved, n, weight=None, bias=None, mean=None, rstd=None, rms=False,
                       from_output=False, x_dtype=None, eps=1e-5):
    """The production CPU path of :func:`layer_norm_bwd`.

    LayerNorm from the input: torch's fp32 ``native_layer_norm_backward``, as the reference
    already runs it (half operands are widened first: torch's mixed-dtype backward
    accumulates the weight and bias gradients with too little precision). From the output
    (``memory_efficient``): the reference's arithmetic written out
    (:func:`_layer_norm_bwd_from_output_cpu`: ``xhat = (y - bias) / weight``, the weight's
    magnitudes at least :func:`min_weight`, and the row sum from ``(y - bias) * dy``).
    RMSNorm (torch has no CPU backward kernel): the
    reference's arithmetic with its temporaries reused in place (bit for bit)."""
    _check(saved, n, weight, bias)
    x_dtype = x_dtype or saved.dtype
    v = saved.reshape(-1, n)
    dy2 = dy.reshape(-1, n)
    w32 = _f32(weight)
    has_b = bias is not None and not rms
    b32 = _f32(bias) if has_b else None
    div = None
    if from_output and w32 is not None:
        div = _clamped_weight(w32, min_weight(eps, weight.dtype))
    if rms:
        dx, dw = _rms_norm_bwd_cpu(dy2, v, w32, rstd, from_output, n, div)
        db = None
    else:
        dy32 = dy2.float()
        mask = [True, weight is not None, has_b]
        if not from_output:
            # (the reference's own path: torch's fp32 kernel)
            dx, dw, db = torch.ops.aten.native_layer_norm_backward(
                dy32, v.float(), [n], mean[:, None], rstd[:, None], w32, b32, mask)
        else:
            dx, dw, db = _layer_norm_bwd_from_output_cpu(dy32, v, w32, b32, div, rstd)
    dw = None if weight is None else dw.to(weight.dtype).reshape(weight.shape)
    db = None if not has_b else db.to(bias.dtype).reshape(bias.shape)
    return dx.to(x_dtype).reshape(saved.shape), dw, db


def _xhat_from_output(y, w32, b32):
    """``(y - bias) / weight`` in a new fp32 tensor (``y`` itself when fp32 and there is
    nothing to undo); ``w32`` is the divisor, already clamped. Half operands are widened
    first: torch's element-wise ops on mixed dtypes run a slow casting loop."""
    owned = y.dtype != torch.float32
    xhat = y.float()
    if b32 is not None:
        xhat = xhat.sub_(b32) if owned else torch.sub(xhat, b32)
        owned = True
    if w32 is not None:
        xhat = xhat.div_(w32) if owned else torch.div(xhat, w32)
    return xhat


def _layer_norm_bwd_from_output_cpu(dy32, y, w32, b32, div, rstd):
    """LayerNorm's ``(dx, dw, db)`` in fp32 from the output: ``xhat = (y - bias) / div``,
    ``c1 = mean((y - bias) * dy)`` (no division: a clamped weight touches only its own
    column), ``c2 = mean(w dy)``, ``dx = (w dy - (xhat c1 + c2)) rstd``, the reference's
    arithmetic step for step."""
    if b32 is None:
        scaled = y.float()
    else:  # (a new tensor: y itself is the saved output)
        scaled = torch.sub(y, b32) if y.dtype == torch.float32 else y.float().sub_(b32)
        if w32 is not None:  # (weight * xhat is exactly 0 where the weight is 0)
            scaled.masked_fill_(w32 == 0, 0.0)
    xhat = scaled if w32 is None else torch.div(scaled, div)
    wdy = dy32 if w32 is None else torch.mul(dy32, w32)
    c1 = (torch.mul(scaled, dy32) if w32 is not None else torch.mul(xhat, wdy)).mean(
        dim=1, keepdim=True)
    c2 = wdy.mean(dim=1, keepdim=True)
    # wdy - (xhat * c1 + c2) with every rounding (no fused multiply-add), then * rstd
    dx = torch.sub(wdy, torch.mul(xhat, c1).add_(c2)).mul_(rstd[:, None])
    dw = None if w32 is None else torch.mul(dy32, xhat).sum(0)
    db = None if b32 is None else dy32.sum(0)
    return dx, dw, db


def _rms_norm_bwd_cpu(dy, v, w32, rstd, from_output, n, div=None):
    """RMSNorm's ``(dx, dw)`` in fp32, the reference's arithmetic step for step
    (``dx = (w dy - xhat * mean(xhat * w dy)) * rstd``, ``dw = sum(dy * xhat)``, ``xhat =
    x * rstd`` or, from the output, ``y / div``, ``div`` the clamped weight) with its
    temporaries reused in place."""
    dy32 = dy.float()
    r = rstd[:, None]
    if from_output:
        xhat = _xhat_from_output(v, div, None)
    elif v.dtype == torch.float32:
        xhat = torch.mul(v, r)
    else:
        xhat = v.float().mul_(r)
    wdy = dy32 if w32 is None else torch.mul(dy32, w32)
    if from_output and w32 is not None:  # (y * dy: no division, see _c1_term)
        prod = torch.mul(v, dy32) if v.dtype == torch.float32 else v.float().mul_(dy32)
    else:
        prod = torch.mul(xhat, wdy)
    c1 = prod.mean(dim=1, keepdim=True)
    # wdy - xhat * c1 with both roundings (no fused multiply-add), then * rstd
    dx = torch.sub(wdy, torch.mul(xhat, c1, out=prod), out=prod).mul_(r)
    dw = None if w32 is None else xhat.mul_(dy32).sum(0)
    return dx, dw


def layer_norm_fwd_ref(x, n, weight=None, bias=None, eps=1e-5, rms=False, out_dtype=None):
    """Torch reference of :func:`layer_norm_fwd` (fp32 arithmetic, centred variance)."""
    _check(x, n, weight, bias)
    out_dtype = out_dtype or x.dtype
    x2 = x.reshape(-1, n).float()
    if not rms:
        # torch's own fp32 kernel: the same arithmetic (centred variance), and quick on CPU
        w32 = weight.reshape(-1).float() if weight is not None else None
        b32 = bias.reshape(-1).float() if bias is not None else None
        y, mean, rstd = torch.native_layer_norm(x2, [n], w32, b32, eps)
        return y.to(out_dtype).reshape(x.shape), mean.reshape(-1), rstd.reshape(-1)
    if rms:
        mean = None
        xc = x2
    else:
        mean = x2.mean(dim=1)
        xc = x2 - mean[:, None]
    rstd = torch.rsqrt((xc * xc).mean(dim=1) + eps)
    y = xc * rstd[:, None]
    if weight is not None:
        y = y * weight.reshape(-1).float()
    if bias is not None:
        y = y + bias.reshape(-1).float()
    return y.to(out_dtype).reshape(x.shape), mean, rstd


def layer_norm_bwd_ref(dy, saved, n, weight=None, bias=None, mean=None, rstd=None, rms=False,
                       from_output=False, x_dtype=None, eps=1e-5):
    """Torch reference of :func:`layer_norm_bwd`."""
    _check(saved, n, weight, bias)
    x_dtype = x_dtype or saved.dtype
    v = saved.reshape(-1, n).float()
    dy2 = dy.reshape(-1, n).float()
    if not rms and not from_output:
        w32 = weight.reshape(-1).float() if weight is not None else None
        b32 = bias.reshape(-1).float() if bias is not None else None
        dx, dw, db = torch.ops.aten.native_layer_norm_backward(
            dy2, v, [n], mean[:, None], rstd[:, None], w32, b32,
            [True, weight is not None, bias is not None])
        return (dx.to(x_dtype).reshape(saved.shape),
                None if weight is None else dw.to(weight.dtype).reshape(weight.shape),
                None if bias is None else db.to(bias.dtype).reshape(bias.shape))
    w = weight.reshape(-1).float() if weight is not None else None
    if from_output:
        xhat = v
        if bias is not None and not rms:
            xhat = xhat - bias.reshape(-1).float()
            if w is not None:
                # weight * xhat is exactly 0 where the weight is: a half output there is
                # the bias rounded, and its rounding error is not the row's deviation
                xhat = torch.where(w == 0, 0.0, xhat)
        scaled = xhat  # y - bias: weight * xhat, without the clamped division
        if w is not None:
            xhat = xhat / _clamped_weight(w, min_weight(eps, weight.dtype))
    elif rms:
        xhat = v * rstd[:, None]
    else:
        xhat = (v - mean[:, None]) * rstd[:, None]
    wdy = dy2 * w if w is not None else dy2
    if from_output and w is not None:  # (as Apex's kernel: no division in the row sum)
        c1 = (scaled * dy2).mean(dim=1, keepdim=True)
    else:
        c1 = (xhat * wdy).mean(dim=1, keepdim=True)
    if rms:
        dx = (wdy - xhat * c1) * rstd[:, None]
    else:
        dx = (wdy - (xhat * c1 + wdy.mean(dim=1, keepdim=True))) * rstd[:, None]
    dw = (dy2 * xhat).sum(0).to(weight.dtype).reshape(weight.shape) if weight is not None else None
    db = (dy2.sum(0).to(bias.dtype).reshape(bias.shape)
          if bias is not None and not rms else None)
    return dx.to(x_dtype).reshape(saved.shape), dw, db
