"""Small @triton.jit helpers shared by the kernels."""
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
def store_cast(ptr, x, mask, EMULATE_BF16_ROUNDING: tl.constexpr):
    """Store fp32 ``x`` at ``ptr`` in the pointee's dtype, rounding as torch does."""
    if EMULATE_BF16_ROUNDING:
        if ptr.dtype.element_ty == tl.bfloat16:
            tl.store(ptr, _fp32_to_bf16_rne(x), mask=mask)
        else:
            tl.store(ptr, x.to(ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(ptr, x.to(ptr.dtype.element_ty), mask=mask)
