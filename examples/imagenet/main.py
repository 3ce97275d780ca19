"""ImageNet training with hand-managed fp32 master weights and a static loss scale
(Apex's older examples/imagenet/main.py, on tritamp.fp16_utils).

    python main.py -a resnet50 --fp16 --b 224 --workers 4 --static-loss-scale 128.0 ./
    torchrun --nproc_per_node=2 main.py -a resnet50 --fp16 --b 224 --workers 4 ./

With ``--fp16`` the model is converted to half (BatchNorm stays fp32), an fp32 copy of
every parameter is kept, and each step is: scaled loss -> backward into the half
gradients -> copy them to the fp32 masters and unscale -> SGD on the masters -> copy the
masters back into the half model. ``main_amp.py`` does all of this for you.
"""
import torch

# The shared parts, next to this script.
from imagenet_checkpoint import resume
from imagenet_cli import HALF_DTYPES, legacy_fp16_parser, setup
from imagenet_data import make_loaders
from imagenet_model import MasterWeights, datasets_and_model, make_sgd, wrap_ddp
from imagenet_train import fit

from tritamp.fp16_utils import network_to_half


def parse(argv=None):
    p = legacy_fp16_parser("PyTorch ImageNet Training (manual fp16 master weights)")
    return p.parse_args(argv)


def main(argv=None):
    args = parse(argv)
    setup(args)
    half = HALF_DTYPES[args.half_dtype]

    train_dataset, val_dataset, model = datasets_and_model(args)
    if args.fp16:
        model = network_to_half(model, dtype=half)
    # DDP broadcasts rank 0's weights at construction; the masters are copied after it.
    model = wrap_ddp(model, args)

    # With --fp16: fp32 copies of the half parameters (prep_param_lists); the SGD steps them.
    masters = MasterWeights(model, args)

    optimizer = make_sgd(masters.params, args)

    # With --fp16 the checkpoint also holds the fp32 master weights.
    checkpoint = resume(args, model, optimizer, restore=masters.restore)

    train_loader, val_loader, train_sampler = make_loaders(train_dataset, val_dataset, args)

    def train_step(loss):
        # scaled loss -> backward -> (--fp16: half grads to the fp32 masters, unscaled)
        # -> SGD step -> (--fp16: masters copied back into the half model)
        masters.step(loss, optimizer)

    # The half model's inputs are normalised in half precision, as in Apex's prefetcher.
    return fit(args, model, optimizer, train_step, train_loader, val_loader,
               train_sampler, checkpoint_extras=masters.state,
               input_dtype=half if args.fp16 else torch.float32, checkpoint=checkpoint)


if __name__ == "__main__":
    main()
