"""Mixed-precision ImageNet training with tritamp's amp (Apex's examples/imagenet/main_amp.py).

    python main_amp.py -a resnet50 --b 224 --workers 4 --opt-level O2 ./
    torchrun --nproc_per_node=2 main_amp.py -a resnet50 --b 224 --workers 4 --opt-level O1 ./

On a CPU, with the tiny generated data set (make_tiny_imagenet.py):

    python main_amp.py -a resnet18 -b 4 --crop-size 32 --val-resize 36 --epochs 1 \
        --opt-level O2 --half-dtype bf16 --workers 0 /tmp/tiny-imagenet

Three lines enable amp: the import, ``amp.initialize`` after the model and optimizer are
built, and ``amp.scale_loss`` around the backward pass. The model and its inputs are never
converted to half by hand.
"""
import torch

# The shared parts, next to this script.
from imagenet_checkpoint import resume
from imagenet_cli import HALF_DTYPES, base_parser, on_off_flag, setup, str2bool
from imagenet_data import make_loaders
from imagenet_metrics import log
from imagenet_model import broadcast_model, datasets_and_model, make_sgd, wrap_ddp
from imagenet_train import fit

from tritamp import amp  # was: from apex import amp


def parse(argv=None):
    p = base_parser("PyTorch ImageNet Training with tritamp's amp")
    p.add_argument("--opt-level", type=str, required=True,
                   help="O0 (fp32), O1 (autocast), O2 (half model, fp32 masters), O3 (half)")
    p.add_argument("--keep-batchnorm-fp32", type=str, default=None,
                   help="override the opt level's choice: True or False")
    p.add_argument("--loss-scale", type=str, default=None,
                   help='override the opt level\'s loss scale: a number or "dynamic"')
    p.add_argument("--channels-last", type=str2bool, default=False, metavar="BOOL",
                   help="train in channels-last memory format (--channels-last alone turns "
                        "it on; --channels-last False turns it off)")
    p.add_argument("--half-dtype", default="fp16", choices=sorted(HALF_DTYPES),
                   help="the half type of O1-O3 (default: fp16; bf16 needs no loss scaling)")
    return p.parse_args(on_off_flag(argv, "--channels-last"))


def main(argv=None):
    args = parse(argv)
    setup(args)
    log(args, "opt_level = {}".format(args.opt_level))
    log(args, "keep_batchnorm_fp32 = {}".format(args.keep_batchnorm_fp32),
        type(args.keep_batchnorm_fp32))
    log(args, "loss_scale = {}".format(args.loss_scale), type(args.loss_scale))
    log(args, "half_dtype = {}".format(args.half_dtype))
    log(args, "device = {}, world_size = {}".format(args.device, args.world_size))
    if args.device.type == "cuda":
        log(args, "\nCUDNN VERSION: {}\n".format(torch.backends.cudnn.version()))

    memory_format = torch.channels_last if args.channels_last else torch.contiguous_format
    train_dataset, val_dataset, model = datasets_and_model(args, memory_format)
    if args.distributed:
        broadcast_model(model)

    optimizer = make_sgd(model.parameters(), args)

    # amp accepts values or strings for the overrides, for convenient use with argparse.
    model, optimizer = amp.initialize(model, optimizer,
                                      opt_level=args.opt_level,
                                      keep_batchnorm_fp32=args.keep_batchnorm_fp32,
                                      loss_scale=args.loss_scale,
                                      half_dtype=HALF_DTYPES[args.half_dtype])

    def restore_amp(checkpoint):
        if "amp" in checkpoint:
            amp.load_state_dict(checkpoint["amp"])

    # The model's state dict holds the fp32 masters too, at O2.
    checkpoint = resume(args, model, optimizer, restore=restore_amp)

    # DistributedDataParallel wraps the model AFTER amp.initialize (initialize refuses a
    # wrapped model: casting it afterwards would break DDP's gradient hooks).
    model = wrap_ddp(model, args)
    train_loader, val_loader, train_sampler = make_loaders(
        train_dataset, val_dataset, args, channels_last=args.channels_last)

    def train_step(loss):
        # set_to_none=True writes nothing (zero_grad() with O2's master weights zeroes the
        # gradients in place, as Apex's did)
        optimizer.zero_grad(set_to_none=True)
        with amp.scale_loss(loss, optimizer) as scaled_loss:
            scaled_loss.backward()
        optimizer.step()

    return fit(args, model, optimizer, train_step, train_loader, val_loader,
               train_sampler, checkpoint_extras=lambda: {"amp": amp.state_dict()},
               checkpoint=checkpoint)


if __name__ == "__main__":
    main()
