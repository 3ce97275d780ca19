"""Run by tests/test_fsdp2.py under torchrun (2 ranks, gloo, CPU): tritamp with FSDP2's
``fully_shard``. Writes one JSON report per rank into the folder given as argv[1].

The model has a parameter of one row (rank 1's shard of it is empty) and one of five
rows (uneven shards). Cases that compare with torch.optim under the same FSDP2 run give
each rank its own batch; cases that compare with an unsharded model give every rank the
same batch, so FSDP2's averaged gradients are the unsharded model's gradients.

Every case runs the production CPU path; the cases of ``INTERPRETED`` run again with the
Triton kernels in Triton's interpreter (the code a GPU runs)."""
import json
import math
import os
import sys

# Set before Triton is imported, so that its kernels can run in the interpreter; each
# case then picks the path (TRITON_INTERPRET=0: the production CPU path).
os.environ["TRITON_INTERPRET"] = "1"

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import fully_shard

from tritamp import amp
from tritamp.optimizers import (FusedAdagrad, FusedAdam, FusedLAMB, FusedMixedPrecisionLamb,
                                FusedNovoGrad, FusedSGD, clip_grad_norm_)
from tritamp.testing import plans_of, reset_amp

STEPS = 10


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Parameter(torch.randn(1, 8) * 0.5)  # one row: rank 1's shard is empty
        self.fc1 = nn.Linear(8, 16)
        self.norm = nn.LayerNorm(16)
        self.fc2 = nn.Linear(16, 5)                      # five rows: uneven shards

    def forward(self, x):
        return self.fc2(self.norm(torch.relu(self.fc1(x + self.emb))))


def make(sharded=True, dtype=None):
    torch.manual_seed(0)
    model = Net()
    if dtype is not None:
        model.to(dtype)
    if sharded:
        fully_shard(model.fc1)
        fully_shard(model.fc2)
        fully_shard(model)
    return model


def batch(step, rank=None):
    """The batch of ``step``: the rank's own (``rank``), or one for every rank."""
    g = torch.Generator().manual_seed(1000 + 7 * step + (0 if rank is None else 1 + rank))
    return torch.randn(6, 8, generator=g), torch.randn(6, 5, generator=g)


def loss_of(model, x, y):
    x = x.to(model.fc1.weight.dtype)
    return (model(x).float() - y).pow(2).mean()


def full(params):
    """The whole parameters (gathered from the shards), flattened, in fp64."""
    out = []
    for p in params:
        t = p.full_tensor() if hasattr(p, "full_tensor") else p
        out.append(t.detach().double().reshape(-1))
    return torch.cat(out)


def rel_diff(a, b):
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def on_triton(opt):
    """Whether the optimizer's kept sweeps run the Triton kernels."""
    return [bool(cache.prepared.triton) for cache in plans_of(opt).values()]


def train(model, opt, steps, rank=None, start=0):
    for step in range(start, start + steps):
        x, y = batch(step, rank)
        opt.zero_grad()
        loss_of(model, x, y).backward()
        opt.step()


# -- tritamp against torch.optim, both under FSDP2 ---------------------------------------------
TORCH_PAIRS = {
    "adam_w": (lambda p: FusedAdam(p, lr=1e-2, weight_decay=0.1),
               lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1)),
    "adam_l2": (lambda p: FusedAdam(p, lr=1e-2, weight_decay=0.1, adam_w_mode=False),
                lambda p: torch.optim.Adam(p, lr=1e-2, weight_decay=0.1)),
    "sgd": (lambda p: FusedSGD(p, lr=0.05, momentum=0.9, weight_decay=1e-3, nesterov=True),
            lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, weight_decay=1e-3,
                                      nesterov=True)),
    "adagrad": (lambda p: FusedAdagrad(p, lr=0.05, weight_decay=1e-3),
                lambda p: torch.optim.Adagrad(p, lr=0.05, weight_decay=1e-3)),
}


def vs_torch(name, rank):
    ours, theirs = TORCH_PAIRS[name]
    a, b = make(), make()
    opt_a, opt_b = ours(a.parameters()), theirs(b.parameters())
    start = full(a.parameters())
    train(a, opt_a, STEPS, rank)
    train(b, opt_b, STEPS, rank)
    fa, fb = full(a.parameters()), full(b.parameters())
    state = opt_a.state[next(iter(a.parameters()))]
    kinds = sorted({type(v).__name__ for v in state.values()})
    return dict(rel=rel_diff(fa, fb), moved=rel_diff(fa, start), state_types=kinds,
                triton=on_triton(opt_a))


# -- tritamp under FSDP2 against tritamp on the unsharded model --------------------------------
UNSHARDED = {
    "lamb": lambda p: FusedLAMB(p, lr=1e-2, weight_decay=0.01, max_grad_norm=1.0),
    "lamb_nvlamb_clip_small": lambda p: FusedLAMB(p, lr=1e-2, weight_decay=0.0,
                                                  max_grad_norm=0.05, use_nvlamb=True),
    "novograd": lambda p: FusedNovoGrad(p, lr=1e-2, weight_decay=0.01),
    "novograd_max": lambda p: FusedNovoGrad(p, lr=1e-2, norm_type=0, grad_averaging=False),
    # bf16 parameters with fp32 masters (DTensors too) and state
    "mixed_precision_lamb_bf16": lambda p: FusedMixedPrecisionLamb(p, lr=1e-2),
}


def vs_unsharded(name, rank):
    make_opt = UNSHARDED[name]
    dtype = torch.bfloat16 if name.endswith("bf16") else None
    a, b = make(dtype=dtype), make(sharded=False, dtype=dtype)
    opt_a, opt_b = make_opt(a.parameters()), make_opt(b.parameters())
    start = full(b.parameters())
    train(a, opt_a, STEPS)
    train(b, opt_b, STEPS)
    fa, fb = full(a.parameters()), full(b.parameters())
    return dict(rel=rel_diff(fa, fb), moved=rel_diff(fb, start), triton=on_triton(opt_a))


def clip(rank, norm_type=2.0, error_if_nonfinite=False):
    a, b = make(), make(sharded=False)
    x, y = batch(0)
    loss_of(a, x, y).backward()
    loss_of(b, x, y).backward()
    # (rank 1's shard of the one-row parameter is empty: torch's own clipping of other
    # norms refused it on that rank alone, and rank 0 waited for ever)
    total = clip_grad_norm_(a.parameters(), 0.1, norm_type,
                            error_if_nonfinite=error_if_nonfinite)
    ref = torch.nn.utils.clip_grad_norm_(b.parameters(), 0.1, norm_type)
    ga = full([p.grad for p in a.parameters()])
    gb = full([p.grad for p in b.parameters()])
    return dict(total=float(total), ref=float(ref), rel=rel_diff(ga, gb),
                total_is_plain=not hasattr(total, "full_tensor"))


def _step_refused(model, opt):
    """The step's ValueError message (None if it stepped), and whether it changed
    nothing (parameters, optimizer state)."""
    before = full(model.parameters())
    try:
        opt.step()
        message = None
    except ValueError as e:
        message = str(e)
    return dict(message=message, unchanged=bool(torch.equal(before, full(model.parameters()))),
                no_state=len(opt.state) == 0)


def refused(rank):
    """LAMB over DTensors mixed with a plain tensor: refused before anything changes."""
    model = make()
    extra = nn.Parameter(torch.ones(3))
    opt = FusedLAMB(list(model.parameters()) + [extra], lr=1e-2)
    x, y = batch(0)
    (loss_of(model, x, y) + extra.sum()).backward()
    return _step_refused(model, opt)


def mixed_zero_grad(name, rank):
    """A plain parameter sharing an element-wise optimizer with DTensors (documented):
    zero_grad() that zeroes the gradients (FusedSGD's default) zeroes every one (one
    foreach call over DTensor and plain gradients together raised)."""
    model = make()
    extra = nn.Parameter(torch.ones(3))
    make_opt = {"sgd": lambda ps: FusedSGD(ps, lr=1e-2, momentum=0.9),
                "adam": lambda ps: FusedAdam(ps, lr=1e-2, set_grad_none=False)}[name]
    opt = make_opt(list(model.parameters()) + [extra])
    x, y = batch(0)
    (loss_of(model, x, y) + extra.sum()).backward()
    opt.step()
    try:
        opt.zero_grad()
        message = None
    except RuntimeError as e:
        message = str(e)
    grads = [p.grad for p in list(model.parameters()) + [extra]]
    local = [g.to_local() if hasattr(g, "to_local") else g for g in grads]
    return dict(message=message, zeroed=all(bool((g == 0).all()) for g in local))


def refused_gradient(rank):
    """A gradient laid out unlike its DTensor parameter: refused before anything changes."""
    from torch.distributed.tensor import Replicate
    model = make()
    opt = FusedAdam(model.parameters(), lr=1e-2)
    x, y = batch(0)
    loss_of(model, x, y).backward()
    model.fc1.weight.grad = model.fc1.weight.grad.redistribute(placements=[Replicate()])
    return _step_refused(model, opt)


def refused_partial(name, rank):
    """A parameter with a Partial placement (partial sums, not a shard): refused before
    anything changes (the element-wise optimizers stepped each rank's partial sum)."""
    from torch.distributed.tensor import DTensor, Partial
    mesh = make().fc1.weight.device_mesh
    p = nn.Parameter(DTensor.from_local(torch.full((4,), 1.0 + rank), mesh, [Partial()]))
    p.grad = DTensor.from_local(torch.full((4,), 0.5 * (rank + 1)), mesh, [Partial()])
    opt = {"adam": FusedAdam, "adagrad": FusedAdagrad, "sgd": FusedSGD}[name]([p], lr=0.1)
    before = p.to_local().clone()
    try:
        opt.step()
        message = None
    except ValueError as e:
        message = str(e)
    return dict(message=message, unchanged=bool(torch.equal(before, p.to_local())),
                no_state=len(opt.state) == 0)


# -- torch.distributed.checkpoint: save, resume, bitwise -----------------------------------------
def _save_continue_reload(build, rank, path):
    """Train 3 steps, save with torch.distributed.checkpoint, train 3 more (the straight
    run); build afresh, load, train the same 3: ``(model, opt, straight, resumed)``, the
    whole parameters of both runs, and the straight run's objects."""
    model, opt = build()
    train(model, opt, 3, rank)
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
    train(model, opt, 3, rank, start=3)
    straight = full(model.parameters())

    model2, opt2 = build()
    msd2, osd2 = get_state_dict(model2, opt2)
    state = {"model": msd2, "optim": osd2}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model2, opt2, model_state_dict=state["model"],
                   optim_state_dict=state["optim"])
    train(model2, opt2, 3, rank, start=3)
    return model, opt, straight, full(model2.parameters())


def resume(name, rank, folder):
    make_opt = {"adam": lambda p: FusedAdam(p, lr=1e-2, weight_decay=0.1),
                "sgd": lambda p: FusedSGD(p, lr=0.05, momentum=0.9),
                "lamb": lambda p: FusedLAMB(p, lr=1e-2),
                # emb's shard is empty on rank 1: its per-tensor moment must still be the
                # whole tensor's there (the checkpoint saves one rank's copy of it)
                "novograd": lambda p: FusedNovoGrad(p, lr=1e-2, weight_decay=0.01)}[name]

    def build():
        model = make()
        return model, make_opt(model.parameters())

    _, _, straight, resumed = _save_continue_reload(build, rank,
                                                    os.path.join(folder, f"ckpt_{name}"))
    return dict(bitwise=bool(torch.equal(straight, resumed)), rel=rel_diff(resumed, straight))


def rounding(flag, rank, folder):
    """A bf16 model without masters (FusedAdam with stochastic rounding or Kahan
    summation) over DTensor shards: a checkpoint resumes bitwise; the compensations are
    DTensors; stochastic rounding's keys name the shard (this rank's differ from the
    other's for the same parameters)."""
    kw = (dict(stochastic_rounding=True, seed=5) if flag == "stochastic"
          else dict(kahan_summation=True))

    def build():
        model = make(dtype=torch.bfloat16)
        return model, FusedAdam(model.parameters(), lr=1e-2, **kw)

    model, opt, straight, resumed = _save_continue_reload(
        build, rank, os.path.join(folder, f"ckpt_rounding_{flag}"))
    keys = [int(k) for cache in plans_of(opt).values()
            for k in (cache.prepared.lists.get("keys") or []) if k is not None]
    comps = [type(st["kahan_comp"]).__name__ for st in opt.state.values() if "kahan_comp" in st]
    moved = not torch.equal(straight, full(make(dtype=torch.bfloat16).parameters()))
    return dict(bitwise=bool(torch.equal(straight, resumed)), moved=moved, keys=keys,
                comps=comps, dtypes=sorted({str(p.dtype) for p in model.parameters()}))


def load_other_placements(rank):
    """A state dict whose DTensor moments were redistributed (Replicate) before loading:
    loaded sharded as the parameters again, the run continues as the straight one."""
    import copy
    import warnings
    from torch.distributed.tensor import Replicate
    model = make()
    opt = FusedAdam(model.parameters(), lr=1e-2)
    train(model, opt, 3, rank)
    sd = opt.state_dict()
    other = {"param_groups": copy.deepcopy(sd["param_groups"]),
             "state": {k: {n: (v.redistribute(placements=[Replicate()])
                               if hasattr(v, "placements") else v.clone())
                           for n, v in st.items()} for k, st in sd["state"].items()}}
    model2 = make()
    with torch.no_grad():
        for p, q in zip(model2.parameters(), model.parameters()):
            p.to_local().copy_(q.to_local())
    opt2 = FusedAdam(model2.parameters(), lr=1e-2)
    opt2.load_state_dict(other)
    placements = sorted({str(tuple(st["exp_avg"].placements)) for st in opt2.state.values()})
    train(model, opt, 3, rank, start=3)
    train(model2, opt2, 3, rank, start=3)
    # stochastic rounding without seed= in a group of 2 processes: said
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        FusedAdam(make(dtype=torch.bfloat16).parameters(), stochastic_rounding=True)
        FusedAdam(make(dtype=torch.bfloat16).parameters(), stochastic_rounding=True, seed=1)
    seed_warnings = [str(w.message) for w in caught if "without seed=" in str(w.message)]
    return dict(placements=placements, rel=rel_diff(full(model2.parameters()),
                                                    full(model.parameters())),
                seed_warnings=seed_warnings)


# -- amp -----------------------------------------------------------------------------------------
def amp_o1(half, rank):
    """O1 (autocast) on the sharded model against O1 on the unsharded one, same batches."""
    dtype = dict(fp16=torch.float16, bf16=torch.bfloat16)[half]
    out = {}
    for sharded in (True, False):
        reset_amp()
        model = make(sharded)
        opt = FusedAdam(model.parameters(), lr=1e-2)
        model, opt = amp.initialize(model, opt, opt_level="O1", half_dtype=dtype, verbosity=0)
        for step in range(5):
            x, y = batch(step)
            opt.zero_grad()
            with amp.scale_loss(loss_of(model, x, y), opt) as scaled:
                scaled.backward()
            opt.step()
        out[sharded] = full(model.parameters())
    reset_amp()
    return dict(rel=rel_diff(out[True], out[False]), finite=bool(torch.isfinite(out[True]).all()))


def amp_overflow_one_rank(rank):
    """An inf in rank 1's shard of one gradient: both ranks skip, both halve the scale."""
    reset_amp()
    model = make()
    opt = FusedAdam(model.parameters(), lr=1e-2)
    model, opt = amp.initialize(model, opt, opt_level="O1", loss_scale="dynamic", verbosity=0)
    x, y = batch(0, rank)
    before = full(model.parameters())
    state_before = len(opt.state)
    with amp.scale_loss(loss_of(model, x, y), opt) as scaled:
        scaled.backward()
        if rank == 1:
            model.fc1.weight.grad.to_local()[0, 0] = float("inf")
    opt.step()
    after = full(model.parameters())
    scale = float(amp.state_dict()["loss_scaler0"]["loss_scale"])
    skipped = amp.last_step_skipped(opt)
    nonfinite = [list(x) for x in amp.nonfinite_gradients(opt)]  # this rank's shards
    # a clean step after it trains
    opt.zero_grad()
    with amp.scale_loss(loss_of(model, x, y), opt) as scaled:
        scaled.backward()
    opt.step()
    moved = not torch.equal(after, full(model.parameters()))
    reset_amp()
    return dict(unchanged=bool(torch.equal(before, after)), scale=scale, skipped=bool(skipped),
                state_before=state_before, trained_after=moved, nonfinite=nonfinite)


def amp_o0_with_mixed_precision_policy(rank):
    """FSDP2 casts (MixedPrecisionPolicy: fp16 compute, fp32 gradient reduction); amp O0
    with a dynamic scale scales the loss and skips overflowing steps."""
    from torch.distributed.fsdp import MixedPrecisionPolicy
    reset_amp()
    torch.manual_seed(0)
    model = Net()
    policy = MixedPrecisionPolicy(param_dtype=torch.float16, reduce_dtype=torch.float32)
    for module in (model.fc1, model.fc2, model):
        fully_shard(module, mp_policy=policy)
    opt = FusedAdam(model.parameters(), lr=1e-2)
    model, opt = amp.initialize(model, opt, opt_level="O0", loss_scale="dynamic",
                                verbosity=0)
    losses = []
    for step in range(8):
        x, y = batch(0)
        opt.zero_grad()
        loss = loss_of(model, x, y)
        losses.append(float(loss))
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()
    scale = float(amp.state_dict()["loss_scaler0"]["loss_scale"])
    dtypes = sorted({str(p.dtype) for p in model.parameters()})
    reset_amp()
    return dict(first=losses[0], last=losses[-1], scale=scale, dtypes=dtypes)


def amp_refused(level, rank):
    reset_amp()
    model = make()
    opt = FusedAdam(model.parameters(), lr=1e-2)
    before = full(model.parameters())
    try:
        amp.initialize(model, opt, opt_level=level, verbosity=0)
        message = None
    except RuntimeError as e:
        message = str(e)
    dtypes = sorted({str(p.dtype) for p in model.parameters()})
    reset_amp()
    return dict(message=message, dtypes=dtypes,
                unchanged=bool(torch.equal(before, full(model.parameters()))))


INTERPRETED = ("torch/adam_w", "unsharded/lamb", "unsharded/novograd",
               "unsharded/novograd_max", "clip", "amp/overflow", "rounding/stochastic",
               "rounding/kahan", "resume/novograd")


def cases(rank, out):
    """(name, function) of every case."""
    for name in TORCH_PAIRS:
        yield f"torch/{name}", lambda name=name: vs_torch(name, rank)
    for name in UNSHARDED:
        yield f"unsharded/{name}", lambda name=name: vs_unsharded(name, rank)
    yield "clip", lambda: clip(rank)
    for norm_type in ("inf", "1.0", "3.0"):
        yield f"clip/{norm_type}", lambda p=float(norm_type): clip(rank, p)
    yield "clip/error_if_nonfinite", lambda: clip(rank, error_if_nonfinite=True)
    yield "refused", lambda: refused(rank)
    yield "refused/gradient", lambda: refused_gradient(rank)
    for name in ("sgd", "adam"):
        yield f"mixed/zero_grad/{name}", lambda name=name: mixed_zero_grad(name, rank)
    for name in ("adam", "adagrad", "sgd"):
        yield f"refused/partial/{name}", lambda name=name: refused_partial(name, rank)
    yield "load/other_placements", lambda: load_other_placements(rank)
    for name in ("adam", "sgd", "lamb", "novograd"):
        yield f"resume/{name}", lambda name=name: resume(name, rank, out)
    for flag in ("stochastic", "kahan"):
        yield f"rounding/{flag}", lambda flag=flag: rounding(flag, rank, out)
    for half in ("fp16", "bf16"):
        yield f"amp/O1/{half}", lambda half=half: amp_o1(half, rank)
    yield "amp/overflow", lambda: amp_overflow_one_rank(rank)
    yield "amp/O0/mp_policy", lambda: amp_o0_with_mixed_precision_policy(rank)
    for level in ("O2", "O3"):
        yield f"amp/refused/{level}", lambda level=level: amp_refused(level, rank)


def main():
    out = sys.argv[1]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.set_num_threads(1)
    report = {}
    for name, run in cases(rank, out):
        os.environ["TRITON_INTERPRET"] = "0"
        report[name] = run()
        if name in INTERPRETED:
            os.environ["TRITON_INTERPRET"] = "1"
            report[name + "/interpreted"] = run()
    for key, value in report.items():  # JSON has no inf/nan
        for k, v in value.items():
            if isinstance(v, float) and not math.isfinite(v):
                value[k] = str(v)
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(report, f, indent=1)
    dist.barrier()  # every rank done with its collectives before the group goes
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    # Leave without the interpreter's finalization: gloo's worker threads may still hold
    # work objects whose tensors then take the GIL during teardown, and the process
    # aborts ("terminate called without an active exception") after its work is done.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
