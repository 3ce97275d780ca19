"""The ImageNet examples' command line and the processes it sets up: Apex's options plus
the small-image ones (``base_parser``, ``legacy_fp16_parser``), their checks, and ``setup``/
``finish`` (device, process group under torchrun, determinism)."""
import argparse
import os
import sys

import torch
import torch.distributed as dist
import torchvision.models as models

HALF_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


def model_names():
    return sorted(models.list_models(module=models))


def str2bool(value):
    s = str(value).strip().lower()
    if s in ("1", "true", "t", "yes", "y", "on"):
        return True
    if s in ("0", "false", "f", "no", "n", "off"):
        return False
    raise argparse.ArgumentTypeError(
        f"expected True or False, got {value!r} (give --channels-last alone to turn it on)")


def on_off_flag(argv, flag):
    """Let ``flag`` be given alone (on) or followed by True/False (Apex's spelling) without
    swallowing the next positional argument: ``--channels-last DIR`` keeps DIR."""
    argv = list(sys.argv[1:] if argv is None else argv)
    out = []
    i = 0
    while i < len(argv):
        tok = argv[i]
        if tok == flag:
            nxt = argv[i + 1] if i + 1 < len(argv) else None
            try:
                str2bool(nxt)
            except argparse.ArgumentTypeError:
                out.append(flag + "=True")
            else:
                out.append(f"{flag}={nxt}")
                i += 1
        else:
            out.append(tok)
        i += 1
    return out


def base_parser(description):
    """Apex's ImageNet command line plus the options that let a CPU run use small images."""
    names = model_names()
    p = argparse.ArgumentParser(description=description)
    p.add_argument("data", metavar="DIR",
                   help="path to dataset: DIR/train and DIR/val hold one folder per class "
                        "(make_tiny_imagenet.py writes a small one)")
    p.add_argument("--arch", "-a", metavar="ARCH", default="resnet18", choices=names,
                   help="model architecture: " + " | ".join(names) + " (default: resnet18)")
    p.add_argument("-j", "--workers", default=4, type=int, metavar="N",
                   help="number of data loading workers (default: 4)")
    p.add_argument("--epochs", default=90, type=int, metavar="N",
                   help="number of total epochs to run")
    p.add_argument("--start-epoch", default=0, type=int, metavar="N",
                   help="manual epoch number (useful on restarts)")
    p.add_argument("-b", "--batch-size", default=256, type=int, metavar="N",
                   help="mini-batch size per process (default: 256)")
    p.add_argument("--lr", "--learning-rate", default=0.1, type=float, metavar="LR",
                   help="Initial learning rate. Will be scaled by <global batch size>/256: "
                        "args.lr = args.lr*float(args.batch_size*args.world_size)/256. A warmup "
                        "schedule will also be applied over the first 5 epochs.")
    p.add_argument("--momentum", default=0.9, type=float, metavar="M", help="momentum")
    p.add_argument("--weight-decay", "--wd", default=1e-4, type=float, metavar="W",
                   help="weight decay (default: 1e-4)")
    p.add_argument("--print-freq", "-p", default=10, type=int, metavar="N",
                   help="print frequency (default: 10)")
    p.add_argument("--resume", default="", type=str, metavar="PATH",
                   help="path to latest checkpoint (default: none)")
    p.add_argument("-e", "--evaluate", dest="evaluate", action="store_true",
                   help="evaluate model on validation set")
    p.add_argument("--pretrained", dest="pretrained", action="store_true",
                   help="use pre-trained model (torchvision's weights; downloaded once)")
    p.add_argument("--prof", default=-1, type=int, metavar="N",
                   help="profile iterations N..N+10 of the first epoch with torch.profiler, "
                        "write the trace to the output directory and stop")
    p.add_argument("--deterministic", action="store_true",
                   help="seed every process and use deterministic algorithms: two runs with "
                        "the same options are bitwise identical")
    p.add_argument("--local_rank", "--local-rank", default=int(os.getenv("LOCAL_RANK", 0)),
                   type=int, help="set by the launcher (torchrun sets LOCAL_RANK)")
    p.add_argument("--sync_bn", action="store_true",
                   help="use tritamp.parallel.SyncBatchNorm (statistics over all processes)")
    p.add_argument("--device", default=None,
                   help="cuda, cuda:N or cpu (default: cuda when available, else cpu)")
    p.add_argument("--crop-size", default=224, type=int, metavar="N",
                   help="training crop and validation centre crop (default: 224)")
    p.add_argument("--val-resize", default=256, type=int, metavar="N",
                   help="validation images are resized to N before the centre crop "
                        "(default: 256)")
    p.add_argument("--output-dir", default=".", metavar="DIR",
                   help="where checkpoint.pth.tar, model_best.pth.tar and profiler traces are "
                        "written (default: current directory)")
    return p


def legacy_fp16_parser(description):
    """base_parser with the older scripts' precision options (Apex's main.py,
    main_fp16_optimizer.py, main_reducer.py)."""
    p = base_parser(description)
    p.add_argument("--fp16", action="store_true",
                   help="Run model fp16 mode (half model, fp32 BatchNorm, fp32 master weights).")
    p.add_argument("--static-loss-scale", type=float, default=1,
                   help="Static loss scale, positive power of 2 values can improve fp16 "
                        "convergence.")
    p.add_argument("--half-dtype", default="fp16", choices=sorted(HALF_DTYPES),
                   help="what --fp16 converts the model to (default: fp16)")
    return p


def check_args(args):
    if args.print_freq < 1:
        sys.exit(f"--print-freq must be >= 1, got {args.print_freq}")
    if args.batch_size < 1:
        sys.exit(f"--batch-size must be >= 1, got {args.batch_size}")
    if args.crop_size < 1:
        sys.exit(f"--crop-size must be >= 1, got {args.crop_size}")
    if args.val_resize < args.crop_size:
        sys.exit(f"--val-resize ({args.val_resize}) must be at least --crop-size "
                 f"({args.crop_size}): validation images are resized, then centre-cropped")
    if args.workers < 0:
        sys.exit(f"--workers must be >= 0, got {args.workers}")
    scale = getattr(args, "static_loss_scale", 1.0)  # (the older scripts' option)
    if not 0 < scale < float("inf"):
        # (0 or inf divided the gradients into nan: a nan model trained and was saved)
        sys.exit(f"--static-loss-scale must be a finite number > 0, got {scale}; "
                 f"e.g. 128.0, or 1 for none")


def setup(args):
    """Device, process group (under torchrun) and determinism; fills in args.device,
    args.distributed, args.rank, args.world_size."""
    check_args(args)
    if args.deterministic:
        # cuBLAS needs this before its first use to pick deterministic workspaces.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit(f"--device {args.device} asks for CUDA but no CUDA device is available; "
                 f"use --device cpu")
    args.distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    args.rank = 0
    args.world_size = 1
    if args.distributed:
        if device.type == "cuda":
            if device.index is None:
                device = torch.device("cuda", args.local_rank % torch.cuda.device_count())
            torch.cuda.set_device(device)
            backend = "nccl"
        else:
            backend = "gloo"
        dist.init_process_group(backend=backend, init_method="env://")
        args.rank = dist.get_rank()
        args.world_size = dist.get_world_size()
    elif device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)
    args.device = device

    torch.backends.cudnn.benchmark = not args.deterministic
    if args.deterministic:
        torch.backends.cudnn.deterministic = True
        # warn_only: a few ops (adaptive average pooling's CUDA backward) have no
        # deterministic twin; they warn instead of stopping the run.
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.manual_seed(args.rank)
        torch.set_printoptions(precision=10)


def finish(args):
    if args.distributed and dist.is_initialized():
        dist.destroy_process_group()
