"""Fused LAMB step (Apex's ``multi_tensor_lamb``) over a list of tensors.

For every tensor, with g = grad * (1/grad_scale) when a scale is given, t the tensor's
step count after this step, bc1 = 1 - beta1**t and bc2 = 1 - beta2**t (1 without bias
correction), beta3 = 1 - beta1 (1 without grad averaging), and
clip = global_grad_norm / max_grad_norm when the global norm exceeds max_grad_norm
(else 1):

    g = g / clip
    g += wd * p                                   (adam_w_mode=False: L2 inside)
    m = beta1 * m + beta3 * g                     v = beta2 * v + (1 - beta2) * g * g
    u = (m / bc1) / (sqrt(v / bc2) + eps)
    u += wd * p                                   (adam_w_mode=True: decoupled)
    ratio = lr * ||p|| / ||u||   if (wd != 0 or use_nvlamb) and ||p|| != 0 and ||u|| != 0
            lr                   otherwise
    p -= ratio * u

Apex's order of operations, in fp32 whatever the parameter dtype; the weight-decay term
is left out entirely (not multiplied by 0) when wd == 0, as Apex's kernel does.

Three launches per dtype group whatever the number of tensors:

1. ``_lamb_moments_kernel``: m and v updated in place; per-block partial sums of p*p and
   u*u written to a small fp32 buffer. The update u is not stored anywhere (Apex writes
   it over the gradient; tritamp never writes gradients).
2. ``_l2norm_segment_kernel`` (from l2norm.py): per-tensor ||p|| and ||u||.
3. ``_lamb_apply_kernel``: recomputes u from the new m, v and the unchanged p with the
   same instructions as stage 1 (same memory traffic as storing u and reading it back,
   and no buffer the size of the model), scales it by the trust ratio and updates p;
   ``copies`` (optional) receive the new parameter in their own dtype.

The global gradient norm is the caller's (``multi_tensor_l2norm`` over every gradient
of every group, ``scale=grad_scale``): a 0-d fp32 device tensor read on the device.
When ``found_inf`` holds a non-zero value nothing is read or written and the step
counts stay: the skipped step leaves no trace.
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
from .l2norm import block_counts, reduce_segments, segment_table


@triton.jit
def _lamb_bias_corrections(step_ptr, betas_ptr, BIAS_CORRECTION: tl.constexpr):
    # 1 - beta**t in fp64 (t the step after this one), rounded once to fp32.
    if BIAS_CORRECTION:
        c1, c2 = bias_corrections(step_ptr, betas_ptr)
        bc1 = c1.to(tl.float32)
        bc2 = c2.to(tl.float32)
    else:
        bc1 = tl.full((), 1.0, tl.float32)
        bc2 = tl.full((), 1.0, tl.float32)
    return bc1, bc2


@triton.jit
def _lamb_update(m, v, p, bc1, bc2, eps, weight_decay, ADAM_W: tl.constexpr,
                 HAS_DECAY: tl.constexpr):
    # The update direction; stages 1 and 3 both call this, so they agree bit for bit.
    denom = tl.sqrt_rn(tl.div_rn(v, bc2)) + eps
    u = tl.div_rn(tl.div_rn(m, bc1), denom)
    if ADAM_W:
        if HAS_DECAY:
            u = u + weight_decay * p
    return u


@triton.jit
def _lamb_moments_kernel(
    meta_ptr,        # int64 [n, 7]: param, grad, exp_avg, exp_avg_sq, copy, step addresses; numel
    blocks_ptr,      # int32 [n_blocks, 2]: tensor index, block index within that tensor
    partials_ptr,    # fp32 [2, partials_stride]: per-block sums of p*p (row 0) and u*u (row 1)
    partials_stride, # elements between the two rows of partials (>= n_blocks)
    p_proto,         # a param tensor: carries the parameter element type
    g_proto,         # a gradient tensor: carries the gradient element type
    betas_ptr,       # fp64 [2]: beta1, beta2 (bias corrections in fp64)
    beta1, beta3, beta2, one_minus_beta2, eps, weight_decay,
    grad_norm_ptr,   # fp32 scalar: the global norm of the (unscaled) gradients (HAS_CLIP)
    max_grad_norm,   # clip gradients by global_norm / max_grad_norm above this norm
    scale_ptr,       # fp32 scalar: the loss scale the gradients carry (HAS_SCALE)
    found_inf_ptr,   # fp32 scalar: non-zero means skip this step (HAS_FOUND_INF)
    HAS_CLIP: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    HAS_FOUND_INF: tl.constexpr,
    ADAM_W: tl.constexpr,
    HAS_DECAY: tl.constexpr,       # weight_decay != 0
    USE_RATIO: tl.constexpr,       # the trust ratio applies (weight decay, or NVLAMB)
    BIAS_CORRECTION: tl.constexpr,
    EMULATE_BF16_ROUNDING: tl.constexpr,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    tensor, row, offs, mask = sweep_block(meta_ptr, blocks_ptr, found_inf_ptr, 6, HAS_FOUND_INF, BLOCK)
    m_ptr = tl.load(row + 2).to(tl.pointer_type(tl.float32))
    v_ptr = tl.load(row + 3).to(tl.pointer_type(tl.float32))
    step_ptr = tl.load(row + 5).to(tl.pointer_type(tl.float32))

    g = load_grad(row, g_proto, offs, mask, scale_ptr, HAS_SCALE, EMULATE_BF16_ROUNDING)
    if HAS_CLIP:
        gn = tl.load(grad_norm_ptr)
        g = tl.div_rn(g, tl.where(gn > max_grad_norm, tl.div_rn(gn, max_grad_norm), 1.0))
    if HAS_DECAY or USE_RATIO:
        p_ptr = tl.load(row + 0).to(tl.pointer_type(p_proto.dtype.element_ty))
        p = load_f32(p_ptr + offs, mask, EMULATE_BF16_ROUNDING)
    else:
        p = tl.zeros([BLOCK], dtype=tl.float32)
    if not ADAM_W:
        if HAS_DECAY:
            g = g + weight_decay * p
    m = tl.load(m_ptr + offs, mask=mask, other=0.0)
    v = tl.load(v_ptr + offs, mask=mask, other=0.0)
    m = m * beta1 + beta3 * g
    v = v * beta2 + one_minus_beta2 * g * g
    tl.store(m_ptr + offs, m, mask=mask)
    tl.store(v_ptr + offs, v, mask=mask)
    bc1, bc2 = _lamb_bias_corrections(step_ptr, betas_ptr, BIAS_CORRECTION)
    u = _lamb_update(m, v, p, bc1, bc2, eps, weight_decay, ADAM_W, HAS_DECAY)
    u = tl.where(mask, u, 0.0)  # masked lanes would add eps-sized noise
    tl.store(partials_ptr + partials_stride + pid, tl.sum(u * u, axis=0))
    if USE_RATIO:
        tl.store(partials_ptr + pid, tl.sum(p * p, axis=0))
    else:
        tl.store(partials_ptr + pid, 0.0)


@triton.jit
def _lamb_apply_kernel(
    meta_ptr,        # int64 [n, 7]: param, grad, exp_avg, exp_avg_sq, copy, step addresses; numel
    blocks_ptr,      # int32 [n_blocks, 2]: tensor index, block index within that tensor
    norms_ptr,       # fp32 [2, norms_stride]: ||p|| (row 0) and ||u|| (row 1) per tensor
    norms_stride,    # elements between the two rows of norms (= n_tensors)
    p_proto,         # a param tensor: carries the parameter element type
    c_proto,         # a copy tensor (or any tensor without copies): carries the copy type
    lr,              # learning rate: a float, or an fp32 scalar tensor when LR_IS_TENSOR
    betas_ptr,       # fp64 [2]: beta1, beta2
    eps, weight_decay,
    found_inf_ptr,   # fp32 scalar: non-zero means skip this step (HAS_FOUND_INF)
    LR_IS_TENSOR: tl.constexpr,
    HAS_FOUND_INF: tl.constexpr,
    ADAM_W: tl.constexpr,
    HAS_DECAY: tl.constexpr,
    USE_RATIO: tl.constexpr,
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

    p = load_f32(p_ptr + offs, mask, EMULATE_BF16_ROUNDING)
    m = tl.load(m_ptr + offs, mask=mask, other=0.0)
    v = tl.load(v_ptr + offs, mask=mask, other=0.0)
    bc1, bc2 = _lamb_bias_corrections(step_ptr, betas_ptr, BIAS_CORRECTION)
    u = _lamb_update(m, v, p, bc1, bc2, eps, weight_decay, ADAM_W, HAS_DECAY)
    ratio = load_lr(lr, LR_IS_TENSOR)
    if USE_RATIO:
        p_norm = tl.load(norms_ptr + tensor)
        u_norm = tl.load(norms_ptr + norms_stride + tensor)
        usable = (p_norm != 0.0) & (u_norm != 0.0)
        # Divide by 1 where unusable, so no 0/0 is formed even in the discarded branch.
        ratio = tl.where(usable, ratio * tl.div_rn(p_norm, tl.where(usable, u_norm, 1.0)), ratio)
    p = p - ratio * u
    store_param(row, p_ptr, p, offs, mask, c_proto, 4, HAS_COPY, EMULATE_BF16_ROUNDING)


def _check(params, grads, exp_avgs, exp_avg_sqs, steps, copies):
    check_lists("lamb_step", params, fp32=("exp_avgs", "exp_avg_sqs"), grads=grads,
                exp_avgs=exp_avgs, exp_avg_sqs=exp_avg_sqs, steps=steps, copies=copies)


@torch.no_grad()
def lamb_step(params, grads, exp_avgs, exp_avg_sqs, steps, copies=None, *, lr, beta1, beta2,
              eps, weight_decay, adam_w_mode=True, grad_averaging=True, bias_correction=True,
              use_nvlamb=False, global_grad_norm=None, max_grad_norm=1.0, grad_scale=None,
              found_inf=None):
    """One LAMB step for lists of same-shaped tensors (see the module docstring).

    ``global_grad_norm`` (0-d fp32 device tensor, or None for no clipping) is the norm
    of the unscaled gradients; ``steps`` are fp32 0-d tensors, advanced by one unless
    ``found_inf`` is non-zero; ``lr`` a float or an fp32 0-d tensor. No host sync."""
    params = list(params)
    if not params:
        return
    _check(params, grads, exp_avgs, exp_avg_sqs, steps, copies)
    kw = dict(lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay,
              adam_w_mode=adam_w_mode, grad_averaging=grad_averaging,
              bias_correction=bias_correction, use_nvlamb=use_nvlamb,
              global_grad_norm=global_grad_norm, max_grad_norm=max_grad_norm,
              grad_scale=grad_scale, found_inf=found_inf)
    if not use_triton(params[0]):
        lamb_step_ref(params, grads, exp_avgs, exp_avg_sqs, steps, copies, **kw)
        return
    groups = dtype_groups(params, grads, copies)
    lr_is_tensor = isinstance(lr, torch.Tensor)
    has_decay = weight_decay != 0
    use_ratio = bool(use_nvlamb) or has_decay
    for (device, _, _, copy_dtype), idx in groups.items():
        block, warps = elementwise_settings(device)
        emulate = device.type != "cuda"
        cols = [[params[i] for i in idx], [grads[i] for i in idx], [exp_avgs[i] for i in idx],
                [exp_avg_sqs[i] for i in idx],
                None if copy_dtype is None else [copies[i] for i in idx],
                [steps[i] for i in idx]]
        pl = plan_columns(cols, block)
        anchor = cols[0][0]
        betas = _betas(device, beta1, beta2)
        partials = torch.empty((2, pl.n_blocks), dtype=torch.float32, device=device)
        _lamb_moments_kernel[(pl.n_blocks,)](
            pl.meta, pl.blocks, partials, partials.stride(0), anchor, cols[1][0], betas,
            float(beta1), 1.0 - beta1 if grad_averaging else 1.0, float(beta2), 1.0 - beta2,
            float(eps), float(weight_decay),
            global_grad_norm if global_grad_norm is not None else partials,
            float(max_grad_norm if max_grad_norm is not None else 0.0),
            grad_scale if grad_scale is not None else partials,
            found_inf if found_inf is not None else partials,
            HAS_CLIP=global_grad_norm is not None, HAS_SCALE=grad_scale is not None,
            HAS_FOUND_INF=found_inf is not None, ADAM_W=bool(adam_w_mode),
            HAS_DECAY=has_decay, USE_RATIO=use_ratio, BIAS_CORRECTION=bool(bias_correction),
            EMULATE_BF16_ROUNDING=emulate, BLOCK=block, num_warps=warps)
        if use_ratio:
            table = segment_table(block_counts([t.numel() for t in cols[0]], block), device)
            norms = reduce_segments(partials, table, len(idx), sqrt=True)
        else:
            norms = partials  # not read
        _lamb_apply_kernel[(pl.n_blocks,)](
            pl.meta, pl.blocks, norms, norms.stride(0), anchor,
            cols[4][0] if cols[4] else anchor, lr, betas, float(eps), float(weight_decay),
            found_inf if found_inf is not None else partials,
            LR_IS_TENSOR=lr_is_tensor, HAS_FOUND_INF=found_inf is not None,
            ADAM_W=bool(adam_w_mode), HAS_DECAY=has_decay, USE_RATIO=use_ratio,
            BIAS_CORRECTION=bool(bias_correction), HAS_COPY=copy_dtype is not None,
            EMULATE_BF16_ROUNDING=emulate, BLOCK=block, num_warps=warps)
    advance_steps(list(steps), found_inf)


@torch.no_grad()
def lamb_step_ref(params, grads, exp_avgs, exp_avg_sqs, steps, copies=None, *, lr, beta1, beta2,
                  eps, weight_decay, adam_w_mode=True, grad_averaging=True, bias_correction=True,
                  use_nvlamb=False, global_grad_norm=None, max_grad_norm=1.0, grad_scale=None,
                  found_inf=None):
    """Torch reference of :func:`lamb_step` (same order of operations, fp32; norms from
    torch, so the trust ratio may differ from the kernel's in the last bits)."""
    params = list(params)
    if not params:
        return
    inv = None if grad_scale is None else grad_scale.double().reciprocal().float().reshape(())
    keep = None if found_inf is None else found_inf.reshape(()) == 0
    has_decay = weight_decay != 0
    use_ratio = bool(use_nvlamb) or has_decay
    beta3 = _f32(1.0 - beta1 if grad_averaging else 1.0)
    for i, p in enumerate(params):
        if p.numel() == 0:
            continue
        g = grads[i].float()
        if inv is not None:
            g = g * inv
        if global_grad_norm is not None:
            gn = global_grad_norm.float().reshape(())
            mx = _f32(max_grad_norm)
            g = g / torch.where(gn > mx, gn / mx, _f32(1.0))
        pf = p.float()
        if not adam_w_mode and has_decay:
            g = g + _f32(weight_decay) * pf
        m = exp_avgs[i] * _f32(beta1) + beta3 * g
        v = exp_avg_sqs[i] * _f32(beta2) + _f32(1.0 - beta2) * g * g
        if bias_correction:
            b = _betas(p.device, beta1, beta2)
            t = steps[i].double() + 1.0
            bc1 = (1.0 - torch.exp2(t * torch.log2(b[0]))).float()
            bc2 = (1.0 - torch.exp2(t * torch.log2(b[1]))).float()
        else:
            bc1 = bc2 = _f32(1.0)
        u = (m / bc1) / (torch.sqrt(v / bc2) + _f32(eps))
        if adam_w_mode and has_decay:
            u = u + _f32(weight_decay) * pf
        ratio = lr.float().reshape(()) if isinstance(lr, torch.Tensor) else _f32(lr)
        if use_ratio:
            pn = torch.linalg.vector_norm(pf)
            un = torch.linalg.vector_norm(u)
            ratio = torch.where((pn != 0) & (un != 0), ratio * (pn / un), ratio)
        new_p = pf - ratio * u
        if keep is not None:
            new_p = torch.where(keep, new_p, pf)
            m = torch.where(keep, m, exp_avgs[i])
            v = torch.where(keep, v, exp_avg_sqs[i])
        p.copy_(new_p)
        exp_avgs[i].copy_(m)
        exp_avg_sqs[i].copy_(v)
        if copies is not None:
            if keep is None:
                copies[i].copy_(new_p)
            else:
                copies[i].copy_(torch.where(keep, new_p.to(copies[i].dtype), copies[i]))
    advance_steps(list(steps), found_inf)
