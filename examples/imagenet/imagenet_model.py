"""Model and optimizer setup of the ImageNet examples: the torchvision model (pretrained,
SyncBatchNorm), DistributedDataParallel, the SGD and its learning-rate schedule, and the
hand-managed fp32 master weights of main.py and main_reducer.py (``MasterWeights``).
Each script calls ``amp.initialize`` or wraps its optimizer itself."""
import http.client
import os
import socket
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
import torchvision.models as models

from imagenet_data import make_datasets
from imagenet_metrics import log
from tritamp.fp16_utils import (master_params_to_model_params, model_grads_to_master_grads,
                                prep_param_lists)

# Seconds a --pretrained download may wait on the network before it counts as offline.
DOWNLOAD_TIMEOUT_S = 20.0


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


class MasterWeights:
    """The hand-managed fp32 master weights of the older scripts (Apex's main.py and
    main_reducer.py). With --fp16, ``params`` are fp32 copies of the half model's parameters
    (``prep_param_lists``); without it, the model's own parameters. The optimizer steps
    ``params``."""

    def __init__(self, model, args):
        self.model, self.args = model, args
        if args.static_loss_scale != 1.0 and not args.fp16:
            # (the loss scale is divided out only with --fp16; Apex's main.py reset it,
            # its main_reducer.py did not and trained on scaled gradients)
            log(args, "Warning:  static_loss_scale != 1.0 is only necessary with --fp16. "
                      "Resetting static_loss_scale to 1.0")
            args.static_loss_scale = 1.0
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
