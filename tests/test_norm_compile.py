"""LayerNorm / RMSNorm compiled for an H100 (sm_90) at representative widths, without a
GPU: the launchers run on CPU tensors down the CUDA code path under the launch recorder
(benchmarks/compile_report.py, its "norms" part), and every specialisation they would
compile is compiled and read (registers, spills, access widths, grids).

The limits (docs/checking-gpu-code-without-a-gpu.md): no spills at any width from 256 to
65536; at most 64 registers for the forward and backward up to width 8192; the
weight/bias-gradient reduction's main pass runs at least 2 x SM programs from width 768
on (132 SMs: an H100)."""
import re

import pytest

WIDTHS = (256, 768, 1024, 4096, 8192, 12288, 32768, 65536)
KERNELS = ("_layer_norm_fwd_kernel", "_layer_norm_bwd_kernel", "_layer_norm_bwd_reduce_kernel")


@pytest.fixture(scope="module")
def norms(compiled_kernels):
    return compiled_kernels["compile_report"]["norms"]


def _widths(row):
    return {int(m) for s in row["sources"] for m in re.findall(r"n=(\d+)", s)}


def test_every_width_and_kernel_was_recorded_and_compiled(norms):
    assert norms["errors"] == {}
    assert tuple(norms["widths"]) == WIDTHS
    for kernel in KERNELS:
        rows = [r for r in norms["specialisations"] if r["kernel"] == kernel]
        assert set().union(*map(_widths, rows)) == set(WIDTHS), kernel
    bad = [(r["kernel"], r["error"][-300:]) for r in norms["specialisations"]
           if r.get("error") or "reg" not in r]
    assert bad == []


def test_no_norm_kernel_spills_at_any_width(norms):
    bad = [(r["kernel"], sorted(_widths(r)), r["constexprs"], r["stack"], r["local"])
           for r in norms["specialisations"] if r["spills"]]
    assert bad == []


def test_forward_and_backward_registers_up_to_width_8192(norms):
    bad = [(r["kernel"], sorted(_widths(r)), r["constexprs"], r["reg"])
           for r in norms["specialisations"]
           if min(_widths(r)) <= 8192 and r["reg"] > 64]
    assert bad == []


def test_wide_rows_take_the_chunked_path(norms):
    """Above 16384 (forward) and 4096 (backward) a row is swept in chunks."""
    for r in norms["specialisations"]:
        if r["kernel"] == "_layer_norm_bwd_reduce_kernel":
            continue
        cap = 16384 if r["kernel"] == "_layer_norm_fwd_kernel" else 4096
        one_pass = r["constexprs"]["ONE_PASS"]
        assert one_pass == (max(_widths(r)) <= cap), (r["kernel"], sorted(_widths(r)))


def test_the_reduction_main_pass_fills_the_gpu(norms):
    sms = norms["sm_count"]
    assert sms == 132
    by_scenario = {}
    for launch in norms["launches"]:
        if launch["kernel"] == "_layer_norm_bwd_reduce_kernel":
            gx, gy, gz = launch["grid"]
            by_scenario.setdefault(launch["scenario"], []).append(gx * gy * gz)
    assert by_scenario
    for scenario, passes in by_scenario.items():
        n = int(re.search(r"n=(\d+)", scenario).group(1))
        assert len(passes) in (1, 2), scenario
        if n >= 768:
            assert passes[0] >= 2 * sms, (scenario, passes)
        if len(passes) == 2:  # the final pass: one program per column block
            assert passes[1] == -(-n // 128), (scenario, passes)


def test_the_backward_grid_keeps_every_sm_busy(norms):
    """As many programs per SM as can be resident at the kernel's warps (64 warps per SM),
    2 to 8, each owning a run of rows; never more programs than rows."""
    sms, rows = norms["sm_count"], norms["rows"]
    warps = {i: r["num_warps"] for i, r in enumerate(norms["specialisations"])}
    seen = set()
    for launch in norms["launches"]:
        if launch["kernel"] != "_layer_norm_bwd_kernel":
            continue
        w = warps[launch["spec"]]
        programs = min(rows, max(2, min(8, 64 // w)) * sms)
        per_program = -(-rows // programs)
        assert tuple(launch["grid"]) == (-(-rows // per_program), 1, 1), (launch, w)
        seen.add(w)
    assert {2, 8, 16, 32} <= seen
