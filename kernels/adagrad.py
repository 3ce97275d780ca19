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
non-zero value nothing is read or written and the step counts stay. With ``write_grads``
(``torch.amp.GradScaler``'s contract, see _cpu_optim.GradWrites) the kernel also stores
g, the unscaled gradient before any weight decay, into the gradient, in its dtype.

Square root and division are IEEE round-to-nearest (``tl.sqrt_rn`` / ``tl.div_rn``): on
the GPU plain ``tl.sqrt`` and ``/`` compile to approximate instructions, and the sum of
squares feeds every later step, so the error would compound against torch's.

On the CPU without Triton's interpreter, :func:`adagrad_step_cpu` runs the step on
torch's fused CPU kernel (``torch._fused_adagrad_``), see _cpu_optim.
"""
import torch
import triton
import triton.language as tl

from ._dispatch import use_triton  # noqa: F401  (tests read the module's dispatch)
from ._cpu_optim import (advance_counts, amp_flags, decay_factor, fp32_work, run_in_parts,
                         take_grad_writes, write_back, write_staged_grads)
from .rounding import (ROUNDING_COLUMNS, check_rounding_rows, load_compensated_ref, load_param,
                       row_rounding_ref, step_key, store_rounded_ref, store_updated)
from ._multi_tensor import Column, Sweep, check_amp_args, scalar_arg
from ._ref_utils import advance_steps, f32 as _f32, sqrt_rn as _sqrt_rn
from ._tl_utils import (column, column_f32, finish_tensor_step, load_grad, load_lr,
                        store_cast, sweep_block, tensor_step, unscale_factor)

ADAGRAD = Sweep("adagrad_step", [
    Column("params", "param"), Column("grads", "grad"), Column("sums", "state"),
    Column("copies", "copy", optional=True), Column("steps", "scalar", optional=True),
    *ROUNDING_COLUMNS,
], check=check_rounding_rows,
   writes=("params", "sums", "copies", "comps", "steps"))
_P, _G, _H, _C, _S, _K, _R = (ADAGRAD.col(n) for n in ADAGRAD.names)
_ROW = ADAGRAD.row_width


@triton.jit
def _adagrad_step_kernel(
    meta_ptr,        # int64 [n_tensors, 6]: the ADAGRAD columns' addresses, then numel
    blocks_ptr,      # int32 [n_blocks, 2]: tensor index, block index within that tensor
    counters_ptr,    # int32 [n_tensors]: programs done per tensor (step advance), zeroed
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
    WRITE_GRAD: tl.constexpr,      # store the unscaled gradient back (torch's GradScaler)
    HAS_COPIES: tl.constexpr,
    HAS_STEPS: tl.constexpr,       # per-tensor step counts, advanced here
    HAS_COMPS: tl.constexpr,       # bf16 parameters with a Kahan compensation
    HAS_KEYS: tl.constexpr,        # bf16 parameters rounded stochastically (needs steps)
    VEC: tl.constexpr,             # > 1: every address 16-byte aligned, numel % VEC == 0
    EMULATE_BF16_ROUNDING: tl.constexpr,  # interpreter only: see _tl_utils
    BLOCK: tl.constexpr,
):
    tensor, row, offs, mask = sweep_block(meta_ptr, blocks_ptr, found_inf_ptr, _ROW,
                                          HAS_FOUND_INF, VEC, BLOCK)
    # Per-tensor scalars first: they are live across the element loads otherwise.
    step_ptr, step = tensor_step(row, _S, HAS_STEPS)
    tkey = step_key(row, _R, step, HAS_KEYS)
    inv = unscale_factor(scale_ptr, HAS_SCALE)
    lr_v = load_lr(lr, LR_IS_TENSOR)

    p_ptrs = column(row, _P, offs, p_proto, VEC)
    h_ptrs = column_f32(row, _H, offs, VEC)
    g_ptrs = column(row, _G, offs, g_proto, VEC)
    g = load_grad(g_ptrs, mask, inv, HAS_SCALE, EMULATE_BF16_ROUNDING)
    if WRITE_GRAD:
        store_cast(g_ptrs, g, mask, EMULATE_BF16_ROUNDING)
    k_ptrs, p = load_param(row, _K, p_ptrs, offs, mask, HAS_COMPS, VEC,
                           EMULATE_BF16_ROUNDING)
    h = tl.load(h_ptrs, mask=mask, other=0.0)
    if ADAGRAD_W:
        h = h + g * g
        p = p - lr_v * (tl.div_rn(g, tl.sqrt_rn(h) + eps) + weight_decay * p)
    else:
        g = g + weight_decay * p
        h = h + g * g
        p = p - lr_v * tl.div_rn(g, tl.sqrt_rn(h) + eps)
    store_updated(p_ptrs, column(row, _C, offs, c_proto, VEC), k_ptrs, p, mask, offs, tkey,
                  HAS_COPIES, HAS_COMPS, HAS_KEYS, EMULATE_BF16_ROUNDING)
    tl.store(h_ptrs, h, mask=mask)
    if HAS_STEPS:
        finish_tensor_step(counters_ptr, tensor, row, step_ptr, step, found_inf_ptr, _ROW,
                           HAS_FOUND_INF, BLOCK)


def adagrad_prepare(params, grads, sums, copies=None, steps=None, comps=None, keys=None):
    """Validate and plan an Adagrad sweep over these lists (see _multi_tensor): keep the
    result and pass it to :func:`adagrad_launch` while the tensors stay the same.
    ``copies`` and ``steps`` are optional (None, or None per row); so are ``comps`` /
    ``keys`` (bf16 parameters with a Kahan compensation, or rounded stochastically:
    kernels/rounding.py; keys need steps)."""
    return ADAGRAD.prepare(dict(params=params, grads=grads, sums=sums, copies=copies,
                                steps=steps, comps=comps, keys=keys))


def adagrad_launch(prepared, *, lr, eps, weight_decay=0.0, adagrad_w_mode=False,
                   grad_scale=None, found_inf=None, write_grads=False):
    """One Adagrad step over a prepared sweep: one launch per dtype group.
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
        adagrad_step_cpu(prepared, lr=lr, eps=eps, weight_decay=weight_decay,
                         adagrad_w_mode=adagrad_w_mode, grad_scale=grad_scale,
                         found_inf=found_inf, write_grads=write_grads)
        return
    device = prepared.device
    lr = scalar_arg(lr, "lr", device)
    anchor = prepared.groups[0].meta if prepared.groups else None
    prepared.launch(_adagrad_step_kernel, (
        lr, float(eps), float(weight_decay),
        grad_scale if grad_scale is not None else anchor,
        found_inf if found_inf is not None else anchor), dict(
        LR_IS_TENSOR=isinstance(lr, torch.Tensor), HAS_SCALE=grad_scale is not None,
        HAS_FOUND_INF=found_inf is not None, ADAGRAD_W=bool(adagrad_w_mode),
        WRITE_GRAD=write_grads))
    if write_grads:
        write_staged_grads(prepared)
    prepared.advance_empty_steps(found_inf)


# The step count torch's kernel reads for its learning-rate decay: with lr_decay = 0 its
# step size is lr / (1 + (0 - 1) * 0) = lr exactly, whatever the real counts hold.
_NO_LR_DECAY_STEP = torch.tensor(0.0)


def adagrad_step_cpu(prepared, *, lr, eps, weight_decay=0.0, adagrad_w_mode=False,
                     grad_scale=None, found_inf=None, write_grads=False):
    """The production CPU path of :func:`adagrad_launch`: per dtype group torch's fused
    CPU Adagrad kernel (``lr_decay=0``) on fp32 lists (half parameters and gradients
    through fp32 scratch, see _cpu_optim), ``found_inf`` handed to it (it then writes
    nothing), the step counts advanced by 1 (0 on a skipped step), the copies written
    from the updated values. With ``write_grads`` the kernel's own write of the unscaled
    gradient lands in the gradients (fp32 ones handed to it directly, half ones copied
    back from scratch).

    ``adagrad_w_mode`` (decoupled decay, ``p -= lr * (g / (sqrt(h) + eps) + wd * p)``) is
    taken as ``p *= 1 - lr * wd`` (a factor of exactly 1 on a skipped step) before the
    fused kernel's ``p -= lr * g / (sqrt(h) + eps)`` with no weight decay of its own.

    torch's kernel computes ``(lr * g) / std`` where :func:`adagrad_step_ref` computes
    ``lr * (g / std)``: an ulp or so per step."""
    lr = scalar_arg(lr, "lr", prepared.device)
    skip, keep = amp_flags(found_inf)
    decay = None
    if adagrad_w_mode and weight_decay != 0:
        decay = decay_factor(lr, weight_decay, skip)
    fused_wd = 0.0 if adagrad_w_mode else float(weight_decay)
    eps = float(eps)

    def group_step(group):
        lists = group.lists
        params, steps, grads = lists["params"], lists["steps"], lists["grads"]
        work_p, work_g, scale = fp32_work(prepared, group, params, grads, grad_scale,
                                          write_grads)
        if decay is not None:
            torch._foreach_mul_(work_p, decay)
        torch._fused_adagrad_(work_p, work_g, lists["sums"], [_NO_LR_DECAY_STEP] * len(params),
                              lr=lr, lr_decay=0.0, weight_decay=fused_wd, eps=eps,
                              maximize=False, grad_scale=scale, found_inf=skip)
        if steps is not None:
            advance_counts(group.counted("steps"), keep)
        write_back(params, work_p, lists["copies"], grads if write_grads else None, work_g,
                   rounded=(prepared, group))

    run_in_parts(prepared, group_step, grad_scale, write_grads)
    if write_grads:
        write_staged_grads(prepared)


@torch.no_grad()
def adagrad_step(params, grads, sums, copies=None, *, lr, eps, weight_decay=0.0,
                 adagrad_w_mode=False, steps=None, comps=None, keys=None, grad_scale=None,
                 found_inf=None, write_grads=False):
    """One Adagrad step for lists of same-shaped tensors (see the module docstring).

    ``sums`` are the fp32 sums of squared gradients; ``steps`` (optional) fp32
    one-element tensors advanced by one unless ``found_inf`` is non-zero; ``lr`` a float
    or an fp32 one-element tensor; ``copies`` may hold None for parameters without a
    copy; ``write_grads`` stores the unscaled gradients back into ``grads``. Bad lists
    raise before anything is written. No host sync."""
    adagrad_launch(adagrad_prepare(params, grads, sums, copies, steps, comps, keys), lr=lr,
                   eps=eps,
                   weight_decay=weight_decay, adagrad_w_mode=adagrad_w_mode,
                   grad_scale=grad_scale, found_inf=found_inf, write_grads=write_grads)


@torch.no_grad()
def adagrad_step_ref(params, grads, sums, copies=None, *, lr, eps, weight_decay=0.0,
                     adagrad_w_mode=False, steps=None, comps=None, keys=None, grad_scale=None,
                     found_inf=None):
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
        comp, key = row_rounding_ref(comps, keys, i)
        pf = load_compensated_ref(p, comp)
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
        store_rounded_ref(p, new, comp, key, None if key is None else steps[i].float() + 1.0)
        h.copy_(h_new)
        if copies is not None and copies[i] is not None:
            c = new.to(copies[i].dtype)
            copies[i].copy_(c if keep is None else torch.where(keep, c, copies[i]))
    if steps:
        advance_steps(list(steps), found_inf)
