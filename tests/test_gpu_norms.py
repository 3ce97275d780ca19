"""CUDA checks for the fused norms: compiled kernels against torch at transformer widths
(one-pass and chunked rows), and the custom ops under torch.compile with inductor.

Skipped (with a reason) where no CUDA device is present; CI has none.
"""
import pytest
import torch
import torch.nn.functional as F

from tritamp.normalization import FusedLayerNorm, FusedRMSNorm

pytestmark = pytest.mark.gpu


def _grads(m, x, dy):
    x = x.detach().clone().requires_grad_()
    y = m(x)
    y.backward(dy)
    return [y, x.grad] + [p.grad for p in m.parameters()]


@pytest.mark.parametrize("width", [1024, 4000, 16384, 20000])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("cls", [FusedLayerNorm, FusedRMSNorm])
def test_cuda_matches_torch(cls, dtype, width):
    torch.manual_seed(0)
    ours = cls(width).cuda().to(dtype)
    with torch.no_grad():
        for p in ours.parameters():
            p.copy_(1 + 0.3 * torch.randn_like(p))
    ref = (torch.nn.LayerNorm if cls is FusedLayerNorm else torch.nn.RMSNorm)(width, eps=1e-5)
    ref = ref.cuda().to(dtype)
    ref.load_state_dict(ours.state_dict())
    x = torch.randn(64, width, device="cuda").to(dtype)
    dy = torch.randn(64, width, device="cuda").to(dtype)
    tol = {torch.float32: dict(rtol=1e-4, atol=1e-4), torch.float16: dict(rtol=1e-2, atol=1e-2),
           torch.bfloat16: dict(rtol=5e-2, atol=5e-2)}[dtype]
    for a, b in zip(_grads(ours, x, dy), _grads(ref, x, dy)):
        torch.testing.assert_close(a.float(), b.float(), **tol)


def test_inductor_compiles_around_the_custom_ops():
    torch.manual_seed(0)
    m = FusedLayerNorm(2048).cuda()
    x = torch.randn(8, 2048, device="cuda", requires_grad=True)
    eager = m(x)
    compiled = torch.compile(lambda t: m(t) * 2 + 1, fullgraph=True)
    out = compiled(x)
    torch.testing.assert_close(out, eager * 2 + 1, rtol=1e-5, atol=1e-5)
    out.sum().backward()
    assert x.grad is not None and m.weight.grad is not None


def test_half_input_fp32_weight_matches_fp32_reference():
    torch.manual_seed(0)
    m = FusedLayerNorm(4096).cuda()
    x = torch.randn(32, 4096, device="cuda").half()
    y = m(x)
    assert y.dtype == torch.float16
    torch.testing.assert_close(y.float(), F.layer_norm(x.float(), (4096,), m.weight, m.bias, 1e-5),
                               rtol=1e-3, atol=1e-3)
