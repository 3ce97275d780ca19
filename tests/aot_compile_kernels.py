"""Compile every kernel variant for a Hopper target (sm_90) and print a JSON report.

Run by tests/test_kernel_compile.py in a separate process, because the test session
runs the kernels in Triton's interpreter, which cannot compile. Needs no GPU.

The multi-tensor sweeps (check/unscale, the optimizers, l2norm, scale/axpby) are not
listed by hand: benchmarks/compile_report.py records the specialisations their launchers
really use (every fused optimizer at O1/O2 with fp16/bf16, aligned and odd-sized lists,
the helpers called directly), and each is compiled here with its recorded alignment
attributes, under the key ``recorded/<kernel>/<label>``. LayerNorm, SyncBatchNorm and the
scale update keep their hand-written variants.
"""
import json
import os
import sys

os.environ["TRITON_INTERPRET"] = "0"

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from tritamp.testing import jit_kernels  # noqa: E402

JIT = jit_kernels()

HOPPER = GPUTarget("cuda", 90, 32)
from benchmarks import compile_report  # noqa: E402  (the repository root is on PYTHONPATH)


def compile_one(fn, signature, constexprs, num_warps):
    sig = dict(signature, **{k: "constexpr" for k in constexprs})
    k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=constexprs), target=HOPPER,
                       options={"num_warps": num_warps})
    return k.asm["ptx"]


def main():
    sweeps = compile_report._jsonable(compile_report.build_report())
    if sweeps.get("toolchain_error"):
        sys.exit(f"ptxas / Triton's CUDA toolchain is not usable: {sweeps['toolchain_error']}")
    # The whole compile report rides along: tests/test_engine_compile.py reads its
    # registers, spills and access widths from this one run.
    report = {"compile_report": sweeps}
    report.update(sweep_variants(sweeps))
    sig = {"state_ptr": "*fp32", "config_ptr": "*fp64", "growth_interval": "i32",
           "hysteresis": "i32", "found_slot": "i32"}
    for dynamic in (True, False):
        ptx = compile_one(JIT["scale_update_kernel"], sig, dict(DYNAMIC=dynamic), 1)
        report[f"scale_update/dynamic={dynamic}"] = dict(sm90=".target sm_90" in ptx)
    report.update(norm_variants())
    report.update(syncbn_variants())
    json.dump(report, sys.stdout)


def _ok(ptx):
    return dict(sm90=".target sm_90" in ptx, approx=("sqrt.approx" in ptx or "div.full" in ptx))


def sweep_variants(sweeps):
    """The recorded specialisations of the multi-tensor launchers (``sweeps``: the compile
    report's rows), compiled for sm_90: {"recorded/<kernel>/<label>": {kernel, signature,
    constexprs, sm90, approx, rn_bf16, error}}; "recorded_errors" maps the scenarios
    that could not run to their error."""
    out = {}
    for row in sweeps["specialisations"]:
        out[f"recorded/{row['kernel']}/{row['label']}"] = dict(
            kernel=row["kernel"], signature=row["signature"], constexprs=row["constexprs"],
            sources=row["sources"], error=row.get("error"), sm90=row.get("sm90", False),
            approx=row.get("approx"), rn_bf16=row.get("rn_bf16"))
    out["recorded_errors"] = sweeps["errors"]
    return out


def norm_variants():
    """LayerNorm / RMSNorm forward, backward and the weight-gradient reduction: each dtype
    pairing, one-pass and chunked rows, from the input and from the output."""
    out = {}
    for x, w, y in (("*fp32", "*fp32", "*fp32"), ("*fp16", "*fp16", "*fp16"),
                    ("*bf16", "*bf16", "*bf16"), ("*bf16", "*fp32", "*bf16"),
                    ("*fp16", "*fp32", "*fp32")):
        for rms in (False, True):
            for one_pass in (True, False):
                mode = dict(IS_RMS=rms, HAS_WEIGHT=True, HAS_BIAS=not rms, ONE_PASS=one_pass,
                            EMULATE_BF16_ROUNDING=False, BLOCK=4096 if one_pass else 1024)
                sig = {"x_ptr": x, "y_ptr": y, "w_ptr": w, "b_ptr": w, "mean_ptr": "*fp32",
                       "rstd_ptr": "*fp32", "x_stride": "i32", "N": "i32", "eps": "fp32"}
                out[f"layer_norm_fwd/{x},{w},{y}/rms={rms}/one_pass={one_pass}"] = _ok(
                    compile_one(JIT["layer_norm_fwd_kernel"], sig, mode, 8))
                for from_output in (False, True):
                    sig = {"dy_ptr": y, "v_ptr": y if from_output else x, "w_ptr": w,
                           "b_ptr": w, "mean_ptr": "*fp32", "rstd_ptr": "*fp32", "dx_ptr": x,
                           "dw_part_ptr": "*fp32", "db_part_ptr": "*fp32",
                           "stats_ptr": "*fp32", "v_stride": "i32",
                           "M": "i32", "N": "i32", "rows_per_program": "i32",
                           "min_w": "fp32"}
                    out[f"layer_norm_bwd/{x},{w},{y}/rms={rms}/one_pass={one_pass}/"
                        f"from_output={from_output}"] = _ok(compile_one(
                            JIT["layer_norm_bwd_kernel"], sig,
                            dict(mode, FROM_OUTPUT=from_output), 8))
        sig = {"dw_part_ptr": "*fp32", "db_part_ptr": "*fp32", "dw_ptr": w, "db_ptr": w,
               "G": "i32", "N": "i32", "rows_per_split": "i32"}
        out[f"layer_norm_bwd_reduce/{w}"] = _ok(compile_one(
            JIT["layer_norm_bwd_reduce_kernel"], sig, dict(HAS_WEIGHT=True, HAS_BIAS=True,
                                                     EMULATE_BF16_ROUNDING=False, BLOCK_G=8,
                                                     BLOCK_N=128), 4))
    return out


def syncbn_variants():
    """SyncBatchNorm: each kernel for fp32 / fp16 / bf16 input, both layouts, and the mode
    flags that change the code (residual, fused ReLU, shift, running-stat updates), spread
    over a few combinations rather than their product (each compile costs about 0.5 s)."""
    out = {}
    dims = {"M": "i32", "C": "i32", "B_UNITS": "i32", "NBB": "i32"}

    def tiles(cl):
        return dict(CHANNELS_LAST=cl, B_VEC=1, EMULATE_BF16_ROUNDING=False,
                    BLOCK_R=64 if cl else 1024,
                    BLOCK_C=64 if cl else 4)

    for x in ("*fp32", "*fp16", "*bf16"):
        for cl in (False, True):
            sig = dict({"x_ptr": x, "part_ptr": "*fp32", "shift_ptr": "*fp32"}, **dims,
                       n_segs="i32", segs_per_chunk="i32", row_stride="i32")
            out[f"syncbn_stats/{x}/channels_last={cl}"] = _ok(compile_one(
                JIT["syncbn_stats_kernel"], sig, tiles(cl), 8))
    for x, w, cl, z in (("*fp32", "*fp32", False, False), ("*fp16", "*fp32", True, True),
                        ("*bf16", "*fp32", False, True), ("*bf16", "*bf16", True, False)):
        key = f"{x},{w}/channels_last={cl}/z_relu={z}"
        flags = dict(tiles(cl), HAS_WEIGHT=True, HAS_BIAS=True, HAS_Z=z, RELU=z)
        params = {"mean_ptr": "*fp32", "invstd_ptr": "*fp32", "w_ptr": w, "b_ptr": w}
        sig = dict({"x_ptr": x, "z_ptr": x, "y_ptr": x}, **params, **dims)
        out[f"syncbn_forward/{key}"] = _ok(
            compile_one(JIT["syncbn_forward_kernel"], sig, flags, 8))
        sig = dict({"dy_ptr": x, "x_ptr": x, "z_ptr": x, "part_ptr": "*fp32"}, **params, **dims,
                   n_segs="i32", segs_per_chunk="i32")
        out[f"syncbn_backward_reduce/{key}"] = _ok(compile_one(
            JIT["syncbn_backward_reduce_kernel"], sig, flags, 8))
        for sums in (True, False) if x == "*fp32" else (True,):
            sig = dict({"dy_ptr": x, "x_ptr": x, "z_ptr": x, "dx_ptr": x, "dz_ptr": x},
                       **params, sums_ptr="*fp32", count_ptr="*fp32", **dims)
            out[f"syncbn_backward_input/{key}/sums={sums}"] = _ok(compile_one(
                JIT["syncbn_backward_input_kernel"], sig,
                dict(flags, HAS_DZ=z, HAS_SUMS=sums), 8))
    for w in ("*fp32", "*bf16"):
        sig = {"part_ptr": "*fp32", "P": "i32", "C": "i32", "sums_ptr": "*fp32",
               "invstd_ptr": "*fp32", "gw_ptr": w, "gb_ptr": w}
        out[f"syncbn_reduce_merge/{w}"] = _ok(compile_one(
            JIT["syncbn_reduce_merge_kernel"], sig, dict(HAS_GW=True, HAS_GB=True,
                                                   EMULATE_BF16_ROUNDING=False, BLOCK_P=16,
                                                   BLOCK_C=128), 8))
    for running, final, update, from_count, shift in (
            ("*fp32", False, False, False, True), ("*fp32", False, False, False, False),
            ("*fp32", True, False, False, True), ("*fp32", True, True, False, True),
            ("*fp32", True, True, True, False), ("*bf16", True, True, False, False)):
        sig = {"rows_ptr": "*fp32", "shift_ptr": "*fp32", "P": "i32", "C": "i32",
               "row_stride": "i32", "out_ptr": "*fp32", "mean_ptr": "*fp32", "invstd_ptr": "*fp32",
               "count_ptr": "*fp32", "rmean_ptr": running, "rvar_ptr": running,
               "nbt_ptr": "*i64", "eps": "fp32", "momentum": "fp32"}
        out[f"syncbn_merge/{running}/final={final}/update={update}/from_count={from_count}/"
            f"shift={shift}"] = _ok(compile_one(
                JIT["syncbn_merge_kernel"], sig, dict(HAS_SHIFT=shift, FINAL=final,
                                                UPDATE_RUNNING=update,
                                                MOMENTUM_FROM_COUNT=from_count,
                                                EMULATE_BF16_ROUNDING=False, BLOCK_P=16,
                                                BLOCK_C=128), 8))
    return out

if __name__ == "__main__":
    main()
