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
import torch.nn as nn

import imagenet_common as common  # the shared parts, next to this script

from tritamp.fp16_utils import (master_params_to_model_params,
                                model_grads_to_master_grads, network_to_half, prep_param_lists)


def parse(argv=None):
    p = common.base_parser("PyTorch ImageNet Training (manual fp16 master weights)")
    common.add_legacy_fp16_args(p)
    return p.parse_args(argv)


def main(argv=None):
    args = parse(argv)
    common.setup(args)
    if args.static_loss_scale != 1.0 and not args.fp16:
        common.log(args, "Warning:  static_loss_scale != 1.0 is only necessary with --fp16. "
                         "Resetting static_loss_scale to 1.0")
        args.static_loss_scale = 1.0
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
    # DDP broadcasts rank 0's weights at construction; the masters are copied after it.
    model = common.wrap_ddp(model, args)

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
        common.unwrap(model).load_state_dict(common.model_state(checkpoint))
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
            optimizer.step()

    def extras():
        return {"master_params": [p.detach() for p in master_params]} if args.fp16 else {}

    # The half model's inputs are normalised in half precision, as in Apex's prefetcher.
    return common.fit(args, model, criterion, optimizer, train_step, train_loader, val_loader,
                      train_sampler, checkpoint_extras=extras,
                      input_dtype=half if args.fp16 else torch.float32, checkpoint=checkpoint)


if __name__ == "__main__":
    main()
