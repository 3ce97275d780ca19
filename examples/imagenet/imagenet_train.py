"""The training and validation loops of the ImageNet examples: one epoch of ``train`` (a
script's ``train_step(loss)`` does backward and step), ``validate``, Apex's epoch loop
``fit`` and the --prof profiler.

Each script (main_amp.py, main.py, main_fp16_optimizer.py, main_reducer.py) builds its
model and optimizer its own way and hands them, with its ``train_step``, to ``fit``."""
import contextlib
import os
import sys
import time

import torch
import torch.nn as nn

from imagenet_checkpoint import restore_rng_states, save_epoch
from imagenet_cli import finish
from imagenet_data import DevicePrefetcher
from imagenet_metrics import (AverageMeter, Progress, accuracy, log, record, record_counted,
                              unique_samples)
from imagenet_model import adjust_learning_rate


def device_sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


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
    own, seen = unique_samples(loader), 0  # (the padding's repeats are left out)
    try:
        for i, (inp, target) in enumerate(DevicePrefetcher(loader, args.device, input_dtype), 1):
            n = max(0, min(inp.size(0), own - seen))
            seen += inp.size(0)
            with torch.no_grad():
                output = model(inp)[:n]
                target = target[:n]
                if n:
                    loss = criterion(output, target)
                    prec1, prec5 = accuracy(output, target, topk=(1, 5))
                else:  # (a batch of repeats only: it adds nothing)
                    loss = prec1 = prec5 = output.new_zeros(1)
            record_counted((losses, top1, top5), loss, prec1, prec5, n, args)
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
        save_epoch(args, epoch, model, optimizer, best_prec1, is_best, checkpoint_extras)
    finish(args)
    return best_prec1
