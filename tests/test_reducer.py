"""tritamp.parallel.Reducer: rank 0's weights at construction, gradients averaged over the
ranks on ``reduce()``, equal to DistributedDataParallel's (2 gloo processes on CPU,
uneven batches, two dtypes, an unused parameter)."""
import os
import sys

import pytest
import torch

from conftest import TOL
from tritamp.parallel import Reducer

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "scripts"))
import parallel_launch  # noqa: E402

WORLD = 2


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """The 2-rank world of the SyncBatchNorm tests runs tests/scripts/parallel_reducer.py's
    checks too (one launch for both)."""
    out = parallel_launch.world2(tmp_path_factory)
    return [torch.load(out / f"reducer.rank{r}.pt") for r in range(WORLD)]


def test_construction_broadcasts_rank0s_weights(ranks):
    r0, r1 = ranks
    assert any(not torch.equal(r0["own"][k], r1["own"][k]) for k in r0["own"])
    for k, v in r0["own"].items():
        assert torch.equal(r0["broadcast"][k], v)
        assert torch.equal(r1["broadcast"][k], v)


@pytest.mark.parametrize("mode", ["reducer", "listed"])
def test_reduce_averages_gradients_like_ddp(ranks, mode):
    for step in range(2):
        ours = [r["steps"][step][mode] for r in ranks]
        ddp = ranks[0]["steps"][step]["ddp"]
        assert set(ours[0]) == set(ddp) == {"fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"}
        for name, g in ddp.items():
            assert ours[0][name].dtype == g.dtype
            assert torch.equal(ours[0][name], ours[1][name]), f"ranks disagree on {name}"
            torch.testing.assert_close(ours[0][name], g, **TOL[torch.float32])


def test_parameters_without_gradients_are_left_alone(ranks):
    assert all(r["unused_grad"] is None for r in ranks)


def test_ranks_whose_backwards_reach_other_parameters_reduce_the_same_tensors(ranks):
    """Rank 0 has gradients for branch a only, rank 1 for b only: each parameter is
    averaged with zeros from the rank without one, on both ranks; a parameter no rank's
    backward reached keeps no gradient (Apex's reducer averaged a's gradient with b's)."""
    loc = [r["disjoint"]["local"] for r in ranks]
    for rank, theirs in ((0, "a."), (1, "b.")):
        for name, g in loc[rank].items():
            assert (g is not None) == name.startswith(theirs), (rank, name)
    for r in ranks:
        red = r["disjoint"]["reduced"]
        for name in red:
            if name.startswith("never."):
                assert red[name] is None
                continue
            owner = 0 if name.startswith("a.") else 1
            torch.testing.assert_close(red[name], loc[owner][name] / 2, rtol=0, atol=0)
            assert torch.equal(red[name], ranks[0]["disjoint"]["reduced"][name])


def test_reduce_after_an_amp_block_is_refused_and_inside_it_an_overflow_skips_everywhere(
        ranks):
    for r in ranks:
        got = r["amp_order"]
        assert got["refused"] is not None and "inside the scale_loss block" in got["refused"]
        assert "overflow_process_group" in got["refused"]
        assert got["grads_kept"]
        # rank 0's inf reached rank 1 through the reduction inside the block: both skip
        assert got["weights_kept"] and got["skipped"]
        assert got["scales"][1] == got["scales"][0] / 2


@pytest.mark.parametrize("kind", ["sgd", "fused-sgd"])
def test_reduce_after_an_o2_block_averages_what_the_step_reads(ranks, kind):
    # With overflow_process_group, reduce() after the block is allowed; at O2 the step
    # reads the fp32 masters' gradients: averaged, the ranks' masters stay equal (with
    # torch's SGD each rank stepped on its own gradients: the half ones were reduced).
    m0, m1 = (r["o2_after_block"][kind]["masters"] for r in ranks)
    assert len(m0) == len(m1) > 0
    for a, b in zip(m0, m1):
        assert torch.equal(a, b)


def test_reduce_of_a_list_after_an_o2_block_is_refused_with_nothing_reduced(ranks):
    for r in ranks:
        got = r["o2_after_block"]["listed"]
        assert "Reducer(model)" in got["refused"] and "Nothing was reduced" in got["refused"]
        assert got["grads_kept"]


def test_reducer_needs_torch_distributed():
    with pytest.raises(RuntimeError, match="init_process_group"):
        Reducer(torch.nn.Linear(2, 2))  # (its broadcast)
    # a list is only collected, as in Apex: reduce() is what communicates
    grads = [torch.ones(2), [torch.ones(3)]]
    reducer = Reducer(grads)
    with pytest.raises(RuntimeError, match="init_process_group"):
        reducer.reduce()
    assert all(torch.equal(g, torch.ones(2)) for g in reducer.grads[:1])


@pytest.mark.parametrize("bad,kind", [(torch.arange(3), "torch.int64"),
                                       (torch.ones(2, dtype=torch.bool), "torch.bool"),
                                       (torch.eye(2).to_sparse(), "torch.sparse_coo")])
def test_a_list_with_a_tensor_it_cannot_average_is_refused_when_built(bad, kind):
    # (an integer tensor was all-reduced in place, then refused by the division: left
    # summed over the ranks; a sparse one failed to flatten, in torch's words)
    with pytest.raises(TypeError, match=rf"Reducer averages dense floating-point tensors; "
                                        rf"tensor 1 \(shape \({bad.shape[0]},.*\) is {kind}"):
        Reducer([torch.ones(2), [bad]])


def test_reduce_op_is_torchs_as_apex_exported_it():
    from tritamp.parallel import ReduceOp
    assert ReduceOp is torch.distributed.ReduceOp
