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


NORM_CHILD = textwrap.dedent(r"""
    import json, os
    os.environ["TRITON_INTERPRET"] = "0"
    import torch
    from tritamp.kernels import layer_norm as L
    from tritamp.kernels.recorder import record_launches

    checks = []   # per keyed launch: did it use the variant kernel[grid](...) binds?
    plain_calls = [0]

    class Watch:
        def __init__(self, kept):
            self.kept = kept

        def launch_keyed(self, grid, args, constexprs, key):
            out = self.kept.launch_keyed(grid, args, constexprs, key)
            mine = rec.launches[-1].specialisation
            self.kept.fn[grid](*args, **constexprs)
            checks.append([self.kept.fn.__name__, rec.launches[-1].specialisation is mine])
            return out

        def launch(self, grid, args, constexprs, ckey):
            plain_calls[0] += 1
            return self.kept.launch(grid, args, constexprs, ckey)

    L._FWD, L._BWD, L._REDUCE = Watch(L._FWD), Watch(L._BWD), Watch(L._REDUCE)

    def rows(m, n, dtype, offset=0, row_stride=None):
        row_stride = row_stride or n
        buf = torch.randn(m * row_stride + offset).to(dtype)
        return buf[offset:offset + m * row_stride].view(m, row_stride)[:, :n]

    cases = {
        "bf16": dict(x=rows(4, 1024, torch.bfloat16), wd=torch.bfloat16),
        "fp32 n=1000": dict(x=rows(4, 1000, torch.float32), wd=torch.float32),
        "fp16 x fp32 w": dict(x=rows(4, 768, torch.float16), wd=torch.float32),
        "rows of stride 1040": dict(x=rows(4, 1024, torch.bfloat16, row_stride=1040),
                                    wd=torch.bfloat16),
        # each differs from "bf16" in one int only, which Triton specialises on
        "rows of stride 1025": dict(x=rows(4, 1024, torch.bfloat16, row_stride=1025),
                                    wd=torch.bfloat16),
        "bf16 n=1000": dict(x=rows(4, 1000, torch.bfloat16), wd=torch.bfloat16),
        "rms no bias": dict(x=rows(4, 512, torch.bfloat16), wd=torch.bfloat16, rms=True),
        "no weight": dict(x=rows(4, 512, torch.float32), wd=None),
        "two-pass reduce": dict(x=rows(2048, 256, torch.bfloat16), wd=torch.bfloat16),
        "from output": dict(x=rows(4, 1024, torch.bfloat16), wd=torch.bfloat16, me=True),
        "misaligned": dict(x=rows(4, 1024, torch.bfloat16, offset=1), wd=torch.bfloat16),
    }
    out = {}
    with record_launches() as rec:
        for name, c in cases.items():
            x, n, rms, me = c["x"], c["x"].shape[-1], c.get("rms", False), c.get("me", False)
            w = None if c["wd"] is None else torch.randn(n).to(c["wd"])
            b = None if c["wd"] is None or rms else torch.randn(n).to(c["wd"])
            before_checks, before_plain = len(checks), plain_calls[0]
            for _ in range(2):  # the second call launches kept variants
                y, mean, rstd = L.layer_norm_fwd(x, n, w, b, 1e-5, rms)
                dy = torch.randn(y.shape).to(y.dtype)
                L.layer_norm_bwd(dy, y if me else x, n, w, b, mean, rstd, rms,
                                 from_output=me)
            out[name] = dict(keyed=len(checks) - before_checks,
                             plain=plain_calls[0] - before_plain)
    out["all_same"] = all(same for _, same in checks)
    out["kernels"] = sorted({name for name, _ in checks})
    print(json.dumps(out))
""")


def test_the_norms_keyed_launches_use_the_variant_triton_would_bind():
    """The norm launchers key their launches themselves when every pointer is aligned
    (launch_keyed): every such launch, over dtypes, widths that are and are not multiples
    of 16, strided rows, RMSNorm, no weight, the two-pass reduction and the backward from
    the output, ran the variant kernel[grid](...) binds for the same arguments; a
    misaligned input takes the computed key."""
    env = dict(os.environ, TRITON_INTERPRET="0")
    proc = subprocess.run([sys.executable, "-c", NORM_CHILD], capture_output=True, text=True,
                          env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["all_same"]
    assert out["kernels"] == ["_layer_norm_bwd_kernel", "_layer_norm_bwd_reduce_kernel",
                              "_layer_norm_fwd_kernel"]
    for name in ("bf16", "fp32 n=1000", "fp16 x fp32 w", "rows of stride 1040",
                 "rows of stride 1025", "bf16 n=1000", "rms no bias", "two-pass reduce",
                 "from output"):
        assert out[name]["keyed"] >= 6 and out[name]["plain"] == 0, (name, out[name])
    assert out["two-pass reduce"]["keyed"] == 8, out["two-pass reduce"]  # 2 x (fwd, bwd, 2 reduce)
    assert out["no weight"] == dict(keyed=4, plain=0)  # no weight gradient: no reduction
    # the misaligned input's forward and backward row kernels take the computed key
    assert out["misaligned"]["plain"] == 4 and out["misaligned"]["keyed"] == 2


def test_host_cdiv_and_next_power_of_2_give_tritons_results():
    """The launchers' host arithmetic (triton.cdiv / next_power_of_2 are constexpr
    functions costing about 2 us a host call in Triton 3.8)."""
    import triton

    from tritamp.testing import host_cdiv as cdiv
    from tritamp.testing import host_next_power_of_2 as next_power_of_2
    values = list(range(0, 4200)) + [(1 << k) + d for k in range(1, 63) for d in (-1, 0, 1)]
    assert [next_power_of_2(n) for n in values] == [triton.next_power_of_2(n) for n in values]
    pairs = [(a, b) for a in range(0, 300) for b in range(1, 40)] + [(1 << 40, 3), (7, 1 << 33)]
    assert [cdiv(a, b) for a, b in pairs] == [triton.cdiv(a, b) for a, b in pairs]


STEADY_CHILD = textwrap.dedent(r"""
    import json, os
    os.environ["TRITON_INTERPRET"] = "0"
    import torch
    from triton.runtime.jit import JITFunction
    from tritamp.kernels.l2norm import multi_tensor_l2norm
    from tritamp.kernels.novograd import novograd_step
    from tritamp.kernels.recorder import record_launches
    from tritamp.kernels.scale_update import scale_update, STATE_SIZE
    from tritamp.parallel import SyncBatchNorm

    bound = []
    plain_run = JITFunction.run

    def counting_run(self, *args, **kwargs):
        bound.append(self.__name__)
        return plain_run(self, *args, **kwargs)

    ps = [torch.randn(n) for n in (5, 300, 17)]
    gs = [torch.randn(n) for n in (5, 300, 17)]
    m = [torch.zeros(n) for n in (5, 300, 17)]
    v = [torch.zeros(()) for _ in ps]
    steps = [torch.zeros(()) for _ in ps]
    state = torch.zeros(STATE_SIZE)
    state[0] = 1024.0
    bn = SyncBatchNorm(8)
    x = torch.randn(4, 8, 3, 3, requires_grad=True)
    calls = {
        "scale_update": lambda: scale_update(state),
        "l2norm": lambda: multi_tensor_l2norm(gs),
        "novograd": lambda: novograd_step(ps, gs, m, v, steps, lr=1e-2, beta1=0.95,
                                          beta2=0.98, eps=1e-8, weight_decay=0.0),
        "syncbn": lambda: bn(x).sum().backward(),
    }
    out = {}
    with record_launches() as rec:
        for name, call in calls.items():
            call()  # first call: Triton binds (and the recorder records) each variant
            rec.launches.clear()
            bound.clear()
            JITFunction.run = counting_run
            try:
                call()
            finally:
                JITFunction.run = plain_run
            out[name] = dict(launched=sorted({l.name for l in rec.launches}),
                             bound=sorted(set(bound)))
    print(json.dumps(out))
""")


def test_steady_calls_launch_every_kernel_without_tritons_binding():
    """The loss scaler's update, the l2-norm's segment pass, NovoGrad's blend and every
    SyncBatchNorm kernel are kept launches: a second call with the same arguments' key
    launches the kept variants and goes through no JITFunction.run (about 10 us each)."""
    env = dict(os.environ, TRITON_INTERPRET="0")
    proc = subprocess.run([sys.executable, "-c", STEADY_CHILD], capture_output=True,
                          text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert "_scale_update_kernel" in out["scale_update"]["launched"]
    assert "_l2norm_segment_kernel" in out["l2norm"]["launched"]
    assert "_novograd_blend_kernel" in out["novograd"]["launched"]
    assert {"_syncbn_stats_kernel", "_syncbn_merge_kernel", "_syncbn_forward_kernel",
            "_syncbn_backward_reduce_kernel", "_syncbn_reduce_merge_kernel",
            "_syncbn_backward_input_kernel"} <= set(out["syncbn"]["launched"])
    assert all(r["bound"] == [] for r in out.values()), out


SYNCBN_CHILD = textwrap.dedent(r"""
    import json, os
    os.environ["TRITON_INTERPRET"] = "0"
    import torch
    from tritamp.kernels import launch as LA
    from tritamp.kernels import syncbn as S
    from tritamp.kernels.recorder import record_launches
    from tritamp.parallel import SyncBatchNorm

    checks = []   # per keyed launch: did it use the variant kernel[grid](...) binds?
    plain = []    # kernels launched under the computed key
    keyed_launch, plain_launch = LA.KeptKernel.launch_keyed, LA.KeptKernel.launch

    def watched_keyed(self, grid, args, constexprs, key):
        out = keyed_launch(self, grid, args, constexprs, key)
        mine = rec.launches[-1].specialisation
        self.fn[grid](*args, **constexprs)
        checks.append([self.fn.__name__, rec.launches[-1].specialisation is mine])
        return out

    def watched_plain(self, grid, args, constexprs, ckey):
        plain.append(self.fn.__name__)
        return plain_launch(self, grid, args, constexprs, ckey)

    LA.KeptKernel.launch_keyed, LA.KeptKernel.launch = watched_keyed, watched_plain

    def module_case(c, shape, dtype, cl=False, z=False, relu=False, affine=True,
                    momentum=0.1, wdtype=None):
        bn = SyncBatchNorm(c, affine=affine, momentum=momentum, fuse_relu=relu)
        if wdtype is not None:
            bn = bn.to(wdtype)
        x = torch.randn(shape).to(dtype)
        if cl:
            x = x.contiguous(memory_format=torch.channels_last)
        x.requires_grad_()
        zz = torch.randn(x.shape).to(dtype) if z else None
        def run():
            y = bn(x, zz)
            y.backward(torch.randn(y.shape).to(dtype))
        return run

    def misaligned_case():
        buf = torch.randn(2 * 24 * 16 + 1).to(torch.bfloat16)
        x = buf[1:].view(2, 24, 16)   # contiguous, 2 bytes past an aligned address
        def run():
            rows, shift = S.syncbn_stats(x)
            mean, invstd, count = S.syncbn_finalize(rows, 1e-5, shift=shift)
            S.syncbn_forward(x, mean, invstd)
        return run

    cases = {
        "bf16 64ch 4x4": module_case(64, (2, 64, 4, 4), torch.bfloat16),
        "fp32 30ch 7x7": module_case(30, (2, 30, 7, 7), torch.float32),
        "fp16 16ch 3x3 z relu": module_case(16, (2, 16, 3, 3), torch.float16, z=True,
                                            relu=True),
        "bf16 channels-last": module_case(24, (2, 24, 5, 5), torch.bfloat16, cl=True),
        "bf16 x, bf16 params": module_case(32, (4, 32, 2, 2), torch.bfloat16,
                                           wdtype=torch.bfloat16),
        "no affine, cumulative": module_case(8, (3, 8, 6), torch.float32, affine=False,
                                             momentum=None),
        "2-D input": module_case(40, (6, 40), torch.float32),
        # differs from "bf16 64ch 4x4" only in the ints Triton specialises on
        "bf16 65ch 4x4": module_case(65, (2, 65, 4, 4), torch.bfloat16),
        "misaligned": misaligned_case(),
    }
    out = {}
    with record_launches() as rec:
        for name, run in cases.items():
            before_checks, before_plain = len(checks), len(plain)
            for _ in range(2):  # the second call launches kept variants
                run()
            out[name] = dict(keyed=len(checks) - before_checks,
                             plain=sorted(set(plain[before_plain:])))
    out["all_same"] = all(same for _, same in checks)
    out["kernels"] = sorted({name for name, _ in checks})
    print(json.dumps(out))
""")


def test_syncbn_keyed_launches_use_the_variant_triton_would_bind():
    """SyncBatchNorm's launchers key their launches by the tensors' dtypes and the ints
    themselves when every pointer is aligned (launch_aligned): every such launch, over
    dtypes, channel counts and planes that are and are not multiples of 16, channels-last,
    2-D input, a residual with ReLU, no affine parameters and the cumulative average,
    ran the variant kernel[grid](...) binds for the same arguments; a misaligned input
    takes the computed key for the kernels that read it."""
    env = dict(os.environ, TRITON_INTERPRET="0")
    proc = subprocess.run([sys.executable, "-c", SYNCBN_CHILD], capture_output=True,
                          text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["all_same"]
    assert out["kernels"] == sorted([
        "_syncbn_stats_kernel", "_syncbn_merge_kernel", "_syncbn_forward_kernel",
        "_syncbn_backward_reduce_kernel", "_syncbn_reduce_merge_kernel",
        "_syncbn_backward_input_kernel"])
    for name, r in out.items():
        if name in ("all_same", "kernels", "misaligned"):
            continue
        # 2 x (stats, merge, forward, backward_reduce, reduce_merge, backward_input)
        assert r == dict(keyed=12, plain=[]), (name, r)
    assert out["misaligned"] == dict(keyed=2, plain=["_syncbn_forward_kernel",
                                                     "_syncbn_stats_kernel"])
