"""Device-side loss-scale update: growth tracker, hysteresis, clamps, skip counters.

The scaler's whole state lives in one fp32 device vector so that it is updated by one
single-program launch and read back (for logging) by one non-blocking copy:

    SCALE        the scale the next backward multiplies the loss by
    UNSKIPPED    clean steps since the last growth or overflow (Apex's ``_unskipped``,
                 torch's growth tracker); a static scaler counts all clean steps
    HYSTERESIS   overflows still tolerated before backing off (Megatron's tracker)
    FOUND_INF    1.0 when the last checked gradients held inf/NaN
    USED_SCALE   the scale the last checked gradients carry (what a fused step divides by)
    SKIPPED      total skipped steps (lets a late reader count every skip)
    FLOOR_STREAK consecutive overflowing steps spent at the minimum scale
    FOUND_INF_NEXT the other overflow slot: the scaler alternates between FOUND_INF and
                 this one, and each update zeroes the slot the next backward will use,
                 so clearing the flag costs no launch of its own
    PREV_FOUND   what that other slot held before the update zeroed it: the flag of the
                 step before (a step's flag stays readable for one more update, with
                 no launch of its own)

Counters are exact in fp32 up to 2**24, which bounds growth_interval and hysteresis.
The factors and clamps live in a small fp64 device vector uploaded once per setting.

Update rule (dynamic), given found = FOUND_INF:
    found:  HYSTERESIS -= 1; if HYSTERESIS <= 0: SCALE = max(SCALE * backoff, min_scale)
            UNSKIPPED = 0; SKIPPED += 1
    clean:  UNSKIPPED += 1; if UNSKIPPED == growth_interval:
                SCALE = min(SCALE * growth, max_scale) if that is finite; UNSKIPPED = 0
                HYSTERESIS = hysteresis
Static scaling keeps SCALE and only counts. With hysteresis=1 and no clamps this is
``torch._amp_update_scale_``'s rule; with min/max clamps and factors 2 / 0.5 it is
Apex's ``LossScaler.update_scale``.
"""
import numbers

import torch
import triton
import triton.language as tl

from ._dispatch import use_triton
from .launch import kept_kernel
from ._multi_tensor import host_number

SCALE, UNSKIPPED, HYSTERESIS, FOUND_INF, USED_SCALE, SKIPPED, FLOOR_STREAK, FOUND_INF_NEXT, \
    PREV_FOUND = range(9)
STATE_SIZE = 9


def other_found_slot(slot):
    """The overflow slot that is not ``slot`` (FOUND_INF <-> FOUND_INF_NEXT)."""
    return FOUND_INF + FOUND_INF_NEXT - slot


@triton.jit
def _scale_update_kernel(
    state_ptr,         # fp32 [STATE_SIZE]: the scaler state described in the module docstring
    config_ptr,        # fp64 [4]: growth factor, backoff factor, min scale, max scale
    growth_interval,   # int: clean steps between growths
    hysteresis,        # int: overflows tolerated before a backoff, restored on growth
    found_slot,        # int: the overflow slot to read (FOUND_INF or FOUND_INF_NEXT)
    DYNAMIC: tl.constexpr,
):
    scale = tl.load(state_ptr + 0)
    unskipped = tl.load(state_ptr + 1)
    hyst = tl.load(state_ptr + 2)
    # Anything but 0.0 in the flag (NaN included) counts as an overflow.
    found = tl.load(state_ptr + found_slot) != 0.0
    clean = tl.load(state_ptr + found_slot) == 0.0
    skipped = tl.load(state_ptr + 5)
    streak = tl.load(state_ptr + 6)
    tl.store(state_ptr + 4, scale)
    if DYNAMIC:
        growth_factor = tl.load(config_ptr + 0)
        backoff_factor = tl.load(config_ptr + 1)
        min_scale = tl.load(config_ptr + 2)
        max_scale = tl.load(config_ptr + 3)
        # Products in fp64, rounded once to fp32: torch multiplies its fp32 scale by a
        # double factor the same way.
        scale64 = scale.to(tl.float64)
        backed_off = tl.maximum(scale64 * backoff_factor, min_scale).to(tl.float32)
        grown = (scale64 * growth_factor).to(tl.float32)
        # torch keeps the old scale when growth would overflow fp32
        grown = tl.where(tl.abs(grown) == float("inf"), scale,
                         tl.minimum(grown.to(tl.float64), max_scale).to(tl.float32))
        hyst_after = tl.where(found, hyst - 1.0, hyst)
        clean_count = unskipped + 1.0
        grow = clean & (clean_count >= growth_interval)
        new_scale = tl.where(found & (hyst_after <= 0.0), backed_off, tl.where(grow, grown, scale))
        new_unskipped = tl.where(found | grow, 0.0, clean_count)
        new_hyst = tl.where(grow, hysteresis * 1.0, tl.maximum(hyst_after, 0.0))
        at_floor = new_scale.to(tl.float64) <= min_scale
        new_streak = tl.where(found & at_floor, streak + 1.0, 0.0)
        tl.store(state_ptr + 0, new_scale)
        tl.store(state_ptr + 1, new_unskipped)
        tl.store(state_ptr + 2, new_hyst)
        tl.store(state_ptr + 6, new_streak)
    else:
        tl.store(state_ptr + 1, tl.where(found, unskipped, unskipped + 1.0))
    tl.store(state_ptr + 5, tl.where(found, skipped + 1.0, skipped))
    # The other slot is the one the next backward's check writes into: keep what it held
    # (the step before's flag) and clear it now.
    other = state_ptr + (3 + 7 - found_slot)
    tl.store(state_ptr + 8, tl.load(other))
    tl.store(other, 0.0)


_configs = {}


def _config(device, growth_factor, backoff_factor, min_scale, max_scale):
    """The fp64 config vector on ``device``, uploaded once per distinct setting."""
    if (growth_factor.__class__ is float and backoff_factor.__class__ is float
            and min_scale.__class__ is float and max_scale.__class__ is float):
        key = (device, growth_factor, backoff_factor, min_scale, max_scale)
    else:  # ints, numpy numbers, one-element tensors (read here); anything else named
        key = (device,) + tuple(host_number(v, name, "scale_update") for name, v in (
            ("growth_factor", growth_factor), ("backoff_factor", backoff_factor),
            ("min_scale", min_scale), ("max_scale", max_scale)))
    t = _configs.get(key)
    if t is None:
        t = torch.tensor(key[1:], dtype=torch.float64).to(device)
        _configs[key] = t
    return t


def _check_counts(growth_interval, hysteresis):
    """Whole numbers of at least 1: the kernel takes them as ints, the CPU path compared
    the counters with the values given (2.5 grew the scale on one path, not the other)."""
    for name, v in (("growth_interval", growth_interval), ("hysteresis", hysteresis)):
        whole = v.__class__ is int or (isinstance(v, numbers.Integral)
                                       and not isinstance(v, bool))
        if not whole or v < 1:
            raise ValueError(f"scale_update: {name} must be a whole number of at least 1, got "
                             f"{v!r}")


def _check_state(state):
    if state.dtype != torch.float32 or state.shape != (STATE_SIZE,) or not state.is_contiguous():
        raise ValueError(f"scale_update: state must be a contiguous float32 tensor of shape "
                         f"({STATE_SIZE},), got {state.dtype} {tuple(state.shape)}")


@torch.no_grad()
def scale_update(state, growth_factor=2.0, backoff_factor=0.5, growth_interval=2000,
                 hysteresis=1, min_scale=0.0, max_scale=float("inf"), dynamic=True,
                 found_slot=FOUND_INF):
    """Update the scaler ``state`` in place from its overflow slot ``found_slot`` and
    zero the other overflow slot (no host sync)."""
    _check_state(state)
    _check_counts(growth_interval, hysteresis)
    if found_slot not in (FOUND_INF, FOUND_INF_NEXT):
        raise ValueError(f"scale_update: found_slot must be FOUND_INF ({FOUND_INF}) or "
                         f"FOUND_INF_NEXT ({FOUND_INF_NEXT}), got {found_slot!r}")
    if not use_triton(state):
        scale_update_cpu(state, growth_factor, backoff_factor, growth_interval,
                         hysteresis, min_scale, max_scale, dynamic, found_slot)
        return
    config = _config(state.device, growth_factor, backoff_factor, min_scale, max_scale)
    consts, ckey = _CONSTS[bool(dynamic)]
    kept_kernel(_scale_update_kernel).launch(
        (1,), (state, config, int(growth_interval), int(hysteresis), int(found_slot)), consts,
        ckey)


# constexprs and their key per `dynamic`: one kept launch a step, no Triton binding
_CONSTS = {d: (dict(DYNAMIC=d, num_warps=1), (d, 1)) for d in (False, True)}
_cpu_index = {}


def _written_slots(device, found_slot, dynamic):
    """The slots the CPU path writes, as an index tensor made once per device and case."""
    key = (device, found_slot, dynamic)
    t = _cpu_index.get(key)
    if t is None:
        slots = ((SCALE, UNSKIPPED, HYSTERESIS, FLOOR_STREAK) if dynamic else (UNSKIPPED,)) \
            + (USED_SCALE, SKIPPED, other_found_slot(found_slot), PREV_FOUND)
        t = _cpu_index[key] = torch.tensor(slots, dtype=torch.long).to(device)
    return t


@torch.no_grad()
def scale_update_cpu(state, growth_factor=2.0, backoff_factor=0.5, growth_interval=2000,
                     hysteresis=1, min_scale=0.0, max_scale=float("inf"), dynamic=True,
                     found_slot=FOUND_INF):
    """The production CPU path of :func:`scale_update`: the kernel's rule as a handful of
    element-wise ops on 0-d views of the state, written back with one ``index_copy_``;
    nothing read on the host. The arithmetic is the kernel's (products in fp64 rounded
    once to fp32), so the state equals :func:`scale_update_ref`'s bit for bit.

    (``torch._amp_update_scale_`` has neither hysteresis nor clamps.)"""
    slots = state.unbind()
    scale, unskipped, hyst, skipped, streak = (slots[SCALE], slots[UNSKIPPED],
                                               slots[HYSTERESIS], slots[SKIPPED],
                                               slots[FLOOR_STREAK])
    found = slots[found_slot] != 0.0  # NaN counts as an overflow
    prev = slots[other_found_slot(found_slot)]
    zero = scale.new_zeros(())
    new_skipped = torch.where(found, skipped + 1.0, skipped)
    if dynamic:
        growth, backoff, lo, hi = _config(state.device, growth_factor, backoff_factor,
                                          min_scale, max_scale).unbind()
        scale64 = scale.double()
        backed_off = torch.maximum(scale64 * backoff, lo).float()
        grown = (scale64 * growth).float()
        grown = torch.where(torch.isinf(grown), scale, torch.minimum(grown.double(), hi).float())
        hyst_after = torch.where(found, hyst - 1.0, hyst)
        clean_count = unskipped + 1.0
        grow = (~found) & (clean_count >= growth_interval)
        new_scale = torch.where(found & (hyst_after <= 0), backed_off,
                                torch.where(grow, grown, scale))
        new = torch.stack([
            new_scale,
            torch.where(found | grow, zero, clean_count),
            torch.where(grow, float(hysteresis), torch.clamp(hyst_after, min=0.0)),
            torch.where(found & (new_scale.double() <= lo), streak + 1.0, zero),
            scale, new_skipped, zero, prev])
    else:
        new = torch.stack([torch.where(found, unskipped, unskipped + 1.0), scale, new_skipped,
                           zero, prev])
    state.index_copy_(0, _written_slots(state.device, found_slot, bool(dynamic)), new)


@torch.no_grad()
def scale_update_ref(state, growth_factor=2.0, backoff_factor=0.5, growth_interval=2000,
                     hysteresis=1, min_scale=0.0, max_scale=float("inf"), dynamic=True,
                     found_slot=FOUND_INF):
    """Torch reference of :func:`scale_update` (same arithmetic and rounding, device-side)."""
    _check_state(state)
    scale, unskipped, hyst, skipped, streak = (state[SCALE], state[UNSKIPPED],
                                               state[HYSTERESIS], state[SKIPPED],
                                               state[FLOOR_STREAK])
    found = state[found_slot] != 0
    new = state.clone()
    new[PREV_FOUND] = state[other_found_slot(found_slot)]
    new[other_found_slot(found_slot)] = 0.0
    new[USED_SCALE] = scale
    new[SKIPPED] = torch.where(found, skipped + 1.0, skipped)
    if dynamic:
        growth, backoff, lo, hi = _config(state.device, growth_factor, backoff_factor,
                                          min_scale, max_scale).unbind()
        scale64 = scale.double()
        backed_off = torch.maximum(scale64 * backoff, lo).float()
        grown = (scale64 * growth).float()
        grown = torch.where(torch.isinf(grown), scale, torch.minimum(grown.double(), hi).float())
        hyst_after = torch.where(found, hyst - 1.0, hyst)
        clean_count = unskipped + 1.0
        grow = (~found) & (clean_count >= growth_interval)
        new_scale = torch.where(found & (hyst_after <= 0), backed_off,
                                torch.where(grow, grown, scale))
        new[SCALE] = new_scale
        new[UNSKIPPED] = torch.where(found | grow, torch.zeros_like(clean_count), clean_count)
        new[HYSTERESIS] = torch.where(grow, torch.full_like(hyst, float(hysteresis)),
                                      torch.clamp(hyst_after, min=0.0))
        new[FLOOR_STREAK] = torch.where(found & (new_scale.double() <= lo), streak + 1.0,
                                        torch.zeros_like(streak))
    else:
        new[UNSKIPPED] = torch.where(found, unskipped, unskipped + 1.0)
    state.copy_(new)
