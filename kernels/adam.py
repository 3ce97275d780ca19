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
With ``write_grads`` (``torch.amp.GradScaler``'s contract, see _cpu_optim.GradWrites)
the kernel also stores g, the unscaled gradient before any weight decay, into the
gradient, in the gradient's dtype.

On the CPU without Triton's interpreter, :func:`adam_step_cpu` runs the step on torch's
fused CPU kernel (``torch._fused_adamw_`` / ``torch._fused_adam_``), see _cpu_optim.
"""
import torch
import triton
import triton.language as tl

from ._cpu_optim import (advance_counts, amp_flags, fp32_work, run_in_parts, take_grad_writes,
                         write_back, write_staged_grads)
from ._multi_tensor import Column, Sweep, check_amp_args, device_constants, scalar_arg
from ._ref_utils import advance_steps, f32 as _f32, sqrt_rn as _sqrt_rn
from ._tl_utils import (bias_corrections, column, finish_tensor_step, load_f32,
                        load_grad, load_lr, store_cast, sweep_block, tensor_step,
                        unscale_factor)
from .rounding import (MOMENT_DTYPES, ROUNDING_COLUMNS, check_rounding_rows, load_compensated_ref,
                       load_param, row_rounding_ref, step_key, store_rounded_ref,
                       store_updated)

ADAM = Sweep("adam_step", [
    Column("params", "param"), Column("grads", "grad"),
    Column("exp_avgs", "state", typed=True, dtypes=MOMENT_DTYPES),
    Column("exp_avg_sqs", "state", typed=True, dtypes=MOMENT_DTYPES),
    Column("copies", "copy", optional=True), Column("steps", "scalar"),
    *ROUNDING_COLUMNS,
], check=check_rounding_rows,
   writes=("params", "exp_avgs", "exp_avg_sqs", "copies", "comps", "steps"))
_P, _G, _M, _V, _C, _S, _K, _R = (ADAM.col(n) for n in ADAM.names)
_ROW = ADAM.row_width


@triton.jit
def _adam_step_kernel(
    meta_ptr,        # int64 [n_tensors, 7]: the ADAM columns' addresses, then numel
    blocks_ptr,      # int32 [n_blocks, 2]: tensor index, block index within that tensor
    counters_ptr,    # int32 [n_tensors]: programs done per tensor (step advance), zeroed
    p_proto,         # a param tensor: carries the parameter element type
    g_proto,         # a gradient tensor: carries the gradient element type
    m_proto,         # a first moment: carries the moments' type (fp32, or bf16 state)
    v_proto,         # a second moment
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
    WRITE_GRAD: tl.constexpr,      # store the unscaled gradient back (torch's GradScaler)
    HAS_COPIES: tl.constexpr,
    HAS_COMPS: tl.constexpr,       # bf16 parameters with a Kahan compensation
    HAS_KEYS: tl.constexpr,        # bf16 parameters rounded stochastically
    VEC: tl.constexpr,             # > 1: every address 16-byte aligned, numel % VEC == 0
    EMULATE_BF16_ROUNDING: tl.constexpr,
    BLOCK: tl.constexpr,
):
    tensor, row, offs, mask = sweep_block(meta_ptr, blocks_ptr, found_inf_ptr, _ROW,
                                          HAS_FOUND_INF, VEC, BLOCK)
    # Per-tensor scalars first: they are live across the element loads otherwise.
    step_ptr, step = tensor_step(row, _S, True)
    tkey = step_key(row, _R, step, HAS_KEYS)
    inv = unscale_factor(scale_ptr, HAS_SCALE)
    lr_v = load_lr(lr, LR_IS_TENSOR)
    if ADAM_W:
        if LR_IS_TENSOR:
            decay = 1.0 - lr_v * weight_decay
        else:
            decay = decay_factor
    if BIAS_CORRECTION:
        bc1, bc2 = bias_corrections(step, betas_ptr)
        bc2_sqrt = tl.sqrt(bc2).to(tl.float32)
        step_size = (lr_v.to(tl.float64) / bc1).to(tl.float32)
    else:
        bc2_sqrt = 1.0
        step_size = lr_v

    p_ptrs = column(row, _P, offs, p_proto, VEC)
    m_ptrs = column(row, _M, offs, m_proto, VEC)
    v_ptrs = column(row, _V, offs, v_proto, VEC)
    g_ptrs = column(row, _G, offs, g_proto, VEC)
    g = load_grad(g_ptrs, mask, inv, HAS_SCALE, EMULATE_BF16_ROUNDING)
    if WRITE_GRAD:
        store_cast(g_ptrs, g, mask, EMULATE_BF16_ROUNDING)
    k_ptrs, p = load_param(row, _K, p_ptrs, offs, mask, HAS_COMPS, VEC, EMULATE_BF16_ROUNDING)
    m = load_f32(m_ptrs, mask, EMULATE_BF16_ROUNDING)
    v = load_f32(v_ptrs, mask, EMULATE_BF16_ROUNDING)
    if ADAM_W:
        p = p * decay
    else:
        g = g + weight_decay * p
    m = m + one_minus_beta1 * (g - m)
    v = v * beta2 + one_minus_beta2 * g * g
    if BIAS_CORRECTION:
        denom = tl.div_rn(tl.sqrt_rn(v), bc2_sqrt) + eps
    else:
        denom = tl.sqrt_rn(v) + eps
    p = p - step_size * tl.div_rn(m, denom)
    store_updated(p_ptrs, column(row, _C, offs, c_proto, VEC), k_ptrs, p, mask, offs, tkey,
                  HAS_COPIES, HAS_COMPS, HAS_KEYS, EMULATE_BF16_ROUNDING)
    store_cast(m_ptrs, m, mask, EMULATE_BF16_ROUNDING)
    store_cast(v_ptrs, v, mask, EMULATE_BF16_ROUNDING)
    finish_tensor_step(counters_ptr, tensor, row, step_ptr, step, found_inf_ptr, _ROW,
                       HAS_FOUND_INF, BLOCK)


def adam_prepare(params, grads, exp_avgs, exp_avg_sqs, steps, copies=None, comps=None,
                 keys=None):
    """Validate and plan an Adam sweep over these lists (see _multi_tensor): keep the
    result and pass it to :func:`adam_launch` while the tensors stay the same. ``comps``
    / ``keys`` (optional, per row or None): bf16 parameters stored with a Kahan
    compensation, or rounded stochastically (kernels/rounding.py)."""
    return ADAM.prepare(dict(params=params, grads=grads, exp_avgs=exp_avgs,
                             exp_avg_sqs=exp_avg_sqs, steps=steps, copies=copies,
                             comps=comps, keys=keys))


def adam_launch(prepared, *, lr, beta1, beta2, eps, weight_decay, adam_w_mode=True,
                bias_correction=True, grad_scale=None, found_inf=None, write_grads=False):
    """One Adam/AdamW step over a prepared sweep: one launch per dtype group.
    ``write_grads`` (or a :class:`~._cpu_optim.GradWrites` for ``prepared``) stores each
    unscaled gradient back into its gradient, unless the step is skipped; without a
    ``grad_scale`` there is nothing to write."""
    prepared, write_grads = take_grad_writes(prepared, write_grads)
    if prepared.n == 0:
        return
    # (checked before anything is written, whichever path runs)
    check_amp_args(prepared.device, grad_scale=grad_scale, found_inf=found_inf)
    write_grads = write_grads and grad_scale is not None
    if not prepared.triton:
        adam_step_cpu(prepared, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
                      weight_decay=weight_decay, adam_w_mode=adam_w_mode,
                      bias_correction=bias_correction, grad_scale=grad_scale,
                      found_inf=found_inf, write_grads=write_grads)
        return
    device = prepared.device
    prepared.advance_empty_steps(found_inf)
    lr = scalar_arg(lr, "lr", device)
    lr_is_tensor = isinstance(lr, torch.Tensor)
    anchor = prepared.groups[0].meta if prepared.groups else None
    prepared.launch(_adam_step_kernel, (
        lr, device_constants(device, (beta1, beta2)), 1.0 - beta1, float(beta2), 1.0 - beta2,
        float(eps), float(weight_decay), 1.0 if lr_is_tensor else 1.0 - lr * weight_decay,
        grad_scale if grad_scale is not None else anchor,
        found_inf if found_inf is not None else anchor), dict(
        LR_IS_TENSOR=lr_is_tensor, HAS_SCALE=grad_scale is not None,
        HAS_FOUND_INF=found_inf is not None, ADAM_W=bool(adam_w_mode),
        BIAS_CORRECTION=bool(bias_correction), WRITE_GRAD=write_grads))
    if write_grads:
        write_staged_grads(prepared)


@torch.no_grad()
def adam_step(params, grads, exp_avgs, exp_avg_sqs, steps, copies=None, comps=None, keys=None,
              *, lr, beta1, beta2, eps, weight_decay, adam_w_mode=True, bias_correction=True,
              grad_scale=None, found_inf=None, write_grads=False):
    """One Adam/AdamW step for lists of same-shaped tensors (see the module docstring).

    ``steps`` are fp32 one-element tensors, advanced by one unless ``found_inf`` is
    non-zero; ``lr`` a float or an fp32 one-element tensor (capturable); ``copies`` may
    hold None for parameters without a copy. ``write_grads`` stores the unscaled
    gradients back into ``grads``. Bad lists raise before anything is written. No host
    sync."""
    adam_launch(adam_prepare(params, grads, exp_avgs, exp_avg_sqs, steps, copies, comps, keys),
                lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay,
                adam_w_mode=adam_w_mode, bias_correction=bias_correction,
                grad_scale=grad_scale, found_inf=found_inf, write_grads=write_grads)


# A step count of +inf: torch's fused kernel then computes 1 - beta**inf = 1 for both bias
# corrections (C's pow(beta, +inf) is +0 for |beta| < 1), so its update is exactly Adam's
# without bias correction: step size lr, denominator sqrt(v) / 1 + eps.
_NO_BIAS_CORRECTION = torch.tensor(float("inf"))


def adam_step_cpu(prepared, *, lr, beta1, beta2, eps, weight_decay, adam_w_mode=True,
                  bias_correction=True, grad_scale=None, found_inf=None, write_grads=False):
    """The production CPU path of :func:`adam_launch`: per dtype group one call of torch's
    fused CPU Adam/AdamW kernel on fp32 lists (half parameters and gradients through fp32
    scratch, see _cpu_optim), the step counts advanced first (torch's kernel reads the
    count of the step being taken), ``found_inf`` handed to the kernel (it then writes
    nothing) and the copies written from the updated fp32 values. With ``write_grads``
    the kernel's own write of the unscaled gradient lands in the gradients (fp32 ones
    are handed to it directly, half ones copied back from their scratch).

    torch's kernel rounds differently from :func:`adam_step_ref` in two places (the
    first moment as one fused multiply-add, ``(lr / bc1 * m) / denom`` for
    ``lr / bc1 * (m / denom)``): a few ulps per step, as between torch's own fused and
    foreach Adam."""
    if not bias_correction and not (abs(beta1) < 1.0 and abs(beta2) < 1.0):
        # beta ** inf is not 0 here: the fused kernel cannot express this (degenerate)
        # setting, which FusedAdam refuses anyway.
        adam_step_ref(**prepared.lists, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
                      weight_decay=weight_decay, adam_w_mode=adam_w_mode,
                      bias_correction=False, grad_scale=grad_scale, found_inf=found_inf,
                      write_grads=write_grads)
        if write_grads:
            write_staged_grads(prepared)
        return
    lr = scalar_arg(lr, "lr", prepared.device)
    skip, keep = amp_flags(found_inf)
    fused = torch._fused_adamw_ if adam_w_mode else torch._fused_adam_
    beta1, beta2, eps, weight_decay = float(beta1), float(beta2), float(eps), float(weight_decay)

    def group_step(group):
        lists = group.lists
        params, steps, grads = lists["params"], lists["steps"], lists["grads"]
        work_p, work_g, scale = fp32_work(prepared, group, params, grads, grad_scale,
                                          write_grads)
        advance_counts(group.counted("steps"), keep)
        m, v = lists["exp_avgs"], lists["exp_avg_sqs"]
        work_m, work_v = m, v
        if m[0].dtype != torch.float32:  # bf16 moments (state_dtype): through fp32 scratch
            work_m = prepared.buffers(group, "exp_avgs", m)
            work_v = prepared.buffers(group, "exp_avg_sqs", v)
            torch._foreach_copy_(work_m, m)
            torch._foreach_copy_(work_v, v)
        fused(work_p, work_g, work_m, work_v, [],
              steps if bias_correction else [_NO_BIAS_CORRECTION] * len(steps),
              lr=lr, beta1=beta1, beta2=beta2, weight_decay=weight_decay, eps=eps,
              amsgrad=False, maximize=False, grad_scale=scale, found_inf=skip)
        if work_m is not m:  # unchanged on a skipped step: the round trip is exact
            torch._foreach_copy_(m, work_m)
            torch._foreach_copy_(v, work_v)
        write_back(params, work_p, lists["copies"], grads if write_grads else None, work_g,
                   rounded=(prepared, group))

    run_in_parts(prepared, group_step, grad_scale, write_grads)
    if write_grads:
        write_staged_grads(prepared)


def _betas(device, beta1, beta2):
    """fp64 (beta1, beta2) on ``device``, uploaded once per distinct pair."""
    return device_constants(device, (beta1, beta2))


@torch.no_grad()
def adam_step_ref(params, grads, exp_avgs, exp_avg_sqs, steps, copies=None, comps=None,
                  keys=None, *, lr, beta1, beta2, eps, weight_decay, adam_w_mode=True,
                  bias_correction=True, grad_scale=None, found_inf=None, write_grads=False):
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
            if write_grads:
                grads[i].copy_(g if keep is None else torch.where(keep, g, grads[i].float()))
        comp, key = row_rounding_ref(comps, keys, i)
        pf = x0 = load_compensated_ref(p, comp)
        m0, v0 = exp_avgs[i].float(), exp_avg_sqs[i].float()
        lr_v = lr.float() if isinstance(lr, torch.Tensor) else lr
        if adam_w_mode:
            factor = (1.0 - lr_v * weight_decay) if isinstance(lr, torch.Tensor) \
                else _f32(1.0 - lr * weight_decay)
            pf = pf * factor
        else:
            g = g + _f32(weight_decay) * pf
        m = m0 + _f32(1.0 - beta1) * (g - m0)
        v = v0 * _f32(beta2) + _f32(1.0 - beta2) * g * g
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
            pf = torch.where(keep, pf, x0)
            m = torch.where(keep, m, m0)
            v = torch.where(keep, v, v0)
        store_rounded_ref(p, pf, comp, key, steps[i].float() + 1.0)
        exp_avgs[i].copy_(m)
        exp_avg_sqs[i].copy_(v)
        if copies is not None and copies[i] is not None:
            copies[i].copy_(pf)
    advance_steps(list(steps), found_inf)
