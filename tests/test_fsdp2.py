"""tritamp with FSDP2 (``fully_shard``), 2 ranks under torchrun (gloo, CPU): the fused
optimizers step DTensor parameters (each rank its shards) and match torch.optim under
the same FSDP2 run; FusedLAMB, FusedNovoGrad and clip_grad_norm_ reduce their norms over
the shards and match the unsharded model; a torch.distributed.checkpoint resumes
bitwise; amp O1 agrees on overflows across ranks; O2/O3 are refused.

One torchrun world runs every case (tests/scripts/fsdp_worker.py, which says how the
batches are chosen); the cases marked interpreted ran again on the Triton kernels in
Triton's interpreter."""
import json
import os

import pytest
import torch

from conftest import torchrun

HERE = os.path.dirname(os.path.abspath(__file__))
# Relative difference of the whole parameters after 10 steps: torch's optimizers and
# tritamp's order their fp32 operations differently (torch's own foreach and fused
# implementations differ from each other by as much).
REL = 1e-6


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    if not torch.distributed.is_available():
        pytest.skip("torch.distributed is not available in this build")
    out = tmp_path_factory.mktemp("fsdp2")
    torchrun(os.path.join(HERE, "scripts", "fsdp_worker.py"), out, timeout=600)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def _both(reports, key):
    return [rep[key] for rep in reports]


@pytest.mark.parametrize("key", ["torch/adam_w", "torch/adam_l2", "torch/sgd",
                                 "torch/adagrad", "torch/adam_w/interpreted"])
def test_fused_optimizers_step_dtensors_as_torch_optim_does(reports, key):
    for r in _both(reports, key):
        assert r["rel"] <= REL, r
        assert r["moved"] > 1e-3, r  # the run trained
        # state sharded as its parameter (moments), step counts plain
        assert r["state_types"] == ["DTensor", "Tensor"], r
        assert all(r["triton"]) == key.endswith("interpreted"), r


@pytest.mark.parametrize("key", ["unsharded/lamb", "unsharded/lamb_nvlamb_clip_small",
                                 "unsharded/novograd", "unsharded/novograd_max",
                                 "unsharded/mixed_precision_lamb_bf16",
                                 "unsharded/lamb/interpreted", "unsharded/novograd/interpreted",
                                 "unsharded/novograd_max/interpreted"])
def test_lamb_and_novograd_norms_are_those_of_the_whole_tensors(reports, key):
    # A norm taken over one shard only would change the trust ratio, the clip or the
    # second moment by far more than REL.
    for r in _both(reports, key):
        assert r["rel"] <= REL, r
        assert r["moved"] > 1e-3, r
        assert all(r["triton"]) == key.endswith("interpreted"), r


@pytest.mark.parametrize("key", ["clip", "clip/interpreted", "clip/inf", "clip/1.0",
                                 "clip/3.0", "clip/error_if_nonfinite"])
def test_clip_grad_norm_over_sharded_gradients(reports, key):
    for r in _both(reports, key):
        assert r["total"] == pytest.approx(r["ref"], rel=1e-6), r
        assert r["total"] > 0.1  # so the gradients were clipped
        assert r["rel"] <= REL and r["total_is_plain"], r


def test_a_plain_tensor_among_dtensors_is_refused_before_anything_changes(reports):
    for r in _both(reports, "refused"):
        assert "tensor 7 (shape (3,)) is a plain tensor among DTensors" in r["message"], r
        assert r["unchanged"] and r["no_state"], r


@pytest.mark.parametrize("name", ["sgd", "adam"])
def test_zero_grad_zeroes_dtensor_and_plain_gradients_of_one_optimizer(reports, name):
    for r in _both(reports, f"mixed/zero_grad/{name}"):
        assert r["message"] is None and r["zeroed"], r


def test_a_gradient_laid_out_unlike_its_parameter_is_refused(reports):
    for r in _both(reports, "refused/gradient"):
        assert "parameter 1 is a DTensor with placements (Shard(dim=0),) but its gradient " \
               "has placements (Replicate(),)" in r["message"], r
        assert r["unchanged"] and r["no_state"], r


@pytest.mark.parametrize("name", ["adam", "adagrad", "sgd"])
def test_a_partial_parameter_is_refused_before_anything_changes(reports, name):
    for r in _both(reports, f"refused/partial/{name}"):
        assert "parameter 0 is a DTensor with placements (Partial(sum),): a Partial " \
               "placement holds partial sums, not a shard" in (r["message"] or ""), r
        assert r["unchanged"] and r["no_state"], r


def test_state_with_other_placements_loads_sharded_as_the_parameters(reports):
    for r in _both(reports, "load/other_placements"):
        assert r["placements"] == ["(Shard(dim=0),)"] and r["rel"] == 0.0, r
        # stochastic rounding without seed= in a group of 2 processes warns (once: the
        # optimizer given seed= does not)
        assert len(r["seed_warnings"]) == 1 and "Pass the same seed=" in r["seed_warnings"][0]


@pytest.mark.parametrize("name", ["adam", "sgd", "lamb", "novograd", "novograd/interpreted"])
def test_a_distributed_checkpoint_resumes_bitwise(reports, name):
    for r in _both(reports, f"resume/{name}"):
        assert r["bitwise"], r


@pytest.mark.parametrize("flag", ["stochastic", "kahan", "stochastic/interpreted",
                                  "kahan/interpreted"])
def test_bf16_weights_without_masters_over_shards(reports, flag):
    """FusedAdam with stochastic rounding or Kahan summation on a bf16 model under
    FSDP2: a distributed checkpoint resumes bitwise (seed, step counts and DTensor
    compensations restored); each shard of a parameter draws its own bits."""
    rs = _both(reports, f"rounding/{flag}")
    for r in rs:
        assert r["bitwise"] and r["moved"] and r["dtypes"] == ["torch.bfloat16"], r
    if flag.startswith("kahan"):
        assert all(r["comps"] and set(r["comps"]) == {"DTensor"} for r in rs), rs
    else:
        assert rs[0]["keys"] and len(rs[0]["keys"]) == len(rs[1]["keys"]), rs
        assert not set(rs[0]["keys"]) & set(rs[1]["keys"]), rs


@pytest.mark.parametrize("half", ["fp16", "bf16"])
def test_amp_o1_on_the_sharded_model_matches_the_unsharded_one(reports, half):
    for r in _both(reports, f"amp/O1/{half}"):
        assert r["finite"] and r["rel"] <= REL, r


@pytest.mark.parametrize("key", ["amp/overflow", "amp/overflow/interpreted"])
def test_an_overflow_on_one_rank_skips_the_step_on_both(reports, key):
    for rank, r in enumerate(_both(reports, key)):
        # amp.nonfinite_gradients counts each rank's own shards (it raised on DTensors)
        nonfinite = [["fc1.weight", 1]] if rank == 1 else []
        assert r == dict(unchanged=True, scale=32768.0, skipped=True, state_before=0,
                         trained_after=True, nonfinite=nonfinite), r


@pytest.mark.parametrize("level", ["O2", "O3"])
def test_amp_o2_o3_refuse_dtensors_and_point_at_mixed_precision_policy(reports, level):
    for r in _both(reports, f"amp/refused/{level}"):
        assert f"opt_level='{level}' casts the model" in r["message"], r
        assert "MixedPrecisionPolicy" in r["message"], r
        assert r["unchanged"] and r["dtypes"] == ["torch.float32"], r


def test_amp_o0_dynamic_scale_with_fsdp2_mixed_precision_policy(reports):
    # FSDP2 computes in fp16 from fp32 shards (which stay the masters); amp scales the loss
    for r in _both(reports, "amp/O0/mp_policy"):
        assert r["last"] < 0.7 * r["first"], r
        assert r["scale"] == 65536.0 and r["dtypes"] == ["torch.float32"], r
