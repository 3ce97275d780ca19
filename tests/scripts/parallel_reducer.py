"""One rank of a gloo group checking tritamp.parallel.Reducer against DistributedDataParallel.

Used by tests/test_reducer.py: ``run`` is called inside the 2-rank launch of
tests/scripts/syncbn_worker.py (``--reducer``); ``main`` runs it alone with
``--init-file`` (a file:// rendezvous). Each rank builds the model from its own seed (so
ranks start different), hands it to ``Reducer`` (which broadcasts rank 0's weights),
copies the result into a DDP model, runs two steps on its own batch with both, and saves
what the test compares to ``<out>/reducer.rank<r>.pt``: the weights after the broadcast,
Reducer's averaged gradients (module mode and gradient-list mode) and DDP's; then
``disjoint``: each rank's backward reaches another branch of one model; ``amp_order``:
Reducer with amp's dynamic loss scale, reduced after the block (refused) and inside it
with an overflow on rank 0 alone; ``o2_after_block``: reduced after the block at O2 with
``overflow_process_group`` (the masters' gradients averaged).
"""
import argparse
import copy
import os
import sys

import torch
import torch.distributed as dist
from torch import nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(5, 7)
        self.fc2 = nn.Linear(7, 3).double()      # a second dtype: a second flat bucket
        self.unused = nn.Linear(2, 2)            # never gets a gradient

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)).double())


def run(out_dir):
    """Run the checks on this rank of the initialised default group; save the results."""
    from tritamp.parallel import Reducer

    rank = dist.get_rank()
    torch.manual_seed(100 + rank)              # every rank starts from other weights
    model = Net()
    own = {k: v.clone() for k, v in model.state_dict().items()}
    reducer = Reducer(model)
    result = dict(own=own, broadcast={k: v.clone() for k, v in model.state_dict().items()})
    ddp = nn.parallel.DistributedDataParallel(copy.deepcopy(model),
                                              find_unused_parameters=True)
    listed = copy.deepcopy(model)
    g = torch.Generator().manual_seed(rank)
    steps = []
    for step in range(2):
        x = torch.randn(4 + 2 * rank, 5, generator=g)   # uneven batches
        for m in (model, ddp, listed):
            m.zero_grad(set_to_none=False)
            m(x).pow(2).mean().backward()
        reducer.reduce()
        grads = [q.grad for q in listed.parameters() if q.grad is not None]
        Reducer([grads[:1], (grads[1:],)]).reduce()   # any nesting of tensors
        steps.append(dict(
            reducer={n: q.grad.clone() for n, q in model.named_parameters()
                     if q.grad is not None},
            listed={n: q.grad.clone() for n, q in listed.named_parameters()
                    if q.grad is not None},
            ddp={n: q.grad.clone() for n, q in ddp.module.named_parameters()
                 if q.grad is not None and not n.startswith("unused.")}))
        with torch.no_grad():
            for m in (model, ddp.module, listed):
                for q in m.parameters():
                    if q.grad is not None:
                        q -= 0.1 * q.grad
    result["steps"] = steps
    result["unused_grad"] = model.unused.weight.grad
    result["disjoint"] = disjoint(rank)
    result["amp_order"] = amp_order(rank)
    result["o2_after_block"] = {kind: o2_after_block(rank, kind)
                                for kind in ("sgd", "fused-sgd", "listed")}
    torch.save(result, os.path.join(out_dir, f"reducer.rank{rank}.pt"))


class Branches(nn.Module):
    """Rank r's backward reaches branch ``a`` (rank 0) or ``b`` (rank 1), never ``never``."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(3, 3)
        self.b = nn.Linear(3, 3)
        self.never = nn.Linear(2, 2)

    def forward(self, x, which):
        return (self.a if which == 0 else self.b)(x)


def _grads(model):
    return {n: None if q.grad is None else q.grad.clone() for n, q in model.named_parameters()}


def disjoint(rank):
    """The gradients before and after reduce() when the ranks' backwards reach other
    parameters of the same sizes (Apex's reducer flattened each rank's own list: rank 0's
    ``a`` gradient was averaged with rank 1's ``b``)."""
    from tritamp.parallel import Reducer
    torch.manual_seed(7)
    model = Branches()
    reducer = Reducer(model)
    x = torch.randn(4, 3, generator=torch.Generator().manual_seed(rank))
    model(x, rank).pow(2).sum().backward()
    local = _grads(model)
    reducer.reduce()
    return dict(local=local, reduced=_grads(model))


def amp_order(rank):
    """amp O1 with a dynamic scale (bf16): reduce() after the scale_loss block exited is
    refused with nothing reduced; inside it, an overflow on rank 0 alone makes both ranks
    skip (amp checks the averaged gradients) and halve their scales."""
    from tritamp import amp
    from tritamp.testing import reset_amp as reset
    from tritamp.parallel import Reducer
    torch.manual_seed(3)
    model = nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O1", half_dtype=torch.bfloat16,
                                loss_scale="dynamic", verbosity=0)
    out = {}
    try:
        reducer = Reducer(model)
        x = torch.randn(4, 3, generator=torch.Generator().manual_seed(rank))
        with amp.scale_loss(model(x).float().pow(2).sum(), opt) as scaled:
            scaled.backward()
        before = _grads(model)
        try:
            reducer.reduce()
            out["refused"] = None
        except RuntimeError as e:
            out["refused"] = str(e)
        out["grads_kept"] = all(torch.equal(before[n], g) for n, g in _grads(model).items())
        opt.step()
        opt.zero_grad()
        weights = [q.detach().clone() for q in model.parameters()]
        scale = amp.state_dict()["loss_scaler0"]["loss_scale"]
        loss = model(x).float().pow(2).sum() * (float("inf") if rank == 0 else 1.0)
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
            reducer.reduce()
        opt.step()
        out["weights_kept"] = all(torch.equal(w, q) for w, q in zip(weights, model.parameters()))
        out["scales"] = (scale, amp.state_dict()["loss_scaler0"]["loss_scale"])
        out["skipped"] = amp.last_step_skipped(opt)
    finally:
        reset()
    return out


def o2_after_block(rank, kind):
    """amp O2 (bf16) with overflow_process_group: reduce() after the scale_loss block is
    allowed, and the step reads the fp32 masters' gradients (unscaled into them at the
    exit, or left to a fused step in the half ones): the Reducer averages those, so the
    ranks' masters stay equal (reducing the half gradients left each rank stepping on
    its own). A Reducer over a list of tensors there is refused, nothing reduced."""
    from tritamp import amp
    from tritamp.optimizers import FusedSGD
    from tritamp.parallel import Reducer
    from tritamp.testing import reset_amp as reset
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3), nn.Linear(3, 2))
    make = FusedSGD if kind == "fused-sgd" else torch.optim.SGD
    opt = make(model.parameters(), lr=0.1, momentum=0.9)
    model, opt = amp.initialize(model, opt, opt_level="O2", half_dtype=torch.bfloat16,
                                loss_scale="dynamic", verbosity=0,
                                overflow_process_group=dist.group.WORLD)
    out = {}
    try:
        reducer = Reducer(model) if kind != "listed" else \
            Reducer([q.grad for q in model.parameters()])
        x = torch.randn(4 + 2 * rank, 4, generator=torch.Generator().manual_seed(rank))
        for _ in range(2):
            with amp.scale_loss(model(x).float().pow(2).mean(), opt) as scaled:
                scaled.backward()
            before = _grads(model)
            try:
                reducer.reduce()
            except RuntimeError as e:
                out["refused"] = str(e)
                out["grads_kept"] = all(
                    (g is None and before[n] is None) or torch.equal(before[n], g)
                    for n, g in _grads(model).items())
                return out
            opt.step()
            opt.zero_grad()
        out["masters"] = [q.detach().clone() for g in opt.param_groups for q in g["params"]]
    finally:
        reset()
    return out


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--init-file", required=True)
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world-size", type=int, required=True)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="file://" + args.init_file, rank=args.rank,
                            world_size=args.world_size)
    try:
        run(args.out)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
