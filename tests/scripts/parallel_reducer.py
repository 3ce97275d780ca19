"""One rank of a gloo group checking tritamp.parallel.Reducer against DistributedDataParallel.

Used by tests/test_reducer.py: ``run`` is called inside the 2-rank launch of
tests/scripts/syncbn_worker.py (``--reducer``); ``main`` runs it alone with
``--init-file`` (a file:// rendezvous). Each rank builds the model from its own seed (so
ranks start different), hands it to ``Reducer`` (which broadcasts rank 0's weights),
copies the result into a DDP model, runs two steps on its own batch with both, and saves
what the test compares to ``<out>/reducer.rank<r>.pt``: the weights after the broadcast,
Reducer's averaged gradients (module mode and gradient-list mode) and DDP's.
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
    torch.save(result, os.path.join(out_dir, f"reducer.rank{rank}.pt"))


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
