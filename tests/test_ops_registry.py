"""Every op of the registry (tritamp.kernels.registry) on each of its samples: the Triton
kernel (interpreted) and the production CPU path against the op's ``*_ref`` oracle, with
the op's tolerances; and the registry is complete: every public launcher of
``tritamp.kernels`` and every launcher / ``*_ref`` / ``*_cpu`` / ``*_prepare`` /
``*_launch`` of each kernels module is in it, so a new op cannot be left out.

An argument the oracle leaves unchanged (a gradient, an input) must come back bitwise
unchanged from either path. The other outputs (return values, tensors written in place)
are compared with the tolerance the op names for that output, path and dtype; a
tolerance of ``Tol(0, 0)`` is bit for bit (NaN payloads aside).
"""
import importlib
import inspect
import pkgutil
import sys

import pytest
import torch

import conftest
from tritamp import kernels
from tritamp.kernels import registry
from tritamp.testing import force_cpu_path, interpreter_on

OPS = registry.OPS
IDS = [op.name for op in OPS]
_BITS = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16,
         torch.float64: torch.int64}


def same_bits(a, b):
    """Bit for bit, NaN compared equal to NaN whatever its payload."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.dtype not in _BITS:
        return torch.equal(a, b)
    a, b = a.reshape(-1), b.reshape(-1)
    nan_a, nan_b = torch.isnan(a), torch.isnan(b)
    bits = _BITS[a.dtype]
    return torch.equal(nan_a, nan_b) and torch.equal(a.view(bits)[~nan_a], b.view(bits)[~nan_b])


def mismatches(op, path, sample, before, ours, theirs):
    """What differs between the launcher's outputs and the oracle's, as messages."""
    bad = []
    names = [n for n, _ in theirs]
    if [n for n, _ in ours] != names:
        return [f"outputs {[n for n, _ in ours]} != the oracle's {names}"]
    for (name, a), (_, e) in zip(ours, theirs):
        if a is None or e is None:
            if (a is None) != (e is None):
                bad.append(f"{name}: {a is None and 'None' or 'a tensor'} where the oracle "
                           f"gives {e is None and 'None' or 'a tensor'}")
            continue
        if a.dtype != e.dtype or a.shape != e.shape:
            bad.append(f"{name}: {a.dtype} {tuple(a.shape)} != {e.dtype} {tuple(e.shape)}")
            continue
        if name in before and same_bits(before[name], e):
            if not same_bits(before[name], a):
                bad.append(f"{name}: changed; the oracle leaves it unchanged")
            continue
        tol = op.tolerance(path, name, a.dtype)
        if tol.exact:
            if not same_bits(a, e):
                diff = (a.double() - e.double()).abs().nan_to_num(float("inf")).max().item()
                bad.append(f"{name}: not bit for bit (largest difference {diff:g})")
            continue
        try:
            torch.testing.assert_close(a, e, rtol=tol.rtol, atol=tol.atol, equal_nan=True)
        except AssertionError as err:
            bad.append(f"{name} ({tol}): " + " ".join(
                line.strip() for line in str(err).splitlines() if line.strip()))
    return [f"{op.name} [{sample.name}] on the {path} path: {m}" for m in bad]


class Spy:
    """Counts the calls of a module-level function the launcher looks up at call time."""

    def __init__(self, fn):
        self.fn, self.calls = fn, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.fn(*args, **kwargs)


def run_launcher(op, sample, path, monkeypatch):
    """The launcher on ``sample`` down ``path``; (result, calls of op.cpu, calls of op.ref
    made by the launcher)."""
    spies = {}
    with monkeypatch.context() as m:
        for key, fn in (("cpu", op.cpu), ("ref", op.ref)):
            if fn is not None:
                spies[key] = Spy(fn)
                m.setattr(sys.modules[fn.__module__], fn.__name__, spies[key])
        if path == "cpu":
            with force_cpu_path():
                result = sample.call(op.launcher)
        else:
            result = sample.call(op.launcher)
    return result, {k: s.calls for k, s in spies.items()}


@pytest.mark.parametrize("path", registry.PATHS)
@pytest.mark.parametrize("op", OPS, ids=IDS)
def test_launcher_matches_its_ref_on_every_sample(op, path, monkeypatch):
    if path == "kernel" and not interpreter_on():
        pytest.skip("the kernels run on CPU tensors only under TRITON_INTERPRET=1")
    samples = op.sample_inputs()
    assert samples, op.name
    bad = []
    for sample in samples:
        mine, ref = sample.clone(), sample.clone()
        before = dict(op.arguments(sample))
        result, calls = run_launcher(op, mine, path, monkeypatch)
        expected = ref.call(op.ref)
        bad += mismatches(op, path, sample, before, op.outputs(mine, result),
                          op.outputs(ref, expected))
        if path == "kernel":
            # the Triton kernel ran: neither the CPU path nor the oracle
            assert calls == {k: 0 for k in calls}, (op.name, sample.name, calls)
        elif op.cpu is not None:
            assert calls["cpu"] >= 1 and calls["ref"] == 0, (op.name, sample.name, calls)
    assert bad == []


# --------------------------------------------------------------------------------------
# The registry is complete and well formed
# --------------------------------------------------------------------------------------

def _registered():
    fns = set()
    for op in OPS:
        fns.update(f for f in (op.launcher, op.ref, op.cpu, op.prepare, op.launch) if f)
    return fns


# Public helpers of tritamp.kernels that are not ops: where a kernel runs, its block
# settings, the scaler's slot arithmetic.
NOT_OPS = {"use_triton", "interpreter_on", "elementwise_settings", "other_found_slot"}


def test_every_public_launcher_of_the_package_is_registered():
    fns = _registered()
    missing = [name for name in kernels.__all__
               if inspect.isfunction(getattr(kernels, name)) and name not in NOT_OPS
               and getattr(kernels, name) not in fns]
    assert missing == []


def _kernel_modules():
    for info in pkgutil.iter_modules(kernels.__path__):
        # registry, recorder, engine, launch and rounding hold no kernel: the table, the
        # launch recorder, the engine's public re-exports, the kept launches, and the
        # optimizers' bf16 store (device helpers and the oracle every optimizer's
        # *_ref calls, held to it through those ops)
        if info.name.startswith("_") or info.name in ("registry", "recorder", "engine",
                                                       "launch", "rounding"):
            continue
        yield importlib.import_module(f"{kernels.__name__}.{info.name}")


def test_every_launcher_ref_pair_of_every_kernel_module_is_registered():
    pairs = {(op.launcher, op.ref) for op in OPS}
    roles = {"_cpu": {op.cpu for op in OPS}, "_prepare": {op.prepare for op in OPS},
             "_launch": {op.launch for op in OPS}}
    modules = list(_kernel_modules())
    assert len(modules) >= 10
    missing = []
    for mod in modules:
        own = {name: fn for name, fn in vars(mod).items()
               if inspect.isfunction(fn) and fn.__module__ == mod.__name__
               and not name.startswith("_")}
        if not any(op.launcher.__module__ == mod.__name__ for op in OPS):
            missing.append(f"{mod.__name__}: no op registered")
        for name, fn in own.items():
            if name.endswith("_ref"):
                launcher = own.get(name[:-len("_ref")])
                if (launcher, fn) not in pairs:
                    missing.append(f"{mod.__name__}.{name[:-4]} / {name}")
            for suffix, registered in roles.items():
                if name.endswith(suffix) and fn not in registered:
                    missing.append(f"{mod.__name__}.{name}")
    assert missing == []


@pytest.mark.parametrize("op", OPS, ids=IDS)
def test_entry_is_well_formed(op):
    assert op.ref.__name__ == op.launcher.__name__ + "_ref"
    assert op.ref.__module__ == op.launcher.__module__
    if op.cpu is not None:
        assert op.cpu.__name__.endswith("_cpu") and op.cpu.__module__ == op.launcher.__module__
    assert (op.prepare is None) == (op.launch is None)
    if op.prepare is not None:
        assert op.prepare.__name__[:-len("_prepare")] == op.launch.__name__[:-len("_launch")]
    assert set(op.tol) == set(registry.PATHS)
    tables = [op.tol[p] for p in registry.PATHS]
    tables += [t for per_path in op.output_tol.values() for t in per_path.values()]
    for table in tables:
        assert all(isinstance(k, torch.dtype) and isinstance(v, registry.Tol)
                   for k, v in table.items())
    for path in op.output_tol.values():
        assert set(path) <= set(registry.PATHS)
    samples = op.sample_inputs()
    assert {s.dtype for s in samples} == set(op.dtypes)
    assert len({s.name for s in samples}) == len(samples), "sample names repeat"
    if op.multi_tensor:
        # its sweeps are found in the compile report by this prefix, held to this budget
        module = sys.modules[op.launcher.__module__]
        assert any(name.lstrip("_").startswith(op.kernel_family) and name.endswith("_kernel")
                   for name in vars(module)), op.kernel_family
        assert isinstance(op.register_budget, int) and op.register_budget > 0
        # odd shapes: one element, a partial block, a 2-D tensor
        for s in samples:
            shapes = {tuple(t.shape) for _, t in op.arguments(s) if t is not None}
            assert set(registry.SHAPES) <= shapes, (s.name, shapes)


def test_multi_tensor_samples_take_the_shapes_asked_for():
    shapes = [(8,), (7,)]
    for op in OPS:
        if op.multi_tensor:
            for s in op.sample_inputs("cpu", shapes):
                first_list = next(a for a in s.args if isinstance(a, list))
                assert [tuple(t.shape) for t in first_list] == shapes, (op.name, s.name)


def test_tolerance_table_is_the_tests_table():
    assert {dt: t.as_dict() for dt, t in registry.TORCH_TOL.items()} == conftest.TOL


def test_every_benchmark_row_makes_a_sample_of_its_op():
    rows = [(op, row, make) for op in OPS for row, make in op.benchmarks.items()]
    assert {"amp check", "amp unscale->fp32", "l2norm"} <= {row for _, row, _ in rows}
    for op, row, make in rows:
        sample, nbytes = make([(3, 5), (7,)], torch.device("cpu"))
        assert nbytes > 0
        op.arguments(sample)  # binds to the launcher's signature
