"""Fused Adam / AdamW step over a list of tensors, one launch per dtype group.

For every tensor, with g = grad * (1/grad_scale) when a scale is given, and t the
tensor's step count after this step:

    p *= 1 - lr * wd                 (AdamW)      g += wd * p          (Adam, L2)
    m = lerp(m, g, 1 - beta1)        v = beta2 * v + (1 - beta2) * g * g
    p -= lr / (1 - beta1**t) * m / (sqrt(v) / sqrt(1 - beta2**t) + eps)

torch.optim.Adam's order of operations, in fp32 whatever the parameter dtype, with IEEE
round-to-nearest square root and division (``tl.sqrt_rn`` / ``tl.div_rn``; plain
``tl.sqrt`` and ``/`` compile to approximate instructions on the GPU). ``copies``
(optional) receive the updated parameter in their own dtype: the half model copy of an
fp32 master weight, written in the same pass. When ``found_inf`` holds a non-zero value
nothing is read or written and the step counts stay: the skipped step leaves no trace.
"""
import torch
import triton
import triton.language as tl

from ._dispatch import elementwise_settings, use_triton
from ._ref_utils import f32 as _f32, sqrt_rn as _sqrt_rn
from ._multi_tensor import check_lists, dtype_groups, plan_columns
from ._tl_utils import bias_corrections, load_f32, load_grad, load_lr, store_param, sweep_block


@triton.jit
def _adam_step_kernel(
    meta_ptr,        # int64 [n_tensors, 7]: param, grad, exp_avg, exp_avg_sq, copy, step addresses; numel
    blocks_ptr,      # int32 [n_blocks, 2]: tensor index, block index within that tensor
    p_proto,         # a param tensor: carries the parameter element type
    g_proto,         # a gradient tensor: carries the gradient element type
    c_proto,         # a copy tensor (or any tensor without copies): carries the copy type
    lr,              # learning rate: a float, or an fp32 scalar tensor when LR_IS_TENSOR
    betas_ptr,       # fp64 [2]: beta1, beta2 (bias corrections in fp64, as torch's)
    one_minus_beta1, beta2, one_minus_beta2, eps, weight_decay,
    decay_factor,    # 1 - lr * weight_decay rounded once on the host (AdamW, float lr)
    scale_ptr,       # fp32 scalar: the loss scale the gradients carry (HAS_SCALE)
    found_inf_ptr,   # fp32 scalar: non-zero means skip this step (HAS_FOUND_INF)
    LR_IS_TENSOR: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    HAS_FOUND_INF: tl.constexpr,
    ADAM_W: tl.constexpr,
    BIAS_CORRECTION: tl.constexpr,
    HAS_COPY: tl.constexpr,
    EMULATE_BF16_ROUNDING: tl.constexpr,
    BLOCK: tl.constexpr,
):
    tensor, row, offs, mask = sweep_block(meta_ptr, blocks_ptr, found_inf_ptr, 6, HAS_FOUND_INF, BLOCK)
    p_ptr = tl.load(row + 0).to(tl.pointer_type(p_proto.dtype.element_ty))
    m_ptr = tl.load(row + 2).to(tl.pointer_type(tl.float32))
    v_ptr = tl.load(row + 3).to(tl.pointer_type(tl.float32))
    step_ptr = tl.load(row + 5).to(tl.pointer_type(tl.float32))

    g = load_grad(row, g_proto, offs, mask, scale_ptr, HAS_SCALE, EMULATE_BF16_ROUNDING)
    p = load_f32(p_ptr + offs, mask, EMULATE_BF16_ROUNDING)
    m = tl.load(m_ptr + offs, mask=mask, other=0.0)
    v = tl.load(v_ptr + offs, mask=mask, other=0.0)
    lr_v = load_lr(lr, LR_IS_TENSOR)
    if ADAM_W:
        if LR_IS_TENSOR:
            p = p * (1.0 - lr_v * weight_decay)
        else:
            p = p * decay_factor
    else:
        g = g + weight_decay * p
    m = m + one_minus_beta1 * (g - m)
    v = v * beta2 + one_minus_beta2 * g * g
    if BIAS_CORRECTION:
        bc1, bc2 = bias_corrections(step_ptr, betas_ptr)
        bc2_sqrt = tl.sqrt(bc2).to(tl.float32)
        step_size = (lr_v.to(tl.float64) / bc1).to(tl.float32)
        denom = tl.div_rn(tl.sqrt_rn(v), bc2_sqrt) + eps
    else:
        step_size = lr_v
        denom = tl.sqrt_rn(v) + eps
    p = p - step_size * tl.div_rn(m, denom)
    store_param(row, p_ptr, p, offs, mask, c_proto, 4, HAS_COPY, EMULATE_BF16_ROUNDING)
    tl.store(m_ptr + offs, m, mask=mask)
    tl.store(v_ptr + offs, v, mask=mask)


def _check(params, grads, exp_avgs, exp_avg_sqs, steps, copies):
    check_lists("adam_step", params, fp32=("exp_avgs", "exp_avg_sqs"), grads=grads,
                exp_avgs=exp_avgs, exp_avg_sqs=exp_avg_sqs, steps=steps, copies=copies)


@torch.no_grad()
def adam_step(params, grads, exp_avgs, exp_avg_sqs, steps, copies=None, *, lr, beta1, beta2,
              eps, weight_decay, adam_w_mode=True, bias_correction=True, grad_scale=None,
              found_inf=None):
    """One Adam/AdamW step for lists of same-shaped tensors (see the module docstring).

    ``steps`` are fp32 0-d tensors, advanced by one unless ``found_inf`` is non-zero;
    ``lr`` a float or an fp32 0-d tensor (capturable). No host sync."""
    params = list(params)
    if not params:
        return
    _check(params, grads, exp_avgs, exp_avg_sqs, steps, copies)
    if not use_triton(params[0]):
        adam_step_ref(params, grads, exp_avgs, exp_avg_sqs, steps, copies, lr=lr, beta1=beta1,
                      beta2=beta2, eps=eps, weight_decay=weight_decay, adam_w_mode=adam_w_mode,
                      bias_correction=bias_correction, grad_scale=grad_scale,
                      found_inf=found_inf)
        return
    groups = dtype_groups(params, grads, copies)
    lr_is_tensor = isinstance(lr, torch.Tensor)
    for (device, _, _, copy_dtype), idx in groups.items():
        block, warps = elementwise_settings(device)
        cols = [[params[i] for i in idx], [grads[i] for i in idx], [exp_avgs[i] for i in idx],
                [exp_avg_sqs[i] for i in idx],
                None if copy_dtype is None else [copies[i] for i in idx],
                [steps[i] for i in idx]]
        pl = plan_columns(cols, block)
        anchor = cols[0][0]
        _adam_step_kernel[(pl.n_blocks,)](
            pl.meta, pl.blocks, anchor, cols[1][0], cols[4][0] if cols[4] else anchor,
            lr, _betas(device, beta1, beta2), 1.0 - beta1, float(beta2), 1.0 - beta2, float(eps),
            float(weight_decay), 1.0 if lr_is_tensor else 1.0 - lr * weight_decay,
            grad_scale if grad_scale is not None else anchor,
            found_inf if found_inf is not None else anchor,
            LR_IS_TENSOR=lr_is_tensor, HAS_SCALE=grad_scale is not None,
            HAS_FOUND_INF=found_inf is not None, ADAM_W=bool(adam_w_mode),
            BIAS_CORRECTION=bool(bias_correction), HAS_COPY=copy_dtype is not None,
            EMULATE_BF16_ROUNDING=device.type != "cuda", BLOCK=block, num_warps=warps)
    advance_steps(list(steps), found_inf)


_betas_cache = {}


def _betas(device, beta1, beta2):
    """fp64 (beta1, beta2) on ``device``, uploaded once per distinct pair."""
    key = (device, float(beta1), float(beta2))
    t = _betas_cache.get(key)
    if t is None:
        t = torch.tensor(key[1:], dtype=torch.float64).to(device)
        _betas_cache[key] = t
    return t


def advance_steps(steps, found_inf):
    """step += 1 for every step tensor, += 0 when ``found_inf`` is non-zero (on device)."""
    if not steps:
        return
    if found_inf is None:
        torch._foreach_add_(steps, 1.0)
    else:
        keep = (found_inf.reshape(()) == 0).to(steps[0].dtype)
        torch._foreach_add_(steps, keep)


@torch.no_grad()
def adam_step_ref(params, grads, exp_avgs, exp_avg_sqs, steps, copies=None, *, lr, beta1, beta2,
                  eps, weight_decay, adam_w_mode=True, bias_correction=True, grad_scale=None,
                  found_inf=None):
    """Torch reference of :func:`adam_step` (same order of operations, fp32)."""
    params = list(params)
    if not params:
        return
    inv = None if grad_scale is None else grad_scale.double().reciprocal().float()
    keep = None if found_inf is None else found_inf.reshape(()) == 0
    for i, p in enumerate(params):
        if p.numel() == 0:
            continue
        g = grads[i].float()
        if inv is not None:
            g = g * inv
        pf = p.float()
        lr_v = lr.float() if isinstance(lr, torch.Tensor) else lr
        if adam_w_mode:
            factor = (1.0 - lr_v * weight_decay) if isinstance(lr, torch.Tensor) \
                else _f32(1.0 - lr * weight_decay)
            pf = pf * factor
        else:
            g = g + _f32(weight_decay) * pf
        m = exp_avgs[i] + _f32(1.0 - beta1) * (g - exp_avgs[i])
        v = exp_avg_sqs[i] * _f32(beta2) + _f32(1.0 - beta2) * g * g
        if bias_correction:
            b = _betas(p.device, beta1, beta2)
            t = steps[i].double() + 1.0
            bc1 = 1.0 - torch.exp2(t * torch.log2(b[0]))
            bc2_sqrt = torch.sqrt(1.0 - torch.exp2(t * torch.log2(b[1]))).float()
            step_size = (torch.as_tensor(lr_v, dtype=torch.float32).double() / bc1).float()
            denom = _sqrt_rn(v) / bc2_sqrt + _f32(eps)
        else:
            step_size = torch.as_tensor(lr_v, dtype=torch.float32)
            denom = _sqrt_rn(v) + _f32(eps)
        pf = pf - step_size * (m / denom)
        if keep is not None:
            pf = torch.where(keep, pf, p.float())
            m = torch.where(keep, m, exp_avgs[i])
            v = torch.where(keep, v, exp_avg_sqs[i])
        p.copy_(pf)
        exp_avgs[i].copy_(m)
        exp_avg_sqs[i].copy_(v)
        if copies is not None:
            copies[i].copy_(pf)
    advance_steps(list(steps), found_inf)
