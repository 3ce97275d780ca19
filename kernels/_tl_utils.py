"""Small @triton.jit helpers shared by the kernels.

``EMULATE_BF16_ROUNDING`` is on under Triton's interpreter only: there bf16 <-> fp32
conversions truncate and flush subnormals, where the GPU and torch are exact (widening)
and round to nearest even (narrowing). On the GPU the native conversions are used.
"""
import triton
import triton.language as tl


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
