"""How the fused optimizers store a bf16 parameter that has no fp32 master: stochastic
rounding and Kahan-compensated summation. Every optimizer kernel, its ``*_ref`` and its
production CPU path use what is defined here, so the three paths store the same bits for
the same fp32 update.

**Stochastic rounding.** The update is computed in fp32, then rounded to bf16 up or down
with probabilities proportional to the distance to each neighbour: 16 random bits are
added to the low half of the fp32 pattern and the low half is dropped. The expected
value of the stored bf16 is the fp32 value, so updates far below half a bf16 ulp still
move the weights on average. Non-finite values round to nearest (a NaN stays a NaN, an
infinity stays infinite). A bf16 value already exact stays as it is whatever the bits.

The bits come from a counter-based hash (no generator state): per parameter a 32-bit key
made from the optimizer's ``seed`` and the parameter's position among the optimizer's
parameters (:func:`param_key`); per step that key mixed with the parameter's step count
after the step (:func:`tensor_key`); per element the tensor key mixed with the element's
offset in the parameter's storage (:func:`element_bits`). A run resumed from a
checkpoint (the seed and the step counts are in the optimizer's state dict) draws the
same bits as an uninterrupted one: the runs are bitwise equal.

**Kahan summation.** A bf16 compensation ``c`` per parameter holds what rounding the
parameter dropped. A step reads ``x = p + c`` (fp32, exact), updates ``x`` in fp32, and
stores ``p = bf16_rn(x)`` and ``c = bf16_trunc(x - p)`` (the remainder, exact in fp32,
truncated toward zero; a non-finite remainder is stored as 0). Truncation keeps ``c``
between 0 and the remainder, so ``p + c`` lies between ``p`` and ``x``, its nearest bf16
is ``p`` and the split of ``p + c`` is ``(p, c)`` again: a step that changes nothing
(skipped, or an update of 0) stores the same bits. The pair carries about 16 bits of
mantissa.

The hash is the 32-bit integer mixer ``x ^= x >> 16; x *= 0x21F0AAAD; x ^= x >> 15;
x *= 0x735A2D97; x ^= x >> 15`` (an invertible map with low bias), in uint32 on the
device and in int64 masked to 32 bits in torch.
"""
import torch
import triton
import triton.language as tl

from ._multi_tensor import Column, _size, _stride, flat_views
from ._tl_utils import from_bf16, load_f32, store_param, to_bf16


def check_rounding_rows(sweep, lists):
    """A sweep's rule across its rounding columns (the engine runs it with its own checks,
    before anything is written): a row with a compensation or a key is a bf16 parameter,
    has one of them, not both, and a key comes with the row's step count (the bits are
    drawn from it)."""
    comps, keys = lists.get("comps"), lists.get("keys")
    if comps is None and keys is None:
        return
    params, steps = lists["params"], lists.get("steps")
    for i, p in enumerate(params):
        comp = None if comps is None else comps[i]
        key = None if keys is None else keys[i]
        if comp is None and key is None:
            continue
        what = "comps" if key is None else "keys"
        if comp is not None and key is not None:
            raise ValueError(
                f"{sweep.name}: comps[{i}] and keys[{i}] are both given; a bf16 parameter is "
                "stored with a Kahan compensation or rounded stochastically, not both: pass "
                "None for one of them")
        if getattr(p, "dtype", None) != torch.bfloat16:
            raise TypeError(
                f"{sweep.name}: {what}[{i}] is given for params[{i}], which is "
                f"{getattr(p, 'dtype', type(p).__name__)}; compensations and stochastic "
                "rounding are for bf16 parameters: pass None for it")
        if key is not None and (steps is None or steps[i] is None):
            raise ValueError(
                f"{sweep.name}: keys[{i}] needs steps[{i}] (the stochastic rounding bits "
                "are drawn from the step count): pass one fp32 step count per parameter")


# What an Adam moment may be kept in (``state_dtype``).
MOMENT_DTYPES = (torch.float32, torch.bfloat16)
# The optional columns every optimizer sweep has for bf16 parameters without masters:
# Kahan compensations (bf16, shaped as the parameter) and stochastic rounding keys (one
# int64 per parameter, :func:`param_key`). A row has at most one of them.
ROUNDING_COLUMNS = (Column("comps", "state", optional=True, dtypes=(torch.bfloat16,)),
                    Column("keys", "scalar", optional=True, dtypes=(torch.int64,)))

M32 = 0xFFFFFFFF
_C1 = 0x21F0AAAD
_C2 = 0x735A2D97
# A bf16 pattern in the top half of an fp32: the low half cleared.
_HIGH_HALF = -65536  # 0xFFFF0000 as an int32


def mix32(x):
    """The hash of the module docstring: a Python int, or an int64 tensor of values in
    [0, 2**32)."""
    if isinstance(x, int):
        x &= M32
    x = x ^ (x >> 16)
    x = (x * _C1) & M32
    x = x ^ (x >> 15)
    x = (x * _C2) & M32
    return x ^ (x >> 15)


def param_key(seed, index):
    """The 32-bit key of the parameter at position ``index`` (over every parameter group,
    in order) of an optimizer seeded with ``seed``: a Python int."""
    k = mix32(seed & M32)
    k = mix32(k ^ ((seed >> 32) & M32))
    return mix32(k ^ (index & M32))


def tensor_key(keys, counts):
    """Per tensor, the key of this step: ``keys`` (int64 [n], from :func:`param_key`) mixed
    with ``counts``, the step counts after this step (fp32 [n], whole numbers)."""
    return mix32(keys ^ mix32(counts.to(torch.int64) & M32))


def element_bits(tkeys, offsets):
    """16 random bits per element (int64, [0, 65536)): ``tkeys`` (the element's tensor
    key) mixed with ``offsets`` (its offset in the parameter's storage)."""
    return mix32(tkeys ^ (offsets & M32)) >> 16


def storage_offsets(p):
    """Each element's offset from ``p``'s first element in storage (int64, shaped as ``p``;
    ``p`` dense): the offset a sweep's program gives it."""
    return torch.arange(p.numel(), dtype=torch.int64, device=p.device).as_strided(
        p.shape, p.stride())


def stochastic_round_(x, bits):
    """Round fp32 ``x`` in place to bf16-representable values with the random ``bits``
    (int64 or int32, [0, 65536), shaped as ``x``); non-finite values stay as they are.
    Returns ``x``, whose values are then exact in bf16."""
    i = x.view(torch.int32)
    rounded = (i + bits.to(torch.int32)).bitwise_and_(_HIGH_HALF)
    # An infinity rounds to itself (its low half is 0 and no carry leaves it); a NaN's
    # payload could carry into the sign or round to an infinity: kept as it is.
    i.copy_(torch.where(torch.isnan(x), i, rounded))
    return x


def kahan_remainder_(r):
    """The compensation from fp32 remainders ``r`` (``x - bf16_rn(x)``), in place:
    truncated toward zero to bf16-representable values, 0 where not finite."""
    torch.nan_to_num_(r, nan=0.0, posinf=0.0, neginf=0.0)
    r.view(torch.int32).bitwise_and_(_HIGH_HALF)
    return r


def store_rounded_ref(p, x, comp=None, key=None, count=None):
    """Store fp32 ``x`` into the bf16 parameter ``p``: stochastically with ``key`` (a
    Python int, :func:`param_key`) and ``count`` (the step count after this step, a 0-d
    tensor), with compensation ``comp`` (Kahan), else rounded to nearest. The oracle the
    kernels and the CPU paths are held to."""
    if key is not None:
        tkey = tensor_key(torch.tensor([key], dtype=torch.int64, device=x.device),
                          count.reshape(1))
        bits = element_bits(tkey.reshape(()), storage_offsets(p))
        p.copy_(stochastic_round_(x.clone(), bits))
    elif comp is not None:
        p.copy_(x)
        comp.copy_(kahan_remainder_(x - p.float()))
    else:
        p.copy_(x)


def row_rounding_ref(comps, keys, i):
    """``(comp, key)`` of row ``i`` for the oracles: its Kahan compensation (or None) and
    its stochastic rounding key as a Python int (or None)."""
    comp = None if comps is None else comps[i]
    key = None if keys is None or keys[i] is None else int(keys[i])
    return comp, key


def load_compensated_ref(p, comp=None):
    """A parameter as fp32, plus its compensation when it has one."""
    return p.float() if comp is None else p.float() + comp.float()


# --- the device side -------------------------------------------------------------------
@triton.jit
def _mix32(x):
    x = x ^ (x >> 16)
    x = x * 0x21F0AAAD
    x = x ^ (x >> 15)
    x = x * 0x735A2D97
    return x ^ (x >> 15)


@triton.jit
def step_key(row, COL: tl.constexpr, step, HAS_KEYS: tl.constexpr):
    """The tensor's key for this step (uint32): its parameter key, read from the int64
    scalar table column COL, mixed with ``step + 1`` (``step``: the fp32 count read
    before the step). 0 without HAS_KEYS."""
    if HAS_KEYS:
        key_ptr = tl.load(row + COL).to(tl.pointer_type(tl.int64))
        key = tl.load(key_ptr).to(tl.uint32)
        count = (step + 1.0).to(tl.uint32)
        return _mix32(key ^ _mix32(count))
    else:
        return 0


@triton.jit
def load_param(row, COL: tl.constexpr, p_ptrs, offs, mask, HAS_COMPS: tl.constexpr,
               VEC: tl.constexpr, EMULATE_BF16_ROUNDING: tl.constexpr):
    """``(k_ptrs, p)``: the pointers to the Kahan compensations (table column COL) with
    HAS_COMPS (else ``p_ptrs``, never used), and the parameter as fp32, plus its
    compensation with HAS_COMPS."""
    p = load_f32(p_ptrs, mask, EMULATE_BF16_ROUNDING)
    k_ptrs = p_ptrs
    if HAS_COMPS:
        base = tl.load(row + COL).to(tl.pointer_type(tl.bfloat16))
        k_ptrs = base + offs
        if VEC > 1:
            k_ptrs = tl.max_contiguous(tl.multiple_of(k_ptrs, 16), VEC)
        p = p + load_f32(k_ptrs, mask, EMULATE_BF16_ROUNDING)
    return k_ptrs, p


@triton.jit
def store_updated(p_ptrs, c_ptrs, k_ptrs, p, mask, offs, tkey, HAS_COPIES: tl.constexpr,
                  HAS_COMPS: tl.constexpr, HAS_KEYS: tl.constexpr,
                  EMULATE_BF16_ROUNDING: tl.constexpr):
    """Write the updated fp32 parameter: rounded stochastically or with its compensation
    (:func:`store_param_rounded`), else rounded to nearest, with its half copy when it
    has one (only fp32 masters have copies: never both)."""
    if HAS_COMPS or HAS_KEYS:
        store_param_rounded(p_ptrs, k_ptrs, p, mask, offs, tkey, HAS_COMPS, HAS_KEYS,
                            EMULATE_BF16_ROUNDING)
    else:
        store_param(p_ptrs, c_ptrs, p, mask, HAS_COPIES, EMULATE_BF16_ROUNDING)


@triton.jit
def _bf16_from_high_half(bits):
    # The bf16 whose pattern is the top half of ``bits`` (uint32): a truncation.
    return (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def store_param_rounded(p_ptrs, k_ptrs, p, mask, offs, tkey, HAS_COMPS: tl.constexpr,
                        HAS_KEYS: tl.constexpr, EMULATE_BF16_ROUNDING: tl.constexpr):
    """Store fp32 ``p`` into bf16 parameters: stochastically rounded with HAS_KEYS (bits
    from ``tkey`` and the element ``offs``, added to the bit pattern; a non-finite value
    rounds to nearest), with its compensation into ``k_ptrs`` with HAS_COMPS (see the
    module docstring): the parameter rounded to nearest, the remainder truncated on its
    bits."""
    if HAS_KEYS:
        rnd = _mix32(tkey ^ offs.to(tl.uint32)) >> 16
        sr = _bf16_from_high_half(p.to(tl.uint32, bitcast=True) + rnd)
        hi = tl.where(tl.abs(p) < float("inf"), sr, to_bf16(p, EMULATE_BF16_ROUNDING))
        tl.store(p_ptrs, hi, mask=mask)
    else:
        hi = to_bf16(p, EMULATE_BF16_ROUNDING)
        tl.store(p_ptrs, hi, mask=mask)
        r = p - from_bf16(hi, EMULATE_BF16_ROUNDING)
        r = tl.where(tl.abs(r) < float("inf"), r, 0.0)
        tl.store(k_ptrs, _bf16_from_high_half(r.to(tl.uint32, bitcast=True)), mask=mask)


# --- the production CPU path -------------------------------------------------------------
class _CpuRounding:
    """What the CPU path keeps per dtype group of rounded bf16 parameters: an fp32 working
    copy in one flat buffer (views laid out as the parameters), and for stochastic
    rounding each element's offset in its parameter (int32: the hash's low 32 bits) and
    its row, the rows' keys, and two int32 scratch buffers for the hash."""
    __slots__ = ("flat", "views", "offsets", "owners", "keys", "bits", "tmp")

    def __init__(self, params, keys):
        numels = [p.numel() for p in params]
        total = sum(numels)
        self.flat = torch.empty(total, dtype=torch.float32, device=params[0].device)
        self.views = flat_views(self.flat, params)
        self.offsets = self.owners = self.keys = self.bits = self.tmp = None
        if keys is not None:
            self.keys = torch.stack([k.reshape(()) for k in keys])
            self.offsets = torch.cat([torch.arange(n, dtype=torch.int64) for n in numels]
                                     ).to(torch.int32)
            self.owners = torch.repeat_interleave(
                torch.arange(len(numels), dtype=torch.int64), torch.tensor(numels))
            self.bits = torch.empty(total, dtype=torch.int32)
            self.tmp = torch.empty(total, dtype=torch.int32)

    def element_bits(self, counts):
        """:func:`element_bits` for every element of the group, bit for bit, in int32
        (about 8x faster than the oracle's int64 on a CPU): a multiplication wraps to the
        same low 32 bits, and a logical right shift is an arithmetic one masked."""
        tkeys = tensor_key(self.keys, counts).to(torch.int32)  # the same 32 bits
        h, tmp = self.bits, self.tmp
        torch.index_select(tkeys, 0, self.owners, out=h)
        h.bitwise_xor_(self.offsets)
        for shift, mul in ((16, _C1), (15, _C2), (15, None)):
            torch.bitwise_right_shift(h, shift, out=tmp)
            h.bitwise_xor_(tmp.bitwise_and_((1 << (32 - shift)) - 1))
            if mul is not None:
                h.mul_(mul)
        return h.bitwise_right_shift_(16).bitwise_and_(0xFFFF)


def _cpu_state(prepared, group, params=None):
    """The group's :class:`_CpuRounding`, kept in the sweep's scratch while the
    parameters' layouts and the keys stay the same; without ``params``, the one
    :func:`cpu_load` checked earlier in this step."""
    if params is None:
        return prepared.scratch.kept((group.index, "rounding"))
    keys = group.lists.get("keys")
    sig = (tuple(map(_size, params)), tuple(map(_stride, params)),
           None if keys is None else tuple(map(id, keys)))
    return prepared.scratch.kept((group.index, "rounding"), sig,
                                 lambda: _CpuRounding(params, keys))


def rounds(group):
    """Whether a CPU group's parameters are stored stochastically or with compensation."""
    lists = group.lists
    return lists.get("keys") is not None or lists.get("comps") is not None


def cpu_load(prepared, group, params):
    """The fp32 working list of a rounded group (:func:`rounds`): the parameters plus
    their compensations, in views of one flat buffer kept across steps."""
    st = _cpu_state(prepared, group, params)
    torch._foreach_copy_(st.views, params)
    comps = group.lists.get("comps")
    if comps is not None:
        torch._foreach_add_(st.views, comps)
    return st.views


def cpu_store(prepared, group, params, work, counts):
    """Store the updated working list ``work`` (from :func:`cpu_load`) into the bf16
    parameters as the kernels do. ``counts``: the rows' step counts after this step
    (fp32 [n]) for stochastic rounding."""
    st = _cpu_state(prepared, group)
    comps = group.lists.get("comps")
    if group.lists.get("keys") is not None:
        stochastic_round_(st.flat, st.element_bits(counts))
        torch._foreach_copy_(params, work)
    elif comps is not None:
        torch._foreach_copy_(params, work)
        torch._foreach_sub_(work, params)
        kahan_remainder_(st.flat)
        torch._foreach_copy_(comps, work)


def step_counts(group, advanced):
    """The rows' step counts after this step (fp32 [n]): the counts as they are when the
    CPU path has advanced them already (a skipped step does not use them), else + 1."""
    counts = torch.cat([c.reshape(-1) for c in group.counted("steps")])
    return counts if advanced else counts + 1.0
