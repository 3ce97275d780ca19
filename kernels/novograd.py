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

Apex's order of operations, in fp32 whatever the parameter dtype. ``v`` is one fp32
one-element tensor per parameter (``exp_avg_sqs``); "first step" is read from the
tensor's step count on the device, so a skipped first step still initialises on the
next one.

One sweep (``NOVOGRAD``), two launches per dtype group and one shared launch, whatever
the number of tensors:

1. ``_novograd_norm_kernel`` (per group): per-block partial norms of the gradients
   (sums of squares, or maxima of |g|).
2. ``_novograd_blend_kernel`` (one launch for every group, one small program per
   tensor): reduces the tensor's run of partials in a fixed order and blends v.
3. ``_novograd_step_kernel`` (per group): the elementwise update of m and p; ``copies``
   (optional, None per row allowed) receive the new parameter in their own dtype. The
   last program of each tensor advances its step count (stage 3 is the last to read
   it): no extra launch.

When ``found_inf`` holds a non-zero value nothing is written and the step counts stay:
the skipped step leaves no trace. With ``write_grads`` (``torch.amp.GradScaler``'s
contract, see _cpu_optim.GradWrites) stage 3, the last to read the gradient, also
stores g, the unscaled gradient, into it. :func:`novograd_prepare` validates and plans once
(tables, blend table, buffers); :func:`novograd_launch` then uploads nothing.

On the CPU without the interpreter :func:`novograd_step_cpu` runs the same stages as
torch foreach ops over fp32 working lists, per dtype group (see its docstring).
"""
import functools

import torch
import triton
import triton.language as tl

from ._multi_tensor import (Column, StagedPrepared, Sweep, _upload, check_amp_args,
                            device_constants, scalar_arg)
from .launch import kept_kernel
from ._ref_utils import advance_steps, f32 as _f32
from ._tl_utils import (bias_corrections, column, column_f32, finish_tensor_step,
                        load_grad, load_lr, scalar_ptr, store_cast, sweep_block,
                        tensor_step, unscale_factor)
from ._cpu_optim import advance_counts, amp_flags, take_grad_writes, write_staged_grads
from .rounding import (ROUNDING_COLUMNS, check_rounding_rows, load_compensated_ref, load_param,
                       row_rounding_ref, step_key, store_rounded_ref, store_updated)
from .l2norm import (SEGMENT_BLOCK, SegmentLayout, SquareSums, bias_correction_terms,
                     reduced_by_row, scalar_views)
from .lamb import (_CpuLists, _sgd_, bias_correction_f32, cpu_lists, first_moment, fp32_grads,
                   fp32_params, fp32_scalar, gated, unscaled_grads, write_params)

NOVOGRAD = Sweep("novograd_step", [
    Column("params", "param"), Column("grads", "grad"), Column("exp_avgs", "state"),
    Column("copies", "copy", optional=True),
    Column("exp_avg_sqs", "scalar"),   # the per-tensor second moment: one fp32 value
    Column("steps", "scalar"), *ROUNDING_COLUMNS,
], check=check_rounding_rows,
   writes=("params", "exp_avgs", "copies", "comps", "exp_avg_sqs", "steps"))
_P, _G, _M, _C, _VS, _S, _K, _R = (NOVOGRAD.col(n) for n in NOVOGRAD.names)
_ROW = NOVOGRAD.row_width


@triton.jit
def _novograd_norm_kernel(
    meta_ptr,        # int64 [n_tensors, 7]: the NOVOGRAD columns' addresses, then numel
    blocks_ptr,      # int32 [n_blocks, 2]: tensor index, block index within that tensor
    counters_ptr,    # int32 [n_tensors]: unused here (stage 3 advances the steps)
    p_proto,         # a param tensor: unused here
    g_proto,         # a gradient tensor: carries the gradient element type
    c_proto,         # a copy tensor (or any tensor): unused here
    partials_ptr,    # fp32 [n_blocks]: this group's per-block sum of g*g, or max |g|
    scale_ptr,       # fp32 scalar: the loss scale the gradients carry (HAS_SCALE)
    found_inf_ptr,   # fp32 scalar: non-zero means skip this step (HAS_FOUND_INF)
    HAS_SCALE: tl.constexpr,
    HAS_FOUND_INF: tl.constexpr,
    MAX_NORM: tl.constexpr,        # norm_type 0
    HAS_COPIES: tl.constexpr,
    HAS_COMPS: tl.constexpr,       # unused here (stage 3 reads and stores the parameters)
    HAS_KEYS: tl.constexpr,
    VEC: tl.constexpr,             # > 1: every address 16-byte aligned, numel % VEC == 0
    EMULATE_BF16_ROUNDING: tl.constexpr,
    BLOCK: tl.constexpr,
):
    tensor, row, offs, mask = sweep_block(meta_ptr, blocks_ptr, found_inf_ptr, _ROW,
                                          HAS_FOUND_INF, VEC, BLOCK)
    inv = unscale_factor(scale_ptr, HAS_SCALE)
    g = load_grad(column(row, _G, offs, g_proto, VEC), mask, inv, HAS_SCALE,
                  EMULATE_BF16_ROUNDING)
    if MAX_NORM:
        # tl.max may drop NaN (the GPU and the interpreter do): carry it through by hand.
        has_nan = tl.max((g != g).to(tl.int32), axis=0) > 0
        part = tl.where(has_nan, float("nan"), tl.max(tl.abs(g), axis=0))
    else:
        part = tl.sum(g * g, axis=0)
    tl.store(partials_ptr + tl.program_id(0), part)


@triton.jit
def _novograd_blend_kernel(
    tensors_ptr,     # int64 [n_tensors, 4]: first partial, number of partials, v address,
                     # step address (every non-empty tensor of every group)
    partials_ptr,    # fp32 [n_partials]: from _novograd_norm_kernel
    sums_ptr,        # fp32 [n_tensors]: each tensor's reduced norm (STAGE 1 writes, 2 reads)
    beta2, one_minus_beta2,
    found_inf_ptr,   # fp32 scalar: non-zero means skip this step (HAS_FOUND_INF)
    HAS_FOUND_INF: tl.constexpr,
    MAX_NORM: tl.constexpr,
    INIT_ZERO: tl.constexpr,       # v starts at 0 rather than at the first norm
    STAGE: tl.constexpr,           # 0: reduce and blend; 1: reduce into sums; 2: blend sums
    BLOCK_R: tl.constexpr,
):
    # One program per tensor, a fixed summation order: deterministic. Sharded tensors
    # run STAGE 1, sum (or max) the sums over the processes, then STAGE 2.
    t = tl.program_id(0).to(tl.int64)
    start = tl.load(tensors_ptr + 4 * t)
    count = tl.load(tensors_ptr + 4 * t + 1)
    v_ptr = tl.load(tensors_ptr + 4 * t + 2).to(tl.pointer_type(tl.float32))
    step_ptr = tl.load(tensors_ptr + 4 * t + 3).to(tl.pointer_type(tl.float32))
    acc = tl.zeros([BLOCK_R], dtype=tl.float32)
    if STAGE == 2:
        if MAX_NORM:
            n = tl.load(sums_ptr + t)
        else:
            sq = tl.load(sums_ptr + t)
            n = tl.sqrt_rn(sq)
    elif MAX_NORM:
        # tl.max drops NaN (the GPU's max.f32 and the interpreter alike): count it apart.
        bad = tl.zeros([BLOCK_R], dtype=tl.int32)
        for off in range(0, count, BLOCK_R):
            idx = off + tl.arange(0, BLOCK_R)
            x = tl.load(partials_ptr + start + idx, mask=idx < count, other=0.0)
            bad = bad | (x != x).to(tl.int32)
            acc = tl.maximum(acc, x)
        n = tl.where(tl.max(bad, axis=0) > 0, float("nan"), tl.max(acc, axis=0))
    else:
        for off in range(0, count, BLOCK_R):
            idx = off + tl.arange(0, BLOCK_R)
            acc += tl.load(partials_ptr + start + idx, mask=idx < count, other=0.0)
        sq = tl.sum(acc, axis=0)
        n = tl.sqrt_rn(sq)
    if STAGE == 1:
        if MAX_NORM:
            tl.store(sums_ptr + t, n)
        else:
            tl.store(sums_ptr + t, sq)
        return
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
    meta_ptr,        # int64 [n_tensors, 7]: the NOVOGRAD columns' addresses, then numel
    blocks_ptr,      # int32 [n_blocks, 2]: tensor index, block index within that tensor
    counters_ptr,    # int32 [n_tensors]: programs done per tensor (step advance), zeroed
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
    WRITE_GRAD: tl.constexpr,      # store the unscaled gradient back (torch's GradScaler)
    HAS_COPIES: tl.constexpr,
    HAS_COMPS: tl.constexpr,       # bf16 parameters with a Kahan compensation
    HAS_KEYS: tl.constexpr,        # bf16 parameters rounded stochastically
    VEC: tl.constexpr,
    EMULATE_BF16_ROUNDING: tl.constexpr,
    BLOCK: tl.constexpr,
):
    tensor, row, offs, mask = sweep_block(meta_ptr, blocks_ptr, found_inf_ptr, _ROW,
                                          HAS_FOUND_INF, VEC, BLOCK)
    # Per-tensor scalars first: they are live across the element loads otherwise.
    step_ptr, step = tensor_step(row, _S, True)
    tkey = step_key(row, _R, step, HAS_KEYS)
    if BIAS_CORRECTION:
        c1, c2 = bias_corrections(step, betas_ptr)
        bc1 = c1.to(tl.float32)
        bc2 = tl.sqrt(c2).to(tl.float32)
    else:
        bc1 = 1.0
        bc2 = 1.0
    denom = tl.div_rn(tl.load(scalar_ptr(row, _VS)), bc2) + eps
    inv = unscale_factor(scale_ptr, HAS_SCALE)
    lr_v = load_lr(lr, LR_IS_TENSOR)

    p_ptrs = column(row, _P, offs, p_proto, VEC)
    m_ptrs = column_f32(row, _M, offs, VEC)
    g_ptrs = column(row, _G, offs, g_proto, VEC)
    g = load_grad(g_ptrs, mask, inv, HAS_SCALE, EMULATE_BF16_ROUNDING)
    if WRITE_GRAD:
        store_cast(g_ptrs, g, mask, EMULATE_BF16_ROUNDING)
    k_ptrs, p = load_param(row, _K, p_ptrs, offs, mask, HAS_COMPS, VEC,
                           EMULATE_BF16_ROUNDING)
    m = tl.load(m_ptrs, mask=mask, other=0.0)
    if REG_INSIDE_MOMENT:
        g = tl.div_rn(g, denom) + weight_decay * p
        m = beta1 * m + beta3 * g
        p = p - lr_v * tl.div_rn(m, bc1)
    else:
        m = beta1 * m + beta3 * g
        p = p - lr_v * (tl.div_rn(tl.div_rn(m, bc1), denom) + weight_decay * p)
    store_updated(p_ptrs, column(row, _C, offs, c_proto, VEC), k_ptrs, p, mask, offs, tkey,
                  HAS_COPIES, HAS_COMPS, HAS_KEYS, EMULATE_BF16_ROUNDING)
    tl.store(m_ptrs, m, mask=mask)
    finish_tensor_step(counters_ptr, tensor, row, step_ptr, step, found_inf_ptr, _ROW,
                       HAS_FOUND_INF, BLOCK)


def _check_norm_type(norm_type):
    if norm_type not in (0, 2):
        raise ValueError(f"novograd_step: norm_type must be 2 (L2) or 0 (max norm), "
                         f"got {norm_type}")


class NovoGradPrepared(StagedPrepared):
    """A prepared ``NOVOGRAD`` sweep and what its three stages share, built once: the
    per-group slices of the partials buffer and the blend stage's table (per non-empty
    tensor: its run of partials, the addresses of its v and step)."""
    __slots__ = ("partials", "tensors", "n_tensors", "norm_args", "cpu", "_rows", "empties",
                 "_empty_rows")

    def __init__(self, prepared):
        super().__init__(prepared)
        self.partials = self.tensors = self._rows = self.empties = self._empty_rows = None
        self.n_tensors = 0
        self.norm_args = ()
        self.cpu = None  # the CPU path's per-group lists (_NovoGradCpuLists), on first use
        if self.triton and prepared.empty_rows:
            # Empty tensors' v and step addresses, for the blend stage of a sharded step:
            # an empty local shard of a tensor that is not empty takes the reduced norm.
            vs, steps = self.lists["exp_avg_sqs"], self.lists["steps"]
            rows = [(0, 0, vs[i].data_ptr(), steps[i].data_ptr()) for i in prepared.empty_rows]
            self.empties = _upload(torch.tensor(rows, dtype=torch.int64), self.device)
        if not self.triton or not prepared.groups:
            return
        layout = SegmentLayout(prepared)
        # Reused every step: launches on one stream are ordered.
        self.partials = torch.empty(layout.n_partials, dtype=torch.float32, device=self.device)
        self.norm_args = [(self.partials[b:],) for b in layout.block_bases]
        vs, steps = self.lists["exp_avg_sqs"], self.lists["steps"]
        rows = [layout.runs[i] + (vs[i].data_ptr(), steps[i].data_ptr())
                for g in prepared.groups for i in g.rows]
        self.n_tensors = len(rows)
        self.tensors = _upload(torch.tensor(rows, dtype=torch.int64), self.device)

    def empty_rows(self):
        """The rows of the empty tensors, as a device index tensor (built on first use)."""
        if self._empty_rows is None:
            self._empty_rows = torch.tensor(self.prepared.empty_rows, dtype=torch.int64,
                                            device=self.device)
        return self._empty_rows

    def blend_rows(self):
        """The row of the prepared lists of each blend program (non-empty tensors, group
        after group), as a device index tensor (built on first use, for a caller that
        reduces the norms across processes by row)."""
        if self._rows is None:
            rows = [i for g in self.prepared.groups for i in g.rows]
            self._rows = torch.tensor(rows, dtype=torch.int64, device=self.device)
        return self._rows


def novograd_prepare(params, grads, exp_avgs, exp_avg_sqs, steps, copies=None, comps=None,
                     keys=None):
    """Validate and plan a NovoGrad sweep over these lists (see _multi_tensor;
    ``exp_avg_sqs`` and ``steps`` hold one fp32 one-element tensor per parameter): keep
    the result and pass it to :func:`novograd_launch` while the tensors stay the same.
    ``comps`` / ``keys`` (optional, per row or None): bf16 parameters stored with a Kahan
    compensation, or rounded stochastically (kernels/rounding.py)."""
    return NovoGradPrepared(NOVOGRAD.prepare(dict(
        params=params, grads=grads, exp_avgs=exp_avgs, copies=copies, exp_avg_sqs=exp_avg_sqs,
        steps=steps, comps=comps, keys=keys)))


def novograd_launch(prepared, *, lr, beta1, beta2, eps, weight_decay, reg_inside_moment=False,
                    grad_averaging=True, norm_type=2, init_zero=False, bias_correction=True,
                    grad_scale=None, found_inf=None, write_grads=False, norm_reduce=None):
    """One NovoGrad step over a prepared sweep: per dtype group the norm and step
    launches, and one blend launch (every tensor of every group) between them.
    ``write_grads`` (or a :class:`~._cpu_optim.GradWrites` for ``prepared``) stores each
    unscaled gradient back into its gradient, unless the step is skipped; without a
    ``grad_scale`` there is nothing to write.

    ``norm_reduce`` (sharded tensors): called as ``norm_reduce(t, op)`` with an fp32
    tensor of per-tensor squared L2 norms (``op="sum"``) or max norms (``op="max"``),
    which it must reduce in place over the processes holding the other shards. On the
    Triton path ``t`` has one entry per row (0 for an empty local shard; the blend
    stage then runs in two launches around it); on the CPU path one per row of a dtype
    group, group after group. With ``norm_reduce`` a tensor whose local shard is empty
    takes the reduced norm into its moment on that process too, so that every process
    holds the same moment (a distributed checkpoint saves one copy of it); without it an
    empty tensor keeps its moment, as in the reference."""
    _check_norm_type(norm_type)
    prepared, write_grads = take_grad_writes(prepared, write_grads)
    if prepared.n == 0:
        return
    # (checked before anything is written, whichever path runs)
    check_amp_args(prepared.device, grad_scale=grad_scale, found_inf=found_inf)
    lr = scalar_arg(lr, "lr", prepared.device)
    write_grads = write_grads and grad_scale is not None
    if not prepared.triton:
        novograd_step_cpu(prepared, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
                          weight_decay=weight_decay, reg_inside_moment=reg_inside_moment,
                          grad_averaging=grad_averaging, norm_type=norm_type,
                          init_zero=init_zero, bias_correction=bias_correction,
                          grad_scale=grad_scale, found_inf=found_inf, write_grads=write_grads,
                          norm_reduce=norm_reduce)
        return
    op = "max" if norm_type == 0 else "sum"
    has_inf = found_inf is not None
    max_norm = norm_type == 0

    def blend_empties(full):
        # (before the empty tensors' steps advance: the blend reads the step count)
        if prepared.empties is not None:
            sums = full[prepared.empty_rows()]
            consts, ckey = _blend_consts(2, has_inf, max_norm, bool(init_zero))
            kept_kernel(_novograd_blend_kernel).launch(
                (len(prepared.prepared.empty_rows),),
                (prepared.empties, sums, sums, float(beta2), 1.0 - beta2,
                 found_inf if has_inf else sums), consts, ckey)

    if not prepared.norm_args:
        if norm_reduce is not None:  # the other processes' reduce
            full = torch.zeros(prepared.n, dtype=torch.float32, device=prepared.device)
            norm_reduce(full, op)
            blend_empties(full)
        prepared.prepared.advance_empty_steps(found_inf)
        return  # every tensor is empty
    device = prepared.device
    anchor = prepared.partials
    scale = grad_scale if grad_scale is not None else anchor
    skip = found_inf if found_inf is not None else anchor
    prepared.prepared.launch(_novograd_norm_kernel, (scale, skip),
                             # HAS_COPIES=False: this stage writes no copy.
                             dict(HAS_SCALE=grad_scale is not None, HAS_FOUND_INF=has_inf,
                                  MAX_NORM=max_norm, HAS_COPIES=False),
                             group_args=prepared.norm_args)
    def blend(args, stage):
        consts, ckey = _blend_consts(stage, has_inf, max_norm, bool(init_zero))
        kept_kernel(_novograd_blend_kernel).launch((prepared.n_tensors,), args, consts, ckey)

    if norm_reduce is None:
        blend((prepared.tensors, prepared.partials, anchor, float(beta2), 1.0 - beta2, skip), 0)
    else:
        sums = anchor.new_empty(prepared.n_tensors)
        args = (prepared.tensors, prepared.partials, sums, float(beta2), 1.0 - beta2, skip)
        blend(args, 1)
        full = reduced_by_row(sums, prepared.blend_rows(), prepared.n, norm_reduce, op)
        sums.copy_(full[prepared.blend_rows()])
        blend(args, 2)
        blend_empties(full)
    prepared.prepared.advance_empty_steps(found_inf)
    prepared.prepared.launch(_novograd_step_kernel, (
        lr, device_constants(device, (beta1, beta2)), float(beta1),
        1.0 - beta1 if grad_averaging else 1.0, float(eps), float(weight_decay), scale, skip),
        dict(LR_IS_TENSOR=isinstance(lr, torch.Tensor), HAS_SCALE=grad_scale is not None,
             HAS_FOUND_INF=has_inf, REG_INSIDE_MOMENT=bool(reg_inside_moment),
             BIAS_CORRECTION=bool(bias_correction), WRITE_GRAD=write_grads))
    if write_grads:
        write_staged_grads(prepared.prepared)


@functools.lru_cache(maxsize=None)
def _blend_consts(stage, has_inf, max_norm, init_zero):
    """(constexprs, their key) of the blend kernel, kept per combination of flags."""
    consts = dict(STAGE=stage, HAS_FOUND_INF=has_inf, MAX_NORM=max_norm,
                  INIT_ZERO=init_zero, BLOCK_R=SEGMENT_BLOCK, num_warps=4)
    return consts, tuple(consts.values())


@torch.no_grad()
def novograd_step(params, grads, exp_avgs, exp_avg_sqs, steps, copies=None, comps=None,
                  keys=None, *, lr, beta1,
                  beta2, eps, weight_decay, reg_inside_moment=False, grad_averaging=True,
                  norm_type=2, init_zero=False, bias_correction=True, grad_scale=None,
                  found_inf=None, write_grads=False):
    """One NovoGrad step for lists of tensors (see the module docstring).

    ``exp_avg_sqs`` are fp32 one-element tensors (the per-tensor running gradient norm),
    ``steps`` fp32 one-element tensors advanced by one unless ``found_inf`` is non-zero;
    ``lr`` a float or an fp32 one-element tensor; ``copies`` may hold None for
    parameters without a copy; ``write_grads`` stores the unscaled gradients back into
    ``grads``. Bad lists raise before anything is written. No host sync."""
    _check_norm_type(norm_type)
    novograd_launch(novograd_prepare(params, grads, exp_avgs, exp_avg_sqs, steps, copies,
                                     comps, keys),
                    lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay,
                    reg_inside_moment=reg_inside_moment, grad_averaging=grad_averaging,
                    norm_type=norm_type, init_zero=init_zero, bias_correction=bias_correction,
                    grad_scale=grad_scale, found_inf=found_inf, write_grads=write_grads)


# --- the production CPU path -------------------------------------------------------------

class _NovoGradCpuLists(_CpuLists):
    """:class:`~.lamb._CpuLists` plus one-element views of the second moments, which
    rows are empty (their moment stays, as in the reference) and the gradient norms'
    :class:`~.l2norm.SquareSums` (kept with the list it reads)."""
    __slots__ = ("moments", "nonempty", "rows", "_picked", "_sums")

    def __init__(self, group):
        super().__init__(group)
        params = group["params"]
        self.moments = scalar_views(group["exp_avg_sqs"])
        numels = list(map(torch.Tensor.numel, params))
        self.rows = self.nonempty = None  # None: no empty tensor in the group
        if not all(numels):
            self.rows = [i for i, n in enumerate(numels) if n]
            self.nonempty = torch.tensor([n > 0 for n in numels], device=params[0].device)
        self._picked = self._sums = None

    def sums(self, grads):
        """The :class:`~.l2norm.SquareSums` of ``grads``: built again only for another
        list (the fp32 scratch is kept; the user's own gradients are a new list after a
        kept plan takes a step's gradients)."""
        if self._sums is None or self._sums[0] is not grads:
            self._sums = (grads, SquareSums(grads))
        return self._sums[1]

    def nonempty_of(self, work):
        """The non-empty tensors of ``work`` (a persistent list), picked once per list."""
        if self._picked is None or self._picked[0] is not work:
            index = torch.tensor(self.rows, dtype=torch.int64, device=work[0].device)
            self._picked = (work, [work[i] for i in self.rows], index)
        return self._picked[1], self._picked[2]


@torch.no_grad()
def novograd_step_cpu(prepared, *, lr, beta1, beta2, eps, weight_decay,
                      reg_inside_moment=False, grad_averaging=True, norm_type=2,
                      init_zero=False, bias_correction=True, grad_scale=None, found_inf=None,
                      write_grads=False, norm_reduce=None):
    """The production CPU path of :func:`novograd_launch`: :func:`novograd_step_ref`'s
    stages as torch foreach ops, per dtype group, with no Python work per tensor and no
    host read.

    The gradients are only read: copied into an fp32 scratch (unscaled there by the
    reference's fp32 ``1/scale``) unless they are fp32 and used as they are. Each
    tensor's norm, from that fp32 gradient: L2 from :class:`~.l2norm.SquareSums` (fp32
    pieces added in fp64, rounded to fp32), max from ``torch._foreach_max`` of ``|g|``
    (NaN propagates). The per-tensor moments, bias
    corrections and denominators are vectors of ``n`` values computed with the
    reference's ops and applied through lists of 0-d views; the parameter update folds
    its per-tensor factors (``lr / (bc1 * denom)``) into one multiplier, so values
    differ from the reference's in the last bits. A skipped step changes nothing (see
    lamb.py's CPU path: the gradient is gated, every write an identity; the update's
    addend is then ``m * 0``, so a parameter holding -0.0 would come back +0.0).
    ``write_grads``: the gradients are unscaled in place first (see lamb.py's
    ``unscaled_grads``) and the step reads them unscaled."""
    _check_norm_type(norm_type)
    device = prepared.device
    engine = prepared.prepared
    skip, keep = amp_flags(found_inf)
    lr32 = fp32_scalar(lr, device)
    inv = None if grad_scale is None else grad_scale.double().reciprocal().float().reshape(())
    decay = None  # (the decoupled decay's factor; inside the moment it is added below)
    if weight_decay != 0 and not reg_inside_moment:
        decay = gated(torch.rsub(lr32 * weight_decay, 1.0), keep, 1.0)
    plans = cpu_lists(prepared, _NovoGradCpuLists)
    write_grads = write_grads and inv is not None
    read_inv = None if write_grads else inv

    def group(g):
        plan = plans[g.index]
        params, grads = g["params"], g["grads"]
        n = len(params)
        if write_grads:
            grads = unscaled_grads(engine, g, grads, inv, keep)
        p = fp32_params(engine, g, params)
        if skip is None and read_inv is None and not reg_inside_moment \
                and grads[0].dtype == torch.float32:
            grad = grads  # read as they are
        else:
            grad = fp32_grads(engine, g, grads, read_inv, skip,
                              engine.buffers(g, "spare", params))
        v_old = torch.cat(plan.moments)
        if norm_type == 0:
            norm = _max_abs(engine, g, grad, plan)
            if norm_reduce is not None:
                norm_reduce(norm, "max")
        else:
            # The reference's g (bitwise): its fp32 squares overflow where the
            # reference's do.
            sq = plan.sums(grad)().float()
            if norm_reduce is not None:
                norm_reduce(sq, "sum")
            norm = sq.double().sqrt().float()
        steps = torch.cat(plan.steps)
        v = v_old if init_zero else torch.where(steps == 0, norm, v_old)
        if norm_type == 0:
            v = v * beta2 + norm * (1.0 - beta2)
        else:
            v = torch.sqrt(v * beta2 * v + sq * (1.0 - beta2))
        if plan.nonempty is not None and norm_reduce is None:
            # (sharded: an empty local shard took the reduced norm, as the other shards)
            v = torch.where(plan.nonempty, v, v_old)
        v = gated(v, keep, v_old)
        if bias_correction:
            bc1 = bias_correction_f32(steps, beta1)
            bc2 = torch.sqrt(bias_correction_terms(steps, beta2)).float()
            denom = v / bc2 + eps
        else:
            bc1 = None
            denom = v + eps
        m = g["exp_avgs"]
        if reg_inside_moment:
            # A skipped step divides its -0.0 gradient by 1 (a zero denominator: NaN).
            torch._foreach_div_(grad, gated(denom, keep, 1.0).unbind(0))
            if weight_decay != 0:
                # grad += weight_decay * p, nothing at all on a skipped step (a gated
                # 0 * p would turn the -0.0 gradient, and the moment's sign bits, to +0.0)
                _sgd_(grad, p, -float(weight_decay), skip)
            first_moment(m, grad, beta1, grad_averaging, keep)
            step = lr32 if bc1 is None else lr32 / bc1
        else:
            first_moment(m, grad, beta1, grad_averaging, keep)
            if decay is not None:
                torch._foreach_mul_(p, decay)
            step = lr32 / denom if bc1 is None else lr32 / (bc1 * denom)
        step = gated(step, keep, 0.0)
        torch._foreach_addcmul_(p, m, step.expand(n).unbind(0), value=-1.0)
        write_params(engine, g, params, p, plan, skip, advanced=False)
        torch._foreach_copy_(plan.moments, v.split(1))
        advance_counts(g.counted("steps"), keep)

    engine.run_cpu(group)
    if write_grads:
        write_staged_grads(engine)


def _max_abs(engine, group, grad, plan):
    """max |g| per tensor (fp32 [n]; NaN where g holds one; 0 for an empty tensor)."""
    work = engine.buffers(group, "spare", grad)
    torch._foreach_copy_(work, grad)
    torch._foreach_abs_(work)
    if plan.rows is None:
        return torch.stack(torch._foreach_max(work))
    out = torch.zeros(len(work), dtype=torch.float32, device=work[0].device)
    picked, index = plan.nonempty_of(work)
    if picked:
        out.index_copy_(0, index, torch.stack(torch._foreach_max(picked)))
    return out


@torch.no_grad()
def novograd_step_ref(params, grads, exp_avgs, exp_avg_sqs, steps, copies=None, comps=None,
                      keys=None, *, lr, beta1,
                      beta2, eps, weight_decay, reg_inside_moment=False, grad_averaging=True,
                      norm_type=2, init_zero=False, bias_correction=True, grad_scale=None,
                      found_inf=None):
    """Torch reference of :func:`novograd_step` (same order of operations, fp32; norms
    from torch, so they may differ from the kernel's in the last bits)."""
    params = list(params)
    if not params:
        return
    _check_norm_type(norm_type)
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
            b = device_constants(p.device, (beta1, beta2))
            t = steps[i].double() + 1.0
            bc1 = (1.0 - torch.exp2(t * torch.log2(b[0]))).float()
            bc2 = torch.sqrt(1.0 - torch.exp2(t * torch.log2(b[1]))).float()
        else:
            bc1 = bc2 = _f32(1.0)
        lr_v = lr.float().reshape(()) if isinstance(lr, torch.Tensor) else _f32(lr)
        comp, key = row_rounding_ref(comps, keys, i)
        pf = load_compensated_ref(p, comp)
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
        store_rounded_ref(p, new_p, comp, key, steps[i].float() + 1.0)
        exp_avgs[i].copy_(m)
        exp_avg_sqs[i].copy_(v.reshape(exp_avg_sqs[i].shape))
        if copies is not None and copies[i] is not None:
            if keep is None:
                copies[i].copy_(new_p)
            else:
                copies[i].copy_(torch.where(keep, new_p.to(copies[i].dtype), copies[i]))
    advance_steps(list(steps), found_inf)
