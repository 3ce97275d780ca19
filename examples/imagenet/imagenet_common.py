"""What the ImageNet examples share: command line, processes, data, model, meters, the
learning-rate schedule, the training and validation loops, checkpoints and resuming,
profiling, and the hand-managed fp32 master weights of main.py and main_reducer.py.

Each script (main_amp.py, main.py, main_fp16_optimizer.py, main_reducer.py) builds its
model and optimizer its own way and passes a ``train_step(loss)`` that does the backward
pass and the optimizer step; everything else lives here.
"""
import argparse
import contextlib
import http.client
import os
import shutil
import socket
import sys
import tempfile
import time
from functools import partial

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torchvision.datasets as datasets
import torchvision.models as models
import torchvision.transforms as transforms

from tritamp.fp16_utils import (master_params_to_model_params, model_grads_to_master_grads,
                                prep_param_lists)

# ImageNet's channel statistics on the 0..255 scale: batches travel as uint8 and are
# normalised on the device.
MEAN = (0.485 * 255, 0.456 * 255, 0.406 * 255)
STD = (0.229 * 255, 0.224 * 255, 0.225 * 255)

HALF_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}

# Seconds a --pretrained download may wait on the network before it counts as offline.
DOWNLOAD_TIMEOUT_S = 20.0


def model_names():
    return sorted(models.list_models(module=models))


def str2bool(value):
    s = str(value).strip().lower()
    if s in ("1", "true", "t", "yes", "y", "on"):
        return True
    if s in ("0", "false", "f", "no", "n", "off"):
        return False
    raise argparse.ArgumentTypeError(
        f"expected True or False, got {value!r} (give --channels-last alone to turn it on)")


def on_off_flag(argv, flag):
    """Let ``flag`` be given alone (on) or followed by True/False (Apex's spelling) without
    swallowing the next positional argument: ``--channels-last DIR`` keeps DIR."""
    argv = list(sys.argv[1:] if argv is None else argv)
    out = []
    i = 0
    while i < len(argv):
        tok = argv[i]
        if tok == flag:
            nxt = argv[i + 1] if i + 1 < len(argv) else None
            try:
                str2bool(nxt)
            except argparse.ArgumentTypeError:
                out.append(flag + "=True")
            else:
                out.append(f"{flag}={nxt}")
                i += 1
        else:
            out.append(tok)
        i += 1
    return out


def base_parser(description):
    """Apex's ImageNet command line plus the options that let a CPU run use small images."""
    names = model_names()
    p = argparse.ArgumentParser(description=description)
    p.add_argument("data", metavar="DIR",
                   help="path to dataset: DIR/train and DIR/val hold one folder per class "
                        "(make_tiny_imagenet.py writes a small one)")
    p.add_argument("--arch", "-a", metavar="ARCH", default="resnet18", choices=names,
                   help="model architecture: " + " | ".join(names) + " (default: resnet18)")
    p.add_argument("-j", "--workers", default=4, type=int, metavar="N",
                   help="number of data loading workers (default: 4)")
    p.add_argument("--epochs", default=90, type=int, metavar="N",
                   help="number of total epochs to run")
    p.add_argument("--start-epoch", default=0, type=int, metavar="N",
                   help="manual epoch number (useful on restarts)")
    p.add_argument("-b", "--batch-size", default=256, type=int, metavar="N",
                   help="mini-batch size per process (default: 256)")
    p.add_argument("--lr", "--learning-rate", default=0.1, type=float, metavar="LR",
                   help="Initial learning rate. Will be scaled by <global batch size>/256: "
                        "args.lr = args.lr*float(args.batch_size*args.world_size)/256. A warmup "
                        "schedule will also be applied over the first 5 epochs.")
    p.add_argument("--momentum", default=0.9, type=float, metavar="M", help="momentum")
    p.add_argument("--weight-decay", "--wd", default=1e-4, type=float, metavar="W",
                   help="weight decay (default: 1e-4)")
    p.add_argument("--print-freq", "-p", default=10, type=int, metavar="N",
                   help="print frequency (default: 10)")
    p.add_argument("--resume", default="", type=str, metavar="PATH",
                   help="path to latest checkpoint (default: none)")
    p.add_argument("-e", "--evaluate", dest="evaluate", action="store_true",
                   help="evaluate model on validation set")
    p.add_argument("--pretrained", dest="pretrained", action="store_true",
                   help="use pre-trained model (torchvision's weights; downloaded once)")
    p.add_argument("--prof", default=-1, type=int, metavar="N",
                   help="profile iterations N..N+10 of the first epoch with torch.profiler, "
                        "write the trace to the output directory and stop")
    p.add_argument("--deterministic", action="store_true",
                   help="seed every process and use deterministic algorithms: two runs with "
                        "the same options are bitwise identical")
    p.add_argument("--local_rank", "--local-rank", default=int(os.getenv("LOCAL_RANK", 0)),
                   type=int, help="set by the launcher (torchrun sets LOCAL_RANK)")
    p.add_argument("--sync_bn", action="store_true",
                   help="use tritamp.parallel.SyncBatchNorm (statistics over all processes)")
    p.add_argument("--device", default=None,
                   help="cuda, cuda:N or cpu (default: cuda when available, else cpu)")
    p.add_argument("--crop-size", default=224, type=int, metavar="N",
                   help="training crop and validation centre crop (default: 224)")
    p.add_argument("--val-resize", default=256, type=int, metavar="N",
                   help="validation images are resized to N before the centre crop "
                        "(default: 256)")
    p.add_argument("--output-dir", default=".", metavar="DIR",
                   help="where checkpoint.pth.tar, model_best.pth.tar and profiler traces are "
                        "written (default: current directory)")
    return p


def legacy_fp16_parser(description):
    """base_parser with the older scripts' precision options (Apex's main.py,
    main_fp16_optimizer.py, main_reducer.py)."""
    p = base_parser(description)
    p.add_argument("--fp16", action="store_true",
                   help="Run model fp16 mode (half model, fp32 BatchNorm, fp32 master weights).")
    p.add_argument("--static-loss-scale", type=float, default=1,
                   help="Static loss scale, positive power of 2 values can improve fp16 "
                        "convergence.")
    p.add_argument("--half-dtype", default="fp16", choices=sorted(HALF_DTYPES),
                   help="what --fp16 converts the model to (default: fp16)")
    return p


def check_args(args):
    if args.print_freq < 1:
        sys.exit(f"--print-freq must be >= 1, got {args.print_freq}")
    if args.batch_size < 1:
        sys.exit(f"--batch-size must be >= 1, got {args.batch_size}")
    if args.crop_size < 1 or args.val_resize < args.crop_size:
        sys.exit(f"--val-resize ({args.val_resize}) must be at least --crop-size "
                 f"({args.crop_size}): validation images are resized, then centre-cropped")
    if args.workers < 0:
        sys.exit(f"--workers must be >= 0, got {args.workers}")


# ---------------------------------------------------------------- processes and devices

def setup(args):
    """Device, process group (under torchrun) and determinism; fills in args.device,
    args.distributed, args.rank, args.world_size."""
    check_args(args)
    if args.deterministic:
        # cuBLAS needs this before its first use to pick deterministic workspaces.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit(f"--device {args.device} asks for CUDA but no CUDA device is available; "
                 f"use --device cpu")
    args.distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    args.rank = 0
    args.world_size = 1
    if args.distributed:
        if device.type == "cuda":
            if device.index is None:
                device = torch.device("cuda", args.local_rank % torch.cuda.device_count())
            torch.cuda.set_device(device)
            backend = "nccl"
        else:
            backend = "gloo"
        dist.init_process_group(backend=backend, init_method="env://")
        args.rank = dist.get_rank()
        args.world_size = dist.get_world_size()
    elif device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)
    args.device = device

    torch.backends.cudnn.benchmark = not args.deterministic
    if args.deterministic:
        torch.backends.cudnn.deterministic = True
        # warn_only: a few ops (adaptive average pooling's CUDA backward) have no
        # deterministic twin; they warn instead of stopping the run.
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.manual_seed(args.rank)
        torch.set_printoptions(precision=10)


def finish(args):
    if args.distributed and dist.is_initialized():
        dist.destroy_process_group()


def log(args, *a, **kw):
    if args.rank == 0:
        print(*a, **kw)


def unwrap(model):
    return model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model


def broadcast_model(model):
    """Give every process rank 0's initial weights (and buffers) before amp creates its
    fp32 master copies, so the masters agree too."""
    with torch.no_grad():
        for t in model.state_dict().values():
            dist.broadcast(t, src=0)


def wrap_ddp(model, args):
    if not args.distributed:
        return model
    if args.device.type == "cuda":
        return nn.parallel.DistributedDataParallel(model, device_ids=[args.device.index],
                                                   output_device=args.device.index)
    return nn.parallel.DistributedDataParallel(model)


def make_sgd(params, args):
    """torch's SGD, fused where the device has a fused kernel (CPU and CUDA do), at Apex's
    learning rate scaled by the global batch size: args.lr becomes
    args.lr * batch_size * world_size / 256 (the schedule starts from it)."""
    args.lr = args.lr * float(args.batch_size * args.world_size) / 256.
    params = list(params)
    kw = dict(lr=args.lr, momentum=args.momentum, weight_decay=args.weight_decay)
    try:
        return torch.optim.SGD(params, fused=True, **kw)
    except (RuntimeError, ValueError):
        return torch.optim.SGD(params, **kw)


class MasterWeights:
    """The hand-managed fp32 master weights of the older scripts (Apex's main.py and
    main_reducer.py). With --fp16, ``params`` are fp32 copies of the half model's parameters
    (``prep_param_lists``); without it, the model's own parameters. The optimizer steps
    ``params``."""

    def __init__(self, model, args):
        self.model, self.args = model, args
        if args.fp16:
            self.model_params, self.params = prep_param_lists(model)
        else:
            self.model_params = self.params = list(model.parameters())

    def step(self, loss, optimizer, reduce_grads=None):
        """Scale the loss by --static-loss-scale and backward; ``reduce_grads()``, if given,
        averages the gradients over the processes. With --fp16: copy the half gradients to
        the fp32 masters, unscale them, step the optimizer on the masters and copy them back
        into the half model."""
        args = self.args
        loss = loss * args.static_loss_scale
        if args.fp16:
            self.model.zero_grad()
        else:
            optimizer.zero_grad()
        loss.backward()
        if reduce_grads is not None:
            reduce_grads()
        if not args.fp16:
            optimizer.step()
            return
        model_grads_to_master_grads(self.model_params, self.params)
        if args.static_loss_scale != 1:
            for param in self.params:
                if param.grad is not None:
                    param.grad.div_(args.static_loss_scale)
        optimizer.step()
        master_params_to_model_params(self.model_params, self.params)

    def state(self):
        """What the checkpoint adds: the fp32 masters, with --fp16."""
        return {"master_params": [p.detach() for p in self.params]} if self.args.fp16 else {}

    def restore(self, checkpoint):
        """Copy the fp32 masters a --fp16 run saved."""
        if self.args.fp16:
            with torch.no_grad():
                for master, saved in zip(self.params, checkpoint["master_params"]):
                    master.copy_(saved)


# ---------------------------------------------------------------------------- model

def datasets_and_model(args, memory_format=torch.contiguous_format):
    """The training and validation ImageFolders of args.data and a model for their classes."""
    train_dataset, val_dataset = make_datasets(args)
    model = build_model(args, len(train_dataset.classes), memory_format)
    return train_dataset, val_dataset, model


def build_model(args, num_classes, memory_format=torch.contiguous_format):
    """torchvision's model on args.device, its BatchNorm layers SyncBatchNorm with --sync_bn;
    the classifier has one output per class of the data (1000 on ImageNet, as in Apex), or
    the pretrained 1000."""
    extra = {}
    if args.arch in ("googlenet", "inception_v3"):
        extra["aux_logits"] = False      # one output tensor, as the loss expects
    if args.pretrained:
        log(args, "=> using pre-trained model '{}'".format(args.arch))
        model = load_pretrained(args.arch, **extra)
    else:
        log(args, "=> creating model '{}'".format(args.arch))
        model = models.get_model(args.arch, num_classes=num_classes, **extra)
    if args.sync_bn:
        from tritamp.parallel import convert_syncbn_model
        log(args, "using tritamp synced BN")
        model = convert_syncbn_model(model)
    return model.to(args.device, memory_format=memory_format)


def load_pretrained(arch, **extra):
    weights = models.get_model_weights(arch).DEFAULT
    old = socket.getdefaulttimeout()
    socket.setdefaulttimeout(DOWNLOAD_TIMEOUT_S)
    try:
        return models.get_model(arch, weights=weights, **extra)
    except (OSError, http.client.HTTPException) as e:
        target = os.path.join(torch.hub.get_dir(), "checkpoints", os.path.basename(weights.url))
        sys.exit(f"--pretrained: the {arch} weights are not cached and downloading them from "
                 f"{weights.url} failed ({type(e).__name__}: {e}). Without network access, "
                 f"copy that file to {target} (TORCH_HOME moves the cache), or train from "
                 f"scratch without --pretrained.")
    finally:
        socket.setdefaulttimeout(old)


# ----------------------------------------------------------------------------- data

def fast_collate(batch, channels_last=False):
    """PIL images -> one uint8 NCHW tensor (normalisation happens on the device).

    Stacking the HWC arrays gives NHWC memory, which is NCHW in channels-last layout;
    ``.contiguous()`` makes it plain NCHW unless channels-last was asked for.
    """
    arrays = np.stack([np.asarray(img, dtype=np.uint8) for img, _ in batch])
    if arrays.ndim == 3:                       # greyscale images from a custom loader
        arrays = np.repeat(arrays[..., None], 3, axis=-1)
    tensor = torch.from_numpy(arrays).permute(0, 3, 1, 2)
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    targets = torch.tensor([target for _, target in batch], dtype=torch.int64)
    return tensor.contiguous(memory_format=fmt), targets


def make_datasets(args):
    traindir = os.path.join(args.data, "train")
    valdir = os.path.join(args.data, "val")
    for d in (traindir, valdir):
        if not os.path.isdir(d):
            sys.exit(f"{d} is not a directory: DIR must hold train/ and val/, each with one "
                     f"folder of images per class (make_tiny_imagenet.py DIR writes a small one)")
    train_dataset = datasets.ImageFolder(traindir, transforms.Compose([
        transforms.RandomResizedCrop(args.crop_size),
        transforms.RandomHorizontalFlip(),
    ]))
    val_dataset = datasets.ImageFolder(valdir, transforms.Compose([
        transforms.Resize(args.val_resize),
        transforms.CenterCrop(args.crop_size),
    ]))
    if val_dataset.classes != train_dataset.classes:
        sys.exit(f"{traindir} and {valdir} must hold the same class folders")
    return train_dataset, val_dataset


def make_loaders(train_dataset, val_dataset, args, channels_last=False):
    train_sampler = val_sampler = None
    if args.distributed:
        train_sampler = torch.utils.data.distributed.DistributedSampler(train_dataset)
        val_sampler = torch.utils.data.distributed.DistributedSampler(val_dataset, shuffle=False)
    collate = partial(fast_collate, channels_last=channels_last)
    pin = args.device.type == "cuda"
    train_loader = torch.utils.data.DataLoader(
        train_dataset, batch_size=args.batch_size, shuffle=(train_sampler is None),
        num_workers=args.workers, pin_memory=pin, sampler=train_sampler, collate_fn=collate)
    val_loader = torch.utils.data.DataLoader(
        val_dataset, batch_size=args.batch_size, shuffle=False,
        num_workers=args.workers, pin_memory=pin, sampler=val_sampler, collate_fn=collate)
    return train_loader, val_loader, train_sampler


class DevicePrefetcher:
    """Yields (input, target) on the device, input normalised in ``dtype``.

    On CUDA the copy and normalisation of the next batch run on a side stream while the
    current one trains; elsewhere the batch is prepared when it is asked for.
    """

    def __init__(self, loader, device, dtype=torch.float32):
        self.loader = iter(loader)
        self.device = device
        self.dtype = dtype
        self.mean = torch.tensor(MEAN, device=device, dtype=dtype).view(1, 3, 1, 1)
        self.std = torch.tensor(STD, device=device, dtype=dtype).view(1, 3, 1, 1)
        self.stream = None
        if device.type == "cuda":
            self.stream = torch.cuda.Stream(device)
            # mean/std were written on the current stream; the side stream reads them.
            self.stream.wait_stream(torch.cuda.current_stream(device))
        self.next_batch = None
        self._preload()

    def _prepare(self, inp, target):
        inp = inp.to(self.device, non_blocking=True)
        target = target.to(self.device, non_blocking=True)
        # .to(dtype) keeps the memory format (channels-last stays channels-last).
        inp = inp.to(self.dtype).sub_(self.mean).div_(self.std)
        return inp, target

    def _preload(self):
        try:
            inp, target = next(self.loader)
        except StopIteration:
            self.next_batch = None
            return
        if self.stream is None:
            self.next_batch = self._prepare(inp, target)
        else:
            with torch.cuda.stream(self.stream):
                self.next_batch = self._prepare(inp, target)

    def __iter__(self):
        return self

    def __next__(self):
        if self.stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self.stream)
        batch = self.next_batch
        if batch is None:
            raise StopIteration
        if self.stream is not None:
            # The caching allocator must not hand these blocks back to the side stream
            # while the main stream still uses them.
            for t in batch:
                t.record_stream(torch.cuda.current_stream(self.device))
        self._preload()
        return batch


# ------------------------------------------------------------------ meters and schedule

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


def reduce_tensor(tensor, world_size):
    rt = tensor.clone()
    dist.all_reduce(rt, op=dist.ReduceOp.SUM)
    rt /= world_size
    return rt


def learning_rate(base_lr, epoch, step, len_epoch):
    """Apex's ResNet-50 schedule: /10 at epochs 30, 60 (and 80, 90), linear warmup over the
    first 5 epochs by step (``step`` counts from 0, so warmup ends exactly at ``base_lr``)."""
    factor = epoch // 30
    if epoch >= 80:
        factor += 1
    lr = base_lr * (0.1 ** factor)
    if epoch < 5:
        lr = lr * float(1 + step + epoch * len_epoch) / (5. * len_epoch)
    return lr


def adjust_learning_rate(optimizer, base_lr, epoch, step, len_epoch):
    lr = learning_rate(base_lr, epoch, step, len_epoch)
    for group in optimizer.param_groups:
        group["lr"] = lr
    return lr


def device_sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ------------------------------------------------------------------ output and profiling

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


class IterationProfiler:
    """--prof N: a torch.profiler trace of iterations N..N+10, then the run stops."""

    def __init__(self, args):
        self.first = max(args.prof, 1)         # iterations count from 1, as in Apex
        self.last = args.prof + 10
        self.args = args
        self.prof = None
        self.done = False
        self.path = os.path.join(args.output_dir, f"trace_rank{args.rank}.json")

    @property
    def on(self):
        return self.first >= 0

    def region(self, name):
        return torch.profiler.record_function(name) if self.prof is not None else contextlib.nullcontext()

    def begin(self, i):
        if self.on and self.prof is None and not self.done and i == self.first:
            log(self.args, "Profiling begun at iteration {}".format(i))
            activities = [torch.profiler.ProfilerActivity.CPU]
            if self.args.device.type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self.prof = torch.profiler.profile(activities=activities)
            self.prof.start()

    def end(self, i, last_of_epoch):
        """True when profiling is over and the run should stop."""
        if self.prof is None:
            return False
        if i == self.last or last_of_epoch:
            device_sync(self.args.device)
            self.prof.stop()
            os.makedirs(self.args.output_dir, exist_ok=True)
            self.prof.export_chrome_trace(self.path)
            self.prof = None
            self.done = True
            note = "" if i == self.last else " (the epoch ended first)"
            log(self.args, "Profiling ended at iteration {}{}; trace written to {}".format(
                i, note, self.path))
            return True
        return False


# ------------------------------------------------------------------ train and validate

def train(loader, model, criterion, optimizer, train_step, epoch, args, input_dtype=torch.float32,
          profiler=None):
    """One epoch. ``train_step(loss)`` does zero_grad, backward and step. Returns True when
    --prof asked the run to stop."""
    batch_time = AverageMeter()
    losses = AverageMeter()
    top1 = AverageMeter()
    top5 = AverageMeter()
    model.train()
    len_epoch = len(loader)
    progress = Progress(len_epoch, f"Epoch {epoch}", args.rank == 0)
    end = time.time()
    stop = False
    try:
        for i, (inp, target) in enumerate(DevicePrefetcher(loader, args.device, input_dtype), 1):
            if profiler is not None:
                profiler.begin(i)
            region = profiler.region if profiler is not None else (lambda name: contextlib.nullcontext())
            with region("Body of iteration {}".format(i)):
                adjust_learning_rate(optimizer, args.lr, epoch, i - 1, len_epoch)
                with region("forward"):
                    output = model(inp)
                    loss = criterion(output, target)
                with region("backward and optimizer.step()"):
                    train_step(loss)

            if i % args.print_freq == 0:
                # Every print_freq iterations: accuracy, an all-reduce and a host sync;
                # the iterations in between queue work without waiting for the device.
                prec1, prec5 = accuracy(output.detach(), target, topk=(1, 5))
                record((losses, top1, top5), loss.detach(), prec1, prec5, inp.size(0), args)
                device_sync(args.device)
                batch_time.update((time.time() - end) / args.print_freq)
                end = time.time()
                progress.write(
                    'Epoch: [{0}][{1}/{2}]\t'
                    'Time {batch_time.val:.3f} ({batch_time.avg:.3f})\t'
                    'Speed {3:.3f} ({4:.3f})\t'
                    'Loss {loss.val:.10f} ({loss.avg:.4f})\t'
                    'Prec@1 {top1.val:.3f} ({top1.avg:.3f})\t'
                    'Prec@5 {top5.val:.3f} ({top5.avg:.3f})'.format(
                        epoch, i, len_epoch,
                        args.world_size * args.batch_size / batch_time.val,
                        args.world_size * args.batch_size / batch_time.avg,
                        batch_time=batch_time, loss=losses, top1=top1, top5=top5))
                progress.update(loss=f"{losses.val:.4f}", prec1=f"{top1.val:.1f}")
            else:
                progress.update()
            if profiler is not None and profiler.end(i, i == len_epoch):
                stop = True
                break
    finally:
        progress.close()
    return stop


def validate(loader, model, criterion, args, input_dtype=torch.float32):
    batch_time = AverageMeter()
    losses = AverageMeter()
    top1 = AverageMeter()
    top5 = AverageMeter()
    model.eval()
    progress = Progress(len(loader), "Test", args.rank == 0)
    end = time.time()
    try:
        for i, (inp, target) in enumerate(DevicePrefetcher(loader, args.device, input_dtype), 1):
            with torch.no_grad():
                output = model(inp)
                loss = criterion(output, target)
            prec1, prec5 = accuracy(output, target, topk=(1, 5))
            record((losses, top1, top5), loss, prec1, prec5, inp.size(0), args)
            batch_time.update(time.time() - end)
            end = time.time()
            if i % args.print_freq == 0:
                progress.write(
                    'Test: [{0}/{1}]\t'
                    'Time {batch_time.val:.3f} ({batch_time.avg:.3f})\t'
                    'Speed {2:.3f} ({3:.3f})\t'
                    'Loss {loss.val:.4f} ({loss.avg:.4f})\t'
                    'Prec@1 {top1.val:.3f} ({top1.avg:.3f})\t'
                    'Prec@5 {top5.val:.3f} ({top5.avg:.3f})'.format(
                        i, len(loader),
                        args.world_size * args.batch_size / batch_time.val,
                        args.world_size * args.batch_size / batch_time.avg,
                        batch_time=batch_time, loss=losses, top1=top1, top5=top5))
            progress.update()
    finally:
        progress.close()
    log(args, ' * Prec@1 {top1.avg:.3f} Prec@5 {top5.avg:.3f}'.format(top1=top1, top5=top5))
    return top1.avg


# ------------------------------------------------------------------------ checkpoints

def _atomic_write(path, write):
    """Write through a temporary file in the same folder, fsync, then rename over ``path``:
    an interrupted write leaves the previous file whole and no partial one behind."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix="." + os.path.basename(path) + ".",
                               suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)      # mkstemp makes 0600; match a plain open()
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    with contextlib.suppress(OSError):     # make the rename itself durable
        dfd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)


def save_checkpoint(state, is_best, directory=".", filename="checkpoint.pth.tar",
                    best_filename="model_best.pth.tar"):
    path = os.path.join(directory, filename)
    _atomic_write(path, lambda f: torch.save(state, f))
    if is_best:
        with open(path, "rb") as src:
            _atomic_write(os.path.join(directory, best_filename),
                          lambda f: shutil.copyfileobj(src, f))


def load_checkpoint(path, args):
    if not os.path.isfile(path):
        sys.exit("=> no checkpoint found at '{}': check the path, or drop --resume to start "
                 "from scratch".format(path))
    log(args, "=> loading checkpoint '{}'".format(path))
    return torch.load(path, map_location=args.device, weights_only=True)


def resume(args, model, optimizer, restore=None):
    """--resume: load the checkpoint into the model (DDP-wrapped or not) and the optimizer
    and continue from its epoch; ``restore(checkpoint)`` loads what the script added (amp's
    state, fp32 master weights). Returns the checkpoint, or None without --resume."""
    if not args.resume:
        return None
    checkpoint = load_checkpoint(args.resume, args)
    args.start_epoch = checkpoint["epoch"]
    unwrap(model).load_state_dict(model_state(checkpoint))
    optimizer.load_state_dict(checkpoint["optimizer"])
    if restore is not None:
        restore(checkpoint)
    log(args, "=> loaded checkpoint '{}' (epoch {})".format(args.resume, checkpoint["epoch"]))
    return checkpoint


def model_state(checkpoint):
    """The model's state dict, without the ``module.`` prefix a DDP-wrapped save adds."""
    sd = checkpoint["state_dict"]
    if sd and all(k.startswith("module.") for k in sd):
        sd = {k[len("module."):]: v for k, v in sd.items()}
    return sd


def rng_states(args):
    """Every process's random-number state (collective under torch.distributed)."""
    mine = {"cpu": torch.get_rng_state()}
    if args.device.type == "cuda":
        mine["cuda"] = torch.cuda.get_rng_state(args.device)
    if not args.distributed:
        return [mine]
    gathered = [None] * args.world_size
    dist.all_gather_object(gathered, mine)
    return gathered


def restore_rng_states(states, args):
    """Continue the random streams where the checkpointed run stopped (data order,
    augmentation, dropout), so a resumed run matches an uninterrupted one bit for bit."""
    if not states:
        return
    if len(states) != args.world_size:
        log(args, "=> checkpoint was written by {} process(es), this run has {}: random "
                  "streams are not restored".format(len(states), args.world_size))
        return
    mine = states[args.rank]
    torch.set_rng_state(mine["cpu"].cpu())
    if "cuda" in mine and args.device.type == "cuda":
        torch.cuda.set_rng_state(mine["cuda"].cpu(), args.device)


def fit(args, model, optimizer, train_step, train_loader, val_loader, train_sampler,
        checkpoint_extras, input_dtype=torch.float32, checkpoint=None):
    """Apex's epoch loop with the cross-entropy loss: train, validate, checkpoint (rank 0),
    keep model_best.

    ``checkpoint_extras()`` returns what a script adds to the checkpoint (amp state,
    master parameters); ``checkpoint`` is the loaded --resume checkpoint, if any.
    Returns the best Prec@1 seen.
    """
    criterion = nn.CrossEntropyLoss().to(args.device)
    best_prec1 = checkpoint.get("best_prec1") if checkpoint else None
    if args.evaluate:
        prec1 = validate(val_loader, model, criterion, args, input_dtype)
        finish(args)
        return prec1
    if checkpoint:
        restore_rng_states(checkpoint.get("rng"), args)
    if args.prof > len(train_loader):
        sys.exit(f"--prof {args.prof}: an epoch has only {len(train_loader)} iterations; "
                 f"profile from an iteration in 1..{len(train_loader)}")
    profiler = IterationProfiler(args) if args.prof >= 0 else None
    for epoch in range(args.start_epoch, args.epochs):
        if train_sampler is not None:
            train_sampler.set_epoch(epoch)
        if train(train_loader, model, criterion, optimizer, train_step, epoch, args,
                 input_dtype, profiler):
            break
        prec1 = validate(val_loader, model, criterion, args, input_dtype)
        is_best = best_prec1 is None or prec1 > best_prec1
        best_prec1 = prec1 if is_best else best_prec1
        states = rng_states(args)
        if args.rank == 0:
            state = {
                "epoch": epoch + 1,
                "arch": args.arch,
                "state_dict": unwrap(model).state_dict(),
                "best_prec1": best_prec1,
                "optimizer": optimizer.state_dict(),
                "rng": states,
            }
            state.update(checkpoint_extras())
            save_checkpoint(state, is_best, args.output_dir)
    finish(args)
    return best_prec1
