"""CUDA checks of fixes found by audits (amp's skip counts and restored gradients,
FP16_Optimizer's master gradients, LARC around amp, convert_to_amp's per-step scale,
the norms' shapes and clamp), on CUDA tensors: the CPU tests hold the same behaviour on
both CPU paths. Skipped where no CUDA device is present; CI has none.
"""
import numpy as np
import pytest
import torch
import torch.nn as nn

from tritamp import amp, convert_to_amp
from tritamp.fp16_utils import FP16_Optimizer
from tritamp.normalization import FusedLayerNorm, FusedRMSNorm
from tritamp.optimizers import FusedAdam, FusedSGD
from tritamp.parallel import LARC
from tritamp.testing import reset_amp as reset

pytestmark = pytest.mark.gpu
dev = "cuda"


def test_an_overflow_in_the_leading_parameters_only_is_counted_and_skipped():
    """overflow in the leading parameters only: counted, skipped, scale halved"""
    a, b = nn.Linear(4, 3).to(dev), nn.Linear(4, 3).to(dev)
    opt = FusedAdam(list(a.parameters()) + list(b.parameters()), lr=1e-3)
    [a, b], opt = amp.initialize([a, b], opt, opt_level="O2", half_dtype=torch.float16, loss_scale="dynamic", verbosity=1)
    w = [p.detach().clone() for p in list(a.parameters()) + list(b.parameters())]
    for _ in range(2):
        with amp.scale_loss(a(torch.randn(2, 4, device=dev, dtype=torch.float16)).float().sum() * float("inf"), opt) as s:
            s.backward()
        opt.step(); opt.zero_grad()
    assert amp.last_step_skipped(opt)
    assert amp.state_dict()["loss_scaler0"]["loss_scale"] == 2.0 ** 14
    assert all(torch.equal(x, y) for x, y in zip(w, list(a.parameters()) + list(b.parameters())))


def test_o2_fused_steps_a_restored_unscaled_fp32_gradient_as_it_is():
    """O2 fused: restored unscaled fp32 gradient stepped as it is"""
    for make in (lambda p: FusedSGD(p, lr=0.1), lambda p: FusedAdam(p, lr=0.1)):
        reset()
        m = nn.Linear(4, 2).to(dev)
        extra = nn.Parameter(torch.tensor([1.0, -2.0, 3.0], device=dev)); twin = nn.Parameter(extra.detach().clone())
        opt, ref = make(list(m.parameters()) + [extra]), make([twin])
        m, opt = amp.initialize(m, opt, opt_level="O2", half_dtype=torch.bfloat16, loss_scale="dynamic", verbosity=0)
        for _ in range(2):
            opt.zero_grad(); ref.zero_grad()
            extra.pow(2).sum().backward(); twin.pow(2).sum().backward()
            with amp.scale_loss(m(torch.randn(3, 4, device=dev)).float().mean(), opt) as s:
                s.backward()
            opt.step(); ref.step()
            torch.testing.assert_close(extra.detach(), twin.detach(), rtol=1e-6, atol=1e-7)


def test_fp16_optimizer_leaves_master_gradients_for_a_clipping_loop():
    """FP16_Optimizer(FusedSGD): master grads after backward, loop clip == clip_master_grads"""
    def run(clip):
        torch.manual_seed(0)
        model = nn.Linear(4, 3).to(dev).to(torch.float16)
        opt = FP16_Optimizer(FusedSGD(model.parameters(), lr=0.5, momentum=0.9), static_loss_scale=128.0, verbose=False)
        x = torch.randn(5, 4, device=dev, dtype=torch.float16)
        for _ in range(2):
            opt.zero_grad(); opt.backward(model(x).float().pow(2).sum())
            masters = [p for g in opt.fp32_from_fp16_groups for p in g]
            assert all(p.grad is not None for p in masters)
            if clip == "loop": torch.nn.utils.clip_grad_norm_(masters, 0.01)
            elif clip == "method": opt.clip_master_grads(0.01)
            opt.step()
        return [p.detach().clone() for p in model.parameters()]
    a, b, c = run("loop"), run("method"), run(None)
    assert all(torch.equal(x, y) for x, y in zip(a, b)) and any(not torch.equal(x, y) for x, y in zip(a, c))


def test_larc_around_an_o2_amp_optimizer_equals_larc_passed_to_initialize():
    """LARC around an O2 amp FusedSGD == LARC passed to initialize"""
    def run(order):
        reset(); torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2)).to(dev)
        opt = FusedSGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)
        if order == "before": opt = LARC(opt)
        model, opt = amp.initialize(model, opt, opt_level="O2", half_dtype=torch.bfloat16, loss_scale=128.0, verbosity=0)
        if order == "after": opt = LARC(opt)
        g = torch.Generator(device=dev).manual_seed(1)
        for _ in range(3):
            x = torch.randn(6, 4, device=dev, generator=g)
            opt.zero_grad()
            with amp.scale_loss(model(x).float().pow(2).sum(), opt.optim if order == "after" else opt) as s:
                s.backward()
            opt.step()
        return [p.detach().float().clone() for p in model.parameters()]
    a, b, c = run("before"), run("after"), run(None)
    assert all(torch.equal(x, y) for x, y in zip(a, b)) and any(not torch.equal(x, y) for x, y in zip(a, c))


def test_convert_to_amp_torch_mode_accumulates_as_grad_scaler():
    """convert_to_amp torch mode with accumulation == autocast + GradScaler"""
    torch.manual_seed(0)
    def net(): torch.manual_seed(0); return nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3)).to(dev)
    g = torch.Generator(device=dev).manual_seed(5)
    micro = [[(torch.randn(4, 6, device=dev, generator=g), torch.randn(4, 3, device=dev, generator=g)) for _ in range(2)] for _ in range(4)]
    blows = [[1.0, 1.0], [1.0, float("inf")], [float("inf"), float("inf")], [1.0, 1.0]]
    ref = net(); ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler(dev, init_scale=2.**10, growth_interval=1)
    want = []
    for bs, bl in zip(micro, blows):
        ref_opt.zero_grad()
        for (x, y), k in zip(bs, bl):
            with torch.autocast(dev, dtype=torch.bfloat16):
                loss = nn.functional.mse_loss(ref(x), y) * k
            scaler.scale(loss).backward()
        scaler.step(ref_opt); scaler.update(); want.append(scaler.get_scale())
    model = net()
    model, opt, crit = convert_to_amp(model, torch.optim.SGD(model.parameters(), lr=0.1), nn.MSELoss(), mode="torch", half_dtype=torch.bfloat16, init_scale=2.**10, growth_interval=1)
    got = []
    for bs, bl in zip(micro, blows):
        opt.zero_grad()
        for (x, y), k in zip(bs, bl):
            opt.backward(crit(model(x), y) * k)
        opt.step(); got.append(opt.loss_scale)
    assert got == want, (got, want)
    for a, b in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_convert_to_amp_naive_constant_scale_skips_an_overflow():
    """convert_to_amp naive constant scale skips an overflow"""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3)).to(dev)
    model, opt, _ = convert_to_amp(model, torch.optim.Adam(model.parameters(), lr=1e-2), None, mode="naive", dynamic_grad_scale=False, initial_scale=32.0)
    x, y = torch.randn(8, 6, device=dev), torch.randn(8, 3, device=dev)
    for k in (1.0, float("inf"), 1.0):
        before = [p.detach().clone() for p in model.parameters()]
        opt.zero_grad(); opt.backward(nn.functional.mse_loss(model(x.half()).float(), y) * k); opt.step()
        assert all(torch.isfinite(p).all() for p in model.parameters())
        if k != 1.0:
            assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
        assert opt.loss_scale == 32.0


def test_norms_numpy_shape_and_fp16_memory_efficient_clamp():
    """norms: numpy-int normalized_shape, fp16 memory_efficient clamp, on CUDA"""
    for cls, ref_cls in ((FusedLayerNorm, nn.LayerNorm), (FusedRMSNorm, nn.RMSNorm)):
        m = cls(np.int64(6)).to(dev); r = ref_cls(6, eps=m.eps).to(dev)
        x = torch.randn(3, 6, device=dev)
        torch.testing.assert_close(m(x), r(x), rtol=1e-5, atol=1e-5)
        x = torch.randn(4, 8, device=dev).half(); dy = torch.randn(4, 8, device=dev).half()
        gs = []
        for me in (False, True):
            mm = cls(8, memory_efficient=me).to(dev).half()
            with torch.no_grad(): mm.weight[3] = 3e-5
            xx = x.clone().requires_grad_(); mm(xx).backward(dy); gs.append(mm.weight.grad.float())
        torch.testing.assert_close(gs[1], gs[0], rtol=2e-2, atol=2e-3)
