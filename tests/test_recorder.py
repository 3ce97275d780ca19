"""tritamp.kernels.recorder: the CUDA code path, specialised by Triton, without a GPU.

The recorder needs compiled-mode kernels (``TRITON_INTERPRET=0`` when tritamp is
imported) and swaps Triton's active driver; this session runs the interpreter. So the
recording tests run in a child process that prints what it saw as JSON; the refusal
under the interpreter and the torch launch counter run here.
"""
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

CHILD = textwrap.dedent(r"""
    import json, os
    os.environ["TRITON_INTERPRET"] = "0"
    import torch
    from triton.runtime import driver
    from triton.runtime.jit import JITFunction
    from tritamp.kernels import adam
    from tritamp.kernels.recorder import record_launches

    out = {}
    # A kernel with a cache entry of its own from before: it must come back untouched.
    sentinel = object()
    adam._adam_step_kernel.device_caches[7] = sentinel
    do_compile = JITFunction.__dict__["_do_compile"]
    active = driver._active

    def lists(numels, gdt, cdt):
        ps = [torch.zeros(n) for n in numels]
        return dict(params=ps, grads=[torch.zeros(n, dtype=gdt) for n in numels],
                    exp_avgs=[torch.zeros(n) for n in numels],
                    exp_avg_sqs=[torch.zeros(n) for n in numels],
                    steps=[torch.zeros(()) for _ in numels],
                    copies=None if cdt is None else [torch.zeros(n, dtype=cdt) for n in numels])

    hyper = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0,
                 grad_scale=torch.full((), 8.0), found_inf=torch.zeros(()))
    aligned = lists([2048, 16, 1000], torch.float16, torch.float16)
    odd = lists([2048, 7], torch.bfloat16, None)
    with record_launches() as rec:
        out["driver_target"] = str(driver.active.get_current_target())
        adam.adam_step(**aligned, **hyper)
        out["after_first"] = len(rec.specialisations)
        adam.adam_step(**aligned, **hyper)
        out["after_second"] = len(rec.specialisations)
        adam.adam_step(**odd, **hyper)
        out["specs"] = [s.as_dict() for s in rec.specialisations]
        out["launches"] = [[l.name, list(l.grid)] for l in rec.launches]
        out["counts"] = rec.counts()
        # the recorded variant compiles as recorded (same attrs: 16-byte alignment)
        out["step_values"] = [float(s) for s in aligned["steps"]]
        out["param_touched"] = bool(aligned["params"][0].abs().sum() != 0)
    out["restored_driver"] = driver._active is active
    out["restored_do_compile"] = JITFunction.__dict__["_do_compile"] is do_compile
    caches = adam._adam_step_kernel.device_caches
    out["restored_caches"] = caches.get(7) is sentinel and 0 not in caches
    out["forced_after"] = __import__("tritamp.kernels._dispatch", fromlist=["x"]).gpu_path_forced()
    # an exception inside the block restores everything too
    try:
        with record_launches():
            raise KeyError("boom")
    except KeyError:
        pass
    out["restored_after_error"] = (driver._active is active
                                   and JITFunction.__dict__["_do_compile"] is do_compile)
    print(json.dumps(out))
""")


@pytest.fixture(scope="module")
def child():
    pytest.importorskip("triton.backends.nvidia")
    env = dict(os.environ, TRITON_INTERPRET="0")
    proc = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True,
                          env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_stand_in_driver_reports_hopper(child):
    assert "cuda" in child["driver_target"] and "90" in child["driver_target"]


def test_first_call_records_one_specialisation_second_call_hits_the_cache(child):
    assert child["after_first"] == 1
    assert child["after_second"] == 1
    assert child["counts"] == {"_adam_step_kernel": 3}


def test_aligned_group_is_specialised_for_16_byte_vectors(child):
    spec = child["specs"][0]
    assert spec["kernel"] == "_adam_step_kernel"
    assert spec["module"] == "tritamp.kernels.adam"
    assert spec["signature"]["p_proto"] == "*fp32"
    assert spec["signature"]["g_proto"] == "*fp16"
    assert spec["signature"]["c_proto"] == "*fp16"
    cx = spec["constexprs"]
    assert cx["VEC"] == 8 and cx["BLOCK"] == 1024 and cx["HAS_COPIES"] is True
    assert cx["EMULATE_BF16_ROUNDING"] is False     # the GPU path, not the interpreter's
    assert spec["num_warps"] == 4
    # Triton proved every pointer 16-byte aligned, as it would on the GPU
    for name in ("meta_ptr", "blocks_ptr", "counters_ptr", "p_proto", "g_proto", "c_proto"):
        assert name in spec["aligned"], name


def test_odd_sized_group_takes_the_masked_path(child):
    assert len(child["specs"]) == 2
    spec = child["specs"][1]
    assert spec["signature"]["g_proto"] == "*bf16"
    assert spec["constexprs"]["VEC"] == 1
    assert spec["constexprs"]["HAS_COPIES"] is False


def test_launch_grids_are_the_block_counts(child):
    # 2048 + 16 + 1000 elements in blocks of 1024: 2 + 1 + 1 programs
    assert child["launches"][0] == ["_adam_step_kernel", [4, 1, 1]]
    assert child["launches"][2] == ["_adam_step_kernel", [3, 1, 1]]


def test_nothing_runs(child):
    assert child["step_values"] == [0.0, 0.0, 0.0]   # steps advance in the kernel only
    assert child["param_touched"] is False


def test_everything_is_restored(child):
    assert child["restored_driver"]
    assert child["restored_do_compile"]
    assert child["restored_caches"]
    assert child["forced_after"] is False
    assert child["restored_after_error"]


CACHE_CHILD = textwrap.dedent(r"""
    import json, os, tempfile
    os.environ["TRITON_INTERPRET"] = "0"
    import torch
    from triton.runtime.jit import JITFunction
    from tritamp.kernels.recorder import record_launches
    from tritamp.normalization import fused_layer_norm_affine

    x = torch.zeros(64, 768, dtype=torch.bfloat16)
    w, b = torch.ones(768, dtype=torch.bfloat16), torch.zeros(768, dtype=torch.bfloat16)
    do_compile = JITFunction.__dict__["_do_compile"]

    def entries(d):
        return len(os.listdir(d)) if os.path.isdir(d) else 0

    def launch_as_on_the_device():
        # Triton's own compile, through its cache; the stand-in driver cannot launch
        compiled = []
        def counting(self, *args, **kwargs):
            compiled.append(self.__name__)
            return do_compile(self, *args, **kwargs)
        with record_launches():
            JITFunction._do_compile = counting  # (the recorder restores it on exit)
            try:
                with torch.no_grad():
                    fused_layer_norm_affine(x, w, b, (768,), 1e-5)
            except Exception:
                pass
        return compiled

    out = {}
    for phase in ("launch only", "recorded and compiled first"):
        cache = os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp()
        if phase != "launch only":
            with record_launches() as rec, torch.no_grad():
                fused_layer_norm_affine(x, w, b, (768,), 1e-5)
            for spec in rec.specialisations:
                spec.compile()
        before = entries(cache)
        compiled = launch_as_on_the_device()
        out[phase] = dict(before=before, after=entries(cache), compiled=compiled)
    print(json.dumps(out))
""")


def test_a_recorded_compile_is_the_cache_entry_the_launch_loads():
    """Specialisation.compile() stores its kernel in Triton's cache under the key the
    device launch of the same call computes: the GPU report's compile report, run first,
    saves the later steps those compiles."""
    pytest.importorskip("triton.backends.nvidia")
    env = dict(os.environ, TRITON_INTERPRET="0")
    proc = subprocess.run([sys.executable, "-c", CACHE_CHILD], capture_output=True,
                          text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    fresh, warm = out["launch only"], out["recorded and compiled first"]
    # the launch reaches Triton's compile: on an empty cache it adds the kernel ...
    assert (fresh["before"], fresh["after"]) == (0, 1)
    assert fresh["compiled"] == ["_layer_norm_fwd_kernel"]
    # ... and after the recorded compile it finds it there: no second entry
    assert (warm["before"], warm["after"]) == (1, 1)
    assert warm["compiled"] == ["_layer_norm_fwd_kernel"]


def test_refuses_interpreted_kernels():
    from tritamp.kernels import interpreter_on
    from tritamp.kernels.recorder import record_launches
    if not interpreter_on():
        pytest.skip("this session compiles kernels; the refusal concerns the interpreter")
    from tritamp.testing import gpu_path_forced
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=0"):
        with record_launches():
            pass
    assert not gpu_path_forced()


def test_torch_launch_counter_skips_views_and_allocations():
    from tritamp.kernels.recorder import count_torch_launches
    x = torch.ones(4, 4)
    with count_torch_launches() as count:
        y = x.view(16)[2:]          # views: nothing launched
        torch.empty(8)               # allocation: nothing launched
        z = y * 2                    # one kernel
        torch._foreach_add_([x, z], 1.0)   # one foreach launch
        z.sum().item()               # one reduction, then a host read
    assert count.by_op == {"mul": 1, "_foreach_add_": 1, "sum": 1}
    assert count.launches == 3
    assert count.host_reads == {"_local_scalar_dense": 1}
