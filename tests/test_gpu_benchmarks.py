"""CUDA checks of the benchmarks' timer: the CUDA-graph timing agrees with CUDA events
around plain calls, and the kernel benchmark's rows come out timed from graphs.

Skipped (with a reason) where no CUDA device is present; CI has none (the timer's logic
is checked there with stand-ins for torch.cuda: tests/test_benchmark_optimizers.py).
"""
import json

import pytest
import torch

from benchmarks import kernels as kb
from benchmarks import optimizers as ob

pytestmark = pytest.mark.gpu


def test_graph_timing_of_a_copy_agrees_with_events_around_plain_calls():
    import triton.testing
    src = torch.ones(16 << 20, device="cuda")  # 64 MB: a memory-bound copy of ~50 us
    dst = torch.empty_like(src)
    step = lambda: dst.copy_(src)  # noqa: E731
    med, p20, p80 = ob.cuda_graph_ms(step)
    plain = triton.testing.do_bench(step, warmup=25, rep=100, quantiles=[0.5])
    plain = plain[0] if isinstance(plain, (list, tuple)) else plain
    assert p20 <= med <= p80
    assert 0.75 < med / plain < 1.25, (med, plain)


def test_small_rows_are_timed_from_cuda_graphs(tmp_path):
    rc = kb.main(["--sizes", "1M", "--layouts", "transformer", "--no-optimizers",
                  "--no-norms", "--no-syncbn", "--budget-s", "60", "--out", str(tmp_path)])
    assert rc == 0
    rows = json.loads((tmp_path / "kernels_cuda.json").read_text())["rows"]
    assert rows and all(r.get("time_ms", 0) > 0 and r["host_ms"] > 0 for r in rows), rows
    # tritamp's rows read nothing back on the host: every one is captured in a graph
    ours = [r for r in rows if r["impl"] == "tritamp"]
    assert ours and all(r["timing"] == "cuda graph" for r in ours), ours
    # 1M parameters move a few MB, under the L2: each row rotates its own working sets
    l2 = ob.l2_bytes(torch.device("cuda"))
    assert l2 > 0 and all(r["rotated"] == ob.rotation(r["bytes"], l2) > 1 for r in rows), rows
