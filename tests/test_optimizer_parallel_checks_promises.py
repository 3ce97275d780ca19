"""Promises of the optimizers', LARC's, the Reducer's and the kernels' input checks that
the other tests leave open: a Fraction learning rate given to the
constructor steps as a float, and numpy numbers set on a group later are taken; a group
that turns the optimizer's rounding mode off is refused as one that turns it on; a step
after a refused one (its checkpoint state put back) steps as if the refused one never
ran; LARC finds a
non-contiguous gradient overlapping another group's past its first element; the Reducer
takes complex tensors; scale_update refuses a Python bool factor; on a one-rank mesh,
sharded gradients are clipped by other p-norms as torch clips them (an empty shard
included, which torch's infinity norm refused) and a two-element max_norm is refused."""
import copy
from fractions import Fraction

import numpy as np
import pytest
import torch

from conftest import step_alike
from tritamp.optimizers import FusedAdam
from tritamp.parallel import LARC, Reducer


def _pair(seed=0):
    gen = torch.Generator().manual_seed(seed)
    ps = [torch.randn(3, 4, generator=gen).requires_grad_()]
    return ps, [p.detach().clone().requires_grad_() for p in ps], gen


def test_a_fraction_learning_rate_given_to_the_constructor_steps_as_a_float(cpu_path):
    ps, qs, gen = _pair()
    opt, ref = FusedAdam(ps, lr=Fraction(1, 4)), FusedAdam(qs, lr=0.25)
    assert type(opt.param_groups[0]["lr"]) is float
    step_alike(ps, qs, opt, ref, gen)


def test_numpy_numbers_set_on_a_group_after_construction_step_as_floats(cpu_path):
    ps, qs, gen = _pair(1)
    opt, ref = FusedAdam(ps, lr=0.1), FusedAdam(qs, lr=0.1)
    opt.param_groups[0].update(eps=np.float32(0.5), weight_decay=np.float64(0.25),
                               betas=(np.float64(0.5), np.float32(0.75)))
    ref.param_groups[0].update(eps=0.5, weight_decay=0.25, betas=(0.5, 0.75))
    step_alike(ps, qs, opt, ref, gen)


@pytest.mark.parametrize("flag,kw", [("stochastic_rounding", dict(seed=1)),
                                     ("kahan_summation", {})])
def test_a_group_turning_the_optimizers_rounding_mode_off_is_refused(flag, kw):
    a = torch.nn.Parameter(torch.ones(3, dtype=torch.bfloat16))
    b = torch.nn.Parameter(torch.ones(3, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=f"says {flag}=False"):
        FusedAdam([{"params": [a], flag: False}], lr=1e-3, **{flag: True}, **kw)
    opt = FusedAdam([a], lr=1e-3, **{flag: True}, **kw)
    with pytest.raises(ValueError, match=f"says {flag}=False"):
        opt.add_param_group({"params": [b], flag: False})
    assert len(opt.param_groups) == 1


def _kahan_checkpoint():
    gen = torch.Generator().manual_seed(3)
    a = torch.nn.Parameter(torch.randn(5, generator=gen).to(torch.bfloat16))
    b = torch.nn.Parameter(torch.randn(3, generator=gen).to(torch.bfloat16))
    opt = FusedAdam([{"params": [a]}, {"params": [b]}], lr=1e-3, kahan_summation=True)
    for _ in range(2):
        a.grad = torch.randn(5, generator=gen).to(torch.bfloat16)
        b.grad = torch.randn(3, generator=gen).to(torch.bfloat16)
        opt.step()
    assert opt.state[a]["kahan_comp"].any()
    return a, b, copy.deepcopy(opt.state_dict())


def test_a_step_after_a_refused_one_steps_the_checkpoint_state_it_put_back(path):
    # (a Kahan checkpoint loaded for masters: the refused step made a master from it and
    # put the compensation back; the next step must not reuse that master)
    a, b, saved = _kahan_checkpoint()
    runs = []
    for refuse_first in (True, False):
        a2 = torch.nn.Parameter(a.detach().clone())
        b2 = torch.nn.Parameter(b.detach().clone())
        opt = FusedAdam([{"params": [a2]}, {"params": [b2]}], lr=1e-3, master_weights=True)
        opt.load_state_dict(copy.deepcopy(saved))
        if refuse_first:
            a2.grad = torch.ones_like(a2)
            b2.grad = torch.zeros(3, dtype=torch.bfloat16).to_sparse()  # group 1 refused
            with pytest.raises(RuntimeError, match="sparse"):
                opt.step()
        a2.grad = torch.full_like(a2, 0.5)
        b2.grad = torch.full_like(b2, -0.5)
        opt.step()
        runs.append((a2, b2, opt))
    (a2, b2, opt), (a3, b3, ref) = runs
    assert torch.equal(a2, a3) and torch.equal(b2, b3)
    for p, q in ((a2, a3), (b2, b3)):
        assert sorted(opt.state[p]) == sorted(ref.state[q])
        assert torch.equal(opt.state[p]["master_param"], ref.state[q]["master_param"])


def test_larc_non_contiguous_gradient_overlapping_another_groups_past_its_first_element(path):
    g = torch.Generator().manual_seed(0)
    ps = [torch.nn.Parameter(torch.randn(4, generator=g)) for _ in range(2)]
    base = torch.randn(4, 4, generator=g)
    ps[0].grad = base[:, 0]  # elements 0, 4, 8, 12 of base: not contiguous
    ps[1].grad = base[2]  # elements 8..11: element 8 is ps[0]'s gradient's third
    opt = torch.optim.SGD([{"params": ps[:1]}, {"params": ps[1:]}], lr=0.1)
    before = [t.clone() for t in (*ps, base)]
    with pytest.raises(ValueError, match=r"param_groups\[0\]\['params'\]\[0\].*"
                                         r"param_groups\[1\]\['params'\]\[0\].*share memory"):
        LARC(opt).step()
    assert all(torch.equal(x, y) for x, y in zip(before, (*ps, base)))


def test_reducer_takes_a_list_of_complex_tensors_when_built():
    grads = [torch.ones(2), torch.ones(3, dtype=torch.complex64)]
    assert Reducer(grads).grads[1] is grads[1]


@pytest.mark.parametrize("name", ["growth_factor", "backoff_factor", "min_scale",
                                  "max_scale"])
def test_scale_update_refuses_a_python_bool_factor(path, name):
    from tritamp.kernels.scale_update import STATE_SIZE, scale_update
    state = torch.zeros(STATE_SIZE)
    state[0] = 4.0
    before = state.clone()
    with pytest.raises(TypeError, match=rf"scale_update: {name} must be a real number, "
                                        r"got bool True"):
        scale_update(state, **{name: True})
    assert torch.equal(state, before)


@pytest.fixture
def one_rank_mesh(tmp_path):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("norm_type", [1.0, 3.0, float("inf")])
def test_sharded_clip_of_other_norms_matches_torch_and_takes_an_empty_shard(one_rank_mesh,
                                                                             norm_type):
    from torch.distributed.tensor import Shard, distribute_tensor
    from tritamp.optimizers import clip_grad_norm_
    values = [torch.tensor([3.0, -1.0, 2.0, 0.5]), torch.tensor([-4.0, 1.0]), torch.zeros(0)]
    ps = [torch.nn.Parameter(distribute_tensor(torch.ones(v.shape), one_rank_mesh,
                                               [Shard(0)])) for v in values]
    want = torch.linalg.vector_norm(torch.cat(values), norm_type)
    for max_norm in (1.0, 2 * float(want)):  # clipped; then left alone (coefficient 1)
        for p, v in zip(ps, values):
            p.grad = distribute_tensor(v.clone(), one_rank_mesh, [Shard(0)])
        norm = clip_grad_norm_(ps, max_norm, norm_type=norm_type)
        # (torch's implementation refused the empty shard for inf: "cannot compute")
        torch.testing.assert_close(getattr(norm, "full_tensor", lambda: norm)(), want)
        coef = min(max_norm / (float(want) + 1e-6), 1.0)
        for p, v in zip(ps, values):
            torch.testing.assert_close(p.grad.to_local(), v * coef)


def test_sharded_clip_of_another_norm_refuses_a_max_norm_of_two_elements(one_rank_mesh):
    from torch.distributed.tensor import Shard, distribute_tensor
    from tritamp.optimizers import clip_grad_norm_
    p = torch.nn.Parameter(distribute_tensor(torch.ones(4), one_rank_mesh, [Shard(0)]))
    p.grad = distribute_tensor(torch.tensor([3.0, -1.0, 2.0, 0.5]), one_rank_mesh, [Shard(0)])
    with pytest.raises(ValueError, match=r"max_norm is a torch.float32 tensor of shape \(2,\)"):
        clip_grad_norm_([p], torch.tensor([1.0, 2.0]), norm_type=1.0)
    assert torch.equal(p.grad.to_local(), torch.tensor([3.0, -1.0, 2.0, 0.5]))
