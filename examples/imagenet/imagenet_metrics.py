"""Logging and metrics of the ImageNet examples: rank-0 printing (``log``), the tqdm-or-print
``Progress``, ``AverageMeter``, top-k ``accuracy`` and ``record`` (averaged over the processes;
validation's ``record_counted`` sums every image once)."""
import sys

import torch
import torch.distributed as dist
from torch.utils.data.distributed import DistributedSampler


def log(args, *a, **kw):
    if args.rank == 0:
        print(*a, **kw)


class AverageMeter:
    """Computes and stores the average and current value."""

    def __init__(self):
        self.val = self.avg = self.sum = 0.0
        self.count = 0

    def update(self, val, n=1):
        self.val = val
        self.sum += val * n
        self.count += n
        self.avg = self.sum / self.count


def accuracy(output, target, topk=(1,)):
    """Precision@k in percent, as 1-element device tensors. k above the number of classes
    counts every class (so Prec@5 is 100 on a 2-class problem)."""
    maxk = min(max(topk), output.size(1))
    batch_size = target.size(0)
    _, pred = output.topk(maxk, 1, True, True)
    correct = pred.t().eq(target.view(1, -1).expand(maxk, -1))
    return [correct[:min(k, maxk)].reshape(-1).float().sum(0, keepdim=True).mul_(100.0 / batch_size)
            for k in topk]


def record(meters, loss, prec1, prec5, batch_size, args):
    """Average loss and precisions over the processes, then add them to the
    (losses, top1, top5) meters."""
    values = (loss, prec1, prec5)
    if args.distributed:
        values = [reduce_tensor(v, args.world_size) for v in values]
    for meter, value in zip(meters, values):
        meter.update(value.item(), batch_size)


def record_counted(meters, loss, prec1, prec5, n, args):
    """Validation's ``record``: each process's batch weighed by the ``n`` samples it really
    holds (see :func:`unique_samples`), summed over the processes in one all-reduce, so the
    meters see every validation image once, however the batches fall on the ranks."""
    sums = torch.stack([loss.reshape(()).float() * n, prec1.reshape(()).float() * n,
                        prec5.reshape(()).float() * n,
                        torch.tensor(float(n), device=loss.device)])
    if args.distributed:
        dist.all_reduce(sums, op=dist.ReduceOp.SUM)
    loss_sum, top1_sum, top5_sum, count = sums.tolist()
    if count:
        for meter, total in zip(meters, (loss_sum, top1_sum, top5_sum)):
            meter.update(total / count, int(count))


def unique_samples(loader):
    """The samples of this process's share of ``loader`` that are its own: a
    DistributedSampler pads the set to a multiple of the processes by repeating its
    first samples, which land at the end of some processes' lists (counted twice
    otherwise)."""
    sampler = loader.sampler
    if isinstance(sampler, DistributedSampler) and not sampler.drop_last:
        return len(range(sampler.rank, len(sampler.dataset), sampler.num_replicas))
    return len(sampler)


def reduce_tensor(tensor, world_size):
    rt = tensor.clone()
    dist.all_reduce(rt, op=dist.ReduceOp.SUM)
    rt /= world_size
    return rt


class Progress:
    """A tqdm bar when stdout is a terminal (and tqdm is installed), plain prints otherwise.
    Only rank 0 says anything."""

    def __init__(self, total, desc, enabled):
        self.enabled = enabled
        self.bar = None
        if enabled and sys.stdout.isatty():
            try:
                from tqdm import tqdm
            except ImportError:
                tqdm = None
            if tqdm is not None:
                self.bar = tqdm(total=total, desc=desc, file=sys.stdout, leave=False,
                                dynamic_ncols=True)

    def write(self, line):
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.write(line, file=sys.stdout)
        else:
            print(line, flush=True)

    def update(self, **postfix):
        if self.bar is not None:
            if postfix:
                self.bar.set_postfix(postfix, refresh=False)
            self.bar.update(1)

    def close(self):
        if self.bar is not None:
            self.bar.close()
            self.bar = None
