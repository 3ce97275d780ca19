"""Promises of tritamp.parallel (LARC, Reducer, SyncBatchNorm, convert_syncbn_model) and
tritamp.normalization that the other test files leave unchecked: CPU only, tiny tensors,
expected values from closed forms or torch's own modules."""
import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tritamp.normalization import (FusedLayerNormAffineFunction,
                                   FusedLayerNormAffineMixedDtypesFunction,
                                   FusedLayerNormFunction, FusedRMSNormAffineFunction,
                                   FusedRMSNormAffineMixedDtypesFunction, FusedRMSNormFunction,
                                   MixedFusedRMSNorm, mixed_dtype_fused_layer_norm_affine)
from tritamp.parallel import LARC, SyncBatchNorm, convert_syncbn_model


def test_larc_closure_gets_gradients_even_when_step_is_called_under_no_grad():
    """step(closure) runs the closure with autograd on, like torch's optimizers, so a
    step taken inside torch.no_grad() still gets the closure's gradients."""
    p = torch.nn.Parameter(torch.tensor([3.0, 4.0]))
    opt = LARC(torch.optim.SGD([p], lr=1.0), trust_coefficient=0.02, clip=False)

    def closure():
        opt.zero_grad()
        loss = (p * torch.tensor([0.6, 0.8])).sum()  # gradient [0.6, 0.8], norm 1
        loss.backward()
        return loss

    with torch.no_grad():
        loss = opt.step(closure)
    assert loss.item() == pytest.approx(5.0)
    # ||p|| = 5, ||g|| = 1: factor 0.02 * 5 / (1 + 1e-8) = 0.1 (scale mode, lr 1)
    torch.testing.assert_close(p.detach(), torch.tensor([3.0 - 0.06, 4.0 - 0.08]))


class _FailingSGD(torch.optim.SGD):
    def step(self, closure=None):
        raise RuntimeError("inner step failed")


def test_larc_restores_weight_decay_when_the_wrapped_step_raises():
    """LARC switches the optimizer's weight decay off only for the wrapped step: a step
    that raises leaves every group's weight_decay as the user set it."""
    a = torch.nn.Parameter(torch.tensor([1.0, 2.0]))
    b = torch.nn.Parameter(torch.tensor([3.0]))
    a.grad, b.grad = torch.tensor([0.5, 0.5]), torch.tensor([1.0])
    opt = LARC(_FailingSGD([{"params": [a], "weight_decay": 0.1},
                            {"params": [b], "weight_decay": 0.25}], lr=0.1))
    with pytest.raises(RuntimeError, match="inner step failed"):
        opt.step()
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.25]


def test_larc_accepts_eps_zero():
    """eps only has to be >= 0: eps=0 is taken and gives trust * ||p|| / ||g||."""
    p = torch.nn.Parameter(torch.tensor([3.0, 4.0]))
    p.grad = torch.tensor([0.0, 2.0])
    opt = LARC(torch.optim.SGD([p], lr=1.0), trust_coefficient=0.1, clip=False, eps=0)
    opt.step()
    # factor 0.1 * 5 / 2 = 0.25 times the gradient
    torch.testing.assert_close(p.detach(), torch.tensor([3.0, 4.0 - 0.5]))


def test_larc_zero_grad_passes_set_to_none_on():
    """zero_grad(set_to_none=False) reaches the wrapped optimizer: gradients are zeroed,
    not dropped."""
    p = torch.nn.Parameter(torch.tensor([1.0, 2.0]))
    p.grad = torch.tensor([3.0, 4.0])
    opt = LARC(torch.optim.SGD([p], lr=0.1))
    opt.zero_grad(set_to_none=False)
    assert p.grad is not None and p.grad.tolist() == [0.0, 0.0]
    opt.zero_grad()
    assert p.grad is None


def test_apex_specify_methods_set_process_group_and_channel_last():
    """Apex's SyncBatchNorm._specify_process_group / _specify_channel_last set the layer's
    group and layout; channel_last then reads channels from the last dimension."""
    bn = SyncBatchNorm(3)
    group = object()  # (only recorded: no distributed call is made outside a world)
    bn._specify_process_group(group)
    assert bn.process_group is group
    bn._specify_channel_last(True)
    assert bn.channel_last
    x = torch.arange(24, dtype=torch.float32).reshape(2, 4, 3)  # (N, L, C)
    ref = nn.BatchNorm1d(3)
    torch.testing.assert_close(bn(x), ref(x.permute(0, 2, 1)).permute(0, 2, 1),
                               rtol=1e-5, atol=1e-5)


def test_convert_without_a_group_keeps_a_syncbatchnorms_own_group():
    """convert_syncbn_model(model) with process_group=None leaves the group of a layer that
    already is a SyncBatchNorm alone."""
    group = object()
    model = nn.Sequential(SyncBatchNorm(3, process_group=group), nn.BatchNorm1d(3))
    conv = convert_syncbn_model(model)
    assert conv[0].process_group is group
    assert conv[1].process_group is None


def test_convert_shares_running_buffers_and_the_batch_count():
    """The converted layer holds the BatchNorm's own running_mean, running_var and
    num_batches_tracked tensors, so a cumulative average (momentum=None) goes on from the
    batches already counted."""
    bn = nn.BatchNorm1d(2, momentum=None)
    x0 = torch.tensor([[0.0, 1.0], [2.0, 5.0]])
    bn(x0)
    bn(x0 + 1.0)
    mean, var, count = bn.running_mean, bn.running_var, bn.num_batches_tracked
    ref = copy.deepcopy(bn)
    conv = convert_syncbn_model(bn)
    assert conv.running_mean is mean and conv.running_var is var
    assert conv.num_batches_tracked is count and int(count) == 2
    x = torch.tensor([[4.0, -1.0], [8.0, 3.0], [0.0, 1.0]])
    conv(x)
    ref(x)
    assert int(conv.num_batches_tracked) == 3
    torch.testing.assert_close(conv.running_mean, ref.running_mean)
    torch.testing.assert_close(conv.running_var, ref.running_var)


def test_convert_syncbn_model_carries_the_qconfig_over():
    """A BatchNorm's quantisation config (``qconfig``) survives the conversion, as with
    torch.nn.SyncBatchNorm.convert_sync_batchnorm."""
    marker = object()
    net = nn.Sequential(nn.Conv2d(2, 3, 1), nn.BatchNorm2d(3))
    net[1].qconfig = marker
    ref = nn.SyncBatchNorm.convert_sync_batchnorm(copy.deepcopy(net))
    assert ref[1].qconfig is not None
    out = convert_syncbn_model(net)
    assert type(out[1]) is SyncBatchNorm
    assert out[1].qconfig is marker


def _x_w_b(n=8, rows=3):
    g = torch.Generator().manual_seed(11)
    return (torch.randn(rows, n, generator=g), 1 + 0.3 * torch.randn(n, generator=g),
            0.3 * torch.randn(n, generator=g))


def test_apex_function_entry_points_compute_their_norms():
    """The *Function.apply entry points (called directly by Megatron) compute the norm
    their name says, with eps as given."""
    x, w, b = _x_w_b()
    tol = dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(FusedLayerNormFunction.apply(x, (8,), 1e-6),
                               F.layer_norm(x, (8,), eps=1e-6), **tol)
    torch.testing.assert_close(FusedRMSNormFunction.apply(x, (8,), 1e-6),
                               F.rms_norm(x, (8,), eps=1e-6), **tol)
    torch.testing.assert_close(FusedRMSNormAffineFunction.apply(x, w, (8,), 1e-6),
                               F.rms_norm(x, (8,), w, 1e-6), **tol)


def test_mixed_dtype_entry_points_give_the_weights_dtype():
    """The mixed-dtype forms and their Function entry points give their output in the
    weight's dtype (fp32 weights, bf16 input -> fp32 output)."""
    x, w, b = _x_w_b()
    xb = x.bfloat16()
    want_ln = F.layer_norm(xb.float(), (8,), w, b, 1e-6)
    want_rms = F.rms_norm(xb.float(), (8,), w, 1e-6)
    tol = dict(rtol=1e-5, atol=1e-5)
    for y in (mixed_dtype_fused_layer_norm_affine(xb, w, b, (8,)),
              FusedLayerNormAffineMixedDtypesFunction.apply(xb, w, b, (8,), 1e-6)):
        assert y.dtype == torch.float32
        torch.testing.assert_close(y, want_ln, **tol)
    y = FusedRMSNormAffineMixedDtypesFunction.apply(xb, w, (8,), 1e-6)
    assert y.dtype == torch.float32
    torch.testing.assert_close(y, want_rms, **tol)


def test_mixed_fused_rms_norm_module_output_takes_the_weights_dtype():
    """MixedFusedRMSNorm with fp32 weights on bf16 input gives fp32, as torch's RMSNorm on
    the fp32 input would; bf16 weights on fp32 input give bf16."""
    x, w, _ = _x_w_b()
    xb = x.bfloat16()
    m = MixedFusedRMSNorm(8)
    with torch.no_grad():
        m.weight.copy_(w)
    y = m(xb)
    assert y.dtype == torch.float32
    torch.testing.assert_close(y, F.rms_norm(xb.float(), (8,), w, 1e-5), rtol=1e-5, atol=1e-5)
    assert m.bfloat16()(x).dtype == torch.bfloat16


def test_plain_affine_entry_points_keep_the_inputs_dtype():
    """FusedLayerNormAffineFunction / FusedRMSNormAffineFunction give the input's dtype
    (bf16 input with fp32 weights -> bf16), unlike the mixed-dtype ones."""
    x, w, b = _x_w_b()
    xb = x.bfloat16()
    y = FusedLayerNormAffineFunction.apply(xb, w, b, (8,), 1e-6)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y, F.layer_norm(xb.float(), (8,), w, b, 1e-6).bfloat16(),
                               rtol=1.6e-2, atol=1e-2)
    y = FusedRMSNormAffineFunction.apply(xb, w, (8,), 1e-6)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y, F.rms_norm(xb.float(), (8,), w, 1e-6).bfloat16(),
                               rtol=1.6e-2, atol=1e-2)
