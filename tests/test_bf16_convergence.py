"""Convergence on real data without fp32 masters: scikit-learn's digits (8x8 images of
handwritten digits, 1797 samples, 10 classes), a small MLP trained 600 steps under
``amp.initialize(opt_level="O2", half_dtype=torch.bfloat16)``.

With fp32 master weights (the baseline), with bf16 weights stochastically rounded, with
bf16 weights and a Kahan compensation, and with bf16 weights rounded to nearest. The
learning rates are chosen so that most updates are smaller than half a bf16 ulp of the
weights: round to nearest then loses them and stalls, the other two keep them (in
expectation, or in the compensation) and end within 2% of the baseline's loss. On the
production CPU path (the kernels are held to the same oracles elsewhere)."""
import pytest
import torch
from torch import nn

import tritamp.optimizers as O
from tritamp import amp

sklearn_datasets = pytest.importorskip("sklearn.datasets")

STEPS = 600
BATCH = 64


def _digits():
    x, y = sklearn_datasets.load_digits(return_X_y=True)
    return torch.tensor(x, dtype=torch.float32) / 16.0, torch.tensor(y)


def _final_loss(x, y, opt_name, lr, mode):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
    flags = {"sr": dict(stochastic_rounding=True, seed=0), "kahan": dict(kahan_summation=True)}
    extra = {"momentum": 0.9} if opt_name == "FusedSGD" else {}
    opt = getattr(O, opt_name)(model.parameters(), lr=lr, **extra, **flags.get(mode, {}))
    model, opt = amp.initialize(model, opt, opt_level="O2", half_dtype=torch.bfloat16,
                                master_weights=mode == "masters", loss_scale=1.0,
                                verbosity=0)
    gen = torch.Generator().manual_seed(1)
    for _ in range(STEPS):
        idx = torch.randint(0, len(x), (BATCH,), generator=gen)
        loss = nn.functional.cross_entropy(model(x[idx]).float(), y[idx])
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()
        opt.zero_grad()
    with torch.no_grad():
        return nn.functional.cross_entropy(model(x).float(), y).item()


@pytest.mark.parametrize("opt_name, lr", [("FusedAdam", 3e-4), ("FusedSGD", 0.01)])
def test_bf16_without_masters_converges_like_fp32_masters(cpu_path, opt_name, lr):
    x, y = _digits()
    loss = {mode: _final_loss(x, y, opt_name, lr, mode)
            for mode in ("masters", "sr", "kahan", "nearest")}
    base = loss["masters"]
    assert base < 0.5, loss  # the baseline learns the task
    assert abs(loss["sr"] - base) <= 0.02 * base, loss
    assert abs(loss["kahan"] - base) <= 0.02 * base, loss
    # round to nearest without masters is clearly worse in this setting
    assert loss["nearest"] > 1.5 * base, loss
