"""Fused SGD step (momentum, dampening, Nesterov, weight decay) over a list of tensors.

For every tensor, with g = grad * (1/grad_scale) when a scale is given:

    g += wd * p                               (unless wd_after_momentum)
    buf = g  (first step)  or  buf = momentum * buf + (1 - dampening) * g
    g = g + momentum * buf  (Nesterov)  or  g = buf
    g += wd * p                               (wd_after_momentum, Apex's option)
    p -= lr * g

torch.optim.SGD's order of operations, in fp32; the momentum buffer is fp32 whatever the
parameter dtype. ``copies`` receive the updated parameter in their own dtype (the half
model copy of an fp32 master). A non-zero ``found_inf`` makes it read and write nothing
and leaves the step counts as they are. With ``write_grads`` (``torch.amp.GradScaler``'s
contract, see _cpu_optim.GradWrites) the kernel also stores g, the unscaled gradient
before any weight decay, into the gradient, in the gradient's dtype.

"First step" is ``first_run`` (every buffer starts from the gradient) or, per tensor, a
step count of 0 in ``steps``: the count is read on the device, so a skipped first step
leaves the buffer unused, as torch's lazily created buffer would be. The counts advance
inside the kernel (see _tl_utils.finish_tensor_step).

On the CPU without Triton's interpreter, :func:`sgd_step_cpu` runs the step on torch's
fused CPU kernel (``torch._fused_sgd_``), see _cpu_optim.
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
from ._ref_utils import advance_steps, f32
from ._tl_utils import (column, column_f32, finish_tensor_step, load_grad, load_lr,
                        store_cast, sweep_block, tensor_step, unscale_factor)

SGD = Sweep("sgd_step", [
    Column("params", "param"), Column("grads", "grad"),
    Column("momentum_buffers", "state", optional=True), Column("copies", "copy", optional=True),
    Column("steps", "scalar", optional=True), *ROUNDING_COLUMNS,
], check=check_rounding_rows,
   writes=("params", "momentum_buffers", "copies", "comps", "steps"))
_P, _G, _B, _C, _S, _K, _R = (SGD.col(n) for n in SGD.names)
_ROW = SGD.row_width


@triton.jit
def _sgd_step_kernel(
    meta_ptr,        # int64 [n_tensors, 6]: the SGD columns' addresses, then numel
    blocks_ptr,      # int32 [n_blocks, 2]: tensor index, block index within that tensor
    counters_ptr,    # int32 [n_tensors]: programs done per tensor (step advance), zeroed
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
    HAS_MOMENTUM: tl.constexpr,    # momentum != 0: the buffers are read and written
    FIRST_RUN: tl.constexpr,       # every momentum buffer starts as the gradient
    NESTEROV: tl.constexpr,
    WD_AFTER_MOMENTUM: tl.constexpr,
    WRITE_GRAD: tl.constexpr,      # store the unscaled gradient back (torch's GradScaler)
    HAS_MOMENTUM_BUFFERS: tl.constexpr,
    HAS_COPIES: tl.constexpr,
    HAS_STEPS: tl.constexpr,       # per-tensor step counts: first run on device, advanced
    HAS_COMPS: tl.constexpr,       # bf16 parameters with a Kahan compensation
    HAS_KEYS: tl.constexpr,        # bf16 parameters rounded stochastically (needs steps)
    VEC: tl.constexpr,             # > 1: every address 16-byte aligned, numel % VEC == 0
    EMULATE_BF16_ROUNDING: tl.constexpr,
    BLOCK: tl.constexpr,
):
    tensor, row, offs, mask = sweep_block(meta_ptr, blocks_ptr, found_inf_ptr, _ROW,
                                          HAS_FOUND_INF, VEC, BLOCK)
    # Per-tensor scalars first: they are live across the element loads otherwise.
    step_ptr, step = tensor_step(row, _S, HAS_STEPS)
    tkey = step_key(row, _R, step, HAS_KEYS)
    inv = unscale_factor(scale_ptr, HAS_SCALE)
    if LR_IS_TENSOR:
        neg_lr = -load_lr(lr, LR_IS_TENSOR)
    else:
        neg_lr = -lr

    p_ptrs = column(row, _P, offs, p_proto, VEC)
    g_ptrs = column(row, _G, offs, g_proto, VEC)
    g = load_grad(g_ptrs, mask, inv, HAS_SCALE, EMULATE_BF16_ROUNDING)
    if WRITE_GRAD:
        store_cast(g_ptrs, g, mask, EMULATE_BF16_ROUNDING)
    k_ptrs, p = load_param(row, _K, p_ptrs, offs, mask, HAS_COMPS, VEC,
                           EMULATE_BF16_ROUNDING)
    if not WD_AFTER_MOMENTUM:
        g = g + weight_decay * p
    if HAS_MOMENTUM:
        b_ptrs = column_f32(row, _B, offs, VEC)
        if FIRST_RUN:
            buf = g
        else:
            buf = tl.load(b_ptrs, mask=mask, other=0.0)
            buf = buf * momentum + one_minus_dampening * g
            if HAS_STEPS:
                # A step that was skipped did not count: the buffer starts at the first
                # step actually taken, as torch's does.
                buf = tl.where(step == 0.0, g, buf)
        tl.store(b_ptrs, buf, mask=mask)
        if NESTEROV:
            g = g + momentum * buf
        else:
            g = buf
    if WD_AFTER_MOMENTUM:
        g = g + weight_decay * p
    p = p + neg_lr * g
    store_updated(p_ptrs, column(row, _C, offs, c_proto, VEC), k_ptrs, p, mask, offs, tkey,
                  HAS_COPIES, HAS_COMPS, HAS_KEYS, EMULATE_BF16_ROUNDING)
    if HAS_STEPS:
        finish_tensor_step(counters_ptr, tensor, row, step_ptr, step, found_inf_ptr, _ROW,
                           HAS_FOUND_INF, BLOCK)


def sgd_prepare(params, grads, momentum_buffers=None, copies=None, steps=None, comps=None,
                keys=None):
    """Validate and plan an SGD sweep over these lists (see _multi_tensor): keep the
    result and pass it to :func:`sgd_launch` while the tensors stay the same.
    ``momentum_buffers``, ``copies`` and ``steps`` are optional (None, or None per row);
    so are ``comps`` / ``keys`` (bf16 parameters with a Kahan compensation, or rounded
    stochastically: kernels/rounding.py; keys need steps)."""
    return SGD.prepare(dict(params=params, grads=grads, momentum_buffers=momentum_buffers,
                            copies=copies, steps=steps, comps=comps, keys=keys))


def _missing_buffer(prepared):
    """The index of a non-empty parameter without a momentum buffer, or None. The groups
    say it (a steady step scans no list)."""
    if prepared.triton:
        if all(g.constexprs["HAS_MOMENTUM_BUFFERS"] for g in prepared.groups):
            return None
    elif all(g.lists["momentum_buffers"] is not None for g in prepared.cpu_groups):
        return None
    bufs = prepared.lists.get("momentum_buffers")
    for i, p in enumerate(prepared.lists["params"]):
        if (bufs is None or bufs[i] is None) and p.numel() != 0:
            return i
    return None


def sgd_launch(prepared, *, lr, momentum=0.0, dampening=0.0, weight_decay=0.0, nesterov=False,
               wd_after_momentum=False, first_run=False, grad_scale=None, found_inf=None,
               write_grads=False):
    """One SGD step over a prepared sweep: one launch per dtype group. ``write_grads``
    (or a :class:`~._cpu_optim.GradWrites` for ``prepared``) stores each unscaled
    gradient back into its gradient, unless the step is skipped; without a
    ``grad_scale`` there is nothing to write."""
    prepared, write_grads = take_grad_writes(prepared, write_grads)
    if prepared.n == 0:
        return
    # (checked before anything is written, whichever path runs)
    check_amp_args(prepared.device, grad_scale=grad_scale, found_inf=found_inf)
    write_grads = write_grads and grad_scale is not None
    if momentum != 0:
        missing = _missing_buffer(prepared)
        if missing is not None:
            what = ("momentum_buffers is None" if prepared.lists.get("momentum_buffers") is None
                    else f"momentum_buffers[{missing}] is None")
            raise ValueError(f"sgd_step: momentum != 0 needs momentum_buffers ({what}); pass "
                             "one fp32 buffer per parameter")
    if not prepared.triton:
        sgd_step_cpu(prepared, lr=lr, momentum=momentum, dampening=dampening,
                     weight_decay=weight_decay, nesterov=nesterov,
                     wd_after_momentum=wd_after_momentum, first_run=first_run,
                     grad_scale=grad_scale, found_inf=found_inf, write_grads=write_grads)
        return
    device = prepared.device
    lr = scalar_arg(lr, "lr", device)
    anchor = prepared.groups[0].meta if prepared.groups else None
    prepared.launch(_sgd_step_kernel, (
        lr, float(momentum), 1.0 - dampening, float(weight_decay),
        grad_scale if grad_scale is not None else anchor,
        found_inf if found_inf is not None else anchor), dict(
        LR_IS_TENSOR=isinstance(lr, torch.Tensor), HAS_SCALE=grad_scale is not None,
        HAS_FOUND_INF=found_inf is not None, HAS_MOMENTUM=momentum != 0,
        FIRST_RUN=bool(first_run), NESTEROV=bool(nesterov),
        WD_AFTER_MOMENTUM=bool(wd_after_momentum), WRITE_GRAD=write_grads))
    if write_grads:
        write_staged_grads(prepared)
    prepared.advance_empty_steps(found_inf)


def sgd_step_cpu(prepared, *, lr, momentum=0.0, dampening=0.0, weight_decay=0.0,
                 nesterov=False, wd_after_momentum=False, first_run=False, grad_scale=None,
                 found_inf=None, write_grads=False):
    """The production CPU path of :func:`sgd_launch`: per dtype group torch's fused CPU
    SGD kernel on fp32 lists (half parameters and gradients through fp32 scratch, see
    _cpu_optim), ``found_inf`` handed to it (it then writes nothing), the step counts
    advanced by 1 (0 on a skipped step), the copies written from the updated values.
    With ``write_grads`` the kernel's own write of the unscaled gradient lands in the
    gradients (fp32 ones handed to it directly, half ones copied back from scratch).

    - First step: torch's kernel takes one ``is_first_step`` for the whole call, the
      kernel's rule is per tensor (``first_run``, or a step count of 0). Without
      dampening no flag is needed: a buffer at step count 0 holds zeros (the optimizers
      create it so and a skipped step leaves it so), and ``momentum * 0 + g`` is ``g``.
      With dampening the counts are looked at on the host (CPU tensors: no device
      synchronisation, but a host read): all started -> one call, none started -> one
      call with ``is_first_step``, a mix -> one call for each part.
    - ``wd_after_momentum`` (Apex): ``p -= lr * (d + wd * p)`` is taken as
      ``p *= 1 - lr * wd`` (a factor of exactly 1 on a skipped step) before the fused
      kernel's ``p -= lr * d`` with no weight decay of its own.

    torch's kernel fuses ``g + wd * p`` and the buffer update into multiply-adds where
    :func:`sgd_step_ref` rounds twice: an ulp or so per step."""
    lr = scalar_arg(lr, "lr", prepared.device)
    skip, keep = amp_flags(found_inf)
    decay = None
    if wd_after_momentum and weight_decay != 0:
        decay = decay_factor(lr, weight_decay, skip)
    kw = dict(weight_decay=0.0 if wd_after_momentum else float(weight_decay),
              momentum=float(momentum), lr=lr, dampening=float(dampening),
              nesterov=bool(nesterov), maximize=False, found_inf=skip)

    def group_step(group):
        lists = group.lists
        params, bufs, steps = lists["params"], lists["momentum_buffers"], lists["steps"]
        if momentum != 0 and bufs is None:  # sgd_launch checked: every parameter is empty
            if steps is not None:
                advance_counts(group.counted("steps"), keep)
            return
        grads = lists["grads"]
        work_p, work_g, scale = fp32_work(prepared, group, params, grads, grad_scale,
                                          write_grads)
        if decay is not None:
            torch._foreach_mul_(work_p, decay)
        if momentum == 0:
            torch._fused_sgd_(work_p, work_g, [], is_first_step=False, grad_scale=scale, **kw)
        elif first_run or steps is None:
            torch._fused_sgd_(work_p, work_g, bufs, is_first_step=bool(first_run),
                              grad_scale=scale, **kw)
        elif dampening == 0:
            # Without dampening the first step needs no flag: a buffer whose step count is
            # 0 holds zeros (created so, a skipped step leaves it so, FusedSGD zeroes it on
            # load), and momentum * 0 + g is g. No count is read.
            torch._fused_sgd_(work_p, work_g, bufs, is_first_step=False, grad_scale=scale,
                              **kw)
        else:
            _momentum_step_by_counts(work_p, work_g, bufs, steps, scale, kw)
        if steps is not None:
            advance_counts(group.counted("steps"), keep)
        write_back(params, work_p, lists["copies"], grads if write_grads else None, work_g,
                   rounded=(prepared, group))

    run_in_parts(prepared, group_step, grad_scale, write_grads)
    if write_grads:
        write_staged_grads(prepared)


def _momentum_step_by_counts(params, grads, bufs, steps, scale, kw):
    """torch's fused SGD with ``is_first_step`` decided per tensor by its step count."""
    try:
        counts = torch.stack(steps)
    except RuntimeError:  # one-element counts of different shapes
        counts = torch.stack([s.reshape(()) for s in steps])
    first = counts.reshape(-1).eq(0)
    if not first.any():
        torch._fused_sgd_(params, grads, bufs, is_first_step=False, grad_scale=scale, **kw)
        return
    flags = first.tolist()
    if all(flags):
        torch._fused_sgd_(params, grads, bufs, is_first_step=True, grad_scale=scale, **kw)
        return
    for is_first in (True, False):
        rows = [i for i, f in enumerate(flags) if f == is_first]
        torch._fused_sgd_([params[i] for i in rows], [grads[i] for i in rows],
                          [bufs[i] for i in rows], is_first_step=is_first, grad_scale=scale,
                          **kw)


@torch.no_grad()
def sgd_step(params, grads, momentum_buffers=None, copies=None, *, lr, momentum=0.0,
             dampening=0.0, weight_decay=0.0, nesterov=False, wd_after_momentum=False,
             first_run=False, steps=None, comps=None, keys=None, grad_scale=None,
             found_inf=None, write_grads=False):
    """One SGD step for lists of same-shaped tensors (see the module docstring).

    ``first_run`` says the momentum buffers hold nothing yet (they are set to the
    gradient). Alternatively ``steps`` (fp32 one-element device tensors, one per
    parameter) decide it on the device: a buffer whose step count is 0 starts from the
    gradient, so a skipped first step leaves no trace; the counts advance unless
    ``found_inf``. ``lr`` is a float or an fp32 one-element tensor; ``copies`` may hold
    None for parameters without a copy; ``write_grads`` stores the unscaled gradients
    back into ``grads``. Bad lists raise before anything is written. No host sync."""
    sgd_launch(sgd_prepare(params, grads, momentum_buffers, copies, steps, comps, keys), lr=lr,
               momentum=momentum, dampening=dampening, weight_decay=weight_decay,
               nesterov=nesterov, wd_after_momentum=wd_after_momentum, first_run=first_run,
               grad_scale=grad_scale, found_inf=found_inf, write_grads=write_grads)


@torch.no_grad()
def sgd_step_ref(params, grads, momentum_buffers=None, copies=None, *, lr, momentum=0.0,
                 dampening=0.0, weight_decay=0.0, nesterov=False, wd_after_momentum=False,
                 first_run=False, steps=None, comps=None, keys=None, grad_scale=None,
                 found_inf=None):
    """Torch reference of :func:`sgd_step` (same order of operations, fp32)."""
    inv = None if grad_scale is None else grad_scale.double().reciprocal().float()
    keep = None if found_inf is None else found_inf.reshape(()) == 0
    for i, p in enumerate(params):
        if p.numel() == 0:
            continue
        g = grads[i].float()
        if inv is not None:
            g = g * inv
        comp, key = row_rounding_ref(comps, keys, i)
        pf = load_compensated_ref(p, comp)
        if not wd_after_momentum:
            g = g + f32(weight_decay) * pf
        if momentum != 0:
            buf = g if first_run else momentum_buffers[i] * f32(momentum) + f32(1.0 - dampening) * g
            if steps is not None and steps[i] is not None and not first_run:
                buf = torch.where(steps[i].reshape(()) == 0, g, buf)
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
        store_rounded_ref(p, new, comp, key, None if key is None else steps[i].float() + 1.0)
        if copies is not None and copies[i] is not None:
            copies[i].copy_(new)
    if steps is not None:
        advance_steps(list(steps), found_inf)
