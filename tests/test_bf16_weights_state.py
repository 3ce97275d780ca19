"""bf16 weights without masters, the optimizers' checkpoint conversions and the overflow
counter: a Kahan compensation does not outlive the weight it compensated
(a weight written between steps is taken as written); an optimizer loaded in the same
process keeps the loaded fp32 masters (the weights it wrote before the load are not
"written since the last step"); a refused step leaves no master it made and no
checkpoint state it converted (a master made from the weights of a refused step
overwrote weights loaded before the next one); a masters checkpoint converted into a
compensation survives a skipped step bit for bit; a group's numpy integer seed stays an
int, and a group's own rounding flag (which would be ignored) is refused;
``count_nonfinite`` takes a found_inf of any one-element shape and dtype and an empty
list on both paths, and refuses a bool index in its own words. Both paths: Triton's
interpreter and the production CPU path."""
import copy

import numpy as np
import pytest
import torch

from tritamp.kernels.overflow import count_nonfinite
from tritamp.optimizers import FusedAdam, FusedSGD


def _bf16_linear():
    torch.manual_seed(0)
    return torch.nn.Linear(4, 3).to(torch.bfloat16)


@pytest.mark.parametrize("write", ["load_state_dict", "new_storage"])
def test_a_bf16_weight_written_between_steps_drops_its_kahan_compensation(path, write):
    model = _bf16_linear()
    opt = FusedSGD(model.parameters(), lr=1.0, kahan_summation=True)
    with torch.no_grad():
        model.weight.fill_(256.0)  # half an ulp of 256 in bf16 is 1.0
    for _ in range(3):  # +0.3 a step: held by the compensation, the weight stays at 256
        model.weight.grad = torch.full_like(model.weight, -0.3)
        model.bias.grad = torch.zeros_like(model.bias)
        opt.step()
    assert torch.equal(model.weight, torch.full_like(model.weight, 256.0))
    assert opt.state[model.weight]["kahan_comp"].abs().min() > 0.5
    loaded = torch.full_like(model.weight, 0.001)
    if write == "load_state_dict":
        model.load_state_dict({"weight": loaded, "bias": model.bias.detach().clone()})
    else:
        model.weight.data = loaded.clone()
    model.weight.grad = torch.zeros_like(model.weight)
    model.bias.grad = torch.zeros_like(model.bias)
    opt.step()  # a zero update: the weight stays as written (the stale 0.9 was added to it)
    assert torch.equal(model.weight.detach(), loaded)
    assert not opt.state[model.weight]["kahan_comp"].any()


def _train(model, opt, steps, start=0):
    for s in range(start, start + steps):
        x = torch.randn(2, 4, generator=torch.Generator().manual_seed(s)).to(torch.bfloat16)
        opt.zero_grad()
        model(x).float().pow(2).mean().backward()
        opt.step()


@pytest.mark.parametrize("kind", ["master_param", "kahan_comp"])
def test_an_optimizer_loaded_in_process_keeps_the_loaded_state(path, kind):
    # (fp32 masters were overwritten by the weights written before the load; Kahan
    # compensations were zeroed as belonging to weights written since the last step)
    kw = (dict(lr=1e-3, master_weights=True) if kind == "master_param"
          else dict(lr=1e-2, kahan_summation=True))
    model = _bf16_linear()
    opt = FusedAdam(model.parameters(), **kw)
    _train(model, opt, 2)
    saved = copy.deepcopy((model.state_dict(), opt.state_dict()))
    loaded = [opt.state[p][kind].clone() for p in model.parameters()]
    assert all(t.any() for t in loaded)
    _train(model, opt, 2, start=100)  # on, then back to the checkpoint in this process
    model.load_state_dict(saved[0])
    opt.load_state_dict(saved[1])
    _train(model, opt, 1, start=2)

    fresh = _bf16_linear()
    fresh_opt = FusedAdam(fresh.parameters(), **kw)
    fresh.load_state_dict(saved[0])
    fresh_opt.load_state_dict(saved[1])
    _train(fresh, fresh_opt, 1, start=2)
    for p, q, t in zip(model.parameters(), fresh.parameters(), loaded):
        assert torch.equal(opt.state[p][kind], fresh_opt.state[q][kind])
        assert torch.equal(p, q)
        if kind == "master_param":  # the loaded master, not the bf16 weight, was stepped
            assert not torch.equal(opt.state[p][kind], t)


def _two_groups(opt_cls, **kw):
    torch.manual_seed(0)
    a = torch.nn.Parameter(torch.ones(3, dtype=torch.bfloat16))
    b = torch.nn.Parameter(torch.ones(3, dtype=torch.bfloat16))
    return a, b, opt_cls([{"params": [a]}, {"params": [b]}], **kw)


def test_a_refused_step_leaves_no_master_to_overwrite_weights_written_before_the_next(path):
    a, b, opt = _two_groups(FusedAdam, lr=0.0, master_weights=True)
    a.grad = torch.zeros_like(a)
    b.grad = torch.zeros(3, dtype=torch.bfloat16).to_sparse()  # group 1 refused
    with pytest.raises(RuntimeError, match="sparse"):
        opt.step()
    assert len(opt.state) == 0
    with torch.no_grad():  # the model's weights loaded, say, before the next step
        a.fill_(5.0)
        b.fill_(5.0)
    b.grad = torch.zeros_like(b)
    opt.step()  # lr 0: nothing moves
    assert torch.equal(a, torch.full_like(a, 5.0))
    assert torch.equal(b, torch.full_like(b, 5.0))


CONVERSIONS = {
    "masters-to-kahan": (dict(master_weights=True), dict(kahan_summation=True)),
    "kahan-to-masters": (dict(kahan_summation=True), dict(master_weights=True)),
    "kahan-to-stochastic": (dict(kahan_summation=True), dict(stochastic_rounding=True, seed=1)),
    "masters-to-stochastic": (dict(master_weights=True), dict(stochastic_rounding=True, seed=1)),
}


def _state_bits(opt):
    return {(i, k): (v.clone().reshape(-1).view(torch.uint8) if isinstance(v, torch.Tensor)
                     else v)
            for i, st in opt.state_dict()["state"].items() for k, v in st.items()}


@pytest.mark.parametrize("conversion", sorted(CONVERSIONS))
def test_a_refused_step_keeps_a_loaded_checkpoints_masters_and_compensations(path,
                                                                              conversion):
    saved_kw, kw = CONVERSIONS[conversion]
    a, b, opt = _two_groups(FusedAdam, lr=1e-3, **saved_kw)
    for _ in range(2):
        a.grad = torch.randn_like(a)
        b.grad = torch.randn_like(b)
        opt.step()
    saved = copy.deepcopy(opt.state_dict())
    a2 = torch.nn.Parameter(a.detach().clone())
    b2 = torch.nn.Parameter(b.detach().clone())
    opt2 = FusedAdam([{"params": [a2]}, {"params": [b2]}], lr=1e-3, **kw)
    opt2.load_state_dict(saved)
    before = _state_bits(opt2)
    a2.grad = torch.randn_like(a2)
    b2.grad = torch.zeros(3, dtype=torch.bfloat16).to_sparse()  # group 1 refused
    with pytest.raises(RuntimeError, match="sparse"):
        opt2.step()
    after = _state_bits(opt2)
    assert sorted(after) == sorted(before)
    for key, value in before.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(after[key], value), key
        else:
            assert after[key] == value, key


@pytest.mark.parametrize("found_inf", [torch.ones(1), torch.ones((), dtype=torch.bfloat16),
                                       torch.ones((1, 1), dtype=torch.float16)],
                         ids=["fp32-shape-1", "bf16-0d", "fp16-shape-1x1"])
def test_count_nonfinite_takes_a_one_element_found_inf_of_any_shape_and_dtype(cpu_path,
                                                                              found_inf):
    counts = torch.zeros(2, dtype=torch.int32)
    srcs = [torch.tensor([float("inf"), 1.0, float("nan")]), torch.ones(2, dtype=torch.float16)]
    count_nonfinite(srcs, counts, found_inf)
    assert counts.tolist() == [2, 0]
    count_nonfinite(srcs, counts, torch.zeros_like(found_inf))  # a clean step counts nothing
    assert counts.tolist() == [2, 0]


def test_count_nonfinite_of_no_sources_counts_nothing(path):
    counts = torch.zeros(0, dtype=torch.int32)
    count_nonfinite([], counts, torch.ones(()))
    assert counts.numel() == 0
    with pytest.raises(ValueError, match="found_inf must be a one-element tensor"):
        count_nonfinite([], counts, torch.ones(2))


def test_count_nonfinite_refuses_a_bool_index_in_its_own_words(path):
    counts = torch.zeros(2, dtype=torch.int32)
    srcs = [torch.tensor([float("inf")]), torch.tensor([float("nan")])]
    with pytest.raises(ValueError, match=r"index must hold one int >= 0 per source"):
        count_nonfinite(srcs, counts, torch.ones(()), index=[True, False])
    assert not counts.any()


def test_a_masters_checkpoint_loaded_for_kahan_summation_survives_a_skipped_step(path):
    # the weight 1 + 2**-7 (odd last bit) and a master just under half an ulp above it:
    # the remainder rounded to nearest was half an ulp, and weight + compensation a tie
    # that rounds to the weight's even neighbour
    weight = 1.0 + 2 ** -7
    p = torch.nn.Parameter(torch.full((3,), weight, dtype=torch.bfloat16))
    opt = FusedSGD([p], lr=0.1, kahan_summation=True)
    saved = opt.state_dict()
    saved["state"] = {0: {"master_param": torch.full((3,), weight + 0.0039),
                          "step": torch.tensor(3.0)}}
    opt.load_state_dict(saved)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0)
    scaler.scale(torch.ones(()))
    p.grad = torch.full_like(p, float("inf"))
    scaler.step(opt)  # an overflow: skipped
    scaler.update()
    assert scaler.get_scale() == 1.0
    assert torch.equal(p, torch.full_like(p, weight))
    comp = opt.state[p]["kahan_comp"]
    assert (comp > 0).all() and (comp < 2 ** -8).all()


def test_a_numpy_integer_seed_of_an_added_group_stays_a_whole_number(path):
    a = torch.nn.Parameter(torch.ones(3, dtype=torch.bfloat16))
    b = torch.nn.Parameter(torch.ones(3, dtype=torch.bfloat16))
    opt = FusedAdam([a], lr=1e-3, stochastic_rounding=True, seed=3)
    opt.add_param_group({"params": [b], "seed": np.uint64(2 ** 63 + 1)})
    assert opt.param_groups[1]["seed"] == 2 ** 63 + 1
    assert isinstance(opt.param_groups[1]["seed"], int)
    a.grad = torch.ones_like(a)
    b.grad = torch.ones_like(b)
    opt.step()  # (refused at every step: the seed had become a float)


@pytest.mark.parametrize("flag", ["stochastic_rounding", "kahan_summation"])
def test_a_group_asking_for_a_rounding_mode_the_optimizer_lacks_is_refused(flag):
    a = torch.nn.Parameter(torch.ones(3, dtype=torch.bfloat16))
    b = torch.nn.Parameter(torch.ones(3, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=f"says {flag}=True"):
        FusedAdam([{"params": [a], flag: True}], lr=1e-3)
    opt = FusedAdam([a], lr=1e-3)
    with pytest.raises(ValueError, match=f"says {flag}=True"):
        opt.add_param_group({"params": [b], flag: True})
    assert len(opt.param_groups) == 1
