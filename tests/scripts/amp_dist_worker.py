"""Run by tests/test_amp_distributed.py under torchrun (gloo, CPU): amp with
torch.distributed. Writes one JSON report per rank into the folder given as argv[1]."""
import json
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from tritamp import amp
from tritamp.testing import amp_state
from tritamp.optimizers import FusedSGD


def _reset():
    amp_state().opt_properties = None
    amp_state().loss_scalers = []


def _flat(tensors):
    return torch.cat([t.detach().float().reshape(-1) for t in tensors])


def _same_on_every_rank(t):
    gathered = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, t)
    return all(torch.equal(gathered[0], g) for g in gathered)


def ddp_after_initialize(level, half_dtype, rank):
    """initialize, then DDP; uneven per-rank batches; masters equal across ranks."""
    _reset()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, opt = amp.initialize(model, opt, opt_level=level, half_dtype=half_dtype, verbosity=0)
    ddp = DDP(model)
    start = _flat(amp.master_params(opt)).clone()
    g = torch.Generator().manual_seed(100 + rank)
    for _ in range(3):
        n = 4 + rank
        x, y = torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g)
        loss = F.cross_entropy(ddp(x).float(), y)
        opt.zero_grad()
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()
    masters = _flat(amp.master_params(opt))
    return dict(masters_equal=_same_on_every_rank(masters),
                model_equal=_same_on_every_rank(_flat(model.parameters())),
                trained=not torch.equal(masters, start),
                finite=bool(torch.isfinite(masters).all()))


def overflow_on_one_rank(group, fused, rank):
    """Rank 1's gradient overflows; with an overflow group every rank skips."""
    _reset()
    torch.manual_seed(0)
    model = nn.Linear(6, 3)
    opt = (FusedSGD(model.parameters(), lr=0.1) if fused
           else torch.optim.SGD(model.parameters(), lr=0.1))
    model, opt = amp.initialize(model, opt, opt_level="O2", verbosity=0,
                                overflow_process_group=group)
    before = _flat(amp.master_params(opt)).clone()
    loss = model(0.1 * torch.randn(4, 6)).float().mean()  # no overflow of its own
    with amp.scale_loss(loss, opt) as scaled:
        scaled.backward()
        if rank == 1:
            model.weight.grad[0, 0] = float("inf")
    opt.step()
    after = _flat(amp.master_params(opt))
    return dict(stepped=not torch.equal(before, after),
                loss_scale=amp.state_dict()["loss_scaler0"]["loss_scale"])


def group_without_this_rank(rank):
    """new_group([0]) on rank 1 is GroupMember.NON_GROUP_MEMBER: refused by name."""
    _reset()
    only_rank0 = dist.new_group([0])  # (every rank must call new_group)
    model = nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    try:
        amp.initialize(model, opt, opt_level="O2", verbosity=0,
                       overflow_process_group=only_rank0)
        message = None
    except ValueError as e:
        message = str(e)
    _reset()
    return dict(message=message, unchanged=model.weight.dtype == torch.float32)


def main():
    out = sys.argv[1]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    report = {}
    for level in ("O0", "O1", "O2", "O3"):
        for name, dt in (("fp16", torch.float16), ("bf16", torch.bfloat16)):
            report[f"ddp/{level}/{name}"] = ddp_after_initialize(level, dt, rank)
    pair = dist.new_group([0, 1])
    for fused in (False, True):
        kind = "fused" if fused else "plain"
        report[f"overflow/none/{kind}"] = overflow_on_one_rank(None, fused, rank)
        report[f"overflow/world/{kind}"] = overflow_on_one_rank(dist.group.WORLD, fused, rank)
        report[f"overflow/pair/{kind}"] = overflow_on_one_rank(pair, fused, rank)
    report["overflow/not_a_member"] = group_without_this_rank(rank)
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(report, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
