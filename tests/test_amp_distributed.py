"""amp with torch.distributed (gloo on CPU, launched by torchrun): DDP wrapped after
initialize at every opt level keeps the master weights equal across ranks, and an
overflow on one rank makes every rank of ``overflow_process_group`` skip the step."""
import json
import os

import pytest
import torch

from tritamp import amp

from conftest import torchrun

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    if not torch.distributed.is_available():
        pytest.skip("torch.distributed is not available in this build")
    out = tmp_path_factory.mktemp("amp_dist")
    # the workers run the torch reference paths: quick
    torchrun(os.path.join(HERE, "scripts", "amp_dist_worker.py"), out)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.parametrize("level", ["O0", "O1", "O2", "O3"])
@pytest.mark.parametrize("half", ["fp16", "bf16"])
def test_ddp_after_initialize_keeps_ranks_equal(reports, level, half):
    for rank, report in enumerate(reports):
        r = report[f"ddp/{level}/{half}"]
        assert r["trained"] and r["finite"], (rank, r)
        assert r["masters_equal"] and r["model_equal"], (rank, r)


@pytest.mark.parametrize("kind", ["plain", "fused"])
def test_overflow_on_one_rank_without_a_group_skips_there_only(reports, kind):
    r0, r1 = (rep[f"overflow/none/{kind}"] for rep in reports)
    assert r0 == dict(stepped=True, loss_scale=65536.0)
    assert r1 == dict(stepped=False, loss_scale=32768.0)


@pytest.mark.parametrize("group", ["world", "pair"])
@pytest.mark.parametrize("kind", ["plain", "fused"])
def test_overflow_group_makes_every_rank_skip(reports, kind, group):
    for rep in reports:
        assert rep[f"overflow/{group}/{kind}"] == dict(stepped=False, loss_scale=32768.0)


def test_an_overflow_group_this_rank_is_not_in_is_refused_by_name(reports):
    # (rank 1 got torch's GroupMember.NON_GROUP_MEMBER, -100: refused as "got -100")
    r0, r1 = (rep["overflow/not_a_member"] for rep in reports)
    assert r0["message"] is None
    assert r1["message"].startswith("overflow_process_group: this rank (1) is not a member "
                                    "of the group") and r1["unchanged"], r1


def test_overflow_group_needs_distributed_initialised():
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    with pytest.raises(RuntimeError, match="init_process_group"):
        amp.initialize(model, opt, opt_level="O2", overflow_process_group=object())
    assert model.weight.dtype == torch.float32  # a refused call changes nothing


def test_initialize_accepts_larc():
    """LARC wraps an optimizer without subclassing one; initialize takes it, as Apex did."""
    from tritamp.parallel import LARC
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    ref = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    ref.load_state_dict(model.state_dict())
    opt = LARC(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4))
    ref_opt = LARC(torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4))
    model, opt = amp.initialize(model, opt, opt_level="O2", half_dtype=torch.bfloat16,
                                loss_scale="dynamic", verbosity=0)
    assert isinstance(opt, LARC)
    x = torch.randn(4, 8)
    for _ in range(3):
        loss = model(x).float().pow(2).mean()
        opt.zero_grad()
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()
        ref_loss = ref(x).pow(2).mean()
        ref_opt.zero_grad()
        ref_loss.backward()
        ref_opt.step()
    for m, p in zip(amp.master_params(opt), ref.parameters()):
        assert m.dtype == torch.float32
        torch.testing.assert_close(m, p, rtol=2e-2, atol=2e-3)
    with pytest.raises(TypeError, match="LARC"):
        amp.initialize(torch.nn.Linear(2, 2), "not an optimizer")
