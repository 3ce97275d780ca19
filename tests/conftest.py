"""Test set-up: Triton's interpreter runs the kernels on CPU when there is no GPU.

The variable must be set before anything imports ``tritamp.kernels`` (``triton.jit``
reads it when a kernel is defined), which is why it is set here at collection time.
"""
import os

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

try:  # the same examples on every run: a CI failure reproduces, nothing flakes
    from hypothesis import settings as _hypothesis_settings
    _hypothesis_settings.register_profile("tritamp", derandomize=True)
    _hypothesis_settings.load_profile("tritamp")
except ImportError:
    pass

HAS_CUDA = torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    run_perf = os.environ.get("TRITAMP_PERF") == "1"
    for item in items:
        if "gpu" in item.keywords and not HAS_CUDA:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA device; none is present"))
        if "perf" in item.keywords and not run_perf:
            item.add_marker(pytest.mark.skip(reason="performance run; set TRITAMP_PERF=1"))


@pytest.fixture(autouse=True)
def _fresh_amp_state():
    """Every test starts with amp uninitialised and verbosity at Apex's default."""
    from tritamp.testing import reset_amp
    reset_amp()
    yield
    reset_amp()


@pytest.fixture(autouse=True)
def _autograd_left_on():
    """A test that leaves autograd off (a compiled region that raised between its
    grad-mode changes, say) fails itself, instead of every later backward."""
    yield
    if not torch.is_grad_enabled():
        torch.set_grad_enabled(True)
        pytest.fail("the test left autograd off (torch.is_grad_enabled() is False)")


@pytest.fixture(autouse=True)
def _interpreter_setting_kept():
    """A test that changes TRITON_INTERPRET in this process (importing a benchmark module
    that switches the interpreter off, say) fails itself and the setting is put back,
    instead of every later kernel test failing."""
    before = os.environ.get("TRITON_INTERPRET")
    yield
    after = os.environ.get("TRITON_INTERPRET")
    if after != before:
        if before is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = before
        pytest.fail(f"the test changed TRITON_INTERPRET from {before!r} to {after!r} in the "
                    "test process (run what sets it in a subprocess)")


# One tolerance table keyed by dtype (STYLE.md).
TOL = {
    torch.float32: dict(rtol=1.3e-6, atol=1e-5),
    torch.float16: dict(rtol=1e-3, atol=1e-5),
    torch.bfloat16: dict(rtol=1.6e-2, atol=1e-5),
}


class CountingKernel:
    """Stands in for a @triton.jit kernel: records each launch grid, then launches."""

    def __init__(self, kernel):
        self.kernel = kernel
        self.grids = []

    def __getitem__(self, grid):
        self.grids.append(tuple(grid))
        return self.kernel[grid]


@pytest.fixture
def count_launches(monkeypatch):
    """``count_launches(module, "_kernel_name")`` swaps the module's kernel for a
    CountingKernel for the test and returns it."""
    def count(module, name):
        counter = CountingKernel(getattr(module, name))
        monkeypatch.setattr(module, name, counter)
        return counter
    return count


@pytest.fixture
def cpu_path():
    """The test runs the production CPU path (torch's multi-tensor CPU ops) instead of
    the interpreted kernels: every sweep prepared inside it takes that path."""
    from tritamp.testing import force_cpu_path
    with force_cpu_path():
        yield


@pytest.fixture(params=["kernel", "cpu"])
def path(request):
    """Parametrises a test over both CPU-side paths: the Triton kernels (interpreted)
    and the production CPU path. Yields the path's name."""
    if request.param == "kernel":
        yield "kernel"
        return
    from tritamp.testing import force_cpu_path
    with force_cpu_path():
        yield "cpu"


def run_without_sync(step, warmup=3, steps=3):
    """Run ``step`` ``warmup`` times, then ``steps`` times under CUDA's sync-debug mode
    "error", where any host-device synchronisation raises (GPU tests)."""
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(steps):
            step()
    finally:
        torch.cuda.set_sync_debug_mode(0)


# Helpers of the multi-tensor engine's kernel tests.
def all_tensors(*lists):
    """Every tensor of ``lists`` (None lists and None entries left out)."""
    return [t for lst in lists if lst is not None for t in lst if t is not None]


def step_alike(ps, qs, opt, ref, gen, steps=2):
    """Step ``opt`` over ``ps`` and ``ref`` over ``qs`` with the same random gradients
    (from ``gen``) ``steps`` times; the parameters must come out bitwise equal."""
    for _ in range(steps):
        for p, q in zip(ps, qs):
            p.grad = torch.randn(p.shape, generator=gen)
            q.grad = p.grad.clone()
        opt.step()
        ref.step()
    for p, q in zip(ps, qs):
        assert torch.equal(p, q)


def snapshot(tensors):
    return [t.clone() for t in tensors]


def assert_bitwise_unchanged(before, tensors):
    assert len(before) == len(tensors)
    for i, (b, t) in enumerate(zip(before, tensors)):
        assert torch.equal(b, t), f"tensor {i} changed"


def unaligned_copy(t):
    """``t``'s values in a dense tensor of its shape whose address is one element past a
    16-byte boundary: its group takes the masked path (VEC = 1)."""
    buf = torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)
    out = buf[1:].view(t.shape)
    out.copy_(t)
    assert out.data_ptr() % 16 != 0
    return out


@pytest.fixture(scope="session")
def compiled_kernels():
    """Every kernel variant compiled for sm_90 once per session, in a child process
    (tests/aot_compile_kernels.py: this session interprets the kernels), with the compile
    report of the multi-tensor sweeps under "compile_report"."""
    import json
    import subprocess
    import sys
    pytest.importorskip("triton.backends.nvidia")
    here = os.path.dirname(os.path.abspath(__file__))
    root = os.path.dirname(here)
    env = dict(os.environ, TRITON_INTERPRET="0",
               PYTHONPATH=os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p))
    proc = subprocess.run([sys.executable, os.path.join(here, "aot_compile_kernels.py")],
                          capture_output=True, text=True, env=env, timeout=900)
    if proc.returncode != 0 and ("ptxas" in proc.stderr or "No module named 'triton.backends"
                                 in proc.stderr):
        pytest.skip("Triton's CUDA toolchain is not usable here:\n" + proc.stderr[-500:])
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout)


# The amp training step the amp tests share.
def mse(out, y):
    """Mean squared error in fp32 (``out`` may be half: amp's O2/O3 outputs)."""
    return ((out.float() - y) ** 2).mean()


def amp_step(model, opt, x, y=None, loss_fn=mse, factor=None, loss_id=0, zero_grad=True):
    """One training step through amp's public API::

        opt.zero_grad()                                  # unless zero_grad=False
        loss = loss_fn(model(x), y)
        with amp.scale_loss(loss * factor, opt, loss_id=loss_id) as scaled:
            scaled.backward()
        opt.step()

    ``factor`` (None: the loss itself) scripts the gradients: ``float("inf")`` makes
    every gradient non-finite, so a dynamic scaler backs off and the step is skipped.
    Returns ``loss`` detached (without the factor). ``model`` and ``opt`` are what
    ``amp.initialize`` returned."""
    from tritamp import amp
    if zero_grad:
        opt.zero_grad()
    loss = loss_fn(model(x), y)
    with amp.scale_loss(loss if factor is None else loss * factor, opt,
                        loss_id=loss_id) as scaled:
        scaled.backward()
    opt.step()
    return loss.detach()


# Helpers of the CPU-path tests: a tiny model and a few steps on either path.
def tiny_mlp(dtype=torch.float32):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(7, 9), torch.nn.Tanh(),
                               torch.nn.Linear(9, 3)).to(dtype)


def train_steps(model, opt, cpu, steps=3, seed=5):
    """``steps`` optimizer steps on fixed random batches, on the production CPU path
    (``cpu=True``) or the interpreted kernels."""
    from tritamp.testing import force_cpu_path
    gen = torch.Generator().manual_seed(seed)
    dtype = next(model.parameters()).dtype
    for _ in range(steps):
        x = torch.randn(4, 7, generator=gen).to(dtype)
        opt.zero_grad()
        model(x).float().square().mean().backward()
        if cpu:
            with force_cpu_path():
                opt.step()
        else:
            opt.step()


_BITS = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16,
         torch.int32: torch.int32}


def assert_bits_equal(a, b, what=""):
    """Bit for bit, NaN payloads included (``torch.equal`` calls NaN unequal to itself)."""
    assert a.dtype == b.dtype and a.shape == b.shape, what
    assert torch.equal(a.view(_BITS[a.dtype]), b.view(_BITS[b.dtype])), what


def assert_bits_unchanged(before, tensors):
    """:func:`assert_bitwise_unchanged` with NaN payloads compared too."""
    assert len(before) == len(tensors)
    for i, (b, t) in enumerate(zip(before, tensors)):
        assert_bits_equal(b, t, f"tensor {i} changed")


def assert_close_to_ref(ours, ref, what):
    """A CPU path's lists against the oracle's: fp32 within rtol/atol 1e-6 (torch's fused
    kernels round with multiply-adds where the oracle rounds twice), half values within
    one ulp of their dtype (one rounding of such an fp32 value)."""
    if ours is None or ref is None:
        assert ours is ref, what
        return
    assert len(ours) == len(ref)
    for i, (a, b) in enumerate(zip(ours, ref)):
        if a is None:
            assert b is None
            continue
        assert a.dtype == b.dtype and a.shape == b.shape, f"{what}[{i}]"
        if a.dtype == torch.float32:
            tol = dict(rtol=1e-6, atol=1e-6)
        else:
            tol = dict(rtol=torch.finfo(a.dtype).eps, atol=1e-6)
        torch.testing.assert_close(a, b, **tol, msg=lambda m: f"{what}[{i}]: {m}")


def scaled_grads(grads, scale):
    """The gradients as a loss scaled by ``scale`` would give them."""
    if scale is None:
        return grads
    return [(g.float() * scale).to(g.dtype) for g in grads]


def clone_lists(lists):
    """Clones of lists of tensors (None lists and None entries kept)."""
    return [None if x is None else [None if t is None else t.clone() for t in x]
            for x in lists]


class CountOps(TorchDispatchMode):
    """Counts the aten ops a block runs (a foreach or fused op counts once) and the host
    reads of a tensor's value among them (``.item()``, ``bool()``, ``float()``)."""

    def __init__(self):
        super().__init__()
        self.count = 0
        self.host_reads = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        self.host_reads += func is torch.ops.aten._local_scalar_dense.default
        return func(*args, **(kwargs or {}))


def torchrun(script, *args, nproc=2, timeout=300, keep_interpret=False):
    """Run ``script`` under ``torch.distributed.run`` on ``nproc`` CPU processes (a free
    local port, one thread each); returns its stdout, and fails the test with the end of
    its output when it fails. ``TRITON_INTERPRET`` is left to the script unless
    ``keep_interpret`` (by default the ranks take the production CPU path)."""
    import socket
    import subprocess
    import sys
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    if not keep_interpret:
        env.pop("TRITON_INTERPRET", None)
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
           f"--master_port={port}", "--master_addr=127.0.0.1", str(script), *map(str, args)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout
