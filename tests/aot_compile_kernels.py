"""Compile every kernel variant for a Hopper target (sm_90) and print a JSON report.

Run by tests/test_kernel_compile.py in a separate process, because the test session
runs the kernels in Triton's interpreter, which cannot compile. Needs no GPU.
"""
import json
import os
import sys

os.environ["TRITON_INTERPRET"] = "0"

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from tritamp.kernels.check_unscale import _check_unscale_sweep_kernel  # noqa: E402
from tritamp.kernels.scale_update import _scale_update_kernel  # noqa: E402
from tritamp.kernels.adam import _adam_step_kernel  # noqa: E402
from tritamp.kernels.sgd import _sgd_step_kernel  # noqa: E402
from tritamp.kernels.adagrad import _adagrad_step_kernel  # noqa: E402
from tritamp.kernels.axpby import _axpby_sweep_kernel  # noqa: E402
from tritamp.kernels.l2norm import _l2norm_partial_kernel, _l2norm_segment_kernel  # noqa: E402
from tritamp.kernels.lamb import _lamb_apply_kernel, _lamb_moments_kernel  # noqa: E402
from tritamp.kernels.novograd import (_novograd_blend_kernel, _novograd_norm_kernel,  # noqa: E402
                                      _novograd_step_kernel)

HOPPER = GPUTarget("cuda", 90, 32)
MODES = dict(check_unscale=(True, True, True, False), check_only=(True, True, False, False),
             accumulate=(True, True, True, True), copy=(False, False, True, False))
PAIRS = [("*fp16", "*fp32"), ("*bf16", "*fp32"), ("*fp32", "*fp32"), ("*fp16", "*fp16"),
         ("*bf16", "*bf16"), ("*fp32", "*bf16"), ("*fp32", "*fp16")]


def compile_one(fn, signature, constexprs, num_warps):
    sig = dict(signature, **{k: "constexpr" for k in constexprs})
    k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=constexprs), target=HOPPER,
                       options={"num_warps": num_warps})
    return k.asm["ptx"]


def main():
    report = {}
    for src, dst in PAIRS:
        for mode, (has_scale, check, write, has_add) in MODES.items():
            sig = {"meta_ptr": "*i64", "blocks_ptr": "*i32", "src_proto": src, "dst_proto": dst,
                   "add_proto": dst, "scale_ptr": "*fp32", "found_inf_ptr": "*fp32"}
            ptx = compile_one(_check_unscale_sweep_kernel, sig,
                              dict(HAS_SCALE=has_scale, CHECK=check, WRITE=write, HAS_ADD=has_add,
                                   EMULATE_BF16_ROUNDING=False, BLOCK=2048), 8)
            report[f"check_unscale/{src}->{dst}/{mode}"] = dict(
                sm90=".target sm_90" in ptx, rn_bf16="cvt.rn.bf16.f32" in ptx)
    sig = {"state_ptr": "*fp32", "config_ptr": "*fp64", "growth_interval": "i32",
           "hysteresis": "i32"}
    for dynamic in (True, False):
        ptx = compile_one(_scale_update_kernel, sig, dict(DYNAMIC=dynamic), 1)
        report[f"scale_update/dynamic={dynamic}"] = dict(sm90=".target sm_90" in ptx)
    # optimizers: fp32 params; fp32 masters with half gradients and half copies; half params
    for p, g, c in (("*fp32", "*fp32", "*fp32"), ("*fp32", "*fp16", "*fp16"),
                    ("*fp32", "*bf16", "*bf16"), ("*bf16", "*bf16", "*bf16")):
        for lr_t in (False, True):
            base = {"meta_ptr": "*i64", "blocks_ptr": "*i32", "p_proto": p, "g_proto": g,
                    "c_proto": c, "lr": "*fp32" if lr_t else "fp32"}
            sig = dict(base, betas_ptr="*fp64", one_minus_beta1="fp32", beta2="fp32",
                       one_minus_beta2="fp32", eps="fp32", weight_decay="fp32",
                       decay_factor="fp32", scale_ptr="*fp32", found_inf_ptr="*fp32")
            ptx = compile_one(_adam_step_kernel, sig, dict(
                LR_IS_TENSOR=lr_t, HAS_SCALE=True, HAS_FOUND_INF=True, ADAM_W=True,
                BIAS_CORRECTION=True, HAS_COPY=c != p, EMULATE_BF16_ROUNDING=False,
                BLOCK=2048), 8)
            report[f"adam/{p},{g},{c}/lr_tensor={lr_t}"] = _ok(ptx)
            sig = dict(base, momentum="fp32", one_minus_dampening="fp32", weight_decay="fp32",
                       scale_ptr="*fp32", found_inf_ptr="*fp32")
            ptx = compile_one(_sgd_step_kernel, sig, dict(
                LR_IS_TENSOR=lr_t, HAS_SCALE=True, HAS_FOUND_INF=True, HAS_MOMENTUM=True,
                FIRST_RUN=False, HAS_STEPS=lr_t, NESTEROV=True, WD_AFTER_MOMENTUM=False,
                HAS_COPY=c != p,
                EMULATE_BF16_ROUNDING=False, BLOCK=2048), 8)
            report[f"sgd/{p},{g},{c}/lr_tensor={lr_t}"] = _ok(ptx)
    report.update(optimizer_family_variants())
    report.update(norm_variants())
    report.update(syncbn_variants())
    json.dump(report, sys.stdout)


PGC = [("*fp32", "*fp32", "*fp32"), ("*fp32", "*fp16", "*fp16"), ("*fp32", "*bf16", "*bf16"),
       ("*bf16", "*bf16", "*bf16")]


def _ok(ptx):
    return dict(sm90=".target sm_90" in ptx, approx=("sqrt.approx" in ptx or "div.full" in ptx))


def optimizer_family_variants():
    """Adagrad, LAMB, NovoGrad, the l2-norm and scale/axpby helpers: every dtype case,
    the mode flags that change the code, lr as a float and as a tensor."""
    out = {}
    flags = dict(HAS_SCALE=True, HAS_FOUND_INF=True, EMULATE_BF16_ROUNDING=False, BLOCK=2048)
    for p, g, c in PGC:
        head = {"meta_ptr": "*i64", "blocks_ptr": "*i32"}
        for lr_t in (False, True):
            lr = "*fp32" if lr_t else "fp32"
            for w in (False, True):
                sig = dict(head, p_proto=p, g_proto=g, c_proto=c, lr=lr, eps="fp32",
                           weight_decay="fp32", scale_ptr="*fp32", found_inf_ptr="*fp32")
                out[f"adagrad/{p},{g},{c}/lr_tensor={lr_t}/w={w}"] = _ok(compile_one(
                    _adagrad_step_kernel, sig, dict(flags, LR_IS_TENSOR=lr_t, ADAGRAD_W=w,
                                                     HAS_COPY=c != p), 8))
            for adam_w, decay, ratio in ((True, True, True), (False, True, True),
                                         (True, False, False)):
                sig = dict(head, partials_ptr="*fp32", partials_stride="i32", p_proto=p,
                           g_proto=g, betas_ptr="*fp64", beta1="fp32", beta3="fp32",
                           beta2="fp32", one_minus_beta2="fp32", eps="fp32", weight_decay="fp32",
                           grad_norm_ptr="*fp32", max_grad_norm="fp32", scale_ptr="*fp32",
                           found_inf_ptr="*fp32")
                mode = dict(ADAM_W=adam_w, HAS_DECAY=decay, USE_RATIO=ratio, BIAS_CORRECTION=True)
                out[f"lamb_moments/{p},{g}/lr_tensor={lr_t}/{adam_w},{decay},{ratio}"] = _ok(
                    compile_one(_lamb_moments_kernel, sig, dict(flags, HAS_CLIP=True, **mode), 8))
                sig = dict(head, norms_ptr="*fp32", norms_stride="i32", p_proto=p, c_proto=c,
                           lr=lr, betas_ptr="*fp64", eps="fp32", weight_decay="fp32",
                           found_inf_ptr="*fp32")
                out[f"lamb_apply/{p},{c}/lr_tensor={lr_t}/{adam_w},{decay},{ratio}"] = _ok(
                    compile_one(_lamb_apply_kernel, sig, dict(
                        LR_IS_TENSOR=lr_t, HAS_FOUND_INF=True, HAS_COPY=c != p,
                        EMULATE_BF16_ROUNDING=False, BLOCK=2048, **mode), 8))
            sig = dict(head, p_proto=p, g_proto=g, c_proto=c, lr=lr, betas_ptr="*fp64",
                       beta1="fp32", beta3="fp32", eps="fp32", weight_decay="fp32",
                       scale_ptr="*fp32", found_inf_ptr="*fp32")
            out[f"novograd_step/{p},{g},{c}/lr_tensor={lr_t}"] = _ok(compile_one(
                _novograd_step_kernel, sig, dict(flags, LR_IS_TENSOR=lr_t,
                                                 REG_INSIDE_MOMENT=lr_t, BIAS_CORRECTION=True,
                                                 HAS_COPY=c != p), 8))
    for x in ("*fp32", "*fp16", "*bf16"):
        for max_norm in (False, True):
            sig = {"meta_ptr": "*i64", "blocks_ptr": "*i32", "g_proto": x,
                   "partials_ptr": "*fp32", "scale_ptr": "*fp32", "found_inf_ptr": "*fp32"}
            out[f"novograd_norm/{x}/max={max_norm}"] = _ok(compile_one(
                _novograd_norm_kernel, sig, dict(flags, MAX_NORM=max_norm), 8))
        sig = {"meta_ptr": "*i64", "blocks_ptr": "*i32", "x_proto": x, "partials_ptr": "*fp32",
               "scale_ptr": "*fp32"}
        out[f"l2norm_partial/{x}"] = _ok(compile_one(_l2norm_partial_kernel, sig, dict(
            HAS_SCALE=True, EMULATE_BF16_ROUNDING=False, BLOCK=2048), 8))
        for y, o in (("*fp32", "*fp16"), ("*bf16", "*fp32")):
            for coef_t in (False, True):
                sig = {"meta_ptr": "*i64", "blocks_ptr": "*i32", "x_proto": x, "y_proto": y,
                       "out_proto": o, "a": "*fp32" if coef_t else "fp32",
                       "b": "*fp32" if coef_t else "fp32", "flag_ptr": "*i32"}
                out[f"axpby/{x},{y},{o}/coef_tensor={coef_t}"] = _ok(compile_one(
                    _axpby_sweep_kernel, sig, dict(A_IS_TENSOR=coef_t, B_IS_TENSOR=coef_t,
                                                   HAS_Y=True, CHECK_X=True, CHECK_Y=True,
                                                   EMULATE_BF16_ROUNDING=False, BLOCK=2048), 8))
    for sqrt in (False, True):
        sig = {"partials_ptr": "*fp32", "partials_stride": "i32", "segments_ptr": "*i64",
               "out_ptr": "*fp32", "out_stride": "i32"}
        out[f"l2norm_segment/sqrt={sqrt}"] = _ok(compile_one(
            _l2norm_segment_kernel, sig, dict(SQRT=sqrt, BLOCK_R=1024), 4))
    for max_norm in (False, True):
        for init_zero in (False, True):
            sig = {"meta_ptr": "*i64", "segments_ptr": "*i64", "partials_ptr": "*fp32",
                   "beta2": "fp32", "one_minus_beta2": "fp32", "found_inf_ptr": "*fp32"}
            out[f"novograd_blend/max={max_norm}/init_zero={init_zero}"] = _ok(compile_one(
                _novograd_blend_kernel, sig, dict(HAS_FOUND_INF=True, MAX_NORM=max_norm,
                                                  INIT_ZERO=init_zero, BLOCK_R=1024), 4))
    return out


def norm_variants():
    """LayerNorm / RMSNorm forward, backward and the weight-gradient reduction: each dtype
    pairing, one-pass and chunked rows, from the input and from the output."""
    from tritamp.kernels.layer_norm import (_layer_norm_bwd_kernel,
                                            _layer_norm_bwd_reduce_kernel,
                                            _layer_norm_fwd_kernel)
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
                    compile_one(_layer_norm_fwd_kernel, sig, mode, 8))
                for from_output in (False, True):
                    sig = {"dy_ptr": y, "v_ptr": y if from_output else x, "w_ptr": w,
                           "b_ptr": w, "mean_ptr": "*fp32", "rstd_ptr": "*fp32", "dx_ptr": x,
                           "dw_part_ptr": "*fp32", "db_part_ptr": "*fp32", "v_stride": "i32",
                           "M": "i32", "N": "i32", "rows_per_program": "i32"}
                    out[f"layer_norm_bwd/{x},{w},{y}/rms={rms}/one_pass={one_pass}/"
                        f"from_output={from_output}"] = _ok(compile_one(
                            _layer_norm_bwd_kernel, sig, dict(mode, FROM_OUTPUT=from_output), 8))
        sig = {"dw_part_ptr": "*fp32", "db_part_ptr": "*fp32", "dw_ptr": w, "db_ptr": w,
               "G": "i32", "N": "i32"}
        out[f"layer_norm_bwd_reduce/{w}"] = _ok(compile_one(
            _layer_norm_bwd_reduce_kernel, sig, dict(HAS_WEIGHT=True, HAS_BIAS=True,
                                                     EMULATE_BF16_ROUNDING=False, BLOCK_G=32,
                                                     BLOCK_N=128), 4))
    return out


def syncbn_variants():
    """SyncBatchNorm: each kernel for fp32 / fp16 / bf16 input, both layouts, and the mode
    flags that change the code (residual, fused ReLU, shift, running-stat updates), spread
    over a few combinations rather than their product (each compile costs about 0.5 s)."""
    from tritamp.kernels.syncbn import (_syncbn_backward_input_kernel,
                                        _syncbn_backward_reduce_kernel, _syncbn_forward_kernel,
                                        _syncbn_merge_kernel, _syncbn_reduce_merge_kernel,
                                        _syncbn_stats_kernel)
    out = {}
    dims = {"M": "i32", "C": "i32", "B": "i32", "NBB": "i32"}

    def tiles(cl):
        return dict(CHANNELS_LAST=cl, EMULATE_BF16_ROUNDING=False, BLOCK_R=64 if cl else 1024,
                    BLOCK_C=64 if cl else 4)

    for x in ("*fp32", "*fp16", "*bf16"):
        for cl in (False, True):
            sig = dict({"x_ptr": x, "part_ptr": "*fp32", "shift_ptr": "*fp32"}, **dims,
                       n_segs="i32", segs_per_chunk="i32")
            out[f"syncbn_stats/{x}/channels_last={cl}"] = _ok(compile_one(
                _syncbn_stats_kernel, sig, tiles(cl), 8))
    for x, w, cl, z in (("*fp32", "*fp32", False, False), ("*fp16", "*fp32", True, True),
                        ("*bf16", "*fp32", False, True), ("*bf16", "*bf16", True, False)):
        key = f"{x},{w}/channels_last={cl}/z_relu={z}"
        flags = dict(tiles(cl), HAS_WEIGHT=True, HAS_BIAS=True, HAS_Z=z, RELU=z)
        params = {"mean_ptr": "*fp32", "invstd_ptr": "*fp32", "w_ptr": w, "b_ptr": w}
        sig = dict({"x_ptr": x, "z_ptr": x, "y_ptr": x}, **params, **dims)
        out[f"syncbn_forward/{key}"] = _ok(compile_one(_syncbn_forward_kernel, sig, flags, 8))
        sig = dict({"dy_ptr": x, "x_ptr": x, "z_ptr": x, "part_ptr": "*fp32"}, **params, **dims,
                   n_segs="i32", segs_per_chunk="i32")
        out[f"syncbn_backward_reduce/{key}"] = _ok(compile_one(
            _syncbn_backward_reduce_kernel, sig, flags, 8))
        for sums in (True, False) if x == "*fp32" else (True,):
            sig = dict({"dy_ptr": x, "x_ptr": x, "z_ptr": x, "dx_ptr": x, "dz_ptr": x},
                       **params, sums_ptr="*fp32", count_ptr="*fp32", **dims)
            out[f"syncbn_backward_input/{key}/sums={sums}"] = _ok(compile_one(
                _syncbn_backward_input_kernel, sig, dict(flags, HAS_DZ=z, HAS_SUMS=sums), 8))
    for w in ("*fp32", "*bf16"):
        sig = {"part_ptr": "*fp32", "P": "i32", "C": "i32", "sums_ptr": "*fp32",
               "invstd_ptr": "*fp32", "gw_ptr": w, "gb_ptr": w}
        out[f"syncbn_reduce_merge/{w}"] = _ok(compile_one(
            _syncbn_reduce_merge_kernel, sig, dict(HAS_GW=True, HAS_GB=True,
                                                   EMULATE_BF16_ROUNDING=False, BLOCK_P=32,
                                                   BLOCK_C=128), 4))
    for running, final, update, from_count, shift in (
            ("*fp32", False, False, False, True), ("*fp32", False, False, False, False),
            ("*fp32", True, False, False, True), ("*fp32", True, True, False, True),
            ("*fp32", True, True, True, False), ("*bf16", True, True, False, False)):
        sig = {"rows_ptr": "*fp32", "shift_ptr": "*fp32", "P": "i32", "C": "i32",
               "out_ptr": "*fp32", "mean_ptr": "*fp32", "invstd_ptr": "*fp32",
               "count_ptr": "*fp32", "rmean_ptr": running, "rvar_ptr": running,
               "nbt_ptr": "*i64", "eps": "fp32", "momentum": "fp32"}
        out[f"syncbn_merge/{running}/final={final}/update={update}/from_count={from_count}/"
            f"shift={shift}"] = _ok(compile_one(
                _syncbn_merge_kernel, sig, dict(HAS_SHIFT=shift, FINAL=final,
                                                UPDATE_RUNNING=update,
                                                MOMENTUM_FROM_COUNT=from_count,
                                                EMULATE_BF16_ROUNDING=False, BLOCK_P=32,
                                                BLOCK_C=128), 4))
    return out

if __name__ == "__main__":
    main()
