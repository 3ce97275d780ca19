"""Checkpoints of the ImageNet examples: atomic writes of checkpoint.pth.tar and
model_best.pth.tar, what an epoch's checkpoint holds (``save_epoch``), loading, --resume and
the random-number states that make a resumed run continue bitwise."""
import contextlib
import os
import shutil
import sys
import tempfile

import torch
import torch.distributed as dist

from imagenet_metrics import log
from imagenet_model import unwrap


def _atomic_write(path, write):
    """Write through a temporary file in the same folder, fsync, then rename over ``path``:
    an interrupted write leaves the previous file whole and no partial one behind."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix="." + os.path.basename(path) + ".",
                               suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)      # mkstemp makes 0600; match a plain open()
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    with contextlib.suppress(OSError):     # make the rename itself durable
        dfd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)


def save_checkpoint(state, is_best, directory=".", filename="checkpoint.pth.tar",
                    best_filename="model_best.pth.tar"):
    path = os.path.join(directory, filename)
    _atomic_write(path, lambda f: torch.save(state, f))
    if is_best:
        with open(path, "rb") as src:
            _atomic_write(os.path.join(directory, best_filename),
                          lambda f: shutil.copyfileobj(src, f))


def save_epoch(args, epoch, model, optimizer, best_prec1, is_best, checkpoint_extras):
    """The checkpoint after ``epoch``, written by rank 0 (every process calls this: the
    random-number states are gathered). ``checkpoint_extras()`` returns what the script
    adds (amp state, master parameters)."""
    states = rng_states(args)
    if args.rank == 0:
        state = {
            "epoch": epoch + 1,
            "arch": args.arch,
            "state_dict": unwrap(model).state_dict(),
            "best_prec1": best_prec1,
            "optimizer": optimizer.state_dict(),
            "rng": states,
        }
        state.update(checkpoint_extras())
        save_checkpoint(state, is_best, args.output_dir)


def load_checkpoint(path, args):
    if not os.path.isfile(path):
        sys.exit("=> no checkpoint found at '{}': check the path, or drop --resume to start "
                 "from scratch".format(path))
    log(args, "=> loading checkpoint '{}'".format(path))
    return torch.load(path, map_location=args.device, weights_only=True)


def resume(args, model, optimizer, restore=None):
    """--resume: load the checkpoint into the model (DDP-wrapped or not) and the optimizer
    and continue from its epoch; ``restore(checkpoint)`` loads what the script added (amp's
    state, fp32 master weights). Returns the checkpoint, or None without --resume."""
    if not args.resume:
        return None
    checkpoint = load_checkpoint(args.resume, args)
    args.start_epoch = checkpoint["epoch"]
    unwrap(model).load_state_dict(model_state(checkpoint))
    optimizer.load_state_dict(checkpoint["optimizer"])
    if restore is not None:
        restore(checkpoint)
    log(args, "=> loaded checkpoint '{}' (epoch {})".format(args.resume, checkpoint["epoch"]))
    return checkpoint


def model_state(checkpoint):
    """The model's state dict, without the ``module.`` prefix a DDP-wrapped save adds."""
    sd = checkpoint["state_dict"]
    if sd and all(k.startswith("module.") for k in sd):
        sd = {k[len("module."):]: v for k, v in sd.items()}
    return sd


def rng_states(args):
    """Every process's random-number state (collective under torch.distributed)."""
    mine = {"cpu": torch.get_rng_state()}
    if args.device.type == "cuda":
        mine["cuda"] = torch.cuda.get_rng_state(args.device)
    if not args.distributed:
        return [mine]
    gathered = [None] * args.world_size
    dist.all_gather_object(gathered, mine)
    return gathered


def restore_rng_states(states, args):
    """Continue the random streams where the checkpointed run stopped (data order,
    augmentation, dropout), so a resumed run matches an uninterrupted one bit for bit."""
    if not states:
        return
    if len(states) != args.world_size:
        log(args, "=> checkpoint was written by {} process(es), this run has {}: random "
                  "streams are not restored".format(len(states), args.world_size))
        return
    mine = states[args.rank]
    torch.set_rng_state(mine["cpu"].cpu())
    if "cuda" in mine and args.device.type == "cuda":
        torch.cuda.set_rng_state(mine["cuda"].cpu(), args.device)
