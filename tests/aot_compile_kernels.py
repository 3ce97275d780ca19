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
            report[f"adam/{p},{g},{c}/lr_tensor={lr_t}"] = dict(sm90=".target sm_90" in ptx)
            sig = dict(base, momentum="fp32", one_minus_dampening="fp32", weight_decay="fp32",
                       scale_ptr="*fp32", found_inf_ptr="*fp32")
            ptx = compile_one(_sgd_step_kernel, sig, dict(
                LR_IS_TENSOR=lr_t, HAS_SCALE=True, HAS_FOUND_INF=True, HAS_MOMENTUM=True,
                FIRST_RUN=False, NESTEROV=True, WD_AFTER_MOMENTUM=False, HAS_COPY=c != p,
                EMULATE_BF16_ROUNDING=False, BLOCK=2048), 8)
            report[f"sgd/{p},{g},{c}/lr_tensor={lr_t}"] = dict(sm90=".target sm_90" in ptx)
    json.dump(report, sys.stdout)


if __name__ == "__main__":
    main()
