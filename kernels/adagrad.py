"""Fused Adagrad step over a list of tensors, one launch per dtype group.

For every tensor, with g = grad * (1/grad_scale) when a scale is given:

    L2 mode (default):            g += wd * p
                                  h += g * g
                                  p -= lr * (g / (sqrt(h) + eps))
    decoupled (adagrad_w_mode):   h += g * g
                                  p -= lr * (g / (sqrt(h) + eps) + wd * p)

Apex's ``multi_tensor_adagrad`` arithmetic (the L2 mode is also torch.optim.Adagrad's
with ``lr_decay=0``), in fp32 whatever the parameter dtype; the sum of squares ``h`` is
fp32. ``copies`` (optional) receive the updated parameter in their own dtype: the half
model copy of an fp32 master weight, written in the same pass. When ``found_inf`` holds a
non-zero value nothing is read or written and the step counts stay.

Square root and division are IEEE round-to-nearest (``tl.sqrt_rn`` / ``tl.div_rn``): on
the GPU plain ``tl.sqrt`` and ``/`` compile to approximate instructions, and the sum of
squares feeds every later step, so the error would compound against torch's.
"""
import torch
import triton
import triton.language as tl

from ._dispatch import elementwise_settings, use_triton
from ._ref_utils import f32 as _f32, sqrt_rn as _sqrt_rn
from ._multi_tensor import check_lists, dtype_groups, plan_columns
from ._tl_utils import load_f32, load_grad, load_lr, store_param, sweep_block
from ._ref_utils import advance_steps


@triton.jit
def _adagrad_step_kernel(
    meta_ptr,        # int64 [n_tensors, 5]: param, grad, sum, copy addresses; numel
    blocks_ptr,      # int32 [n_blocks, 2]: tensor index, block index within that tensor
    p_proto,         # a param tensor: carries the parameter element type
    g_proto,         # a gradient tensor: carries the gradient element type
    c_proto,         # a copy tensor (or any tensor without copies): carries the copy type
    lr,              # learning rate: a float, or an fp32 scalar tensor when LR_IS_TENSOR
    eps, weight_decay,
    scale_ptr,       # fp32 scalar: the loss scale the gradients carry (HAS_SCALE)
    found_inf_ptr,   # fp32 scalar: non-zero means skip this step (HAS_FOUND_INF)
    LR_IS_TENSOR: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    HAS_FOUND_INF: tl.constexpr,
    ADAGRAD_W: tl.constexpr,       # decoupled weight decay (Apex's adagrad_w_mode)
    HAS_COPY: tl.constexpr,
    EMULATE_BF16_ROUNDING: tl.constexpr,  # interpreter only: see _tl_utils
    BLOCK: tl.constexpr,
):
    tensor, row, offs, mask = sweep_block(meta_ptr, blocks_ptr, found_inf_ptr, 4, HAS_FOUND_INF, BLOCK)
    p_ptr = tl.load(row + 0).to(tl.pointer_type(p_proto.dtype.element_ty))
    h_ptr = tl.load(row + 2).to(tl.pointer_type(tl.float32))

    g = load_grad(row, g_proto, offs, mask, scale_ptr, HAS_SCALE, EMULATE_BF16_ROUNDING)
    p = load_f32(p_ptr + offs, mask, EMULATE_BF16_ROUNDING)
    h = tl.load(h_ptr + offs, mask=mask, other=0.0)
    lr_v = load_lr(lr, LR_IS_TENSOR)
    if ADAGRAD_W:
        h = h + g * g
        p = p - lr_v * (tl.div_rn(g, tl.sqrt_rn(h) + eps) + weight_decay * p)
    else:
        g = g + weight_decay * p
        h = h + g * g
        p = p - lr_v * tl.div_rn(g, tl.sqrt_rn(h) + eps)
    store_param(row, p_ptr, p, offs, mask, c_proto, 3, HAS_COPY, EMULATE_BF16_ROUNDING)
    tl.store(h_ptr + offs, h, mask=mask)


def _check(params, grads, sums, copies, steps):
    check_lists("adagrad_step", params, fp32=("sums",), grads=grads, sums=sums,
                copies=copies, steps=steps)
    for i in range(len(params)):
        for name, other in (("grad", grads), ("sum", sums), ("copy", copies)):
            if other is not None and other[i].shape != params[i].shape:
                raise ValueError(f"adagrad_step: tensor {i} has shape {tuple(params[i].shape)} but "
                                 f"its {name} has shape {tuple(other[i].shape)}")


@torch.no_grad()
def adagrad_step(params, grads, sums, copies=None, *, lr, eps, weight_decay=0.0,
                 adagrad_w_mode=False, steps=None, grad_scale=None, found_inf=None):
    """One Adagrad step for lists of same-shaped tensors (see the module docstring).

    ``sums`` are the fp32 sums of squared gradients; ``steps`` (optional) fp32 0-d tensors
    advanced by one unless ``found_inf`` is non-zero; ``lr`` a float or an fp32 0-d
    tensor. No host sync."""
    params = list(params)
    if not params:
        return
    grads, sums = list(grads), list(sums)
    copies = None if copies is None else list(copies)
    steps = None if steps is None else list(steps)
    _check(params, grads, sums, copies, steps)
    if not use_triton(params[0]):
        adagrad_step_ref(params, grads, sums, copies, lr=lr, eps=eps, weight_decay=weight_decay,
                         adagrad_w_mode=adagrad_w_mode, steps=steps, grad_scale=grad_scale,
                         found_inf=found_inf)
        return
    groups = dtype_groups(params, grads, copies)
    lr_is_tensor = isinstance(lr, torch.Tensor)
    for (device, _, _, copy_dtype), idx in groups.items():
        block, warps = elementwise_settings(device)
        cols = [[params[i] for i in idx], [grads[i] for i in idx], [sums[i] for i in idx],
                None if copy_dtype is None else [copies[i] for i in idx]]
        pl = plan_columns(cols, block)
        anchor = cols[0][0]
        _adagrad_step_kernel[(pl.n_blocks,)](
            pl.meta, pl.blocks, anchor, cols[1][0], cols[3][0] if cols[3] else anchor,
            lr if lr_is_tensor else float(lr), float(eps), float(weight_decay),
            grad_scale if grad_scale is not None else anchor,
            found_inf if found_inf is not None else anchor,
            LR_IS_TENSOR=lr_is_tensor, HAS_SCALE=grad_scale is not None,
            HAS_FOUND_INF=found_inf is not None, ADAGRAD_W=bool(adagrad_w_mode),
            HAS_COPY=copy_dtype is not None, EMULATE_BF16_ROUNDING=device.type != "cuda",
            BLOCK=block, num_warps=warps)
    if steps is not None:
        advance_steps(steps, found_inf)


@torch.no_grad()
def adagrad_step_ref(params, grads, sums, copies=None, *, lr, eps, weight_decay=0.0,
                     adagrad_w_mode=False, steps=None, grad_scale=None, found_inf=None):
    """Torch reference of :func:`adagrad_step` (same order of operations, fp32)."""
    inv = None if grad_scale is None else grad_scale.double().reciprocal().float()
    keep = None if found_inf is None else found_inf.reshape(()) == 0
    lr_v = lr.float() if isinstance(lr, torch.Tensor) else _f32(lr)
    for i, p in enumerate(params):
        if p.numel() == 0:
            continue
        g = grads[i].float()
        if inv is not None:
            g = g * inv
        pf = p.float()
        h = sums[i]
        if adagrad_w_mode:
            h_new = h + g * g
            new = pf - lr_v * (g / (_sqrt_rn(h_new) + _f32(eps)) + _f32(weight_decay) * pf)
        else:
            g = g + _f32(weight_decay) * pf
            h_new = h + g * g
            new = pf - lr_v * (g / (_sqrt_rn(h_new) + _f32(eps)))
        if keep is not None:
            new = torch.where(keep, new, pf)
            h_new = torch.where(keep, h_new, h)
        p.copy_(new)
        h.copy_(h_new)
        if copies is not None:
            c = new.to(copies[i].dtype)
            copies[i].copy_(c if keep is None else torch.where(keep, c, copies[i]))
    if steps:
        advance_steps(steps, found_inf)
