"""Input checks of the multi-tensor engine and its launchers that hold on every route:
a strided-view parameter whose partners share its strides, a partner or an lr on
another device (the meta device stands in for a GPU here), an overlapping gradient a
sweep writes, NovoGrad's norm_type given to the launcher itself, momentum without
buffers; and the CPU path's Adam with beta1 = 1 and no bias correction.

The launcher calls run on the production CPU path (conftest's ``cpu_path``), except
``novograd_launch``'s check, which also runs on Triton's interpreter; tensors are tiny.
"""
import pytest
import torch

from tritamp.kernels.adam import adam_step
from tritamp.kernels.larc import larc_rescale
from tritamp.kernels.novograd import novograd_launch, novograd_prepare
from tritamp.kernels.sgd import sgd_step

ADAM = dict(lr=0.1, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0)


def _strided(base_shape=(4, 8), fill=0.0):
    """A (4, 4) view of every other column of a fresh (4, 8) tensor: strides (8, 2)."""
    base = torch.full(base_shape, fill)
    return base, base[:, ::2]


@pytest.mark.parametrize("sweep", ["adam", "sgd"])
def test_strided_view_parameter_with_partners_of_its_strides_is_refused(sweep, cpu_path):
    """A parameter that is not dense is refused even when its gradient and state are views
    of the same strides: a flat sweep over it would write the memory between its
    elements."""
    base, p = _strided()
    _, g = _strided(fill=1.0)
    assert p.stride() == g.stride() == (8, 2)
    with pytest.raises(ValueError, match=r"params\[0\] of shape \(4, 4\) has strides \(8, 2\): "
                                         r"not dense"):
        if sweep == "adam":
            m, v = _strided()[1], _strided()[1]
            adam_step([p], [g], [m], [v], [torch.zeros(())], **ADAM)
        else:
            sgd_step([p], [g], lr=0.1)
    assert torch.equal(base, torch.zeros(4, 8))  # the view and its neighbours alike


def test_gradient_on_another_device_is_refused(cpu_path):
    """A partner tensor on another device than its parameter is named, not stepped over."""
    p = torch.ones(3)
    with pytest.raises(ValueError, match=r"grads\[0\] is on meta but params\[0\] is on cpu"):
        adam_step([p], [torch.ones(3, device="meta")], [torch.zeros(3)], [torch.zeros(3)],
                  [torch.zeros(())], **ADAM)
    assert torch.equal(p, torch.ones(3))


def test_lr_tensor_on_another_device_is_refused(cpu_path):
    """An lr tensor must live where the tensors are (it is read there)."""
    p, m = torch.ones(3), torch.zeros(3)
    with pytest.raises(ValueError, match=r"lr is on meta but the tensors are on cpu"):
        adam_step([p], [torch.ones(3)], [m], [torch.zeros(3)], [torch.zeros(())],
                  **dict(ADAM, lr=torch.tensor(0.1, device="meta")))
    assert torch.equal(p, torch.ones(3)) and torch.equal(m, torch.zeros(3))


def test_overlapping_gradient_that_a_sweep_writes_is_refused_before_any_write(cpu_path):
    """larc_rescale writes its gradients: one whose elements share memory (expanded)
    cannot take four rescaled values, and is refused by name before anything is written."""
    p = torch.ones(4)
    source = torch.tensor([2.0])
    g = source.expand(4)
    with pytest.raises(ValueError, match=r"grads\[0\] of shape \(4,\) has strides \(0,\): it "
                                         r"overlaps itself"):
        larc_rescale([p], [g], torch.tensor([0.5]))
    assert torch.equal(source, torch.tensor([2.0])) and torch.equal(p, torch.ones(4))


def test_novograd_launch_refuses_a_norm_type_it_cannot_apply(path):
    """novograd_launch itself takes norm_type 2 (L2) or 0 (max) only: 1 is refused on
    every path, nothing stepped (not run as the L2 norm)."""
    p, g, m = torch.ones(8), torch.ones(8), torch.zeros(8)
    prepared = novograd_prepare([p], [g], [m], [torch.zeros(())], [torch.zeros(())])
    with pytest.raises(ValueError, match=r"norm_type must be 2 \(L2\) or 0 \(max norm\), got 1"):
        novograd_launch(prepared, lr=0.1, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0,
                        norm_type=1)
    assert torch.equal(p, torch.ones(8)) and torch.equal(m, torch.zeros(8))


@pytest.mark.parametrize("buffers,match", [
    (None, r"momentum_buffers is None"),
    ([torch.zeros(3), None], r"momentum_buffers\[1\] is None"),
], ids=["no-list", "one-missing"])
def test_sgd_momentum_without_buffers_is_refused_on_the_cpu_path(buffers, match, cpu_path):
    """sgd_step with momentum needs a buffer per parameter: without one the production
    CPU path refuses it as the kernels do (it does not skip the update)."""
    ps = [torch.ones(3), torch.ones(3)]
    with pytest.raises(ValueError, match=r"momentum != 0 needs momentum_buffers \(" + match):
        sgd_step(ps, [torch.ones(3), torch.ones(3)], buffers, lr=0.1, momentum=0.9)
    assert all(torch.equal(p, torch.ones(3)) for p in ps)


def test_cpu_adam_with_beta1_one_and_no_bias_correction_is_finite(cpu_path):
    """beta1 = 1 without bias correction (the kernel API takes it; the optimizers refuse
    beta >= 1): m stays as it is, and p -= lr * m / (sqrt(v) + eps), finite."""
    lr, b2, eps = 0.1, 0.999, 1e-8
    p, g = torch.tensor([1.0, -2.0]), torch.tensor([0.5, 0.25])
    m, v = torch.tensor([0.1, 0.2]), torch.tensor([0.01, 0.02])
    adam_step([p], [g], [m], [v], [torch.zeros(())], lr=lr, beta1=1.0, beta2=b2, eps=eps,
              weight_decay=0.0, bias_correction=False)
    v_expected = b2 * torch.tensor([0.01, 0.02]) + (1 - b2) * g * g
    p_expected = torch.tensor([1.0, -2.0]) - lr * torch.tensor([0.1, 0.2]) / (
        v_expected.sqrt() + eps)
    assert torch.isfinite(p).all()
    torch.testing.assert_close(m, torch.tensor([0.1, 0.2]), rtol=0, atol=0)
    torch.testing.assert_close(v, v_expected, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(p, p_expected, rtol=1e-6, atol=1e-6)
