"""ImageNet training with tritamp.fp16_utils.FP16_Optimizer managing the fp32 master weights
and the loss scale (Apex's older examples/imagenet/main_fp16_optimizer.py).

    torchrun --nproc_per_node=2 main_fp16_optimizer.py -a resnet50 --fp16 --b 224 \
        --static-loss-scale 128.0 --workers 4 ./
    torchrun --nproc_per_node=2 main_fp16_optimizer.py -a resnet50 --fp16 --b 224 \
        --dynamic-loss-scale --workers 4 ./

``optimizer.backward(loss)`` replaces ``loss.backward()``; an overflowing step is skipped
and, with ``--dynamic-loss-scale``, the scale is halved.
"""
import torch

# The shared parts, next to this script.
from imagenet_checkpoint import resume
from imagenet_cli import HALF_DTYPES, legacy_fp16_parser, setup
from imagenet_data import make_loaders
from imagenet_metrics import log
from imagenet_model import datasets_and_model, make_sgd, wrap_ddp
from imagenet_train import fit

from tritamp.fp16_utils import FP16_Optimizer, network_to_half


def parse(argv=None):
    p = legacy_fp16_parser("PyTorch ImageNet Training (FP16_Optimizer)")
    p.add_argument("--dynamic-loss-scale", action="store_true",
                   help="Use dynamic loss scaling.  If supplied, this argument supersedes "
                        "--static-loss-scale.")
    return p.parse_args(argv)


def main(argv=None):
    args = parse(argv)
    setup(args)
    if (args.static_loss_scale != 1.0 or args.dynamic_loss_scale) and not args.fp16:
        log(args, "Warning:  if --fp16 is not used, static_loss_scale will be ignored.")
    half = HALF_DTYPES[args.half_dtype]

    train_dataset, val_dataset, model = datasets_and_model(args)
    if args.fp16:
        model = network_to_half(model, dtype=half)
    model = wrap_ddp(model, args)

    optimizer = make_sgd(model.parameters(), args)
    if args.fp16:
        optimizer = FP16_Optimizer(optimizer,
                                   static_loss_scale=args.static_loss_scale,
                                   dynamic_loss_scale=args.dynamic_loss_scale,
                                   verbose=False)

    # An FP16_Optimizer's state dict holds the fp32 master weights and the scaler.
    checkpoint = resume(args, model, optimizer)

    train_loader, val_loader, train_sampler = make_loaders(train_dataset, val_dataset, args)

    def train_step(loss):
        optimizer.zero_grad()
        if args.fp16:
            optimizer.backward(loss)
        else:
            loss.backward()
        optimizer.step()

    return fit(args, model, optimizer, train_step, train_loader, val_loader,
               train_sampler, checkpoint_extras=dict,
               input_dtype=half if args.fp16 else torch.float32, checkpoint=checkpoint)


if __name__ == "__main__":
    main()
