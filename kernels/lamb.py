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

One sweep (``LAMB``), two launches per dtype group and one shared launch, whatever the
number of tensors:

1. ``_lamb_moments_kernel`` (per group): m and v updated in place; where the trust ratio
   applies, per-block partial sums of p*p and u*u written to a small fp32 buffer. The
   update u is not stored anywhere (Apex writes it over the gradient; tritamp writes a
   gradient only when asked to unscale it in place).
2. ``_l2norm_segment_kernel`` (l2norm.py, one launch for every group): per-tensor ||p||
   and ||u||. Left out where no group uses the trust ratio.
3. ``_lamb_apply_kernel`` (per group): recomputes u from the new m, v and the unchanged
   p with the same instructions as stage 1 (same memory traffic as storing u and reading
   it back, and no buffer the size of the model), scales it by the trust ratio and
   updates p; ``copies`` (optional, None per row allowed) receive the new parameter in
   their own dtype. The last program of each tensor advances its step count (stage 3
   is the last to read it): no extra launch.

The global gradient norm is the caller's (``multi_tensor_l2norm`` over every gradient
of every group, ``scale=grad_scale``): a 0-d fp32 device tensor read on the device.
When ``found_inf`` holds a non-zero value nothing is read or written and the step
counts stay: the skipped step leaves no trace. With ``write_grads``
(``torch.amp.GradScaler``'s contract, see _cpu_optim.GradWrites) stage 1 also stores g,
the unscaled gradient before clipping and weight decay, into the gradient (stage 1 is
the only stage that reads it; the caller's global norm was taken before).
:func:`lamb_prepare` validates and plans
once (tables, segment table, buffers); :func:`lamb_launch` then uploads nothing.

On the CPU without the interpreter :func:`lamb_step_cpu` runs the same stages as
torch foreach ops over fp32 working lists, per dtype group (see its docstring).
"""
import math

import torch
import triton
import triton.language as tl

from ._multi_tensor import (Column, StagedPrepared, Sweep, check_amp_args, device_constants,
                            scalar_arg)
from ._ref_utils import advance_steps, f32 as _f32
from ._tl_utils import (bias_corrections, column, column_f32, finish_tensor_step,
                        load_grad, load_lr, scalar_ptr, store_cast, sweep_block,
                        tensor_step, unscale_factor)
from ._cpu_optim import advance_counts, amp_flags, take_grad_writes, write_staged_grads
from . import rounding
from .rounding import (ROUNDING_COLUMNS, check_rounding_rows, load_compensated_ref, load_param,
                       row_rounding_ref, step_key, store_rounded_ref, store_updated)
from .l2norm import (SegmentLayout, bias_correction_terms, reduce_by_rows, reduce_segments,
                     scalar_views, segment_pairs)

LAMB = Sweep("lamb_step", [
    Column("params", "param"), Column("grads", "grad"), Column("exp_avgs", "state"),
    Column("exp_avg_sqs", "state"), Column("copies", "copy", optional=True),
    Column("steps", "scalar"), *ROUNDING_COLUMNS,
], check=check_rounding_rows,
   writes=("params", "exp_avgs", "exp_avg_sqs", "copies", "comps", "steps"))
_P, _G, _M, _V, _C, _S, _K, _R = (LAMB.col(n) for n in LAMB.names)
_ROW = LAMB.row_width


@triton.jit
def _lamb_bias_corrections(step, betas_ptr, BIAS_CORRECTION: tl.constexpr):
    # 1 - beta**t in fp64 (t the step after this one), rounded once to fp32.
    if BIAS_CORRECTION:
        c1, c2 = bias_corrections(step, betas_ptr)
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
    meta_ptr,        # int64 [n_tensors, 7]: the LAMB columns' addresses, then numel
    blocks_ptr,      # int32 [n_blocks, 2]: tensor index, block index within that tensor
    counters_ptr,    # int32 [n_tensors]: unused here (stage 3 advances the steps)
    p_proto,         # a param tensor: carries the parameter element type
    g_proto,         # a gradient tensor: carries the gradient element type
    c_proto,         # a copy tensor (or any tensor): unused here
    pp_ptr,          # fp32 [n_blocks]: this group's per-block sums of p*p (USE_RATIO)
    uu_ptr,          # fp32 [n_blocks]: this group's per-block sums of u*u (USE_RATIO)
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
    WRITE_GRAD: tl.constexpr,      # store the unscaled gradient back (torch's GradScaler)
    HAS_COPIES: tl.constexpr,
    HAS_COMPS: tl.constexpr,       # bf16 parameters with a Kahan compensation (p + c read)
    HAS_KEYS: tl.constexpr,        # unused here (stage 3 rounds)
    VEC: tl.constexpr,             # > 1: every address 16-byte aligned, numel % VEC == 0
    EMULATE_BF16_ROUNDING: tl.constexpr,
    BLOCK: tl.constexpr,
):
    tensor, row, offs, mask = sweep_block(meta_ptr, blocks_ptr, found_inf_ptr, _ROW,
                                          HAS_FOUND_INF, VEC, BLOCK)
    # Per-tensor scalars first: they are live across the element loads otherwise.
    inv = unscale_factor(scale_ptr, HAS_SCALE)
    if HAS_CLIP:
        gn = tl.load(grad_norm_ptr)
        clip = tl.where(gn > max_grad_norm, tl.div_rn(gn, max_grad_norm), 1.0)
    if USE_RATIO:
        bc1, bc2 = _lamb_bias_corrections(tl.load(scalar_ptr(row, _S)), betas_ptr,
                                          BIAS_CORRECTION)

    m_ptrs = column_f32(row, _M, offs, VEC)
    v_ptrs = column_f32(row, _V, offs, VEC)
    g_ptrs = column(row, _G, offs, g_proto, VEC)
    g = load_grad(g_ptrs, mask, inv, HAS_SCALE, EMULATE_BF16_ROUNDING)
    if WRITE_GRAD:
        store_cast(g_ptrs, g, mask, EMULATE_BF16_ROUNDING)
    if HAS_CLIP:
        g = tl.div_rn(g, clip)
    if HAS_DECAY or USE_RATIO:
        p_ptrs = column(row, _P, offs, p_proto, VEC)
        k_ptrs, p = load_param(row, _K, p_ptrs, offs, mask, HAS_COMPS, VEC,
                               EMULATE_BF16_ROUNDING)
    else:
        p = tl.zeros([BLOCK], dtype=tl.float32)
    if not ADAM_W:
        if HAS_DECAY:
            g = g + weight_decay * p
    m = tl.load(m_ptrs, mask=mask, other=0.0)
    v = tl.load(v_ptrs, mask=mask, other=0.0)
    m = m * beta1 + beta3 * g
    v = v * beta2 + one_minus_beta2 * g * g
    tl.store(m_ptrs, m, mask=mask)
    tl.store(v_ptrs, v, mask=mask)
    if USE_RATIO:
        u = _lamb_update(m, v, p, bc1, bc2, eps, weight_decay, ADAM_W, HAS_DECAY)
        u = tl.where(mask, u, 0.0)  # masked lanes would add eps-sized noise
        pid = tl.program_id(0)
        tl.store(uu_ptr + pid, tl.sum(u * u, axis=0))
        tl.store(pp_ptr + pid, tl.sum(p * p, axis=0))


@triton.jit
def _lamb_apply_kernel(
    meta_ptr,        # int64 [n_tensors, 7]: the LAMB columns' addresses, then numel
    blocks_ptr,      # int32 [n_blocks, 2]: tensor index, block index within that tensor
    counters_ptr,    # int32 [n_tensors]: programs done per tensor (step advance), zeroed
    p_proto,         # a param tensor: carries the parameter element type
    g_proto,         # a gradient tensor: unused here
    c_proto,         # a copy tensor (or any tensor without copies): carries the copy type
    p_norm_ptr,      # fp32 [n_tensors]: this group's ||p|| per tensor (USE_RATIO)
    u_norm_ptr,      # fp32 [n_tensors]: this group's ||u|| per tensor (USE_RATIO)
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
    HAS_COPIES: tl.constexpr,
    HAS_COMPS: tl.constexpr,       # bf16 parameters with a Kahan compensation
    HAS_KEYS: tl.constexpr,        # bf16 parameters rounded stochastically
    VEC: tl.constexpr,
    EMULATE_BF16_ROUNDING: tl.constexpr,
    BLOCK: tl.constexpr,
):
    tensor, row, offs, mask = sweep_block(meta_ptr, blocks_ptr, found_inf_ptr, _ROW,
                                          HAS_FOUND_INF, VEC, BLOCK)
    ratio = load_lr(lr, LR_IS_TENSOR)
    if USE_RATIO:
        p_norm = tl.load(p_norm_ptr + tensor)
        u_norm = tl.load(u_norm_ptr + tensor)
        usable = (p_norm != 0.0) & (u_norm != 0.0)
        # Divide by 1 where unusable, so no 0/0 is formed even in the discarded branch.
        ratio = tl.where(usable, ratio * tl.div_rn(p_norm, tl.where(usable, u_norm, 1.0)), ratio)
    step_ptr, step = tensor_step(row, _S, True)
    tkey = step_key(row, _R, step, HAS_KEYS)
    bc1, bc2 = _lamb_bias_corrections(step, betas_ptr, BIAS_CORRECTION)

    p_ptrs = column(row, _P, offs, p_proto, VEC)
    k_ptrs, p = load_param(row, _K, p_ptrs, offs, mask, HAS_COMPS, VEC,
                           EMULATE_BF16_ROUNDING)
    m = tl.load(column_f32(row, _M, offs, VEC), mask=mask, other=0.0)
    v = tl.load(column_f32(row, _V, offs, VEC), mask=mask, other=0.0)
    u = _lamb_update(m, v, p, bc1, bc2, eps, weight_decay, ADAM_W, HAS_DECAY)
    p = p - ratio * u
    store_updated(p_ptrs, column(row, _C, offs, c_proto, VEC), k_ptrs, p, mask, offs, tkey,
                  HAS_COPIES, HAS_COMPS, HAS_KEYS, EMULATE_BF16_ROUNDING)
    finish_tensor_step(counters_ptr, tensor, row, step_ptr, step, found_inf_ptr, _ROW,
                       HAS_FOUND_INF, BLOCK)


class LambPrepared(StagedPrepared):
    """A prepared ``LAMB`` sweep and what its three stages share, built once: the
    per-group slices of the partials and norms buffers and the segment table."""
    __slots__ = ("partials", "norms", "segments", "moments_args", "apply_args", "cpu",
                 "layout", "_rows")

    def __init__(self, prepared):
        super().__init__(prepared)
        self.partials = self.norms = self.segments = self.layout = self._rows = None
        self.moments_args = self.apply_args = ()
        self.cpu = None  # the CPU path's per-group lists (_CpuLists), built on first use
        if not self.triton or not prepared.groups:
            return
        layout = self.layout = SegmentLayout(prepared)
        # Rows: p*p, u*u. Reused every step: launches on one stream are ordered.
        self.partials = torch.empty((2, layout.n_partials), dtype=torch.float32,
                                    device=self.device)
        self.norms = torch.empty((2, layout.n_results), dtype=torch.float32, device=self.device)
        self.segments = segment_pairs(layout.result_runs, self.device)
        self.moments_args = [(self.partials[0, b:], self.partials[1, b:])
                             for b in layout.block_bases]
        self.apply_args = [(self.norms[0, b:], self.norms[1, b:]) for b in layout.result_bases]

    def row_norms(self):
        """(rows, results): device index tensors pairing each non-empty row of the
        prepared lists with its column of ``norms`` (built on first use, for a caller
        that reduces the per-tensor norms across processes by row)."""
        if self._rows is None:
            rows, results = [], []
            for g, base in zip(self.prepared.groups, self.layout.result_bases):
                rows += g.rows
                results += range(base, base + len(g.rows))
            self._rows = (torch.tensor(rows, dtype=torch.int64, device=self.device),
                          torch.tensor(results, dtype=torch.int64, device=self.device))
        return self._rows


def lamb_prepare(params, grads, exp_avgs, exp_avg_sqs, steps, copies=None, comps=None,
                 keys=None):
    """Validate and plan a LAMB sweep over these lists (see _multi_tensor): keep the
    result and pass it to :func:`lamb_launch` while the tensors stay the same. ``comps``
    / ``keys`` (optional, per row or None): bf16 parameters stored with a Kahan
    compensation, or rounded stochastically (kernels/rounding.py)."""
    return LambPrepared(LAMB.prepare(dict(params=params, grads=grads, exp_avgs=exp_avgs,
                                          exp_avg_sqs=exp_avg_sqs, steps=steps,
                                          copies=copies, comps=comps, keys=keys)))


def lamb_launch(prepared, *, lr, beta1, beta2, eps, weight_decay, adam_w_mode=True,
                grad_averaging=True, bias_correction=True, use_nvlamb=False,
                global_grad_norm=None, max_grad_norm=1.0, grad_scale=None, found_inf=None,
                write_grads=False, norm_reduce=None):
    """One LAMB step over a prepared sweep: per dtype group the moments and apply
    launches, and one segment launch between them where the trust ratio applies.
    ``write_grads`` (or a :class:`~._cpu_optim.GradWrites` for ``prepared``) stores each
    unscaled gradient back into its gradient, unless the step is skipped; without a
    ``grad_scale`` there is nothing to write.

    ``norm_reduce`` (sharded tensors): called as ``norm_reduce(t, "sum")`` with an fp32
    ``[2, k]`` tensor of the squared norms of ``p`` and ``u`` per tensor, which it must
    sum in place over the processes holding the other shards (an all-reduce). On the
    Triton path ``k`` is the number of rows (0 for an empty local shard), on the CPU path
    the rows of one dtype group, in row order, group after group (the same sequence on
    every process whose lists hold the same dtypes)."""
    prepared, write_grads = take_grad_writes(prepared, write_grads)
    if prepared.n == 0:
        return
    # (checked before anything is written, whichever path runs)
    check_amp_args(prepared.device, grad_scale=grad_scale, found_inf=found_inf,
                   global_grad_norm=global_grad_norm)
    lr = scalar_arg(lr, "lr", prepared.device)
    write_grads = write_grads and grad_scale is not None
    if not prepared.triton:
        lamb_step_cpu(prepared, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
                      weight_decay=weight_decay, adam_w_mode=adam_w_mode,
                      grad_averaging=grad_averaging, bias_correction=bias_correction,
                      use_nvlamb=use_nvlamb, global_grad_norm=global_grad_norm,
                      max_grad_norm=max_grad_norm, grad_scale=grad_scale, found_inf=found_inf,
                      write_grads=write_grads, norm_reduce=norm_reduce)
        return
    prepared.prepared.advance_empty_steps(found_inf)
    has_decay = weight_decay != 0
    use_ratio = bool(use_nvlamb) or has_decay
    if not prepared.moments_args:
        if norm_reduce is not None and use_ratio:  # the other processes' reduce
            norm_reduce(torch.zeros((2, prepared.n), dtype=torch.float32,
                                    device=prepared.device), "sum")
        return  # every tensor is empty
    device = prepared.device
    anchor = prepared.partials
    betas = device_constants(device, (beta1, beta2))
    flags = dict(HAS_FOUND_INF=found_inf is not None, ADAM_W=bool(adam_w_mode),
                 HAS_DECAY=has_decay, USE_RATIO=use_ratio,
                 BIAS_CORRECTION=bool(bias_correction))
    skip = found_inf if found_inf is not None else anchor
    prepared.prepared.launch(_lamb_moments_kernel, (
        betas, float(beta1), 1.0 - beta1 if grad_averaging else 1.0, float(beta2), 1.0 - beta2,
        float(eps), float(weight_decay),
        global_grad_norm if global_grad_norm is not None else anchor,
        float(max_grad_norm or 0.0), grad_scale if grad_scale is not None else anchor, skip),
        # HAS_COPIES=False: this stage writes no copy.
        dict(flags, HAS_CLIP=global_grad_norm is not None, HAS_SCALE=grad_scale is not None,
             HAS_COPIES=False, WRITE_GRAD=write_grads), group_args=prepared.moments_args)
    if write_grads:
        # Before stage 3's launch refreshes the dense copies from the gradients.
        write_staged_grads(prepared.prepared)
    if use_ratio and norm_reduce is None:
        reduce_segments(prepared.partials, prepared.segments, prepared.norms.shape[1],
                        sqrt=True, out=prepared.norms)
    elif use_ratio:
        norms = reduce_segments(prepared.partials, prepared.segments,
                                prepared.norms.shape[1], sqrt=False, out=prepared.norms)
        rows, results = prepared.row_norms()
        norms[:, results] = reduce_by_rows(norms[:, results], rows, prepared.n, norm_reduce,
                                           "sum").sqrt()
    prepared.prepared.launch(_lamb_apply_kernel, (lr, betas, float(eps), float(weight_decay), skip),
                             dict(flags, LR_IS_TENSOR=isinstance(lr, torch.Tensor)),
                             group_args=prepared.apply_args)


@torch.no_grad()
def lamb_step(params, grads, exp_avgs, exp_avg_sqs, steps, copies=None, comps=None, keys=None,
              *, lr, beta1, beta2, eps, weight_decay, adam_w_mode=True, grad_averaging=True,
              bias_correction=True, use_nvlamb=False, global_grad_norm=None,
              max_grad_norm=1.0, grad_scale=None, found_inf=None, write_grads=False):
    """One LAMB step for lists of same-shaped tensors (see the module docstring).

    ``global_grad_norm`` (0-d fp32 device tensor, or None for no clipping) is the norm
    of the unscaled gradients; ``steps`` are fp32 one-element tensors, advanced by one
    unless ``found_inf`` is non-zero; ``lr`` a float or an fp32 one-element tensor;
    ``copies`` may hold None for parameters without a copy; ``write_grads`` stores the
    unscaled gradients back into ``grads``. Bad lists raise before anything is written.
    No host sync."""
    lamb_launch(lamb_prepare(params, grads, exp_avgs, exp_avg_sqs, steps, copies, comps, keys),
                lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay,
                adam_w_mode=adam_w_mode, grad_averaging=grad_averaging,
                bias_correction=bias_correction, use_nvlamb=use_nvlamb,
                global_grad_norm=global_grad_norm, max_grad_norm=max_grad_norm,
                grad_scale=grad_scale, found_inf=found_inf, write_grads=write_grads)


# --- the production CPU path -------------------------------------------------------------
#
# Shared with NovoGrad's CPU path. A skipped step (found_inf non-zero) must leave every
# value as it was without reading the flag on the host, and no foreach op chooses
# between an old value and a new one that may be inf or NaN (0 * inf is NaN). So the one
# input that is non-finite on an overflow, the gradient, is gated: its fp32 working copy
# is written by torch._fused_sgd_ (which skips itself on the flag) over a buffer of -0.0,
# leaving -0.0 on a skipped step; every later write is then an identity: the moments'
# factors become 1 and their addend -0.0 (x * 1 and x + -0.0 are x, bitwise), per-tensor
# vectors keep their old values (torch.where on n values), the step counts add 0, and a
# parameter update and the copies' write go through torch._fused_sgd_ again. (LAMB with
# grad averaging needs no gated gradient: torch._fused_adam_ writes its moments and
# update and skips itself on the flag.)

_NEG_ZERO = {}


def _neg_zero(device):
    t = _NEG_ZERO.get(device)
    if t is None:
        t = _NEG_ZERO[device] = torch.tensor(-0.0, device=device)
    return t


def gated(value, keep, identity):
    """``value`` (a float or a 0-d tensor), or ``identity`` on a skipped step (``keep``
    the 0-d 1/0 flag of ``_cpu_optim.amp_flags``; None: never skipped)."""
    if keep is None:
        return value
    return torch.where(keep.bool(), value, identity)


class _CpuLists:
    """What the CPU path derives once per prepared group: one-element views of the step
    counts, and the rows that have a copy (with the copies) when only some do."""
    __slots__ = ("steps", "copy_rows", "copies", "_sources")

    def __init__(self, group):
        self.steps = scalar_views(group["steps"])
        copies = group["copies"]
        self.copy_rows = self.copies = self._sources = None
        if copies is not None:
            rows = [i for i, c in enumerate(copies) if c is not None]
            self.copies = [copies[i] for i in rows]
            self.copy_rows = None if len(rows) == len(copies) else rows

    def copy_sources(self, work):
        """The rows of ``work`` (a persistent list) that have a copy; picked once per list."""
        if self.copy_rows is None:
            return work
        if self._sources is None or self._sources[0] is not work:
            self._sources = (work, [work[i] for i in self.copy_rows])
        return self._sources[1]


def cpu_lists(prepared, make):
    """The per-group :class:`_CpuLists` (or ``make``'s) of a prepared LAMB or NovoGrad
    sweep, built on first use and kept with it."""
    if prepared.cpu is None:
        prepared.cpu = [make(g) for g in prepared.prepared.cpu_groups]
    return prepared.cpu


def fp32_params(engine, group, params):
    """The parameters as fp32: themselves, or their persistent fp32 scratch filled now
    (the half -> fp32 -> half round trip of a skipped step is exact); for bf16 parameters
    rounded stochastically or with compensation, kernels/rounding.py's working copy."""
    if rounding.rounds(group):
        return rounding.cpu_load(engine, group, params)
    if params[0].dtype == torch.float32:
        return params
    work = engine.buffers(group, "params", params)
    torch._foreach_copy_(work, params)
    return work


def write_params(engine, group, params, work, plan, skip, advanced=True):
    """Half parameters from their fp32 working copy (exact on a skipped step: the
    round trip of an unchanged value), and the copies in their dtype. A copy may differ
    from its parameter's rounding, so on a skipped step it must not be written: the new
    copies are staged in a scratch and moved in as the momentum buffer of torch's fused
    SGD on a "first step" (the buffer takes the gradient exactly), which skips itself on
    the flag. Rounded bf16 parameters (no copies) are stored as the kernels store them
    (kernels/rounding.py; ``advanced``: the step counts were advanced already)."""
    if rounding.rounds(group):
        counts = (rounding.step_counts(group, advanced)
                  if group.lists.get("keys") is not None else None)
        rounding.cpu_store(engine, group, params, work, counts)
        return
    if work is not params:
        torch._foreach_copy_(params, work)
    if plan.copies is None:
        return
    sources = plan.copy_sources(work)
    if skip is None:
        torch._foreach_copy_(plan.copies, sources)
        return
    staged = engine.buffers(group, "copies", plan.copies, dtype=plan.copies[0].dtype)
    torch._foreach_copy_(staged, sources)
    torch._fused_sgd_(staged, staged, plan.copies, weight_decay=0.0, momentum=1.0, lr=0.0,
                      dampening=0.0, nesterov=False, maximize=False, is_first_step=True,
                      grad_scale=None, found_inf=skip)


def fp32_scalar(x, device):
    """A float or a one-element tensor as a 0-d fp32 tensor (the reference's ``_f32``)."""
    if isinstance(x, torch.Tensor):
        return x.float().reshape(())
    return device_constants(device, (x,), torch.float32).reshape(())


def _sgd_(params, grads, lr, skip):
    """params -= lr * grads (``lr`` a float or a 0-d tensor, one rounding), nothing at all
    when ``skip`` is 1: torch's fused SGD CPU kernel without momentum or decay."""
    torch._fused_sgd_(params, grads, [], weight_decay=0.0, momentum=0.0, lr=lr,
                      dampening=0.0, nesterov=False, maximize=False, is_first_step=False,
                      grad_scale=None, found_inf=skip)


def fp32_grads(engine, group, grads, factor, skip, spare):
    """An fp32 scratch (laid out as the parameters) holding ``grads * factor`` (``factor``
    a 0-d fp32 tensor or None for 1: the product rounded once), or -0.0 everywhere when
    ``skip`` is set. ``spare`` (an fp32 scratch list free until later) stages half
    gradients for the fused kernel, which takes one dtype."""
    params = group["params"]
    work = engine.buffers(group, "grads", params)
    if skip is None:
        torch._foreach_copy_(work, grads)
        if factor is not None:
            torch._foreach_mul_(work, factor)
        return work
    if grads[0].dtype != torch.float32:
        torch._foreach_copy_(spare, grads)
        grads = spare
    torch._foreach_copy_(work, [_neg_zero(work[0].device)] * len(work))
    _sgd_(work, grads, -1.0 if factor is None else -factor, skip)
    return work


def unscaled_grads(engine, group, grads, inv, keep):
    """``write_grads``: every gradient unscaled in place (``g * inv``, rounded once to its
    dtype; ``g * 1`` on a skipped step, which leaves every value as it was), and the
    unscaled values as fp32 for the step: the gradients themselves when fp32, else a
    scratch holding the products before rounding (what the kernels compute with). The
    step then takes them as unscaled (no ``inv``)."""
    factor = gated(inv, keep, 1.0)
    if grads[0].dtype == torch.float32:
        torch._foreach_mul_(grads, factor)
        return grads
    work = engine.buffers(group, "unscaled", grads)
    torch._foreach_copy_(work, grads)
    torch._foreach_mul_(work, factor)
    torch._foreach_copy_(grads, work)
    return work


def first_moment(m, grad, beta1, grad_averaging, keep):
    """m = beta1 * m + (1 - beta1) * g (+ g without averaging): the reference's product,
    then an add (which torch's vectorised add may fuse into one rounding). ``lerp`` would
    be one pass fewer but is several ulps off where |g| >> |m|."""
    torch._foreach_mul_(m, gated(beta1, keep, 1.0))
    torch._foreach_add_(m, grad, alpha=1.0 - beta1 if grad_averaging else 1.0)


def bias_correction_f32(steps, beta):
    """:func:`~.l2norm.bias_correction_terms` rounded once to fp32, as the kernel does."""
    return bias_correction_terms(steps, beta).float()


@torch.no_grad()
def lamb_step_cpu(prepared, *, lr, beta1, beta2, eps, weight_decay, adam_w_mode=True,
                  grad_averaging=True, bias_correction=True, use_nvlamb=False,
                  global_grad_norm=None, max_grad_norm=1.0, grad_scale=None, found_inf=None,
                  write_grads=False, norm_reduce=None):
    """The production CPU path of :func:`lamb_launch`: :func:`lamb_step_ref`'s stages on
    torch's multi-tensor CPU ops, per dtype group, with no Python work per tensor and no
    host read.

    fp32 working lists: the parameters (or an fp32 scratch copy of half ones), a scratch
    gradient where the user's cannot be read as it is (they are never written), and the
    update ``u`` in a second scratch. With grad averaging, LAMB's moments and
    ``u = (m / bc1) / (sqrt(v / bc2) + eps)`` are Adam's: one ``torch._fused_adam_``
    call updates m and v and writes ``u`` into a zeroed scratch as its "parameter" (lr
    -1, no decay; unscale and clip folded into its ``grad_scale`` where the gradient is
    a scratch; a step count of +inf turns bias correction off), and skips itself on
    ``found_inf``. Without grad averaging, foreach ops (:func:`_lamb_moments_foreach`).
    Then the decay, the trust ratio from ``torch._foreach_norm`` of p and u (the norm
    the reference takes), and ``p -= ratio * u`` through torch's fused SGD (skipped on
    ``found_inf``). Per-tensor numbers are vectors of ``n`` values applied through lists
    of 0-d views. Adam's kernel computes ``lerp``-style moments and
    ``sqrt(v) / sqrt(bc2)``, so values differ from the reference's in the last bits
    (and more, relative to a first moment that nearly cancels). A skipped step changes
    nothing (see the comment above). ``write_grads``: the gradients are unscaled in
    place first (:func:`unscaled_grads`) and the step reads them unscaled."""
    device = prepared.device
    engine = prepared.prepared
    skip, keep = amp_flags(found_inf)
    has_decay = weight_decay != 0
    use_ratio = bool(use_nvlamb) or has_decay
    l2 = not adam_w_mode and has_decay
    lr32 = fp32_scalar(lr, device)
    inv = None if grad_scale is None else grad_scale.double().reciprocal().float().reshape(())
    clip = None
    if global_grad_norm is not None:
        gn = global_grad_norm.float().reshape(())
        mx = fp32_scalar(float(max_grad_norm), device)
        clip = torch.where(gn > mx, gn / mx, 1.0)
    plans = cpu_lists(prepared, _LambCpuLists)
    write_grads = write_grads and inv is not None
    hyper = dict(beta1=beta1, beta2=beta2, eps=eps, l2=l2, weight_decay=weight_decay,
                 inv=None if write_grads else inv, clip=clip, skip=skip, keep=keep)

    def group(g):
        plan = plans[g.index]
        params, grads = g["params"], g["grads"]
        if write_grads:
            grads = unscaled_grads(engine, g, grads, inv, keep)
        p = fp32_params(engine, g, params)
        u = engine.buffers(g, "update", params)
        if grad_averaging:
            _lamb_moments_fused(engine, g, plan, p, u, grads, bias_correction, **hyper)
        else:
            _lamb_moments_foreach(engine, g, plan, p, u, grads, bias_correction, **hyper)
        if adam_w_mode and has_decay:
            torch._foreach_add_(u, p, alpha=weight_decay)
        # p -= ratio * u: the product rounded, then the subtraction, as the reference.
        if use_ratio:
            p_norm = torch.stack(torch._foreach_norm(p))
            u_norm = torch.stack(torch._foreach_norm(u))
            if norm_reduce is not None:  # sharded: the norms of the whole tensors
                sq = torch.stack((p_norm, u_norm)).square_()
                norm_reduce(sq, "sum")
                p_norm, u_norm = sq.sqrt_().unbind(0)
            ratio = torch.where((p_norm != 0) & (u_norm != 0), lr32 * (p_norm / u_norm), lr32)
            torch._foreach_mul_(u, ratio.unbind(0))
        else:
            torch._foreach_mul_(u, lr32)
        _sgd_(p, u, 1.0, skip)
        write_params(engine, g, params, p, plan, skip)

    engine.run_cpu(group)
    if write_grads:
        write_staged_grads(engine)


class _LambCpuLists(_CpuLists):
    """:class:`_CpuLists` plus a list of +inf step counts (Adam's kernel without bias
    correction), made on first use."""
    __slots__ = ("_no_bias",)

    def __init__(self, group):
        super().__init__(group)
        self._no_bias = None

    def no_bias_steps(self, device):
        if self._no_bias is None:
            self._no_bias = [torch.tensor(math.inf, device=device)] * len(self.steps)
        return self._no_bias


def _lamb_moments_fused(engine, g, plan, p, u, grads, bias_correction, *, beta1, beta2, eps,
                        l2, weight_decay, inv, clip, skip, keep):
    """m, v and u by ``torch._fused_adam_`` (see :func:`lamb_step_cpu`) from ``grads``
    (read only); advances the step counts first (by 1, or 0 on a skipped step), as
    torch's Adam does."""
    scale = None
    if l2 or grads[0].dtype != torch.float32 or inv is not None or clip is not None:
        work = engine.buffers(g, "grads", g["params"])
        torch._foreach_copy_(work, grads)
        grads = work
        if l2:
            # The decay joins the unscaled, clipped gradient before the moments.
            factor = inv if clip is None else (clip.reciprocal() if inv is None else inv / clip)
            if factor is not None:
                torch._foreach_mul_(work, factor)
            torch._foreach_add_(work, p, alpha=weight_decay)
        elif inv is not None or clip is not None:
            # Adam's kernel divides the (scratch) gradient by its grad_scale.
            scale = (clip if inv is None else (clip if clip is not None else 1.0) / inv)
            scale = scale.reshape(())
    advance_counts(g.counted("steps"), keep)
    steps = g["steps"] if bias_correction else plan.no_bias_steps(u[0].device)
    torch._foreach_zero_(u)
    torch._fused_adam_(u, grads, g["exp_avgs"], g["exp_avg_sqs"], [], steps, lr=-1.0,
                       beta1=beta1, beta2=beta2, weight_decay=0.0, eps=eps, amsgrad=False,
                       maximize=False, grad_scale=scale, found_inf=skip)


def _lamb_moments_foreach(engine, g, plan, p, u, grads, bias_correction, *, beta1, beta2, eps,
                          l2, weight_decay, inv, clip, skip, keep):
    """m = beta1 * m + g (no grad averaging), v and u by foreach ops, with the gated
    gradient of the comment above (from ``grads``, read only); advances the step counts
    after."""
    factor = inv if clip is None else (clip.reciprocal() if inv is None else inv / clip)
    grad = fp32_grads(engine, g, grads, factor, skip, u)
    if l2:
        # grad += weight_decay * p, nothing at all on a skipped step: adding a gated
        # 0 * p to the -0.0 gradient would give +0.0, and the moments' sign bits with it
        _sgd_(grad, p, -float(weight_decay), skip)
    m, v = g["exp_avgs"], g["exp_avg_sqs"]
    first_moment(m, grad, beta1, False, keep)
    torch._foreach_mul_(v, gated(beta2, keep, 1.0))
    if keep is None:
        torch._foreach_addcmul_(v, grad, grad, value=1.0 - beta2)
    else:  # (1 - beta2) * g * g is +0.0 for the gated g, and -0.0 + +0.0 is +0.0: the
        # factor is -0.0 on a skipped step instead, making the addend -0.0 (an identity)
        factor = gated(1.0 - beta2, keep, -0.0)
        torch._foreach_addcmul_(v, grad, grad, factor.expand(len(v)).contiguous())
    # u = (m / bc1) / (sqrt(v / bc2) + eps), the denominators in the gradient scratch.
    denom = grad
    torch._foreach_copy_(denom, v)
    torch._foreach_copy_(u, m)
    if bias_correction:
        steps = torch.cat(plan.steps)
        torch._foreach_div_(denom, bias_correction_f32(steps, beta2).unbind(0))
        torch._foreach_div_(u, bias_correction_f32(steps, beta1).unbind(0))
    torch._foreach_sqrt_(denom)
    torch._foreach_add_(denom, eps)
    torch._foreach_div_(u, denom)
    advance_counts(g.counted("steps"), keep)


@torch.no_grad()
def lamb_step_ref(params, grads, exp_avgs, exp_avg_sqs, steps, copies=None, comps=None,
                  keys=None, *, lr, beta1, beta2, eps, weight_decay, adam_w_mode=True,
                  grad_averaging=True, bias_correction=True, use_nvlamb=False,
                  global_grad_norm=None, max_grad_norm=1.0, grad_scale=None, found_inf=None):
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
        comp, key = row_rounding_ref(comps, keys, i)
        pf = load_compensated_ref(p, comp)
        if not adam_w_mode and has_decay:
            g = g + _f32(weight_decay) * pf
        m = exp_avgs[i] * _f32(beta1) + beta3 * g
        v = exp_avg_sqs[i] * _f32(beta2) + _f32(1.0 - beta2) * g * g
        if bias_correction:
            b = device_constants(p.device, (beta1, beta2))
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
        store_rounded_ref(p, new_p, comp, key, steps[i].float() + 1.0)
        exp_avgs[i].copy_(m)
        exp_avg_sqs[i].copy_(v)
        if copies is not None and copies[i] is not None:
            if keep is None:
                copies[i].copy_(new_p)
            else:
                copies[i].copy_(torch.where(keep, new_p.to(copies[i].dtype), copies[i]))
    advance_steps(list(steps), found_inf)
