"""main.py with tritamp.parallel.Reducer in place of DistributedDataParallel (Apex's older
examples/imagenet/main_reducer.py).

    torchrun --nproc_per_node=2 main_reducer.py -a resnet50 --fp16 --b 224 --workers 4 ./

``Reducer(model)`` gives every process rank 0's weights; ``reducer.reduce()`` averages the
gradients over all processes when called, here once per step after the backward pass
(DistributedDataParallel overlaps that with the backward pass instead).
"""
import torch

# The shared parts, next to this script.
from imagenet_checkpoint import resume
from imagenet_cli import HALF_DTYPES, legacy_fp16_parser, setup
from imagenet_data import make_loaders
from imagenet_model import MasterWeights, datasets_and_model, make_sgd
from imagenet_train import fit

from tritamp.fp16_utils import network_to_half
from tritamp.parallel import Reducer


def parse(argv=None):
    p = legacy_fp16_parser("PyTorch ImageNet Training (gradients averaged by Reducer)")
    return p.parse_args(argv)


def main(argv=None):
    args = parse(argv)
    setup(args)
    half = HALF_DTYPES[args.half_dtype]

    train_dataset, val_dataset, model = datasets_and_model(args)
    if args.fp16:
        model = network_to_half(model, dtype=half)
    reducer = Reducer(model) if args.distributed else None   # broadcasts rank 0's weights

    # With --fp16: fp32 copies of the half parameters (prep_param_lists); the SGD steps them.
    masters = MasterWeights(model, args)

    optimizer = make_sgd(masters.params, args)

    # With --fp16 the checkpoint also holds the fp32 master weights.
    checkpoint = resume(args, model, optimizer, restore=masters.restore)

    train_loader, val_loader, train_sampler = make_loaders(train_dataset, val_dataset, args)

    def train_step(loss):
        # main.py's step, with reducer.reduce() averaging the gradients after the backward
        # pass (before they are copied to the fp32 masters with --fp16)
        masters.step(loss, optimizer, reduce_grads=reducer.reduce if reducer is not None else None)

    return fit(args, model, optimizer, train_step, train_loader, val_loader,
               train_sampler, checkpoint_extras=masters.state,
               input_dtype=half if args.fp16 else torch.float32, checkpoint=checkpoint)


if __name__ == "__main__":
    main()
