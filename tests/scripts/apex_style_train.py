"""A training script written against Apex's amp, with only its import changed.

It follows Apex's documented usage: argparse options passed straight through as strings,
initialize after building model and optimizer, scale_loss, gradient clipping on
master_params, and a checkpoint holding model, optimizer and amp state.
"""
import argparse

import torch
import torch.nn as nn

from tritamp import amp  # was: from apex import amp
from tritamp.optimizers import FusedAdagrad, FusedAdam, FusedLAMB, FusedNovoGrad, FusedSGD  # was: apex.optimizers

OPTIMIZERS = {
    "sgd": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, weight_decay=1e-4),
    "fused-sgd": lambda p: FusedSGD(p, lr=0.1, momentum=0.9, weight_decay=1e-4),
    "fused-adam": lambda p: FusedAdam(p, lr=1e-2, weight_decay=0.01),
    "fused-lamb": lambda p: FusedLAMB(p, lr=1e-2),
    "fused-novograd": lambda p: FusedNovoGrad(p, lr=1e-2),
    "fused-adagrad": lambda p: FusedAdagrad(p, lr=1e-1),
}

parser = argparse.ArgumentParser()
parser.add_argument("--opt-level", type=str, default="O1")
parser.add_argument("--keep-batchnorm-fp32", type=str, default=None)
parser.add_argument("--loss-scale", type=str, default=None)
parser.add_argument("--steps", type=int, default=4)
parser.add_argument("--checkpoint", type=str, required=True)
parser.add_argument("--optimizer", choices=sorted(OPTIMIZERS), default="sgd")


def main(argv=None):
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(),
                          nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 3))
    optimizer = OPTIMIZERS[args.optimizer](model.parameters())
    model, optimizer = amp.initialize(model, optimizer, opt_level=args.opt_level,
                                      keep_batchnorm_fp32=args.keep_batchnorm_fp32,
                                      loss_scale=args.loss_scale)
    criterion = nn.CrossEntropyLoss()
    x, y = torch.randn(4, 3, 5, 5), torch.tensor([0, 1, 2, 1])
    losses = []
    for _ in range(args.steps):
        output = model(x)
        loss = criterion(output, y)
        optimizer.zero_grad()
        with amp.scale_loss(loss, optimizer) as scaled_loss:
            scaled_loss.backward()
        torch.nn.utils.clip_grad_norm_(amp.master_params(optimizer), 1.0)
        optimizer.step()
        losses.append(loss.item())
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                "amp": amp.state_dict()}, args.checkpoint)
    return losses


if __name__ == "__main__":
    print(main())
