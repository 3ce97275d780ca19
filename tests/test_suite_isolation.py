"""The suite leaves the process it runs in as it found it where a GPU machine depends on it.

On a machine with CUDA, conftest does not set ``TRITON_INTERPRET``: the kernels compile.
A test module (or a helper it imports) that set the variable while pytest collects would
put every later test of the process under Triton's interpreter: torch.compile's own
kernels then fail on CUDA tensors (an H100 run found this through
``tests/scripts/syncbn_worker.py``, imported for its data). CI has no GPU, so this test
imports every test module in a fresh process that reports a CUDA device and has the
variable unset, and names any module after whose import it is set.
"""
import os
import subprocess
import sys
import textwrap

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

SCRIPT = textwrap.dedent("""
    import glob, importlib, json, os, sys
    os.environ.pop("TRITON_INTERPRET", None)
    import torch
    torch.cuda.is_available = lambda: True  # conftest's GPU branch: it sets nothing
    sys.path[:0] = [sys.argv[1], sys.argv[2]]
    leaks = []
    for path in sorted(glob.glob(os.path.join(sys.argv[1], "test_*.py"))):
        name = os.path.basename(path)[:-3]
        try:
            importlib.import_module(name)
        except Exception:  # a module that needs a real device at import: only the variable counts
            pass
        value = os.environ.pop("TRITON_INTERPRET", None)
        if value is not None:
            leaks.append([name, value])
    print(json.dumps(leaks))
""")


def test_collecting_the_suite_sets_no_triton_interpret_where_cuda_is_reported():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", SCRIPT, HERE, ROOT], env=env, cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "[]", (
        "these test modules set TRITON_INTERPRET when imported (module, value): "
        + out.stdout.strip().splitlines()[-1])
