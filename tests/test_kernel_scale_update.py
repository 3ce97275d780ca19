"""scale_update: the single-program Triton kernel against scale_update_ref (bitwise),
against torch.amp.GradScaler's own update op (golden trajectories), and against the
hysteresis, floor and static rules written out by hand.

The state is one fp32 vector with the slots exported by tritamp.kernels. Without a GPU
the kernel runs in Triton's interpreter (tests/conftest.py); each step is one launch.
"""
import importlib
import math

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from tritamp.kernels import (FLOOR_STREAK, FOUND_INF, FOUND_INF_NEXT, HYSTERESIS, PREV_FOUND,
                             SCALE, SKIPPED,
                             STATE_SIZE, UNSKIPPED, USED_SCALE, check_unscale, scale_update,
                             scale_update_ref)

# The package re-exports the function under the module's name: fetch the module itself.
su_mod = importlib.import_module("tritamp.kernels.scale_update")

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
HYPOTHESIS = dict(deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                         HealthCheck.too_slow])
SLOT_NAMES = {SCALE: "SCALE", UNSKIPPED: "UNSKIPPED", HYSTERESIS: "HYSTERESIS",
              FOUND_INF: "FOUND_INF", USED_SCALE: "USED_SCALE", SKIPPED: "SKIPPED",
              FLOOR_STREAK: "FLOOR_STREAK", FOUND_INF_NEXT: "FOUND_INF_NEXT",
              PREV_FOUND: "PREV_FOUND"}
# Factors exact in fp32 and factors that are not (torch multiplies its fp32 scale by the
# double factor and rounds once).
FACTORS = ((2.0, 0.5), (4.0, 0.25), (1.5, 0.75), (1.25, 0.625), (1.5, 0.7), (3.0, 1 / 3),
           (1.1, 0.9))
# Torch's update takes no floor; this one is far below any scale the golden runs reach
# (at worst 1.0 * 0.25**60 = 2**-120), so it never binds.
NO_FLOOR = 2.0 ** -126


def new_state(scale, hysteresis=1, unskipped=0.0):
    state = torch.zeros(STATE_SIZE, dtype=torch.float32, device=DEVICE)
    state[SCALE] = scale
    state[HYSTERESIS] = hysteresis
    state[UNSKIPPED] = unskipped
    return state


def assert_state_bitwise(actual, expected, what):
    a, e = actual.cpu().view(torch.int32), expected.cpu().view(torch.int32)
    if not torch.equal(a, e):
        slots = [SLOT_NAMES[i] for i in range(STATE_SIZE) if a[i] != e[i]]
        raise AssertionError(f"{what}: slots {slots} differ: got {actual.tolist()}, "
                             f"expected {expected.tolist()}")


def f32(x):
    """x rounded to fp32, as a Python float."""
    return torch.tensor(x, dtype=torch.float32).item()


def test_state_layout():
    assert STATE_SIZE == 9
    assert sorted((SCALE, UNSKIPPED, HYSTERESIS, FOUND_INF, USED_SCALE, SKIPPED,
                   FLOOR_STREAK, FOUND_INF_NEXT, PREV_FOUND)) == list(range(STATE_SIZE))


@pytest.mark.parametrize("fn", [scale_update, scale_update_ref])
@pytest.mark.parametrize("slot", [FOUND_INF, FOUND_INF_NEXT])
def test_update_reads_its_slot_and_clears_the_other(fn, slot):
    # The scaler alternates overflow slots; each update prepares the next one, so
    # clearing the flag needs no launch of its own.
    other = FOUND_INF + FOUND_INF_NEXT - slot
    state = new_state(1024.0)
    state[slot] = 1.0
    state[other] = 1.0
    fn(state, found_slot=slot)
    assert state[SCALE].item() == 512.0
    assert state[SKIPPED].item() == 1.0
    assert state[slot].item() == 1.0      # what the step reads stays
    assert state[other].item() == 0.0     # what the next backward writes is clear
    assert state[PREV_FOUND].item() == 1.0  # ... and what it held (the step before's) kept
    state = new_state(1024.0)
    state[other] = 1.0                    # a flag in the other slot is not this step's
    fn(state, found_slot=slot)
    assert state[SCALE].item() == 1024.0 and state[SKIPPED].item() == 0.0
    assert state[PREV_FOUND].item() == 1.0 and state[other].item() == 0.0
    state[other] = 0.0
    state[slot] = 0.0
    fn(state, found_slot=slot)            # a clean step before: PREV_FOUND follows it
    assert state[PREV_FOUND].item() == 0.0


# ------------------------------------------------------------------- kernel vs ref

@settings(max_examples=30, **HYPOTHESIS)
@given(
    found_seq=st.lists(st.sampled_from((0.0, 1.0, 2.0)), min_size=1, max_size=60),
    growth_interval=st.integers(1, 5),
    hysteresis=st.integers(1, 3),
    factors=st.sampled_from(FACTORS),
    init_scale=st.sampled_from((2.0 ** 16, 1.0, 3.0, 1000.0, 2.0 ** 126, 2.0 ** -120)),
    min_scale=st.sampled_from((0.0, 2.0 ** -100, 1.0, 256.0)),
    max_scale=st.sampled_from((math.inf, 2.0 ** 24, 2.0 ** 17, 1e4)),
    dynamic=st.booleans(),
    start=st.tuples(st.integers(0, 4), st.integers(0, 3)),
)
@example(found_seq=[0.0, 1.0, 0.0, 0.0, 2.0, 1.0, 0.0, 0.0, 0.0] * 3, growth_interval=1,
         hysteresis=2, factors=(1.1, 0.9), init_scale=3.0, min_scale=1.0, max_scale=1e4,
         dynamic=True, start=(0, 2))
def test_kernel_matches_ref_bitwise(found_seq, growth_interval, hysteresis, factors, init_scale,
                                    min_scale, max_scale, dynamic, start):
    """Step by step, every slot equal bit for bit; FOUND_INF values 2.0 stand for the sum
    of several devices' flags."""
    growth, backoff = factors
    unskipped0 = min(start[0], growth_interval - 1)
    ours = new_state(init_scale, hysteresis=min(start[1], hysteresis), unskipped=unskipped0)
    ref = ours.clone()
    args = (growth, backoff, growth_interval, hysteresis, min_scale, max_scale, dynamic)
    for step, flag in enumerate(found_seq):
        ours[FOUND_INF] = flag
        ref[FOUND_INF] = flag
        scale_update(ours, *args)
        scale_update_ref(ref, *args)
        assert_state_bitwise(ours, ref, f"step {step} (found_inf={flag})")


# -------------------------------------------------- golden: torch.amp.GradScaler's op

def _torch_scaler(init_scale, growth, backoff, growth_interval):
    scaler = torch.amp.GradScaler(DEVICE.type, init_scale=init_scale, growth_factor=growth,
                                  backoff_factor=backoff, growth_interval=growth_interval)
    scaler._lazy_init_scale_growth_tracker(DEVICE)
    return scaler


def _run_against_torch(found_seq, init_scale, growth, backoff, growth_interval):
    scaler = _torch_scaler(init_scale, growth, backoff, growth_interval)
    t_scale, t_tracker = scaler._scale, scaler._growth_tracker
    assert t_scale.dtype == torch.float32 and t_tracker.dtype == torch.int32
    state = new_state(init_scale, hysteresis=1)
    for step, overflow in enumerate(found_seq):
        flag = torch.full((1,), float(overflow), device=DEVICE)
        torch._amp_update_scale_(t_scale, t_tracker, flag, scaler._growth_factor,
                                 scaler._backoff_factor, scaler._growth_interval)
        state[FOUND_INF] = float(overflow)
        scale_update(state, growth, backoff, growth_interval, hysteresis=1,
                     min_scale=NO_FLOOR, max_scale=math.inf, dynamic=True)
        what = f"step {step} ({'overflow' if overflow else 'clean'})"
        assert state[SCALE].view(torch.int32).item() == t_scale.view(torch.int32).item(), \
            f"{what}: scale {state[SCALE].item()!r}, torch {t_scale.item()!r}"
        assert state[UNSKIPPED].item() == t_tracker.item(), \
            f"{what}: tracker {state[UNSKIPPED].item()}, torch {t_tracker.item()}"
    return state, t_scale


@settings(max_examples=30, **HYPOTHESIS)
@given(found_seq=st.lists(st.booleans(), min_size=1, max_size=60),
       growth_interval=st.integers(1, 5), factors=st.sampled_from(FACTORS),
       init_scale=st.sampled_from((2.0 ** 16, 1.0, 3.0, 1000.0, 12345.678, 2.0 ** 120)))
@example(found_seq=[False, True, False, False, True, True, False, False, False] * 4,
         growth_interval=2, factors=(1.1, 0.9), init_scale=1000.0)
@example(found_seq=[False] * 8 + [True] * 8, growth_interval=1, factors=(3.0, 1 / 3),
         init_scale=12345.678)
def test_golden_trajectory_against_torch_update_scale(found_seq, growth_interval, factors,
                                                      init_scale):
    growth, backoff = factors
    _run_against_torch(found_seq, f32(init_scale), growth, backoff, growth_interval)


@pytest.mark.parametrize("init_scale, growth", [
    (2.0 ** 126, 2.0), (2.0 ** 127, 2.0), (2.0 ** 127 * 1.5, 1.5), (torch.finfo(torch.float32).max, 4.0)])
def test_growth_that_would_overflow_fp32_keeps_the_scale(init_scale, growth):
    """Torch keeps the old scale (and resets its tracker) when growth would give inf."""
    state, t_scale = _run_against_torch([False] * 5, init_scale, growth, 0.5, 1)
    top = state[SCALE].item()
    assert math.isfinite(top) and top >= init_scale and math.isinf(f32(top * growth))
    assert state[UNSKIPPED].item() == 0.0
    state, _ = _run_against_torch([False] * 5 + [True], init_scale, growth, 0.5, 1)
    assert state[SCALE].item() == top * 0.5  # and backs off from there


def test_golden_trajectory_through_gradscaler_public_api():
    """The same scripted gradients through GradScaler.scale/step/update and through
    check_unscale + scale_update sharing one state vector."""
    script = [1.0, 1.0, math.inf, 1.0, 1.0, 1.0, 1.0, math.nan, -math.inf, 1.0, 1.0, 1.0,
              1.0, 1.0, 1.0, 1.0, math.inf, 1.0]
    scaler = torch.amp.GradScaler(DEVICE.type, init_scale=2.0 ** 16, growth_factor=2.0,
                                  backoff_factor=0.5, growth_interval=3)
    w = torch.zeros(4, device=DEVICE, requires_grad=True)
    opt = torch.optim.SGD([w], lr=0.0)
    state = new_state(2.0 ** 16, hysteresis=1)
    for step, value in enumerate(script):
        x = torch.ones(4, device=DEVICE)
        x[1] = value
        opt.zero_grad()
        scaler.scale((w * x).sum()).backward()
        grads = [x * state[SCALE]]  # the gradient of (w * x).sum() * our scale
        state[FOUND_INF] = 0.0
        check_unscale(grads, state[SCALE], state[FOUND_INF:FOUND_INF + 1])
        scaler.step(opt)
        scaler.update()
        scale_update(state, 2.0, 0.5, 3, hysteresis=1, min_scale=NO_FLOOR)
        assert state[FOUND_INF].item() == float(not math.isfinite(value)), f"step {step}"
        assert state[SCALE].item() == scaler.get_scale(), f"step {step}"
        assert state[UNSKIPPED].item() == scaler._get_growth_tracker(), f"step {step}"
    assert state[SCALE].item() != 2.0 ** 16  # the script moved the scale


@pytest.mark.parametrize("init_scale, factors, found_seq", [
    (100.0, (2.0, 0.3), [True]),       # fp32(0.3) * 100 would round to 30.000002
    (3.0, (1.1, 0.5), [False]),        # fp32(1.1) * 3 would round to 3.3000002
    (2.0 ** 16, (1.5, 0.7), [True, False, True, True, False, False, True] * 3),
])
def test_golden_trajectory_with_factors_inexact_in_fp32(init_scale, factors, found_seq):
    _run_against_torch(found_seq, init_scale, *factors, growth_interval=1)


# -------------------------------------------------------- rules written out by hand

# (found, SCALE, UNSKIPPED, HYSTERESIS, SKIPPED, USED_SCALE) after each step.
# hysteresis=2, growth_interval=3, factors 2 / 0.5, start at 1024 with the tracker full.
HYSTERESIS_2 = [
    (1, 1024, 0, 1, 1, 1024),  # 1st overflow since the start: tolerated
    (1, 512, 0, 0, 2, 1024),   # 2nd: back off
    (1, 256, 0, 0, 3, 512),    # every further overflow backs off
    (0, 256, 1, 0, 3, 256),
    (0, 256, 2, 0, 3, 256),
    (1, 128, 0, 0, 4, 256),    # clean steps did not restore the tracker
    (0, 128, 1, 0, 4, 128),
    (0, 128, 2, 0, 4, 128),
    (0, 256, 0, 2, 4, 128),    # growth restores it
    (1, 256, 0, 1, 5, 256),    # 1st overflow since growth: tolerated
    (0, 256, 1, 1, 5, 256),
    (1, 128, 0, 0, 6, 256),    # 2nd since growth, a clean step in between
    (0, 128, 1, 0, 6, 128),
    (0, 128, 2, 0, 6, 128),
    (0, 256, 0, 2, 6, 128),
    (1, 256, 0, 1, 7, 256),
]
# hysteresis=3, growth_interval=2, start at 64.
HYSTERESIS_3 = [
    (1, 64, 0, 2, 1, 64),
    (1, 64, 0, 1, 2, 64),
    (1, 32, 0, 0, 3, 64),      # 3rd overflow
    (1, 16, 0, 0, 4, 32),
    (0, 16, 1, 0, 4, 16),
    (0, 32, 0, 3, 4, 16),      # growth restores 3
    (1, 32, 0, 2, 5, 32),
    (1, 32, 0, 1, 6, 32),
    (0, 32, 1, 1, 6, 32),
    (1, 16, 0, 0, 7, 32),      # 3rd since growth
]
# hysteresis=1 (torch's rule): every overflow backs off; growth_interval=2, start at 8.
HYSTERESIS_1 = [
    (1, 4, 0, 0, 1, 8),
    (0, 4, 1, 0, 1, 4),
    (1, 2, 0, 0, 2, 4),        # an overflow resets the growth count
    (0, 2, 1, 0, 2, 2),
    (0, 4, 0, 1, 2, 2),
    (1, 2, 0, 0, 3, 4),
]


@pytest.mark.parametrize("hysteresis, growth_interval, init, table", [
    (2, 3, 1024.0, HYSTERESIS_2), (3, 2, 64.0, HYSTERESIS_3), (1, 2, 8.0, HYSTERESIS_1)],
    ids=["h2", "h3", "h1"])
def test_hysteresis_by_hand(hysteresis, growth_interval, init, table):
    state = new_state(init, hysteresis=hysteresis)
    for step, (flag, scale, unskipped, hyst, skipped, used) in enumerate(table):
        state[FOUND_INF] = flag
        scale_update(state, 2.0, 0.5, growth_interval, hysteresis, 0.0, math.inf, True)
        got = [state[i].item() for i in (SCALE, UNSKIPPED, HYSTERESIS, SKIPPED, USED_SCALE,
                                         FLOOR_STREAK, FOUND_INF)]
        assert got == [scale, unskipped, hyst, skipped, used, 0.0, flag], f"step {step}"


# (found, SCALE, FLOOR_STREAK) with min_scale=1, growth_interval=3, factors 2 / 0.5.
FLOOR = [
    (1, 2, 0),
    (1, 1, 1),   # reached the floor on an overflow
    (1, 1, 2),   # clamped, still overflowing
    (1, 1, 3),
    (0, 1, 0),   # a clean step resets the streak
    (1, 1, 1),
    (0, 1, 0),
    (0, 1, 0),
    (0, 2, 0),   # growth lifts it off the floor
    (1, 1, 1),
]


def test_floor_clamp_and_streak_by_hand():
    state = new_state(4.0)
    for step, (flag, scale, streak) in enumerate(FLOOR):
        state[FOUND_INF] = flag
        scale_update(state, 2.0, 0.5, 3, 1, 1.0, math.inf, True)
        assert (state[SCALE].item(), state[FLOOR_STREAK].item()) == (scale, streak), f"step {step}"


def test_floor_streak_counts_tolerated_overflows_at_the_floor():
    """With hysteresis, overflows that do not back off still count while at the floor."""
    state = new_state(1.0, hysteresis=3)
    for step, streak in enumerate((1, 2, 3, 4)):
        state[FOUND_INF] = 1.0
        scale_update(state, 2.0, 0.5, 10, 3, 1.0, math.inf, True)
        assert (state[SCALE].item(), state[FLOOR_STREAK].item()) == (1.0, streak), f"step {step}"


def test_ceiling_clamp_by_hand():
    state = new_state(2.0 ** 23)
    expected = [2.0 ** 24, 2.0 ** 24, 2.0 ** 24]  # growth stops at max_scale
    for step, scale in enumerate(expected):
        state[FOUND_INF] = 0.0
        scale_update(state, 2.0, 0.5, 1, 1, 1.0, 2.0 ** 24, True)
        assert state[SCALE].item() == scale and state[UNSKIPPED].item() == 0.0, f"step {step}"
    state = new_state(1000.0)
    scale_update(state, 4.0, 0.5, 1, 1, 1.0, 3000.0, True)
    assert state[SCALE].item() == 3000.0  # a ceiling that is not a power of two


def _model(found_seq, hysteresis, growth_interval, init, min_scale, max_scale):
    """The documented rule in another form: back off iff the overflows counted since the
    last growth reach ``hysteresis``. Factors 2 / 0.5 and power-of-two clamps keep every
    value exact, so Python floats need no fp32 rounding."""
    scale, clean, since_growth, skipped, streak = init, 0, 0, 0, 0
    rows = []
    for overflow in found_seq:
        used = scale
        if overflow:
            since_growth += 1
            skipped += 1
            clean = 0
            if since_growth >= hysteresis:
                scale = max(scale * 0.5, min_scale)
            streak = streak + 1 if scale <= min_scale else 0
        else:
            clean += 1
            streak = 0
            if clean == growth_interval:
                scale = min(scale * 2.0, max_scale)
                clean = 0
                since_growth = 0
        rows.append([scale, clean, max(hysteresis - since_growth, 0), skipped, used, streak])
    return rows


@settings(max_examples=25, **HYPOTHESIS)
@given(found_seq=st.lists(st.booleans(), min_size=1, max_size=60),
       hysteresis=st.integers(1, 3), growth_interval=st.integers(1, 5),
       init=st.sampled_from((1.0, 2.0 ** 10, 2.0 ** 16)),
       min_scale=st.sampled_from((2.0 ** -20, 1.0, 2.0 ** 8)),
       max_scale=st.sampled_from((2.0 ** 12, 2.0 ** 24)))
def test_hysteresis_rule_against_a_model(found_seq, hysteresis, growth_interval, init,
                                         min_scale, max_scale):
    state = new_state(min(init, max_scale), hysteresis=hysteresis)
    expected = _model(found_seq, hysteresis, growth_interval, min(init, max_scale), min_scale,
                      max_scale)
    for step, (overflow, row) in enumerate(zip(found_seq, expected)):
        state[FOUND_INF] = float(overflow)
        scale_update(state, 2.0, 0.5, growth_interval, hysteresis, min_scale, max_scale, True)
        got = [state[i].item() for i in (SCALE, UNSKIPPED, HYSTERESIS, SKIPPED, USED_SCALE,
                                         FLOOR_STREAK)]
        assert got == row, f"step {step}: got {got}, expected {row}"


# -------------------------------------------------------------------------- static

def test_static_mode_never_changes_the_scale():
    seq = [1, 1, 0, 0, 0, 1, 0, 0, 0, 0, 1, 1, 1]
    state = new_state(128.0, hysteresis=2)
    for step, flag in enumerate(seq):
        state[FOUND_INF] = flag
        scale_update(state, 2.0, 0.5, 2, 2, 1.0, math.inf, False)
        assert state[SCALE].item() == 128.0 and state[USED_SCALE].item() == 128.0, f"step {step}"
        assert state[SKIPPED].item() == sum(seq[:step + 1]), f"step {step}"
        assert state[HYSTERESIS].item() == 2.0 and state[FLOOR_STREAK].item() == 0.0


# ---------------------------------------------------------------- state validation

@pytest.mark.parametrize("bad", [
    lambda: torch.zeros(STATE_SIZE, dtype=torch.float64),
    lambda: torch.zeros(STATE_SIZE, dtype=torch.float16),
    lambda: torch.zeros(STATE_SIZE, dtype=torch.int32),
    lambda: torch.zeros(STATE_SIZE - 1),
    lambda: torch.zeros(STATE_SIZE + 1),
    lambda: torch.zeros(1, STATE_SIZE),
    lambda: torch.zeros(()),
    lambda: torch.zeros(2 * STATE_SIZE)[::2],
], ids=["float64", "float16", "int32", "short", "long", "2d", "0d", "strided"])
@pytest.mark.parametrize("fn", [scale_update, scale_update_ref], ids=["kernel", "ref"])
def test_bad_state_raises(bad, fn):
    state = bad().to(DEVICE)
    before = state.clone()
    with pytest.raises(ValueError, match=rf"state must be a contiguous float32 tensor "
                                         rf"of shape \({STATE_SIZE},\)"):
        fn(state)
    assert torch.equal(state, before)


# ---------------------------------------------------------------------- dispatcher

def test_cpu_without_interpreter_runs_the_production_path(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    calls = []
    real = su_mod.scale_update_cpu

    def spy(*args, **kwargs):
        calls.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(su_mod, "scale_update_cpu", spy)
    monkeypatch.setattr(su_mod, "scale_update_ref",
                        lambda *a, **k: pytest.fail("the reference ran on the CPU path"))
    monkeypatch.setattr(su_mod, "_scale_update_kernel", None)  # launching would fail
    state = torch.zeros(STATE_SIZE)
    state[SCALE], state[FOUND_INF] = 8.0, 1.0
    scale_update(state, 2.0, 0.5, 5, 1)
    assert len(calls) == 1
    assert (state[SCALE].item(), state[USED_SCALE].item(), state[SKIPPED].item()) == (4.0, 8.0, 1.0)


def test_kernel_path_does_not_call_the_reference(monkeypatch):
    monkeypatch.setattr(su_mod, "scale_update_ref",
                        lambda *a, **k: pytest.fail("the reference ran instead of the kernel"))
    state = new_state(8.0)
    state[FOUND_INF] = 1.0
    scale_update(state, 2.0, 0.5, 5, 1)
    assert (state[SCALE].item(), state[USED_SCALE].item(), state[SKIPPED].item()) == (4.0, 8.0, 1.0)
