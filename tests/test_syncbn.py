"""tritamp.parallel.SyncBatchNorm in one process: a BatchNorm, checked against torch's.

Two paths: "kernels" runs the Triton kernels (compiled on a GPU, in the interpreter on a
CPU), "ref" the torch reference path CPU training takes without the interpreter. The
multi-process behaviour is in test_parallel_multiprocess.py.
"""
import pytest
import torch
from torch import nn

from conftest import TOL
from tritamp import amp
from tritamp.parallel import (SyncBatchNorm, convert_syncbn_model, create_syncbn_process_group)

GPU = torch.device("cuda") if torch.cuda.is_available() else None


@pytest.fixture(params=["kernels", "ref"])
def device(request, monkeypatch):
    if request.param == "ref":
        monkeypatch.setenv("TRITON_INTERPRET", "0")
        return torch.device("cpu")
    return GPU or torch.device("cpu")


def _torch_bn(c, dims, **kw):
    cls = {2: nn.BatchNorm1d, 3: nn.BatchNorm1d, 4: nn.BatchNorm2d, 5: nn.BatchNorm3d}[dims]
    return cls(c, **kw)


def _pair(c, dims, device, **kw):
    ref = _torch_bn(c, dims, **kw).to(device)
    if ref.affine:
        with torch.no_grad():
            ref.weight.uniform_(0.5, 1.5)
            ref.bias.uniform_(-1.0, 1.0)
    sync = SyncBatchNorm(c, **kw).to(device)
    sync.load_state_dict(ref.state_dict())
    return sync, ref


def _data(shape, dtype, device, seed=0, mean=4.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * 2.0 + mean).to(dtype).to(device)


def _close_to_exact(ours, theirs, exact, dtype, name):
    """Within 2x torch's own error against float64, plus the table's atol."""
    err = (ours.double() - exact).abs().max().item()
    torch_err = (theirs.double() - exact).abs().max().item()
    assert err <= 2 * torch_err + TOL[dtype]["atol"], (name, err, torch_err)


def _train_steps(sync, ref, exact, xs, dys, memory_format=None, check_exact=True):
    for x, dy in zip(xs, dys):
        if memory_format is not None:
            x = x.contiguous(memory_format=memory_format)
        # torch on the contiguous copy: its CPU channels-last half path is less accurate
        # (about 2.5x the error of its contiguous path against float64)
        xa = x.clone().requires_grad_()
        xb = x.contiguous().clone().requires_grad_()
        xe = x.double().requires_grad_()
        ya, yb, ye = sync(xa), ref(xb), exact(xe)
        for y in (ya, yb, ye):
            y.backward(dy.to(y.dtype))
        assert ya.dtype == x.dtype and ya.shape == x.shape
        if memory_format is not None:
            assert ya.is_contiguous(memory_format=memory_format)
        torch.testing.assert_close(ya, yb, **TOL[x.dtype])
        torch.testing.assert_close(xa.grad, xb.grad, **TOL[x.dtype])
        if check_exact:
            _close_to_exact(ya, yb, ye, x.dtype, "y")
            _close_to_exact(xa.grad, xb.grad, xe.grad, x.dtype, "dx")
        if sync.affine:
            for name in ("weight", "bias"):
                gs, gr = getattr(sync, name).grad, getattr(ref, name).grad
                ge = getattr(exact, name).grad
                assert gs.dtype == gr.dtype
                torch.testing.assert_close(gs, gr, **TOL[torch.float32])
                _close_to_exact(gs, gr, ge, torch.float32, name)
                for m in (sync, ref, exact):
                    getattr(m, name).grad = None
    if sync.track_running_stats:
        torch.testing.assert_close(sync.running_mean, ref.running_mean, **TOL[torch.float32])
        torch.testing.assert_close(sync.running_var, ref.running_var, **TOL[torch.float32])
        assert torch.equal(sync.num_batches_tracked, ref.num_batches_tracked)


SHAPES = [(6, 5), (4, 3, 7), (3, 4, 5, 6), (2, 3, 2, 3, 4)]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{len(s)}d")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_training_matches_torch_batchnorm(device, shape, dtype):
    c = shape[1]
    sync, ref = _pair(c, len(shape), device)
    exact = _torch_bn(c, len(shape)).to(device).double()
    exact.load_state_dict(ref.state_dict())
    xs = [_data(shape, dtype, device, seed=s) for s in range(2)]
    dys = [_data(shape, dtype, device, seed=10 + s, mean=0.0) for s in range(2)]
    _train_steps(sync, ref, exact, xs, dys)
    sync.eval()
    ref.eval()
    with torch.no_grad():
        torch.testing.assert_close(sync(xs[0]), ref(xs[0]), **TOL[dtype])


@pytest.mark.parametrize("shape", [(3, 4, 5, 6), (2, 3, 2, 3, 4), (4, 6, 5)],
                         ids=lambda s: f"{len(s)}d")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_channels_last_memory_format_is_kept(device, shape, dtype):
    """torch's channels_last / channels_last_3d inputs (and the same layout for 3-D input)
    need no flag: statistics come from strides, the output keeps the format."""
    c = shape[1]
    sync, ref = _pair(c, len(shape), device)
    exact = _torch_bn(c, len(shape)).to(device).double()
    exact.load_state_dict(ref.state_dict())
    xs = [_data(shape, dtype, device, seed=s) for s in range(2)]
    dys = [_data(shape, dtype, device, seed=10 + s, mean=0.0) for s in range(2)]
    if len(shape) == 3:  # (N, C, L) stored as (N, L, C)
        xs = [x.transpose(1, 2).contiguous().transpose(1, 2) for x in xs]
        _train_steps(sync, ref, exact, xs, dys)
        y = sync(xs[0])
        assert y.stride(1) == 1
    else:
        fmt = torch.channels_last if len(shape) == 4 else torch.channels_last_3d
        _train_steps(sync, ref, exact, xs, dys, memory_format=fmt)


@pytest.mark.parametrize("case", ["4-D W sliced", "4-D channels sliced", "5-D sliced"])
def test_a_sliced_channels_last_view_gives_channels_last_output(device, case):
    """A slice of a channels_last tensor is not dense, but torch reads its strides as
    channels-last: the output and the input gradient come back in that format, with
    torch's values."""
    cl, cl3 = torch.channels_last, torch.channels_last_3d
    base, view, fmt = {
        "4-D W sliced": ((3, 4, 5, 12), lambda t: t[..., ::2], cl),
        "4-D channels sliced": ((3, 8, 5, 6), lambda t: t[:, :4], cl),
        "5-D sliced": ((2, 3, 4, 3, 10), lambda t: t[..., ::2], cl3),
    }[case]
    x = view(_data(base, torch.float32, device).contiguous(memory_format=fmt))
    assert not x.is_contiguous(memory_format=fmt)
    c = x.shape[1]
    sync, ref = _pair(c, x.dim(), device)
    xs, xr = x.detach().requires_grad_(), x.detach().clone().requires_grad_()
    ys, yr = sync(xs), ref(xr)
    assert ys.is_contiguous(memory_format=fmt) and yr.is_contiguous(memory_format=fmt)
    torch.testing.assert_close(ys, yr, **TOL[torch.float32])
    dy = _data(tuple(x.shape), torch.float32, device, seed=9, mean=0.0)
    (gs,), (gr,) = torch.autograd.grad(ys, [xs], dy), torch.autograd.grad(yr, [xr], dy)
    assert gs.is_contiguous(memory_format=fmt) and gr.is_contiguous(memory_format=fmt)
    torch.testing.assert_close(gs, gr, **TOL[torch.float32])


def test_apex_channel_last_takes_channels_from_the_last_dimension(device):
    sync, ref = _pair(5, 4, device)
    sync.channel_last = True
    x = _data((3, 4, 2, 5), torch.float32, device).requires_grad_()      # N, H, W, C
    dy = _data((3, 4, 2, 5), torch.float32, device, seed=1, mean=0.0)
    y = sync(x)
    y.backward(dy)
    x2 = x.detach().permute(0, 3, 1, 2).clone().requires_grad_()
    y2 = ref(x2)
    y2.backward(dy.permute(0, 3, 1, 2))
    torch.testing.assert_close(y, y2.permute(0, 2, 3, 1), **TOL[torch.float32])
    torch.testing.assert_close(x.grad, x2.grad.permute(0, 2, 3, 1), **TOL[torch.float32])
    torch.testing.assert_close(sync.weight.grad, ref.weight.grad, **TOL[torch.float32])
    torch.testing.assert_close(sync.running_var, ref.running_var, **TOL[torch.float32])
    with pytest.raises(ValueError, match="channels in dimension 3"):
        sync(_data((3, 5, 2, 4), torch.float32, device))


@pytest.mark.parametrize("kw", [dict(momentum=None), dict(affine=False),
                                dict(track_running_stats=False), dict(momentum=0.3, eps=1e-3)],
                         ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()))
def test_constructor_options_match_torch(device, kw):
    sync, ref = _pair(4, 4, device, **kw)
    exact = _torch_bn(4, 4, **kw).to(device).double()
    exact.load_state_dict(ref.state_dict())
    xs = [_data((3, 4, 3, 2), torch.float32, device, seed=s) for s in range(2)]
    dys = [_data((3, 4, 3, 2), torch.float32, device, seed=7 + s, mean=0.0) for s in range(2)]
    _train_steps(sync, ref, exact, xs, dys)
    sync.eval()
    ref.eval()
    with torch.no_grad():  # without running statistics eval mode uses the batch's, as torch
        torch.testing.assert_close(sync(xs[1]), ref(xs[1]), **TOL[torch.float32])


def test_eval_mode_uses_and_keeps_the_running_statistics(device):
    sync, ref = _pair(3, 4, device)
    with torch.no_grad():
        for m in (sync, ref):
            m.running_mean.copy_(torch.tensor([1.0, -2.0, 0.5]))
            m.running_var.copy_(torch.tensor([4.0, 0.25, 1.0]))
    sync.eval()
    ref.eval()
    x = _data((2, 3, 4, 4), torch.float16, device).requires_grad_()
    x2 = x.detach().clone().requires_grad_()
    dy = _data((2, 3, 4, 4), torch.float16, device, seed=3, mean=0.0)
    y, y2 = sync(x), ref(x2)
    y.backward(dy)
    y2.backward(dy)
    torch.testing.assert_close(y, y2, **TOL[torch.float16])
    torch.testing.assert_close(x.grad, x2.grad, **TOL[torch.float16])
    torch.testing.assert_close(sync.weight.grad, ref.weight.grad, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(sync.bias.grad, ref.bias.grad, rtol=1e-5, atol=1e-4)
    assert sync.running_mean.tolist() == [1.0, -2.0, 0.5]
    assert sync.num_batches_tracked.item() == 0


def test_eval_graph_survives_a_training_forward_before_its_backward(device):
    sync, ref = _pair(3, 4, device)
    x = _data((2, 3, 2, 2), torch.float32, device).requires_grad_()
    sync.eval()
    y_eval = sync(x)
    sync.train()
    sync(x.detach())  # updates the running statistics in place
    y_eval.sum().backward()
    ref.eval()
    x2 = x.detach().clone().requires_grad_()
    ref(x2).sum().backward()
    torch.testing.assert_close(x.grad, x2.grad, **TOL[torch.float32])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_residual_and_fused_relu(device, dtype):
    """forward(x, z) with fuse_relu is relu(bn(x) + z), rounded once; z gets dy masked."""
    sync, ref = _pair(4, 4, device)
    sync.fuse_relu = True
    exact = _torch_bn(4, 4).to(device).double()
    exact.load_state_dict(ref.state_dict())
    x = _data((3, 4, 3, 3), dtype, device, mean=0.5)
    z = _data((3, 4, 3, 3), dtype, device, seed=4, mean=0.0)
    dy = _data((3, 4, 3, 3), dtype, device, seed=5, mean=0.0)
    xa, za = x.clone().requires_grad_(), z.clone().requires_grad_()
    ya = sync(xa, za)
    ya.backward(dy)
    xe, ze = x.double().requires_grad_(), z.double().requires_grad_()
    ye = torch.relu(exact(xe) + ze)
    ye.backward(dy.double())
    assert ya.dtype == dtype and (ya >= 0).all()
    torch.testing.assert_close(ya, ye.to(dtype), **TOL[dtype])
    torch.testing.assert_close(xa.grad, xe.grad.to(dtype), **TOL[dtype])
    torch.testing.assert_close(za.grad, ze.grad.to(dtype), **TOL[dtype])
    torch.testing.assert_close(sync.weight.grad.double(), exact.weight.grad, rtol=1e-5,
                               atol=1e-5)
    # without the ReLU, z's gradient is dy itself
    sync.fuse_relu = False
    za.grad = None
    sync(xa, za).backward(dy)
    assert torch.equal(za.grad, dy)


def test_one_value_per_channel_raises_torchs_error(device):
    for shape in ((1, 3), (1, 3, 1, 1)):
        sync, ref = _pair(3, len(shape), device)
        x = torch.ones(shape, device=device)
        with pytest.raises(ValueError) as theirs:
            ref(x)
        with pytest.raises(ValueError) as ours:
            sync(x)
        assert str(ours.value) == str(theirs.value)
        sync.eval()
        assert sync(x).shape == x.shape  # running statistics: fine in eval mode
    # Apex's channel_last reads the channels from the last dimension: one value per
    # channel there too; two values per channel, or none (an empty batch), are fine
    last = SyncBatchNorm(3, channel_last=True).to(device)
    with pytest.raises(ValueError, match="Expected more than 1 value per channel"):
        last(torch.ones(1, 1, 3, device=device))
    assert last(torch.randn(1, 2, 3, device=device)).shape == (1, 2, 3)
    first = SyncBatchNorm(3).to(device)
    assert first(torch.randn(1, 3, 1, 2, device=device)).shape == (1, 3, 1, 2)
    assert first(torch.randn(0, 3, 2, device=device)).shape == (0, 3, 2)


def test_output_may_be_modified_in_place(device):
    """ReLU(inplace=True) after the layer, as in torchvision's ResNets."""
    sync, ref = _pair(3, 4, device)
    x = _data((2, 3, 2, 2), torch.float32, device).requires_grad_()
    y = torch.relu_(sync(x))
    y.sum().backward()
    x2 = x.detach().clone().requires_grad_()
    torch.relu_(ref(x2)).sum().backward()
    torch.testing.assert_close(x.grad, x2.grad, **TOL[torch.float32])


def test_frozen_input_still_gives_parameter_gradients(device):
    sync, ref = _pair(3, 4, device)
    x = _data((2, 3, 2, 2), torch.float32, device)
    sync(x).pow(2).sum().backward()
    ref(x).pow(2).sum().backward()
    torch.testing.assert_close(sync.weight.grad, ref.weight.grad, **TOL[torch.float32])
    torch.testing.assert_close(sync.bias.grad, ref.bias.grad, **TOL[torch.float32])


def test_state_dict_and_repr_are_batchnorms():
    sync, ref = SyncBatchNorm(8), nn.BatchNorm2d(8)
    assert list(sync.state_dict()) == list(ref.state_dict())
    sync.load_state_dict(ref.state_dict())
    assert repr(sync).startswith("SyncBatchNorm(8, eps=1e-05, momentum=0.1, affine=True")
    assert "channel_last=False" in repr(sync) and "fuse_relu=False" in repr(sync)
    assert isinstance(sync, nn.modules.batchnorm._BatchNorm)


def test_bad_input_names_the_fix():
    sync = SyncBatchNorm(4)
    with pytest.raises(ValueError, match="expected at least 2D input"):
        sync(torch.ones(4))
    with pytest.raises(ValueError, match=r"has 3 channels in dimension 1 \(for \(N, \.\.\., C\) "
                                         "input pass channel_last=True\\)"):
        sync(torch.ones(2, 3, 4))
    with pytest.raises(ValueError, match="z must match the input"):
        sync(torch.ones(2, 4, 3), torch.ones(2, 4, 3, dtype=torch.float16))


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.block = nn.Sequential(nn.Conv2d(4, 4, 1), nn.SyncBatchNorm(4, momentum=0.2),
                                   nn.ReLU(), nn.InstanceNorm2d(4, affine=True))
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(4 * 4 * 4, 6),
                                  nn.BatchNorm1d(6, affine=False))

    def forward(self, x):
        return self.head(self.block(self.bn(self.conv(x))))


def test_convert_syncbn_model_keeps_weights_buffers_and_flags(device):
    torch.manual_seed(0)
    net = _Net().to(device)
    with torch.no_grad():
        net.bn.weight.uniform_(0.5, 1.5)
        net.bn.running_mean.fill_(0.25)
    net.bn.bias.requires_grad_(False)
    net.block[1].eval()
    x = _data((3, 3, 4, 4), torch.float32, device, mean=0.0)
    net2 = _Net().to(device)
    net2.load_state_dict(net.state_dict())
    net2.bn.bias.requires_grad_(False)
    net2.block[1].eval()
    expected = [net(x) for _ in range(2)]
    state_before = {k: v.clone() for k, v in net2.state_dict().items()}
    running_mean = net2.bn.running_mean
    conv = convert_syncbn_model(net2, channel_last=False)
    assert conv is net2
    assert type(conv.bn) is SyncBatchNorm and type(conv.block[1]) is SyncBatchNorm
    assert type(conv.head[2]) is SyncBatchNorm and not conv.head[2].affine
    assert type(conv.block[3]) is nn.InstanceNorm2d
    assert conv.bn.running_mean is running_mean  # the same buffer, as in Apex
    assert conv.block[1].momentum == 0.2 and not conv.block[1].training
    assert not conv.bn.bias.requires_grad and conv.bn.weight.requires_grad
    assert list(conv.state_dict()) == list(state_before)
    for k, v in conv.state_dict().items():
        assert torch.equal(v, state_before[k]), k
    got = [conv(x) for _ in range(2)]
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, **TOL[torch.float32])
    for k, v in conv.state_dict().items():
        torch.testing.assert_close(v, net.state_dict()[k], **TOL[torch.float32])


def test_convert_a_bare_batchnorm():
    bn = nn.BatchNorm3d(5, eps=1e-3).to(torch.float64)
    sync = convert_syncbn_model(bn, channel_last=True)
    assert type(sync) is SyncBatchNorm and sync.eps == 1e-3 and sync.channel_last
    assert sync.weight.dtype == torch.float64


def test_process_group_helpers_without_torch_distributed():
    assert create_syncbn_process_group(0) is None
    with pytest.raises(RuntimeError, match="init_process_group"):
        create_syncbn_process_group(2)


@pytest.mark.parametrize("half", [torch.float16, torch.bfloat16], ids=str)
def test_amp_o2_keeps_syncbatchnorm_in_fp32(half):
    device = GPU or torch.device("cpu")
    model = convert_syncbn_model(nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4),
                                               nn.ReLU())).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O2", half_dtype=half, verbosity=0)
    assert model[0].weight.dtype == half
    assert model[1].weight.dtype == torch.float32 and model[1].running_var.dtype == torch.float32
    x = _data((4, 3, 5, 5), torch.float32, device, mean=0.0)
    loss = model(x).float().pow(2).mean()
    with amp.scale_loss(loss, opt) as scaled:
        scaled.backward()
    opt.step()
    assert model[1].weight.grad is not None and model[1].weight.grad.dtype == torch.float32
    assert torch.isfinite(model[1].running_var).all()


def test_benchmark_smoke_run(tmp_path, capsys):
    """benchmarks/syncbn.py on the CPU: one line says so, rows in benchmarks/kernels.py's
    format, torch's CUDA-only sync path reported as skipped rather than crashing."""
    from benchmarks import syncbn as sb

    rc = sb.main(["--device", "cpu", "--batch", "2", "--configs", "fp16-nhwc",
                  "--shapes", "4x3x3", "--cpu-reps", "1", "--out", str(tmp_path)])
    assert rc == 0
    out = capsys.readouterr().out
    assert "No GPU in use" in out and "syncbn fwd+bwd" in out
    import json
    data = json.loads((tmp_path / "syncbn_cpu.json").read_text())
    assert len(data["rows"]) == 3
    impls = {r["impl"] for r in data["rows"]}
    assert impls == {"tritamp", "torch sync", "torch BatchNorm2d"}
    for r in data["rows"]:
        assert r["device"] == data["device"] and "torch" in r and "tritamp" in r
        if r["impl"] == "torch sync":
            assert r["note"].startswith("skipped: torch's SyncBatchNorm kernels are CUDA-only")
        else:
            assert r["time_ms"] > 0 and r["bytes"] == 8 * r["params"] * 2
            assert r["ratio_to_torch"] is not None


@pytest.mark.parametrize("cpu_path", [False, True], ids=["triton", "cpu-path"])
def test_an_empty_batch_leaves_the_running_statistics(cpu_path):
    """As torch's BatchNorm: an empty training batch counts in num_batches_tracked and
    changes neither running statistic (it mixed in mean 0 and variance -0)."""
    import contextlib

    from tritamp.testing import force_cpu_path
    for momentum in (0.1, None):
        bn = SyncBatchNorm(3, momentum=momentum)
        ref = nn.BatchNorm2d(3, momentum=momentum)
        for m in (bn, ref):
            m.running_mean.fill_(2.0)
            m.running_var.fill_(3.0)
        x = torch.randn(0, 3, 4, 4, requires_grad=True)
        with force_cpu_path() if cpu_path else contextlib.nullcontext():
            y = bn(x)
        assert y.shape == x.shape
        ref(x.detach())
        assert torch.equal(bn.running_mean, ref.running_mean)
        assert torch.equal(bn.running_var, ref.running_var)
        assert int(bn.num_batches_tracked) == int(ref.num_batches_tracked) == 1


def test_a_second_derivative_raises_instead_of_being_dropped():
    bn = SyncBatchNorm(3)
    x = torch.randn(4, 3, 2, 2, requires_grad=True)
    (gx,) = torch.autograd.grad(bn(x).square().sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable"):
        gx.square().sum().backward()


@pytest.mark.parametrize("dtype", [torch.int64, torch.float64])
def test_input_it_cannot_normalise_is_refused_before_anything_changes(dtype):
    bn = SyncBatchNorm(3)
    before = [bn.running_mean.clone(), bn.running_var.clone(), bn.num_batches_tracked.clone()]
    with pytest.raises(TypeError, match=f"input is {dtype}"):
        bn(torch.ones(4, 3, 2, 2, dtype=dtype))
    after = [bn.running_mean, bn.running_var, bn.num_batches_tracked]
    assert all(torch.equal(a, b) for a, b in zip(before, after))


def test_a_weight_without_bias_as_torchs_batchnorm(device):
    """bias=False (torch's BatchNorm keyword): a weight and no bias, forward, gradients
    and running statistics as torch's; convert_syncbn_model keeps it so."""
    ref = nn.BatchNorm2d(4, bias=False).to(device)
    with torch.no_grad():
        ref.weight.uniform_(0.5, 1.5)
    sync = SyncBatchNorm(4, bias=False).to(device)
    sync.load_state_dict(ref.state_dict())
    assert sync.bias is None and "bias" not in sync.state_dict()
    x = _data((3, 4, 5, 5), torch.float32, device)
    xs, xr = x.clone().requires_grad_(), x.clone().requires_grad_()
    dy = _data((3, 4, 5, 5), torch.float32, device, mean=0.0, seed=7)
    sync(xs).backward(dy)
    ref(xr).backward(dy)
    torch.testing.assert_close(xs.grad, xr.grad, **TOL[torch.float32])
    torch.testing.assert_close(sync.weight.grad, ref.weight.grad, **TOL[torch.float32])
    torch.testing.assert_close(sync.running_var, ref.running_var, **TOL[torch.float32])
    model = nn.Sequential(nn.BatchNorm2d(4), nn.BatchNorm2d(4, bias=False)).to(device)
    conv = convert_syncbn_model(model)
    assert [type(m) for m in conv] == [SyncBatchNorm, SyncBatchNorm]
    assert conv[1].bias is None and conv[0].bias is not None


def test_a_failed_conversion_leaves_the_model_as_it_was():
    bad = nn.BatchNorm1d(3)
    bad.num_features = -1  # (SyncBatchNorm(-1) cannot be built)
    model = nn.Sequential(nn.BatchNorm2d(3), nn.Sequential(nn.BatchNorm1d(3), bad))
    with pytest.raises(RuntimeError):
        convert_syncbn_model(model)
    assert [type(m) for m in (model[0], *model[1])] == [nn.BatchNorm2d, nn.BatchNorm1d,
                                                         nn.BatchNorm1d]


def test_converting_keeps_tritamps_own_layers():
    """A model that already holds SyncBatchNorm layers (converted twice, or built with the
    fused ReLU): they stay, with fuse_relu and channel_last; a given process group is
    theirs afterwards."""
    fused = SyncBatchNorm(3, fuse_relu=True, channel_last=True)
    model = nn.Sequential(fused, nn.BatchNorm1d(3))
    conv = convert_syncbn_model(model)
    assert conv[0] is fused and fused.fuse_relu and fused.channel_last
    assert type(conv[1]) is SyncBatchNorm
    group = object()  # (conversion only records the group)
    assert convert_syncbn_model(conv, process_group=group)[0].process_group is group
    assert convert_syncbn_model(fused) is fused


def test_a_layer_used_twice_becomes_one_syncbatchnorm_in_both_places():
    """named_children() yields a module listed twice under one parent once: the second
    place kept the unconverted BatchNorm (unsynchronised, its running statistics shared
    with the converted one)."""
    bn = nn.BatchNorm2d(3)
    inner = nn.Sequential(bn)
    model = nn.Sequential(bn, nn.ReLU(), bn, inner)
    conv = convert_syncbn_model(model)
    assert type(conv[0]) is SyncBatchNorm
    assert conv[2] is conv[0] and conv[3][0] is conv[0]
    assert sum(type(m) is SyncBatchNorm for m in conv.modules()) == 1


def test_a_torch_syncbatchnorm_keeps_its_process_group():
    group = object()  # (conversion only records the group)
    model = nn.Sequential(nn.SyncBatchNorm(3, process_group=group), nn.BatchNorm1d(3))
    conv = convert_syncbn_model(model)
    assert type(conv[0]) is SyncBatchNorm and conv[0].process_group is group
    assert conv[1].process_group is None
    other = object()
    model = nn.Sequential(nn.SyncBatchNorm(3, process_group=group))
    assert convert_syncbn_model(model, process_group=other)[0].process_group is other


def test_the_residual_may_change_in_place_after_the_forward_without_fused_relu(device):
    """Without the fused ReLU the backward never reads z, so it is not saved: changing z
    in place before the backward is fine (as for torch's bn(x) + z)."""
    sync, ref = _pair(4, 4, device)
    x = _data((2, 4, 3, 3), torch.float32, device)
    z = _data((2, 4, 3, 3), torch.float32, device, seed=3)
    xs, xr = x.clone().requires_grad_(), x.clone().requires_grad_()
    y = sync(xs, z)
    z.add_(1.0)
    y.sum().backward()
    (ref(xr) + z).sum().backward()
    torch.testing.assert_close(xs.grad, xr.grad, **TOL[torch.float32])


def test_fused_relu_passes_the_gradient_where_the_output_is_nan(device):
    """torch.relu's backward zeroes the gradient where its output is <= 0 only: a NaN
    output passes it, so a NaN input gives the bias and residual the gradient torch's
    relu(bn(x) + z) gives them."""
    sync = SyncBatchNorm(3, fuse_relu=True).to(device)
    ref = nn.BatchNorm2d(3).to(device)
    ref.load_state_dict(sync.state_dict())
    x = _data((2, 3, 3, 3), torch.float32, device)
    x[1, 2, 1, 1] = float("nan")
    z = _data((2, 3, 3, 3), torch.float32, device, seed=5)
    dy = _data((2, 3, 3, 3), torch.float32, device, mean=0.0, seed=6)
    zs, zr = z.clone().requires_grad_(), z.clone().requires_grad_()
    sync(x, zs).backward(dy)
    torch.relu(ref(x) + zr).backward(dy)
    torch.testing.assert_close(sync.bias.grad, ref.bias.grad, **TOL[torch.float32])
    torch.testing.assert_close(zs.grad, zr.grad, **TOL[torch.float32])
    assert torch.equal(zs.grad[:, 2], dy[:, 2])  # the NaN channel: every gradient passes


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_an_infinite_output_gradient_gives_infinite_parameter_gradients(device, dtype):
    """An inf in the output gradient (a loss scale's overflow) gives +-inf parameter
    gradients, as torch's: the backward's compensated sums do not turn it into NaN."""
    sync, ref = _pair(3, 4, device)
    sync, ref = sync.to(dtype), ref.to(dtype)
    x = _data((2, 3, 2, 2), dtype, device)
    dy = _data((2, 3, 2, 2), dtype, device, mean=0.0, seed=8)
    dy[0, 1, 0, 0] = float("inf")
    sync(x.clone().requires_grad_()).backward(dy)
    ref(x.clone().requires_grad_()).backward(dy)
    assert sync.bias.grad[1].item() == ref.bias.grad[1].item() == float("inf")
    assert torch.equal(sync.weight.grad.isnan(), ref.weight.grad.isnan())
    assert torch.equal(sync.weight.grad.isinf(), ref.weight.grad.isinf())


def test_eps_is_checked_as_torchs_batch_norm(device):
    x = _data((2, 3, 2, 2), torch.float32, device)
    for eps in (0.0, -1e-5):
        sync, ref = _pair(3, 4, device, eps=eps)
        with pytest.raises(ValueError) as theirs:
            ref(x)
        with pytest.raises(ValueError) as ours:
            sync(x)
        assert str(ours.value) == str(theirs.value)
    sync, ref = _pair(3, 4, device, eps=0.0)
    sync.eval()
    ref.eval()
    torch.testing.assert_close(sync(x), ref(x), **TOL[torch.float32])  # eval: eps = 0 is fine
    sync.eps = ref.eps = -1.0
    with pytest.raises(ValueError, match="must be non-negative, but got -1.0"):
        sync(x)


def test_strided_weight_and_bias_as_torchs_batchnorm(device):
    """A weight and bias that are strided views (torch's BatchNorm takes them): the same
    output, running statistics and gradients, the gradients reaching the views' base."""
    base_s, base_r = (torch.rand(8, device=device) + 0.5 for _ in range(2))
    base_r.copy_(base_s)
    base_s.requires_grad_(), base_r.requires_grad_()
    sync, ref = SyncBatchNorm(4).to(device), nn.BatchNorm2d(4).to(device)
    del sync.weight, sync.bias, ref.weight, ref.bias
    sync.weight, sync.bias = base_s[::2], base_s[1::2]
    ref.weight, ref.bias = base_r[::2], base_r[1::2]
    x = _data((3, 4, 5, 5), torch.float32, device)
    xs, xr = x.clone().requires_grad_(), x.clone().requires_grad_()
    dy = _data((3, 4, 5, 5), torch.float32, device, mean=0.0, seed=7)
    ys, yr = sync(xs), ref(xr)
    torch.testing.assert_close(ys, yr, **TOL[torch.float32])
    ys.backward(dy)
    yr.backward(dy)
    torch.testing.assert_close(xs.grad, xr.grad, **TOL[torch.float32])
    torch.testing.assert_close(base_s.grad, base_r.grad, **TOL[torch.float32])
    torch.testing.assert_close(sync.running_mean, ref.running_mean, **TOL[torch.float32])


@pytest.mark.parametrize("size", [4, 2], ids=["too-long", "too-short"])
@pytest.mark.parametrize("name", ["weight", "bias", "running_mean", "running_var"])
def test_a_wrong_sized_parameter_or_buffer_is_refused_before_anything_changes(name, size):
    # (the kernels refused a wrong-sized weight only after the running statistics had been
    # updated; one too few must be refused by the same check)
    sync = SyncBatchNorm(3)
    setattr(sync, name, (nn.Parameter if name in ("weight", "bias") else lambda t: t)(
        torch.ones(size)))
    before = {k: v.clone() for k, v in sync.state_dict().items()}
    with pytest.raises(RuntimeError, match=rf"^{name} should contain 3 elements not {size}$"):
        sync(torch.randn(4, 3, 2, 2))
    for k, v in sync.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_two_d_input_of_the_wrong_width_says_what_it_reads():
    with pytest.raises(ValueError, match=r"input of shape \(8, 3\) has 3 channels in dimension "
                                         r"1 \(2-D input is \(N, C\)\)"):
        SyncBatchNorm(4)(torch.randn(8, 3))


def _trained_pair(device, **kw):
    """A SyncBatchNorm and torch's BatchNorm2d after one identical training forward."""
    sync, ref = _pair(3, 4, device, **kw)
    x = _data((4, 3, 2, 2), torch.float32, device)
    return sync, ref, x


@pytest.mark.parametrize("what", ["weight (1, C)", "bias (C, 1)", "running_mean strided",
                                  "running_var (1, C)"])
def test_parameters_and_buffers_of_c_elements_in_other_shapes_as_torchs(what, device):
    # torch's BatchNorm forward reads any tensor of C elements (a strided running_mean
    # included) and updates it in place; the kernels read dense vectors: used through
    # one, and copied back (the (1, C) weight was refused after the statistics had
    # moved). Held to torch's BatchNorm with the usual vectors (torch's own CPU backward
    # refuses a (1, C) weight).
    sync, ref, x = _trained_pair(device)
    name = what.split()[0]
    t = getattr(sync, name).detach()
    if "strided" in what:
        new = torch.zeros(6, device=device)[::2]
        new.copy_(t)
    else:
        new = t.reshape((1, 3) if "(1, C)" in what else (3, 1)).clone()
    setattr(sync, name, nn.Parameter(new) if name in ("weight", "bias") else new)
    for _ in range(2):
        xs, xr = x.clone().requires_grad_(), x.clone().requires_grad_()
        ys, yr = sync(xs), ref(xr)
        torch.testing.assert_close(ys, yr, **TOL[torch.float32])
        ys.square().sum().backward()
        yr.square().sum().backward()
        torch.testing.assert_close(xs.grad, xr.grad, **TOL[torch.float32])
    for k in ("running_mean", "running_var"):
        torch.testing.assert_close(getattr(sync, k).reshape(-1), getattr(ref, k),
                                   **TOL[torch.float32])
    assert getattr(sync, name) is new or getattr(sync, name).data_ptr() == new.data_ptr()
    if name in ("weight", "bias"):
        torch.testing.assert_close(getattr(sync, name).grad.reshape(-1),
                                   getattr(ref, name).grad, rtol=1e-5, atol=1e-5)
    assert torch.equal(sync.num_batches_tracked, ref.num_batches_tracked)


@pytest.mark.parametrize("case", ["weight on meta", "int64 running_var", "str momentum"])
def test_a_parameter_buffer_or_momentum_it_cannot_use_is_refused_before_anything_changes(
        case):
    sync = SyncBatchNorm(3)
    if case == "weight on meta":
        sync.weight = nn.Parameter(torch.ones(3, device="meta"))
        kind, match = RuntimeError, r"^Expected all tensors to be on the same device.*weight"
    elif case == "int64 running_var":
        sync.running_var = torch.ones(3, dtype=torch.int64)
        kind, match = RuntimeError, r"^expected scalar type Float but found Long"
    else:
        sync.momentum = "0.1"
        kind, match = TypeError, (r"^batch_norm\(\): argument 'momentum' \(position 7\) must be "
                                  r"float, not str$")
    before = {k: v.clone() for k, v in sync.state_dict().items() if v.device.type != "meta"}
    with pytest.raises(kind, match=match):
        sync(torch.randn(4, 3, 2, 2))
    for k, v in before.items():
        assert torch.equal(sync.state_dict()[k], v), k


@pytest.mark.parametrize("momentum", [True, False])
def test_a_bool_momentum_is_a_factor_of_one_or_zero_as_in_torch(path, momentum):
    # (refused before, in words torch's batch_norm does not give: it takes a bool)
    sync, ref = _pair(3, 4, torch.device("cpu"), momentum=momentum)
    x = _data((4, 3, 2, 2), torch.float32, torch.device("cpu"))
    torch.testing.assert_close(sync(x), ref(x), **TOL[torch.float32])
    torch.testing.assert_close(sync.running_mean, ref.running_mean, **TOL[torch.float32])
    torch.testing.assert_close(sync.running_var, ref.running_var, **TOL[torch.float32])


def test_cumulative_momentum_without_a_count_leaves_the_statistics_as_torchs():
    # torch's BatchNorm with momentum=None and num_batches_tracked=None: factor 0
    sync, ref = _pair(3, 4, torch.device("cpu"), momentum=None)
    for m in (sync, ref):
        m.num_batches_tracked = None
    x = _data((4, 3, 2, 2), torch.float32, torch.device("cpu"))
    torch.testing.assert_close(sync(x), ref(x), **TOL[torch.float32])
    assert torch.equal(sync.running_mean, ref.running_mean)
    assert torch.equal(sync.running_var, ref.running_var)


def test_a_num_batches_tracked_of_several_elements_is_refused_before_it_is_counted(path):
    # (it was advanced in place, then refused by torch on the CPU path, or read at its
    # first element by the kernels)
    bn = SyncBatchNorm(2, momentum=None)
    bn.num_batches_tracked = torch.tensor([2, 2])
    before = [bn.running_mean.clone(), bn.running_var.clone()]
    with pytest.raises(ValueError, match=r"SyncBatchNorm: num_batches_tracked must be one "
                                         r"element on cpu; got torch.int64 of shape \(2,\)"):
        bn(torch.randn(4, 2))
    assert bn.num_batches_tracked.tolist() == [2, 2]
    assert torch.equal(before[0], bn.running_mean) and torch.equal(before[1], bn.running_var)
