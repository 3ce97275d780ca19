"""Promises of tritamp.parallel (the SyncBatchNorm process groups, Reducer), tritamp.fp16_utils
and tritamp.normalization that a mutation audit found unchecked by the other test files:
CPU only, tiny tensors, one-rank gloo groups made in this process (and destroyed) where a
process group is needed."""
import pytest
import torch
import torch.distributed as dist
from torch import nn

from tritamp import amp
from tritamp.fp16_utils import DynamicLossScaler, FP16_Optimizer, LossScaler, network_to_half
from tritamp.normalization import MixedFusedLayerNorm, MixedFusedRMSNorm
from tritamp.parallel import Reducer, create_syncbn_process_group


@pytest.fixture
def one_rank_group(tmp_path):
    """torch.distributed initialised with a world of one (gloo, file store), torn down after."""
    if not dist.is_available():
        pytest.skip("torch.distributed is not available")
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


# -- SyncBatchNorm / convert ---------------------------------------------------------------

@pytest.mark.parametrize("size", [-1, -2, 2])
def test_create_syncbn_process_group_refuses_a_size_that_is_negative_or_above_the_world(
        one_rank_group, size):
    with pytest.raises(ValueError, match=rf"group_size {size} must divide the world size 1"):
        create_syncbn_process_group(size)


def test_create_syncbn_process_group_of_the_whole_one_rank_world(one_rank_group):
    assert create_syncbn_process_group(0) is None
    group = create_syncbn_process_group(1)
    assert group is not None and dist.get_world_size(group) == 1


# -- Reducer -------------------------------------------------------------------------------

def test_reducer_after_an_amp_block_is_allowed_in_a_world_of_one(one_rank_group):
    # (the refusal after a scale_loss exit guards against another rank's inf/NaN: with one
    # rank there is none, and the gradients are averaged over one, i.e. left as they are)
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O1", verbosity=0)
    reducer = Reducer(model)
    with amp.scale_loss(model(torch.ones(4, 3)).sum(), opt) as scaled:
        scaled.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    reducer.reduce()
    for p, g in zip(model.parameters(), grads):
        assert torch.equal(p.grad, g)
    opt.step()


# -- FP16_Optimizer ------------------------------------------------------------------------

def _fp16_setup(**kwargs):
    torch.manual_seed(0)
    model = nn.Linear(3, 1).to(torch.bfloat16)
    return model, FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.1), verbose=False,
                                 **kwargs)


def test_fp16_optimizer_static_loss_scale_defaults_to_one_as_apex():
    _, opt = _fp16_setup()
    assert opt.dynamic_loss_scale is False
    assert opt.loss_scale == 1.0
    assert opt.state_dict()["loss_scaler"]["loss_scale"] == 1.0


def test_fp16_optimizer_load_state_dict_takes_first_closure_call_this_step():
    # (Apex's key: a checkpoint's value is restored, not reset)
    _, opt = _fp16_setup()
    state = opt.state_dict()
    assert state["first_closure_call_this_step"] is True
    state["first_closure_call_this_step"] = False
    _, other = _fp16_setup()
    other.load_state_dict(state)
    assert other.first_closure_call_this_step is False


# -- fp16util / legacy loss scalers --------------------------------------------------------

def test_network_to_half_defaults_to_float16_as_apex():
    torch.manual_seed(0)
    net = network_to_half(nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2)))
    assert net[1][0].weight.dtype == torch.float16
    assert net[1][1].weight.dtype == torch.float32  # (affine BatchNorm kept fp32)
    assert net[0](torch.ones(1, 2)).dtype == torch.float16


def test_legacy_static_loss_scaler_defaults_to_one():
    assert LossScaler().loss_scale == 1.0


def test_legacy_dynamic_loss_scaler_counters_take_their_lowest_values():
    scaler = DynamicLossScaler()
    scaler.update_scale(False)
    scaler.cur_iter = 0
    scaler.last_overflow_iter = -1
    assert (scaler.cur_iter, scaler.last_overflow_iter) == (0, -1)
    with pytest.raises(ValueError, match=r"cur_iter must be an int >= 0, got -1"):
        scaler.cur_iter = -1
    with pytest.raises(ValueError, match=r"last_overflow_iter must be an int >= -1, got -2"):
        scaler.last_overflow_iter = -2
    assert (scaler.cur_iter, scaler.last_overflow_iter) == (0, -1)


# -- normalization -------------------------------------------------------------------------

@pytest.mark.parametrize("cls", [MixedFusedLayerNorm, MixedFusedRMSNorm])
def test_mixed_fused_norms_default_eps_is_apexs(cls):
    norm = cls(4)
    assert norm.eps == 1e-5
    # (and the forward uses it: as torch with eps=1e-5)
    x = torch.full((1, 4), 0.5)
    want = (nn.functional.layer_norm(x, (4,), eps=1e-5) if cls is MixedFusedLayerNorm
            else nn.functional.rms_norm(x, (4,), eps=1e-5))
    torch.testing.assert_close(norm(x).detach(), want)
