"""Fused NovoGrad step (Apex's ``multi_tensor_novograd``) over a list of tensors.

NovoGrad (Ginsburg et al. 2019) keeps one second-moment scalar per tensor, a running
norm of its gradient. For every tensor, with g = grad * (1/grad_scale) when a scale is
given, t the tensor's step count after this step, bc1 = 1 - beta1**t and
bc2 = sqrt(1 - beta2**t) (1 without bias correction), beta3 = 1 - beta1 (1 without grad
averaging), and n the norm of g (L2 for norm_type=2, max |g| for norm_type=0):

    v = sqrt(beta2 * v**2 + (1 - beta2) * n**2)     (norm_type 2)
    v = beta2 * v + (1 - beta2) * n                  (norm_type 0)
        where v starts at 0 (init_zero) or, on a tensor's first step, at n
    denom = v / bc2 + eps
    reg_inside_moment=False (Apex's default, decoupled):
        m = beta1 * m + beta3 * g;   p -= lr * ((m / bc1) / denom + wd * p)
    reg_inside_moment=True (the paper's form):
        g = g / denom + wd * p;      m = beta1 * m + beta3 * g;   p -= lr * (m / bc1)

Apex's order of operations, in fp32 whatever the parameter dtype. ``v`` is one fp32 0-d
tensor per parameter (``exp_avg_sqs``); "first step" is read from the tensor's step
count on the device, so a skipped first step still initialises on the next one.

Three launches per dtype group whatever the number of tensors: per-block partial norms
of the gradients, one small program per tensor that reduces its partials and blends v,
and the elementwise update. ``copies`` (optional) receive the new parameter in their own
dtype. When ``found_inf`` holds a non-zero value nothing is written and the step counts
stay: the skipped step leaves no trace.
"""
import torch
import triton
import triton.language as tl

from ._dispatch import elementwise_settings, use_triton
from ._ref_utils import f32 as _f32
from ._multi_tensor import check_lists, dtype_groups, plan_columns
from ._tl_utils import bias_corrections, load_f32, load_grad, load_lr, store_param, sweep_block
from ._ref_utils import advance_steps
from .adam import _betas
from .l2norm import SEGMENT_BLOCK, block_counts, segment_table


@triton.jit
def _novograd_norm_kernel(
    meta_ptr,        # int64 [n, 7]: param, grad, exp_avg, copy, step, exp_avg_sq addresses; numel
    blocks_ptr,      # int32 [n_blocks, 2]: tensor index, block index within that tensor
    g_proto,         # a gradient tensor: carries the gradient element type
    partials_ptr,    # fp32 [n_blocks]: the block's sum of g*g (L2) or max |g| (MAX_NORM)
    scale_ptr,       # fp32 scalar: the loss scale the gradients carry (HAS_SCALE)
    found_inf_ptr,   # fp32 scalar: non-zero means skip this step (HAS_FOUND_INF)
    HAS_SCALE: tl.constexpr,
    HAS_FOUND_INF: tl.constexpr,
    MAX_NORM: tl.constexpr,        # norm_type 0
    EMULATE_BF16_ROUNDING: tl.constexpr,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    tensor, row, offs, mask = sweep_block(meta_ptr, blocks_ptr, found_inf_ptr, 6, HAS_FOUND_INF, BLOCK)
    g = load_grad(row, g_proto, offs, mask, scale_ptr, HAS_SCALE, EMULATE_BF16_ROUNDING)
    if MAX_NORM:
        # tl.max may drop NaN (the interpreter does): carry it through by hand.
        has_nan = tl.max((g != g).to(tl.int32), axis=0) > 0
        part = tl.where(has_nan, float("nan"), tl.max(tl.abs(g), axis=0))
    else:
        part = tl.sum(g * g, axis=0)
    tl.store(partials_ptr + pid, part)


@triton.jit
def _novograd_blend_kernel(
    meta_ptr,        # int64 [n_tensors, 7]: as above; exp_avg_sq (col 5) is read and written
    segments_ptr,    # int64 [n_tensors, 2]: index of a tensor's first partial, their count
    partials_ptr,    # fp32 [n_blocks]: from _novograd_norm_kernel
    beta2, one_minus_beta2,
    found_inf_ptr,   # fp32 scalar: non-zero means skip this step (HAS_FOUND_INF)
    HAS_FOUND_INF: tl.constexpr,
    MAX_NORM: tl.constexpr,
    INIT_ZERO: tl.constexpr,       # v starts at 0 rather than at the first norm
    BLOCK_R: tl.constexpr,
):
    # One program per tensor, a fixed summation order: deterministic.
    t = tl.program_id(0).to(tl.int64)
    row = meta_ptr + 7 * t
    start = tl.load(segments_ptr + 2 * t)
    count = tl.load(segments_ptr + 2 * t + 1)
    if MAX_NORM:
        acc = tl.zeros([BLOCK_R], dtype=tl.float32)
        bad = tl.zeros([BLOCK_R], dtype=tl.int32)
        for off in range(0, count, BLOCK_R):
            idx = off + tl.arange(0, BLOCK_R)
            x = tl.load(partials_ptr + start + idx, mask=idx < count, other=0.0)
            bad = bad | (x != x).to(tl.int32)
            acc = tl.maximum(acc, x)
        n = tl.where(tl.max(bad, axis=0) > 0, float("nan"), tl.max(acc, axis=0))
    else:
        acc = tl.zeros([BLOCK_R], dtype=tl.float32)
        for off in range(0, count, BLOCK_R):
            idx = off + tl.arange(0, BLOCK_R)
            acc += tl.load(partials_ptr + start + idx, mask=idx < count, other=0.0)
        sq = tl.sum(acc, axis=0)
        n = tl.sqrt_rn(sq)
    v_ptr = tl.load(row + 5).to(tl.pointer_type(tl.float32))
    step_ptr = tl.load(row + 4).to(tl.pointer_type(tl.float32))
    v = tl.load(v_ptr)
    if not INIT_ZERO:
        v = tl.where(tl.load(step_ptr) == 0.0, n, v)
    if MAX_NORM:
        v = beta2 * v + one_minus_beta2 * n
    else:
        v = tl.sqrt_rn(beta2 * v * v + one_minus_beta2 * sq)
    if HAS_FOUND_INF:
        tl.store(v_ptr, v, mask=tl.load(found_inf_ptr) == 0.0)
    else:
        tl.store(v_ptr, v)


@triton.jit
def _novograd_step_kernel(
    meta_ptr,        # int64 [n, 7]: param, grad, exp_avg, copy, step, exp_avg_sq addresses; numel
    blocks_ptr,      # int32 [n_blocks, 2]: tensor index, block index within that tensor
    p_proto,         # a param tensor: carries the parameter element type
    g_proto,         # a gradient tensor: carries the gradient element type
    c_proto,         # a copy tensor (or any tensor without copies): carries the copy type
    lr,              # learning rate: a float, or an fp32 scalar tensor when LR_IS_TENSOR
    betas_ptr,       # fp64 [2]: beta1, beta2 (bias corrections in fp64)
    beta1, beta3, eps, weight_decay,
    scale_ptr,       # fp32 scalar: the loss scale the gradients carry (HAS_SCALE)
    found_inf_ptr,   # fp32 scalar: non-zero means skip this step (HAS_FOUND_INF)
    LR_IS_TENSOR: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    HAS_FOUND_INF: tl.constexpr,
    REG_INSIDE_MOMENT: tl.constexpr,
    BIAS_CORRECTION: tl.constexpr,
    HAS_COPY: tl.constexpr,
    EMULATE_BF16_ROUNDING: tl.constexpr,
    BLOCK: tl.constexpr,
):
    tensor, row, offs, mask = sweep_block(meta_ptr, blocks_ptr, found_inf_ptr, 6, HAS_FOUND_INF, BLOCK)
    p_ptr = tl.load(row + 0).to(tl.pointer_type(p_proto.dtype.element_ty))
    m_ptr = tl.load(row + 2).to(tl.pointer_type(tl.float32))
    step_ptr = tl.load(row + 4).to(tl.pointer_type(tl.float32))
    v_ptr = tl.load(row + 5).to(tl.pointer_type(tl.float32))

    g = load_grad(row, g_proto, offs, mask, scale_ptr, HAS_SCALE, EMULATE_BF16_ROUNDING)
    p = load_f32(p_ptr + offs, mask, EMULATE_BF16_ROUNDING)
    m = tl.load(m_ptr + offs, mask=mask, other=0.0)
    lr_v = load_lr(lr, LR_IS_TENSOR)
    if BIAS_CORRECTION:
        c1, c2 = bias_corrections(step_ptr, betas_ptr)
        bc1 = c1.to(tl.float32)
        bc2 = tl.sqrt(c2).to(tl.float32)
    else:
        bc1 = 1.0
        bc2 = 1.0
    denom = tl.div_rn(tl.load(v_ptr), bc2) + eps
    if REG_INSIDE_MOMENT:
        g = tl.div_rn(g, denom) + weight_decay * p
        m = beta1 * m + beta3 * g
        p = p - lr_v * tl.div_rn(m, bc1)
    else:
        m = beta1 * m + beta3 * g
        p = p - lr_v * (tl.div_rn(tl.div_rn(m, bc1), denom) + weight_decay * p)
    store_param(row, p_ptr, p, offs, mask, c_proto, 3, HAS_COPY, EMULATE_BF16_ROUNDING)
    tl.store(m_ptr + offs, m, mask=mask)


def _check(params, grads, exp_avgs, exp_avg_sqs, steps, copies, norm_type):
    check_lists("novograd_step", params, fp32=("exp_avgs", "exp_avg_sqs"), grads=grads,
                exp_avgs=exp_avgs, exp_avg_sqs=exp_avg_sqs, steps=steps, copies=copies)
    if norm_type not in (0, 2):
        raise ValueError(f"novograd_step: norm_type must be 2 (L2) or 0 (max norm), "
                         f"got {norm_type}")
    if any(v.numel() != 1 for v in exp_avg_sqs):
        raise ValueError("novograd_step: exp_avg_sqs holds one scalar per tensor")


@torch.no_grad()
def novograd_step(params, grads, exp_avgs, exp_avg_sqs, steps, copies=None, *, lr, beta1,
                  beta2, eps, weight_decay, reg_inside_moment=False, grad_averaging=True,
                  norm_type=2, init_zero=False, bias_correction=True, grad_scale=None,
                  found_inf=None):
    """One NovoGrad step for lists of tensors (see the module docstring).

    ``exp_avg_sqs`` are fp32 0-d tensors (the per-tensor running gradient norm),
    ``steps`` fp32 0-d tensors advanced by one unless ``found_inf`` is non-zero; ``lr`` a
    float or an fp32 0-d tensor. No host sync."""
    params = list(params)
    if not params:
        return
    _check(params, grads, exp_avgs, exp_avg_sqs, steps, copies, norm_type)
    if not use_triton(params[0]):
        novograd_step_ref(params, grads, exp_avgs, exp_avg_sqs, steps, copies, lr=lr,
                          beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay,
                          reg_inside_moment=reg_inside_moment, grad_averaging=grad_averaging,
                          norm_type=norm_type, init_zero=init_zero,
                          bias_correction=bias_correction, grad_scale=grad_scale,
                          found_inf=found_inf)
        return
    groups = dtype_groups(params, grads, copies)
    lr_is_tensor = isinstance(lr, torch.Tensor)
    has_inf = found_inf is not None
    max_norm = norm_type == 0
    for (device, _, _, copy_dtype), idx in groups.items():
        block, warps = elementwise_settings(device)
        emulate = device.type != "cuda"
        cols = [[params[i] for i in idx], [grads[i] for i in idx], [exp_avgs[i] for i in idx],
                None if copy_dtype is None else [copies[i] for i in idx],
                [steps[i] for i in idx], [exp_avg_sqs[i] for i in idx]]
        pl = plan_columns(cols, block)
        anchor = cols[0][0]
        partials = torch.empty(pl.n_blocks, dtype=torch.float32, device=device)
        _novograd_norm_kernel[(pl.n_blocks,)](
            pl.meta, pl.blocks, cols[1][0], partials,
            grad_scale if grad_scale is not None else partials,
            found_inf if has_inf else partials,
            HAS_SCALE=grad_scale is not None, HAS_FOUND_INF=has_inf, MAX_NORM=max_norm,
            EMULATE_BF16_ROUNDING=emulate, BLOCK=block, num_warps=warps)
        table = segment_table(block_counts([t.numel() for t in cols[0]], block), device)
        _novograd_blend_kernel[(len(idx),)](
            pl.meta, table, partials, float(beta2), 1.0 - beta2,
            found_inf if has_inf else partials,
            HAS_FOUND_INF=has_inf, MAX_NORM=max_norm, INIT_ZERO=bool(init_zero),
            BLOCK_R=SEGMENT_BLOCK, num_warps=4)
        _novograd_step_kernel[(pl.n_blocks,)](
            pl.meta, pl.blocks, anchor, cols[1][0], cols[3][0] if cols[3] else anchor,
            lr, _betas(device, beta1, beta2), float(beta1),
            1.0 - beta1 if grad_averaging else 1.0, float(eps), float(weight_decay),
            grad_scale if grad_scale is not None else partials,
            found_inf if has_inf else partials,
            LR_IS_TENSOR=lr_is_tensor, HAS_SCALE=grad_scale is not None, HAS_FOUND_INF=has_inf,
            REG_INSIDE_MOMENT=bool(reg_inside_moment), BIAS_CORRECTION=bool(bias_correction),
            HAS_COPY=copy_dtype is not None, EMULATE_BF16_ROUNDING=emulate, BLOCK=block,
            num_warps=warps)
    advance_steps(list(steps), found_inf)


@torch.no_grad()
def novograd_step_ref(params, grads, exp_avgs, exp_avg_sqs, steps, copies=None, *, lr, beta1,
                      beta2, eps, weight_decay, reg_inside_moment=False, grad_averaging=True,
                      norm_type=2, init_zero=False, bias_correction=True, grad_scale=None,
                      found_inf=None):
    """Torch reference of :func:`novograd_step` (same order of operations, fp32; norms
    from torch, so they may differ from the kernel's in the last bits)."""
    params = list(params)
    if not params:
        return
    if norm_type not in (0, 2):
        raise ValueError(f"novograd_step: norm_type must be 2 (L2) or 0 (max norm), "
                         f"got {norm_type}")
    inv = None if grad_scale is None else grad_scale.double().reciprocal().float().reshape(())
    keep = None if found_inf is None else found_inf.reshape(()) == 0
    beta3 = _f32(1.0 - beta1 if grad_averaging else 1.0)
    for i, p in enumerate(params):
        if p.numel() == 0:
            continue
        g = grads[i].float()
        if inv is not None:
            g = g * inv
        if norm_type == 0:
            n = torch.where(torch.isnan(g).any(), _f32(float("nan")), g.abs().max())
        else:
            sq = (g * g).sum()
            n = sq.double().sqrt().float()
        v_old = exp_avg_sqs[i].reshape(())
        v = v_old if init_zero else torch.where(steps[i].reshape(()) == 0, n, v_old)
        if norm_type == 0:
            v = _f32(beta2) * v + _f32(1.0 - beta2) * n
        else:
            v = torch.sqrt(_f32(beta2) * v * v + _f32(1.0 - beta2) * sq)
        if bias_correction:
            b = _betas(p.device, beta1, beta2)
            t = steps[i].double() + 1.0
            bc1 = (1.0 - torch.exp2(t * torch.log2(b[0]))).float()
            bc2 = torch.sqrt(1.0 - torch.exp2(t * torch.log2(b[1]))).float()
        else:
            bc1 = bc2 = _f32(1.0)
        lr_v = lr.float().reshape(()) if isinstance(lr, torch.Tensor) else _f32(lr)
        pf = p.float()
        denom = v / bc2 + _f32(eps)
        if reg_inside_moment:
            g = g / denom + _f32(weight_decay) * pf
            m = _f32(beta1) * exp_avgs[i] + beta3 * g
            new_p = pf - lr_v * (m / bc1)
        else:
            m = _f32(beta1) * exp_avgs[i] + beta3 * g
            new_p = pf - lr_v * ((m / bc1) / denom + _f32(weight_decay) * pf)
        if keep is not None:
            new_p = torch.where(keep, new_p, pf)
            m = torch.where(keep, m, exp_avgs[i])
            v = torch.where(keep, v, v_old)
        p.copy_(new_p)
        exp_avgs[i].copy_(m)
        exp_avg_sqs[i].copy_(v.reshape(exp_avg_sqs[i].shape))
        if copies is not None:
            if keep is None:
                copies[i].copy_(new_p)
            else:
                copies[i].copy_(torch.where(keep, new_p.to(copies[i].dtype), copies[i]))
    advance_steps(list(steps), found_inf)
