"""tritamp.kernels.launch: kept variants launched directly run what Triton would run.

A kept launch skips ``JITFunction.run`` only when its key says Triton would bind the same
variant. The child process (compiled-mode kernels, launch recorder) launches the
LayerNorm forward kernel with arguments that change every property Triton specialises
on (dtype, 16-byte alignment, integers equal to 1 or multiples of 16, int32/int64), once
through ``kernel[grid](...)`` and once through a :class:`KeptKernel`, and compares the
variants the two recorded launches used; it also counts the calls that went through
``JITFunction.run``.
"""
import json
import os
import subprocess
import sys
import textwrap

import torch

from tritamp.kernels.launch import KeptKernel, arg_key

CHILD = textwrap.dedent(r"""
    import json, os
    os.environ["TRITON_INTERPRET"] = "0"
    import torch
    from tritamp.kernels import layer_norm as L
    from tritamp.kernels.launch import KeptKernel
    from tritamp.kernels.recorder import record_launches

    fn = L._layer_norm_fwd_kernel
    kept = KeptKernel(fn)
    runs = [0]
    plain_run = fn.run

    def counting_run(*args, **kwargs):
        runs[0] += 1
        return plain_run(*args, **kwargs)

    fn.run = counting_run
    ce = dict(IS_RMS=False, HAS_WEIGHT=True, HAS_BIAS=True, ONE_PASS=True,
              EMULATE_BF16_ROUNDING=False, BLOCK=1024, num_warps=4)
    ck = tuple(ce.values())

    def case(dtype, offset, stride, n):
        buf = torch.zeros(4096 + offset, dtype=dtype)
        x = buf[offset:offset + 2048]
        y = torch.zeros(2048, dtype=dtype)
        w = torch.ones(1024, dtype=dtype)
        b = torch.zeros(1024, dtype=dtype)
        st = torch.zeros(2)
        return (x, y, w, b, st, st, stride, n, 1e-5)

    cases = {
        "bf16": case(torch.bfloat16, 0, 1024, 1024),
        "fp32": case(torch.float32, 0, 1024, 1024),
        "misaligned": case(torch.bfloat16, 1, 1024, 1024),
        "stride_odd": case(torch.bfloat16, 0, 1025, 1024),
        "stride_one": case(torch.bfloat16, 0, 1, 1024),
        "n_odd": case(torch.bfloat16, 0, 1024, 1000),
        "stride_int64": case(torch.bfloat16, 0, 1 << 33, 1024),
    }
    out = {"same": {}, "keys": {}}
    with record_launches() as rec:
        for rnd in range(2):
            for name, args in cases.items():
                fn[(2,)](*args, **ce)
                plain = rec.launches[-1]
                kept.launch((2,), args, ce, ck)
                mine = rec.launches[-1]
                out["same"][name] = (plain.specialisation is mine.specialisation
                                     and mine.grid == (2, 1, 1))
                out["keys"][name] = plain.specialisation.key
        out["runs_in_first"] = runs[0]
        out["kept"] = len(kept)
        # the first round's kept calls went through Triton, the second round's did not
    runs[0] = 0
    with record_launches() as rec:  # new caches: nothing kept survives them
        kept.launch((3,), cases["bf16"], ce, ck)
        kept.launch((3,), cases["bf16"], ce, ck)
        out["second_session"] = [[l.name, list(l.grid)] for l in rec.launches]
        out["runs_in_second"] = runs[0]
        out["specs_in_second"] = len(rec.specialisations)
        from tritamp.kernels.launch import forget_all
        forget_all()  # the next launch is bound by Triton again (a cache hit: no new variant)
        kept.launch((3,), cases["bf16"], ce, ck)
        out["runs_after_forget"] = runs[0]
        out["specs_after_forget"] = len(rec.specialisations)
    print(json.dumps(out))
""")


def _run_child():
    env = dict(os.environ, TRITON_INTERPRET="0")
    proc = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True,
                          env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_kept_launches_use_the_variant_triton_would_bind():
    out = _run_child()
    assert all(out["same"].values()), out["same"]
    # the cases really are different variants: each property changes Triton's key
    assert len(set(out["keys"].values())) == len(out["keys"]), out["keys"]
    n = len(out["keys"])
    # round 1: n plain + n kept (first use) through JITFunction.run; round 2: n plain only
    assert out["runs_in_first"] == 3 * n
    assert out["kept"] == n
    assert out["second_session"] == [["_layer_norm_fwd_kernel", [3, 1, 1]]] * 2
    assert out["runs_in_second"] == 1 and out["specs_in_second"] == 1
    assert out["runs_after_forget"] == 2 and out["specs_after_forget"] == 1


def test_arg_key_is_what_triton_specialises_on():
    base = torch.zeros(64)
    assert arg_key(base) == (torch.float32, True)
    assert arg_key(base[1:]) == (torch.float32, False)
    assert arg_key(base.to(torch.bfloat16)) == (torch.bfloat16, True)
    assert arg_key(1) != arg_key(17) != arg_key(16)
    assert arg_key(16) == arg_key(32)
    assert arg_key(17) == arg_key(33)
    assert arg_key(1 << 31) != arg_key(1 << 4) and arg_key(1 << 31) == arg_key(1 << 32)
    assert arg_key(1 << 63) != arg_key(1 << 32)
    assert arg_key(1e-5) is float and arg_key(None) is type(None) and arg_key(True) is bool


def test_interpreted_kernels_take_the_usual_call():
    from tritamp.kernels import layer_norm as L
    kept = KeptKernel(L._layer_norm_fwd_kernel)
    from triton.runtime.jit import JITFunction
    assert kept.direct is isinstance(L._layer_norm_fwd_kernel, JITFunction)
