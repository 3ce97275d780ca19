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


def test_the_one_pass_forward_reduces_across_the_row_twice_at_most(norms):
    """A row held by several warps waits on an exchange between them at each reduction,
    and a program holds one row: the LayerNorm forward takes the sum, then the deviations'
    sum and sum of squares in one joint reduction (4 BAR.SYNC; a separate third reduction
    for the refined mean made it 5), RMSNorm the sum of squares alone (1)."""
    seen = set()
    for r in norms["specialisations"]:
        c = r["constexprs"]
        if r["kernel"] != "_layer_norm_fwd_kernel" or not c["ONE_PASS"]:
            continue
        limit = 1 if c["IS_RMS"] else 4
        assert r["barriers"] <= limit, (sorted(_widths(r)), c, r["barriers"])
        seen.add(c["IS_RMS"])
    assert seen == {False, True}


def test_barriers_counts_every_bar_sync():
    from benchmarks.sass import barriers
    sass = """
        /*0000*/                   BAR.SYNC.DEFER_BLOCKING 0x0 ;
.L_x_0:
        /*0010*/                   SHFL.BFLY PT, R3, R2, 0x1, 0x1f ;
        /*0020*/                   BAR.SYNC.DEFER_BLOCKING 0x0 ;
        /*0030*/               @P0 BRA `(.L_x_0) ;
        /*0040*/                   EXIT ;
"""
    assert barriers(sass) == 2


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


# -- SyncBatchNorm at ResNet-50's shapes ------------------------------------------------------
SYNCBN_KERNELS = ("_syncbn_stats_kernel", "_syncbn_merge_kernel", "_syncbn_forward_kernel",
                  "_syncbn_backward_reduce_kernel", "_syncbn_reduce_merge_kernel",
                  "_syncbn_backward_input_kernel")
TILED = ("_syncbn_stats_kernel", "_syncbn_forward_kernel", "_syncbn_backward_reduce_kernel",
         "_syncbn_backward_input_kernel")


@pytest.fixture(scope="module")
def syncbn(compiled_kernels):
    return compiled_kernels["compile_report"]["syncbn"]


def test_every_syncbn_kernel_was_recorded_and_compiled(syncbn):
    assert syncbn["errors"] == {}
    assert {r["kernel"] for r in syncbn["specialisations"]} == set(SYNCBN_KERNELS)
    scenarios = {s for r in syncbn["specialisations"] for s in r["sources"]}
    for layout in ("CL", "CF"):
        for side in (56, 28, 14, 7):
            assert any(f"syncbn {layout} " in s and f"x{side}x{side} " in s
                       for s in scenarios), (layout, side)
    bad = [(r["kernel"], r["error"][-300:]) for r in syncbn["specialisations"]
           if r.get("error") or "reg" not in r]
    assert bad == []


def test_syncbn_kernels_stay_within_80_registers_without_spills(syncbn):
    bad = [(r["kernel"], r["constexprs"], r["reg"], r["spills"], r["sources"][0])
           for r in syncbn["specialisations"] if r["reg"] > 80 or r["spills"]]
    assert bad == []


def test_syncbn_tiles_load_16_bytes_where_rows_are_aligned(syncbn):
    """Channels last (the channel runs are contiguous and 16-byte aligned), and channels
    first where a plane's size is a multiple of 8 (56x56, 28x28): 16-byte data loads."""
    for r in syncbn["specialisations"]:
        if r["kernel"] not in TILED:
            continue
        cl = r["constexprs"]["CHANNELS_LAST"]
        aligned = cl or all(("x56x56 " in s or "x28x28 " in s) for s in r["sources"])
        if aligned:
            assert r["widest_load"] == 16, (r["kernel"], r["sources"][0], r["loads"])


def test_channels_first_planes_get_the_widest_loads_their_size_allows(syncbn):
    """14x14 = 4 x 49: every plane starts at a multiple of 4 elements, so the data loads
    are 4 elements wide (16 bytes in fp32, 8 in fp16/bf16); 7x7 planes start anywhere
    (B_VEC = 1: single elements, all their alignment allows)."""
    seen = set()
    for r in syncbn["specialisations"]:
        if r["kernel"] not in TILED or r["constexprs"]["CHANNELS_LAST"]:
            continue
        for side, vec in ((14, 4), (7, 1)):
            if all(f"x{side}x{side} " in s for s in r["sources"]):
                assert r["constexprs"]["B_VEC"] == vec, (r["kernel"], r["sources"])
                half = all(not s.endswith("fp32") for s in r["sources"])
                if side == 14:
                    assert r["widest_load"] == (8 if half else 16), (r["kernel"], r["sources"])
                seen.add((r["kernel"], side))
    assert seen == {(k, side) for k in TILED for side in (14, 7)}


def test_syncbn_reductions_keep_barriers_out_of_their_loops(syncbn):
    """The statistics and backward reductions update 2-D running accumulators in the loop
    over a program's tiles and reduce them across the tile's threads once, after it: no
    BAR.SYNC inside any loop (a reduction per tile put 16 there, channels last). Every
    such kernel is compiled with a loop at some shape, in both layouts (a program with
    one tile has its loop compiled away). The merges of their partial rows likewise: a
    running merge (sum) per lane of the row tile (a reduction per block of rows put 12
    (16) barriers in each of 132 iterations at 64 channels, channels last)."""
    looped = set()
    for r in syncbn["specialisations"]:
        if r["kernel"] in ("_syncbn_merge_kernel", "_syncbn_reduce_merge_kernel"):
            assert r["loops"] >= 1 and r["loop_barriers"] == 0, (r["kernel"], r["sources"])
            looped.add(r["kernel"])
            continue
        if r["kernel"] not in ("_syncbn_stats_kernel", "_syncbn_backward_reduce_kernel"):
            continue
        assert r["loop_barriers"] == 0, (r["kernel"], r["sources"], r["loops"])
        if r["loops"]:
            looped.add((r["kernel"], r["constexprs"]["CHANNELS_LAST"],
                        r["constexprs"]["BLOCK_R"] <= 64))
    assert looped >= {(k, cl, small) for k in ("_syncbn_stats_kernel",
                                               "_syncbn_backward_reduce_kernel")
                      for cl, small in ((True, True), (False, False), (False, True))}
    assert looped >= {"_syncbn_merge_kernel", "_syncbn_reduce_merge_kernel"}


def test_loop_barriers_reads_backward_branches():
    from benchmarks.sass import loop_barriers
    sass = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
.L_x_0:
        /*0010*/                   LDG.E.128 R4, desc[UR4][R2.64] ;
        /*0020*/                   BAR.SYNC.DEFER_BLOCKING 0x0 ;
        /*0030*/               @P0 BRA `(.L_x_0) ;
        /*0040*/                   BAR.SYNC.DEFER_BLOCKING 0x0 ;
        /*0050*/               @P1 BRA `(.L_x_1) ;
.L_x_1:
        /*0060*/                   EXIT ;
.L_x_2:
        /*0070*/                   BRA `(.L_x_2);
"""
    # one loop (0010-0030) with one barrier; a forward branch and the closing self-branch
    # are no loops, and the barrier after the loop is not in it
    assert loop_barriers(sass) == (1, 1)


def test_merge_rows_are_padded_to_aligned_rows(syncbn):
    """The partial rows syncbn_stats writes start 64 bytes apart at least (2C + 1 padded
    to a multiple of 16): the merge reads them with 16-byte loads."""
    merges = [r for r in syncbn["specialisations"] if r["kernel"] == "_syncbn_merge_kernel"]
    assert merges
    for r in merges:
        assert r["widest_load"] == 16, (r["sources"][0], r["loads"])


@pytest.mark.parametrize("shape,vec", [((8, 64, 3136), 16), ((8, 128, 784), 16),
                                       ((8, 256, 196), 4), ((8, 512, 49), 1),
                                       ((8, 3, 6), 2), ((8, 64), 1)])
def test_geometry_passes_the_planes_power_of_two_factor(shape, vec):
    from tritamp.testing import syncbn_geometry
    geo = syncbn_geometry(shape, True)
    assert geo.B_VEC == vec
    assert geo.args()[2] * geo.B_VEC == geo.B
