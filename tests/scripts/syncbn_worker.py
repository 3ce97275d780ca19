"""One rank of a gloo group running tritamp.parallel.SyncBatchNorm on a slice of a batch.

Used by tests/test_parallel_multiprocess.py. Launched either by
``python3 -m torch.distributed.run --standalone --nproc_per_node=N`` (rank and world from
the environment) or by the test itself with ``--init-file`` (a file:// rendezvous, no
port). For every case in ``--cases`` (a JSON file, see ``make_data``) each rank takes its
slice of one shared, seeded batch, trains the layer for a few steps (forward, backward
with the slice of a fixed output gradient) and saves what it got to
``<out>/<case>.rank<r>.pt``; the test compares the slices with torch's BatchNorm run on
the whole batch in one process. ``--resnet`` then trains a converted torchvision
ResNet-18 under DistributedDataParallel and, on rank 0, the unconverted model on the
concatenated batch in one process, and saves both. ``--reducer`` runs
tests/scripts/parallel_reducer.py's checks in the same processes.
"""
import argparse
import json
import os
import sys

# Run as a rank, the Triton kernels run in the interpreter on CPU tensors; set before
# tritamp is imported. Imported by a test (for make_data) it sets nothing: the variable
# would reach every later test of that process, torch.compile's kernels on a GPU too.
if __name__ == "__main__":
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402


# -- data shared with the test ---------------------------------------------------------------
def make_data(case):
    """The whole batch of every step, in NCHW, from the case's seed.

    case keys: name, batches (per rank), channels, spatial (list), dtype ("float32",
    "float16", "bfloat16"), layout ("nchw", "channels_last": torch's memory format,
    "apex_last": channel as the last dimension), steps, momentum (None: cumulative),
    fuse_relu, z, affine, interpret, group_size (SyncBatchNorm's process group from
    ``create_syncbn_process_group``)."""
    g = torch.Generator().manual_seed(case.get("seed", 0))
    dtype = getattr(torch, case["dtype"])
    n, c, sp = sum(case["batches"]), case["channels"], list(case["spatial"])
    shape = [n, c] + sp
    steps = []
    for _ in range(case["steps"]):
        # A mean far from 0 against the spread, different per channel.
        offset = torch.linspace(-3.0, 8.0, c).view(1, c, *([1] * len(sp)))
        x = (torch.randn(shape, generator=g) * 1.5 + offset).to(dtype)
        dy = torch.randn(shape, generator=g).to(dtype)
        z = torch.randn(shape, generator=g).to(dtype) if case.get("z") else None
        steps.append(dict(x=x, dy=dy, z=z))
    weight = torch.rand(c, generator=g) + 0.5
    bias = torch.randn(c, generator=g)
    return dict(steps=steps, weight=weight, bias=bias)


def rank_slice(case, rank):
    lo = sum(case["batches"][:rank])
    return lo, lo + case["batches"][rank]


def to_layout(t, layout):
    """An NCHW tensor in the case's layout (same values)."""
    if t is None or layout == "nchw" or t.dim() < 3:
        return t
    if layout == "channels_last":
        fmt = torch.channels_last if t.dim() == 4 else torch.channels_last_3d
        return t.contiguous(memory_format=fmt) if t.dim() in (4, 5) else \
            t.transpose(1, 2).contiguous().transpose(1, 2)
    return t.movedim(1, -1).contiguous()  # apex_last


def from_layout(t, layout):
    if t is None or layout != "apex_last" or t.dim() < 3:
        return t
    return t.movedim(-1, 1)


# -- one case on this rank ---------------------------------------------------------------------
def run_case(case, rank):
    from tritamp.parallel import SyncBatchNorm, create_syncbn_process_group

    os.environ["TRITON_INTERPRET"] = "1" if case.get("interpret") else "0"
    data = make_data(case)
    lo, hi = rank_slice(case, rank)
    layout = case["layout"]
    group = create_syncbn_process_group(case["group_size"]) if "group_size" in case else None
    bn = SyncBatchNorm(case["channels"], momentum=case.get("momentum", 0.1),
                       affine=case.get("affine", True), process_group=group,
                       channel_last=layout == "apex_last",
                       fuse_relu=case.get("fuse_relu", False))
    if bn.affine:
        with torch.no_grad():
            bn.weight.copy_(data["weight"])
            bn.bias.copy_(data["bias"])
    out = dict(y=[], dx=[], dz=[], dw=[], db=[])
    if group is not None:
        try:  # refused before any collective: every rank raises alike
            create_syncbn_process_group(dist.get_world_size() + 1)
        except ValueError as exc:
            out["bad_group_size_error"] = str(exc)
    for step in data["steps"]:
        x = to_layout(step["x"][lo:hi], layout).requires_grad_()
        z = step["z"]
        if z is not None:
            z = to_layout(z[lo:hi], layout).requires_grad_()
        y = bn(x, z)
        y.backward(to_layout(step["dy"][lo:hi], layout))
        out["y"].append(from_layout(y.detach(), layout).contiguous())
        out["dx"].append(from_layout(x.grad, layout).contiguous())
        out["dz"].append(from_layout(z.grad, layout).contiguous() if z is not None else None)
        if bn.affine:
            out["dw"].append(bn.weight.grad.clone())
            out["db"].append(bn.bias.grad.clone())
            bn.weight.grad = bn.bias.grad = None
        out["channels_last_out"] = layout == "channels_last" and y.dim() in (4, 5) and \
            y.is_contiguous(memory_format=torch.channels_last if y.dim() == 4
                            else torch.channels_last_3d)
    out["running_mean"] = bn.running_mean.clone()
    out["running_var"] = bn.running_var.clone()
    out["num_batches_tracked"] = int(bn.num_batches_tracked)
    bn.eval()
    with torch.no_grad():
        x = to_layout(data["steps"][-1]["x"][lo:hi], layout)
        z = data["steps"][-1]["z"]
        out["y_eval"] = from_layout(bn(x, to_layout(z[lo:hi], layout) if z is not None
                                       else None), layout).contiguous()
    return out


# -- ResNet-18 under DDP against one process --------------------------------------------------
def resnet_case(rank, world, steps=2, per_rank=4, size=16):
    import torchvision

    from tritamp.parallel import convert_syncbn_model

    def build():
        torch.manual_seed(0)
        return torchvision.models.resnet18(num_classes=10)

    g = torch.Generator().manual_seed(1)
    images = torch.randn(steps, per_rank * world, 3, size, size, generator=g)
    labels = torch.randint(0, 10, (steps, per_rank * world), generator=g)

    def train(model, opt, xs, ys):
        losses = []
        for s in range(steps):
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(xs[s]), ys[s])
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        return losses

    model = convert_syncbn_model(build())
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.02, momentum=0.9)
    lo, hi = rank * per_rank, (rank + 1) * per_rank
    losses = train(ddp, opt, images[:, lo:hi], labels[:, lo:hi])
    # The loss of the whole batch is the mean of the ranks' (equal batch sizes).
    total = torch.stack(losses)
    dist.all_reduce(total)
    result = dict(sync_losses=total / world, sync_state=model.state_dict(),
                  n_syncbn=sum(type(m).__name__ == "SyncBatchNorm" for m in model.modules()))
    if rank == 0:
        single = build()
        opt = torch.optim.SGD(single.parameters(), lr=0.02, momentum=0.9)
        result["single_losses"] = torch.stack(train(single, opt, images, labels))
        result["single_state"] = single.state_dict()
        exact = build().double()  # the float64 yardstick for both fp32 runs
        opt = torch.optim.SGD(exact.parameters(), lr=0.02, momentum=0.9)
        result["exact_losses"] = torch.stack(train(exact, opt, images.double(), labels))
        result["exact_state"] = exact.state_dict()
    return result


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--cases", help="JSON file: a list of cases (see make_data)")
    p.add_argument("--resnet", action="store_true")
    p.add_argument("--resnet-interpret", action="store_true",
                   help="run the ResNet's SyncBatchNorm kernels in Triton's interpreter")
    p.add_argument("--reducer", action="store_true",
                   help="also run tests/scripts/parallel_reducer.py's checks")
    p.add_argument("--init-file", help="file:// rendezvous (else torchrun's environment)")
    p.add_argument("--rank", type=int)
    p.add_argument("--world-size", type=int)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    if args.init_file:
        dist.init_process_group("gloo", init_method="file://" + args.init_file,
                                rank=args.rank, world_size=args.world_size)
    else:
        # torch's default backend (its name is not "gloo": "undefined", gloo for CPU
        # tensors), as a torchrun script that names none gets it
        dist.init_process_group()
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        cases = json.load(open(args.cases)) if args.cases else []
        for case in cases:
            torch.save(run_case(case, rank),
                       os.path.join(args.out, f"{case['name']}.rank{rank}.pt"))
        if args.resnet:
            os.environ["TRITON_INTERPRET"] = "1" if args.resnet_interpret else "0"
            torch.save(resnet_case(rank, world), os.path.join(args.out, f"resnet.rank{rank}.pt"))
        if args.reducer:  # tests/test_reducer.py's checks, sharing this launch
            sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
            import parallel_reducer
            parallel_reducer.run(args.out)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
