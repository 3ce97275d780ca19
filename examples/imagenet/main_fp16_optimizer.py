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

import imagenet_common as common  # the shared parts, next to this script

from tritamp.fp16_utils import FP16_Optimizer, network_to_half


def parse(argv=None):
    p = common.legacy_fp16_parser("PyTorch ImageNet Training (FP16_Optimizer)")
    p.add_argument("--dynamic-loss-scale", action="store_true",
                   help="Use dynamic loss scaling.  If supplied, this argument supersedes "
                        "--static-loss-scale.")
    return p.parse_args(argv)


def main(argv=None):
    args = parse(argv)
    common.setup(args)
    if (args.static_loss_scale != 1.0 or args.dynamic_loss_scale) and not args.fp16:
        common.log(args, "Warning:  if --fp16 is not used, static_loss_scale will be ignored.")
    half = common.HALF_DTYPES[args.half_dtype]

    train_dataset, val_dataset, model = common.datasets_and_model(args)
    if args.fp16:
        model = network_to_half(model, dtype=half)
    model = common.wrap_ddp(model, args)

    optimizer = common.make_sgd(model.parameters(), args)
    if args.fp16:
        optimizer = FP16_Optimizer(optimizer,
                                   static_loss_scale=args.static_loss_scale,
                                   dynamic_loss_scale=args.dynamic_loss_scale,
                                   verbose=False)

    # An FP16_Optimizer's state dict holds the fp32 master weights and the scaler.
    checkpoint = common.resume(args, model, optimizer)

    train_loader, val_loader, train_sampler = common.make_loaders(train_dataset, val_dataset, args)

    def train_step(loss):
        optimizer.zero_grad()
        if args.fp16:
            optimizer.backward(loss)
        else:
            loss.backward()
        optimizer.step()

    return common.fit(args, model, optimizer, train_step, train_loader, val_loader,
                      train_sampler, checkpoint_extras=dict,
                      input_dtype=half if args.fp16 else torch.float32, checkpoint=checkpoint)


if __name__ == "__main__":
    main()
