"""Small @triton.jit helpers shared by the kernels.

``EMULATE_BF16_ROUNDING`` is on under Triton's interpreter only: there bf16 <-> fp32
conversions truncate and flush subnormals, where the GPU and torch are exact (widening)
and round to nearest even (narrowing). On the GPU the native conversions are used.
"""
import triton
import triton.language as tl


@triton.jit
def sweep_block(meta_ptr, blocks_ptr, found_inf_ptr, ROW: tl.constexpr,
                HAS_FOUND_INF: tl.constexpr, VEC: tl.constexpr, BLOCK: tl.constexpr):
    """This program's share of a multi-tensor sweep (see _multi_tensor.Prepared).

    Returns the tensor index, its table row (ROW - 1 addresses, then numel), the element
    offsets and their mask. With VEC > 1 the host has checked that every numel of the
    group is a multiple of VEC, so the mask is constant over runs of VEC lanes (what
    lets the compiler issue 16-byte accesses). With HAS_FOUND_INF a non-zero flag empties
    the mask: a skipped step reads nothing and writes nothing."""
    pid = tl.program_id(0).to(tl.int64)
    tensor = tl.load(blocks_ptr + 2 * pid).to(tl.int64)
    block = tl.load(blocks_ptr + 2 * pid + 1).to(tl.int64)
    row = meta_ptr + ROW * tensor
    numel = tl.load(row + (ROW - 1))
    if VEC > 1:
        numel = tl.multiple_of(numel, VEC)
    if HAS_FOUND_INF:
        numel = tl.where(tl.load(found_inf_ptr) == 0.0, numel, 0)
    offs = block * BLOCK + tl.arange(0, BLOCK)
    return tensor, row, offs, offs < numel


@triton.jit
def column(row, COL: tl.constexpr, offs, elem_proto, VEC: tl.constexpr):
    """Pointers to this program's elements in table column COL, typed as ``elem_proto``'s
    elements. With VEC > 1 the host has checked that the address is 16-byte aligned; the
    hints say so to the compiler (an address loaded from a table carries no alignment)."""
    base = tl.load(row + COL).to(tl.pointer_type(elem_proto.dtype.element_ty))
    ptrs = base + offs
    if VEC > 1:
        ptrs = tl.max_contiguous(tl.multiple_of(ptrs, 16), VEC)
    return ptrs


@triton.jit
def column_f32(row, COL: tl.constexpr, offs, VEC: tl.constexpr):
    """:func:`column` for an fp32 column (optimizer state)."""
    base = tl.load(row + COL).to(tl.pointer_type(tl.float32))
    ptrs = base + offs
    if VEC > 1:
        ptrs = tl.max_contiguous(tl.multiple_of(ptrs, 16), VEC)
    return ptrs


@triton.jit
def scalar_ptr(row, COL: tl.constexpr):
    """The fp32 scalar (a step count) that table column COL addresses."""
    return tl.load(row + COL).to(tl.pointer_type(tl.float32))


@triton.jit
def finish_tensor_step(counters_ptr, tensor, row, step_ptr, step, found_inf_ptr,
                       ROW: tl.constexpr, HAS_FOUND_INF: tl.constexpr, BLOCK: tl.constexpr):
    """Advance the tensor's step count once every program of the tensor has read it.

    Each program read ``step`` before this call; the atomic (acq_rel) counts the
    programs that are done, and the last one writes step + 1 (+ 0 on a skipped step) and
    resets the counter for the next launch. No extra launch, no race: the write is
    ordered after every read by the counter."""
    n_blocks = tl.cdiv(tl.load(row + (ROW - 1)), BLOCK)
    done = tl.atomic_add(counters_ptr + tensor, 1)
    if done == n_blocks - 1:
        inc = 1.0
        if HAS_FOUND_INF:
            inc = tl.where(tl.load(found_inf_ptr) == 0.0, 1.0, 0.0)
        tl.store(step_ptr, step + inc)
        tl.store(counters_ptr + tensor, 0)


@triton.jit
def inv_scale(scale_ptr):
    """1 / scale taken in fp64 and rounded to fp32, as torch.amp.GradScaler does."""
    return (1.0 / tl.load(scale_ptr).to(tl.float64)).to(tl.float32)


@triton.jit
def unscale_factor(scale_ptr, HAS_SCALE: tl.constexpr):
    """What a sweep multiplies gradients by: 1 / scale (see :func:`inv_scale`) with
    HAS_SCALE, else 1. A per-tensor scalar: computed before the element loads."""
    if HAS_SCALE:
        return inv_scale(scale_ptr)
    else:
        return 1.0


@triton.jit
def tensor_step(row, COL: tl.constexpr, HAS_STEPS: tl.constexpr):
    """(address, value) of the tensor's step count in table column COL; the value is 0
    without HAS_STEPS (the column is then empty and never dereferenced)."""
    step_ptr = scalar_ptr(row, COL)
    if HAS_STEPS:
        return step_ptr, tl.load(step_ptr)
    else:
        return step_ptr, 0.0


@triton.jit
def load_grad(g_ptrs, mask, inv, HAS_SCALE: tl.constexpr, EMULATE_BF16_ROUNDING: tl.constexpr):
    """The gradient at ``g_ptrs`` widened to fp32 and, with HAS_SCALE, multiplied by
    ``inv`` (1 / scale, computed before the element loads)."""
    g = load_f32(g_ptrs, mask, EMULATE_BF16_ROUNDING)
    if HAS_SCALE:
        g = g * inv
    return g


@triton.jit
def store_param(p_ptrs, c_ptrs, p, mask, HAS_COPY: tl.constexpr,
                EMULATE_BF16_ROUNDING: tl.constexpr):
    """Write the updated parameter and, with HAS_COPY, its copy (the half model weight)
    from the same fp32 value."""
    store_cast(p_ptrs, p, mask, EMULATE_BF16_ROUNDING)
    if HAS_COPY:
        store_cast(c_ptrs, p, mask, EMULATE_BF16_ROUNDING)


@triton.jit
def bias_corrections(step, betas_ptr):
    """1 - beta1**t and 1 - beta2**t in fp64, t = step + 1 (the step being taken; torch's
    rule). ``step`` is the fp32 count read from the tensor's step column."""
    t = step.to(tl.float64) + 1.0
    return (1.0 - tl.exp2(t * tl.log2(tl.load(betas_ptr + 0))),
            1.0 - tl.exp2(t * tl.log2(tl.load(betas_ptr + 1))))


@triton.jit
def load_lr(lr, LR_IS_TENSOR: tl.constexpr):
    """The learning rate: a scalar argument, or read from an fp32 device tensor."""
    if LR_IS_TENSOR:
        return tl.load(lr).to(tl.float32)
    else:
        return lr


@triton.jit
def _fp32_to_bf16_rne(x):
    # Round to nearest even by hand. Triton's interpreter truncates fp32 -> bf16,
    # where the GPU (cvt.rn.bf16.f32) and torch round to nearest even.
    bits = x.to(tl.uint32, bitcast=True)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    rounded = tl.where(x != x, 0x7FC0, rounded)  # keep NaN a (quiet) NaN
    return rounded.to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _bf16_to_fp32_exact(x):
    # Widen by moving the 16 bits into the top half of an fp32: exact for every value,
    # subnormals included, which the interpreter's conversion gets wrong.
    bits = x.to(tl.uint16, bitcast=True).to(tl.uint32) << 16
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def to_bf16(x, EMULATE_BF16_ROUNDING: tl.constexpr):
    """fp32 ``x`` rounded to the nearest bf16, ties to even, as torch rounds."""
    if EMULATE_BF16_ROUNDING:
        return _fp32_to_bf16_rne(x)
    else:
        return x.to(tl.bfloat16)


@triton.jit
def from_bf16(x, EMULATE_BF16_ROUNDING: tl.constexpr):
    """bf16 ``x`` widened to fp32 (exact)."""
    if EMULATE_BF16_ROUNDING:
        return _bf16_to_fp32_exact(x)
    else:
        return x.to(tl.float32)


@triton.jit
def load_f32(ptr, mask, EMULATE_BF16_ROUNDING: tl.constexpr):
    """Load from ``ptr`` and upcast to fp32 at once (torch's opmath; bf16 exact)."""
    x = tl.load(ptr, mask=mask, other=0.0)
    if EMULATE_BF16_ROUNDING:
        if ptr.dtype.element_ty == tl.bfloat16:
            return _bf16_to_fp32_exact(x)
        else:
            return x.to(tl.float32)
    else:
        return x.to(tl.float32)


@triton.jit
def store_cast(ptr, x, mask, EMULATE_BF16_ROUNDING: tl.constexpr):
    """Store fp32 ``x`` at ``ptr`` in the pointee's dtype, rounding as torch does."""
    if EMULATE_BF16_ROUNDING:
        if ptr.dtype.element_ty == tl.bfloat16:
            tl.store(ptr, _fp32_to_bf16_rne(x), mask=mask)
        else:
            tl.store(ptr, x.to(ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(ptr, x.to(ptr.dtype.element_ty), mask=mask)
