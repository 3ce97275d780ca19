"""main.py with tritamp.parallel.Reducer in place of DistributedDataParallel (Apex's older
examples/imagenet/main_reducer.py).

    torchrun --nproc_per_node=2 main_reducer.py -a resnet50 --fp16 --b 224 --workers 4 ./

``Reducer(model)`` gives every process rank 0's weights; ``reducer.reduce()`` averages the
gradients over all processes when called, here once per step after the backward pass
(DistributedDataParallel overlaps that with the backward pass instead).
"""
import torch
import torch.nn as nn

import imagenet_common as common  # the shared parts, next to this script

from tritamp.fp16_utils import (master_params_to_model_params,
                                model_grads_to_master_grads, network_to_half, prep_param_lists)
from tritamp.parallel import Reducer


def parse(argv=None):
    p = common.base_parser("PyTorch ImageNet Training (gradients averaged by Reducer)")
    common.add_legacy_fp16_args(p)
    return p.parse_args(argv)


def main(argv=None):
    args = parse(argv)
    common.setup(args)
    half = common.HALF_DTYPES[args.half_dtype]

    train_dataset, val_dataset = common.make_datasets(args)
    model = common.build_model(args, num_classes=len(train_dataset.classes))
    if args.sync_bn:
        from tritamp.parallel import convert_syncbn_model
        common.log(args, "using tritamp synced BN")
        model = convert_syncbn_model(model)
    model = model.to(args.device)
    if args.fp16:
        model = network_to_half(model, dtype=half)
    reducer = Reducer(model) if args.distributed else None   # broadcasts rank 0's weights

    if args.fp16:
        model_params, master_params = prep_param_lists(model)
    else:
        master_params = list(model.parameters())

    criterion = nn.CrossEntropyLoss().to(args.device)
    # Scale learning rate based on global batch size
    args.lr = args.lr * float(args.batch_size * args.world_size) / 256.
    optimizer = common.make_sgd(master_params, args)

    checkpoint = None
    if args.resume:
        checkpoint = common.load_checkpoint(args.resume, args)
        args.start_epoch = checkpoint["epoch"]
        model.load_state_dict(common.model_state(checkpoint))
        if args.fp16:
            with torch.no_grad():
                for master, saved in zip(master_params, checkpoint["master_params"]):
                    master.copy_(saved)
        optimizer.load_state_dict(checkpoint["optimizer"])
        common.log(args, "=> loaded checkpoint '{}' (epoch {})".format(args.resume,
                                                                      checkpoint["epoch"]))

    train_loader, val_loader, train_sampler = common.make_loaders(train_dataset, val_dataset, args)

    def train_step(loss):
        loss = loss * args.static_loss_scale
        if args.fp16:
            model.zero_grad()
            loss.backward()
            if reducer is not None:
                reducer.reduce()
            model_grads_to_master_grads(model_params, master_params)
            if args.static_loss_scale != 1:
                for param in master_params:
                    if param.grad is not None:
                        param.grad.div_(args.static_loss_scale)
            optimizer.step()
            master_params_to_model_params(model_params, master_params)
        else:
            optimizer.zero_grad()
            loss.backward()
            if reducer is not None:
                reducer.reduce()
            optimizer.step()

    def extras():
        return {"master_params": [p.detach() for p in master_params]} if args.fp16 else {}

    return common.fit(args, model, criterion, optimizer, train_step, train_loader, val_loader,
                      train_sampler, checkpoint_extras=extras,
                      input_dtype=half if args.fp16 else torch.float32, checkpoint=checkpoint)


if __name__ == "__main__":
    main()
