"""tritamp installs as a pure-Python wheel that carries tritamp.kernels, and importing it
compiles nothing and makes no CUDA call."""
import os
import subprocess
import sys
import zipfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_import_makes_no_cuda_call_and_compiles_nothing(tmp_path):
    code = (
        "import torch, triton\n"
        "import triton.compiler.compiler as cc\n"
        "calls = []\n"
        "real = cc.compile\n"
        "cc.compile = lambda *a, **k: calls.append(1) or real(*a, **k)\n"
        "torch.cuda._lazy_init = lambda: (_ for _ in ()).throw(AssertionError('CUDA init'))\n"
        "import tritamp, tritamp.kernels, tritamp.amp\n"
        "assert not torch.cuda.is_initialized()\n"
        "assert calls == []\n"
        "print('ok')\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=tmp_path, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    out = tmp_path_factory.mktemp("wheel")
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps",
                           "--no-build-isolation", "-q", "-w", str(out), ROOT],
                          capture_output=True, text=True)
    if proc.returncode != 0 and "No module named" in proc.stderr:
        pytest.skip("building a wheel needs setuptools and wheel: " + proc.stderr[-300:])
    assert proc.returncode == 0, proc.stderr[-3000:]
    wheels = [f for f in os.listdir(out) if f.endswith(".whl")]
    assert len(wheels) == 1
    return os.path.join(out, wheels[0])


def test_wheel_is_pure_python_and_ships_the_kernels(wheel):
    assert wheel.endswith("-py3-none-any.whl")
    names = zipfile.ZipFile(wheel).namelist()
    for needed in ("tritamp/__init__.py", "tritamp/amp/__init__.py",
                   "tritamp/kernels/__init__.py", "tritamp/kernels/check_unscale.py",
                   "tritamp/kernels/scale_update.py"):
        assert needed in names
    assert not any(n.startswith(("kernels/", "tests/", "benchmarks/")) for n in names)
    assert not any(n.endswith((".so", ".pyd", ".cu")) for n in names)


def test_non_editable_install_imports_the_kernels(wheel, tmp_path):
    site = tmp_path / "site"
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q",
                           "--target", str(site), wheel], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    code = ("import tritamp, tritamp.kernels as k; "
            "assert tritamp.__file__.startswith(%r), tritamp.__file__; "
            "print(k.check_unscale.__module__)" % str(site))
    env = dict(os.environ, PYTHONPATH=str(site))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=tmp_path, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "tritamp.kernels.check_unscale"


def test_uninstalled_checkout_says_to_install(tmp_path):
    """``import tritamp`` from a checkout that was never installed: one line saying what
    to do, not the circular-import error the missing ``tritamp.kernels`` used to give.
    The copy has no ``kernels`` mapping, as a fresh clone has none; the editable finder
    of this checkout's own install is taken off the path for the child process."""
    import shutil
    shutil.copytree(os.path.join(ROOT, "tritamp"), tmp_path / "tritamp")
    code = ("import sys\n"
            "sys.meta_path[:] = [f for f in sys.meta_path\n"
            "                    if 'editable' not in type(f).__module__.lower()\n"
            "                    and 'editable' not in getattr(f, '__name__', '').lower()]\n"
            "sys.path_hooks[:] = [h for h in sys.path_hooks\n"
            "                     if 'editable' not in getattr(h, '__module__', '').lower()]\n"
            "sys.path.insert(0, %r)\n"
            "import tritamp\n" % str(tmp_path))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=tmp_path)
    assert out.returncode != 0
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: tritamp is not installed"), out.stderr[-2000:]
    assert "pip install -e ." in last and str(tmp_path) in last
    assert "circular" not in out.stderr
