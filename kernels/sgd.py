"""Fused SGD step (momentum, dampening, Nesterov, weight decay) over a list of tensors.

For every tensor, with g = grad * (1/grad_scale) when a scale is given:

    g += wd * p                               (unless wd_after_momentum)
    buf = g  (first step)  or  buf = momentum * buf + (1 - dampening) * g
    g = g + momentum * buf  (Nesterov)  or  g = buf
    g += wd * p                               (wd_after_momentum, Apex's option)
    p -= lr * g

torch.optim.SGD's order of operations, in fp32; the momentum buffer is fp32 whatever the
parameter dtype. ``copies`` receive the updated parameter in their own dtype (the half
model copy of an fp32 master). A non-zero ``found_inf`` makes it read and write nothing.
"""
import torch
import triton
import triton.language as tl

from ._dispatch import elementwise_settings, use_triton
from ._ref_utils import f32
from ._multi_tensor import check_lists, dtype_groups, plan_columns
from ._tl_utils import load_f32, load_grad, load_lr, store_param, sweep_block
from ._ref_utils import advance_steps


@triton.jit
def _sgd_step_kernel(
    meta_ptr,        # int64 [n_tensors, 6]: param, grad, momentum buffer, copy, step addresses; numel
    blocks_ptr,      # int32 [n_blocks, 2]: tensor index, block index within that tensor
    p_proto,         # a param tensor: carries the parameter element type
    g_proto,         # a gradient tensor: carries the gradient element type
    c_proto,         # a copy tensor (or any tensor without copies): carries the copy type
    lr,              # learning rate: a float, or an fp32 scalar tensor when LR_IS_TENSOR
    momentum, one_minus_dampening, weight_decay,
    scale_ptr,       # fp32 scalar: the loss scale the gradients carry (HAS_SCALE)
    found_inf_ptr,   # fp32 scalar: non-zero means skip this step (HAS_FOUND_INF)
    LR_IS_TENSOR: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    HAS_FOUND_INF: tl.constexpr,
    HAS_MOMENTUM: tl.constexpr,
    FIRST_RUN: tl.constexpr,       # momentum buffers start as the gradient
    HAS_STEPS: tl.constexpr,       # per-tensor step counts decide the first run on device
    NESTEROV: tl.constexpr,
    WD_AFTER_MOMENTUM: tl.constexpr,
    HAS_COPY: tl.constexpr,
    EMULATE_BF16_ROUNDING: tl.constexpr,
    BLOCK: tl.constexpr,
):
    tensor, row, offs, mask = sweep_block(meta_ptr, blocks_ptr, found_inf_ptr, 5, HAS_FOUND_INF, BLOCK)
    p_ptr = tl.load(row + 0).to(tl.pointer_type(p_proto.dtype.element_ty))
    g = load_grad(row, g_proto, offs, mask, scale_ptr, HAS_SCALE, EMULATE_BF16_ROUNDING)
    p = load_f32(p_ptr + offs, mask, EMULATE_BF16_ROUNDING)
    if not WD_AFTER_MOMENTUM:
        g = g + weight_decay * p
    if HAS_MOMENTUM:
        b_ptr = tl.load(row + 2).to(tl.pointer_type(tl.float32))
        if FIRST_RUN:
            buf = g
        else:
            buf = tl.load(b_ptr + offs, mask=mask, other=0.0)
            buf = buf * momentum + one_minus_dampening * g
            if HAS_STEPS:
                # A step that was skipped did not count: the buffer starts at the first
                # step actually taken, as torch's does.
                step_ptr = tl.load(row + 4).to(tl.pointer_type(tl.float32))
                buf = tl.where(tl.load(step_ptr) == 0.0, g, buf)
        tl.store(b_ptr + offs, buf, mask=mask)
        if NESTEROV:
            g = g + momentum * buf
        else:
            g = buf
    if WD_AFTER_MOMENTUM:
        g = g + weight_decay * p
    if LR_IS_TENSOR:
        p = p - load_lr(lr, LR_IS_TENSOR) * g
    else:
        p = p + (-lr) * g
    store_param(row, p_ptr, p, offs, mask, c_proto, 3, HAS_COPY, EMULATE_BF16_ROUNDING)


def _check(params, grads, bufs, copies, steps=None):
    check_lists("sgd_step", params, fp32=("momentum_buffers",), grads=grads,
                momentum_buffers=bufs, copies=copies, steps=steps)


@torch.no_grad()
def sgd_step(params, grads, momentum_buffers=None, copies=None, *, lr, momentum=0.0,
             dampening=0.0, weight_decay=0.0, nesterov=False, wd_after_momentum=False,
             first_run=False, steps=None, grad_scale=None, found_inf=None):
    """One SGD step for lists of same-shaped tensors (see the module docstring).

    ``first_run`` says the momentum buffers hold nothing yet (they are set to the
    gradient). Alternatively ``steps`` (fp32 0-d device tensors, one per parameter)
    decide it on the device: a buffer whose step count is 0 starts from the gradient, so
    a skipped first step leaves no trace; the counts advance unless ``found_inf``.
    ``lr`` is a float or an fp32 0-d tensor. No host sync."""
    params = list(params)
    if not params:
        return
    bufs = None if momentum_buffers is None else list(momentum_buffers)
    steps = None if steps is None else list(steps)
    _check(params, grads, bufs, copies, steps)
    if momentum != 0 and bufs is None:
        raise ValueError("sgd_step: momentum != 0 needs momentum_buffers")
    if not use_triton(params[0]):
        sgd_step_ref(params, grads, bufs, copies, lr=lr, momentum=momentum, dampening=dampening,
                     weight_decay=weight_decay, nesterov=nesterov,
                     wd_after_momentum=wd_after_momentum, first_run=first_run, steps=steps,
                     grad_scale=grad_scale, found_inf=found_inf)
        return
    groups = dtype_groups(params, grads, copies)
    lr_is_tensor = isinstance(lr, torch.Tensor)
    for (device, _, _, copy_dtype), idx in groups.items():
        block, warps = elementwise_settings(device)
        cols = [[params[i] for i in idx], [grads[i] for i in idx],
                None if bufs is None else [bufs[i] for i in idx],
                None if copy_dtype is None else [copies[i] for i in idx],
                None if steps is None else [steps[i] for i in idx]]
        pl = plan_columns(cols, block)
        anchor = cols[0][0]
        _sgd_step_kernel[(pl.n_blocks,)](
            pl.meta, pl.blocks, anchor, cols[1][0], cols[3][0] if cols[3] else anchor,
            lr, float(momentum), 1.0 - dampening, float(weight_decay),
            grad_scale if grad_scale is not None else anchor,
            found_inf if found_inf is not None else anchor,
            LR_IS_TENSOR=lr_is_tensor, HAS_SCALE=grad_scale is not None,
            HAS_FOUND_INF=found_inf is not None, HAS_MOMENTUM=momentum != 0,
            FIRST_RUN=bool(first_run), HAS_STEPS=steps is not None, NESTEROV=bool(nesterov),
            WD_AFTER_MOMENTUM=bool(wd_after_momentum), HAS_COPY=copy_dtype is not None,
            EMULATE_BF16_ROUNDING=device.type != "cuda", BLOCK=block, num_warps=warps)
    if steps is not None:
        advance_steps(steps, found_inf)


@torch.no_grad()
def sgd_step_ref(params, grads, momentum_buffers=None, copies=None, *, lr, momentum=0.0,
                 dampening=0.0, weight_decay=0.0, nesterov=False, wd_after_momentum=False,
                 first_run=False, steps=None, grad_scale=None, found_inf=None):
    """Torch reference of :func:`sgd_step` (same order of operations, fp32)."""
    inv = None if grad_scale is None else grad_scale.double().reciprocal().float()
    keep = None if found_inf is None else found_inf.reshape(()) == 0
    for i, p in enumerate(params):
        if p.numel() == 0:
            continue
        g = grads[i].float()
        if inv is not None:
            g = g * inv
        pf = p.float()
        if not wd_after_momentum:
            g = g + f32(weight_decay) * pf
        if momentum != 0:
            buf = g if first_run else momentum_buffers[i] * f32(momentum) + f32(1.0 - dampening) * g
            if steps is not None and not first_run:
                buf = torch.where(steps[i] == 0, g, buf)
            if keep is not None:
                buf = torch.where(keep, buf, momentum_buffers[i])
            momentum_buffers[i].copy_(buf)
            g = g + f32(momentum) * buf if nesterov else buf
        if wd_after_momentum:
            g = g + f32(weight_decay) * pf
        if isinstance(lr, torch.Tensor):
            new = pf - lr.float() * g
        else:
            new = pf + f32(-lr) * g
        if keep is not None:
            new = torch.where(keep, new, pf)
        p.copy_(new)
        if copies is not None:
            copies[i].copy_(new)
    if steps is not None:
        advance_steps(list(steps), found_inf)
