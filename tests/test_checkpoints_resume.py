"""Checkpoint resume through tritamp's public API, with tritamp's fused optimizers, at every
opt level: K steps in one run against k steps, a checkpoint of ``model.state_dict()``,
``optimizer.state_dict()`` and ``amp.state_dict()`` written with ``torch.save``, a fresh
model and optimizer initialised at the same level that load all three, and K - k more
steps. Weights, fp32 masters, optimizer state and the loss scaler's state must be the same
bits as the uninterrupted run's.

The dynamic-scale cases force an overflow before the checkpoint, so the checkpoint holds a
reduced scale, a clean-step count that decides the next growth (``growth_interval=3``) or a
hysteresis count that decides the next backoff (``hysteresis=2``).
amp's global state is reset around every test by conftest's autouse fixture.
"""
import io

import pytest
import torch
from torch import nn

from conftest import amp_step, assert_bits_equal
from tritamp import amp
from tritamp.optimizers import FusedAdam, FusedSGD

INF = float("inf")
STEPS, SAVE_AT = 6, 3


def tiny_net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))


def batches():
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(4, 6, generator=g), torch.randn(4, 3, generator=g))
            for _ in range(STEPS)]


OPTIMIZERS = {
    "FusedAdam": lambda ps: FusedAdam(ps, lr=1e-2, weight_decay=0.01),
    "FusedSGD": lambda ps: FusedSGD(ps, lr=0.05, momentum=0.9, nesterov=True),
}


def state(model, opt):
    """(model parameters and buffers, the optimizer's parameters (the fp32 masters where
    it has them), its state tensors and groups, amp's state dict)."""
    sd = opt.state_dict()
    tensors = [t.detach().clone() for t in model.state_dict(keep_vars=True).values()]
    tensors += [p.detach().clone() for p in amp.master_params(opt)]
    tensors += [v.clone() for i in sorted(sd["state"]) for k, v in sorted(sd["state"][i].items())
                if torch.is_tensor(v)]
    others = [(i, k, v) for i in sorted(sd["state"]) for k, v in sorted(sd["state"][i].items())
              if not torch.is_tensor(v)]
    groups = [{k: v for k, v in g.items()} for g in sd["param_groups"]]
    return tensors, others, groups, amp.state_dict()


def resume_case(level, half, opt_name, factors, **amp_kw):
    """Runs the uninterrupted and the resumed training; returns both final states and the
    checkpoint's amp state."""
    data = batches()

    def build():
        model = tiny_net()
        opt = OPTIMIZERS[opt_name](model.parameters())
        return amp.initialize(model, opt, opt_level=level, half_dtype=half, verbosity=0,
                              **amp_kw)

    model, opt = build()
    for i, (x, y) in enumerate(data):
        if i == SAVE_AT:
            buf = io.BytesIO()
            torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(),
                        "amp": amp.state_dict()}, buf)
        amp_step(model, opt, x, y, factor=factors[i])
    want = state(model, opt)

    buf.seek(0)
    checkpoint = torch.load(buf)
    model, opt = build()  # fresh objects, amp initialised again
    model.load_state_dict(checkpoint["model"])
    opt.load_state_dict(checkpoint["optimizer"])
    amp.load_state_dict(checkpoint["amp"])
    for i in range(SAVE_AT, STEPS):
        amp_step(model, opt, *data[i], factor=factors[i])
    return want, state(model, opt), checkpoint["amp"]


def assert_same_run(want, got):
    w_tensors, w_others, w_groups, w_amp = want
    g_tensors, g_others, g_groups, g_amp = got
    assert len(w_tensors) == len(g_tensors)
    for i, (a, b) in enumerate(zip(w_tensors, g_tensors)):
        assert_bits_equal(a, b, f"tensor {i}")
        if a.is_floating_point():
            assert torch.isfinite(a).all(), f"tensor {i}"  # a real run, not NaN == NaN
    assert w_others == g_others
    assert w_groups == g_groups
    assert w_amp == g_amp


LEVELS = [("O0", torch.bfloat16), ("O1", torch.bfloat16), ("O2", torch.bfloat16),
          ("O3", torch.bfloat16), ("O0", torch.float16), ("O1", torch.float16),
          ("O2", torch.float16), ("O3", torch.float16)]


@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
@pytest.mark.parametrize("level,half", LEVELS,
                         ids=[f"{lv}-{'bf16' if h == torch.bfloat16 else 'fp16'}"
                              for lv, h in LEVELS])
def test_resume_is_bitwise_at_every_level(level, half, opt_name):
    # fp16 at O1 / O2 scales dynamically: one step overflows before the checkpoint
    dynamic = half == torch.float16 and level in ("O1", "O2")
    factors = [1.0, INF if dynamic else 1.0] + [1.0] * (STEPS - 2)
    want, got, saved = resume_case(level, half, opt_name, factors)
    if dynamic:
        assert saved["loss_scaler0"]["loss_scale"] == 2.0**15
        assert saved["loss_scaler0"]["unskipped"] == 1
    assert_same_run(want, got)


@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
@pytest.mark.parametrize("level,half", [("O1", torch.bfloat16), ("O2", torch.bfloat16),
                                        ("O2", torch.float16)],
                         ids=["O1-bf16", "O2-bf16", "O2-fp16"])
def test_resume_restores_the_clean_step_count_that_decides_the_next_growth(level, half,
                                                                           opt_name, path):
    # (on the interpreted kernels and on the production CPU path)
    # overflow at step 1, checkpoint after step 2 (one clean step), growth after three
    # clean steps: at step 4 in both runs, only if the count came back with the checkpoint
    factors = [1.0, INF, 1.0, 1.0, 1.0, 1.0]
    want, got, saved = resume_case(level, half, opt_name, factors, loss_scale="dynamic",
                                   growth_interval=3)
    assert saved["loss_scaler0"] == dict(saved["loss_scaler0"], loss_scale=2.0**15,
                                         unskipped=1)
    assert want[3]["loss_scaler0"]["loss_scale"] == 2.0**16  # grown back after the resume
    assert_same_run(want, got)


@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
def test_resume_restores_the_hysteresis_count_that_decides_the_next_backoff(opt_name):
    # hysteresis 2: the overflow at step 1 only uses up one of the two; the one at step 4,
    # after the resume, backs off only if that count came back with the checkpoint (a
    # small initial scale: no other step overflows)
    factors = [1.0, INF, 1.0, 1.0, INF, 1.0]
    want, got, saved = resume_case("O2", torch.float16, opt_name, factors, hysteresis=2,
                                   init_scale=2.0**8)
    assert saved["loss_scaler0"]["loss_scale"] == 2.0**8
    assert saved["loss_scaler0"]["hysteresis"] == 1
    assert want[3]["loss_scaler0"]["loss_scale"] == 2.0**7
    assert_same_run(want, got)
