"""A small transformer language model trained with FSDP2 (``fully_shard``) and tritamp,
under torchrun: GPUs with NCCL, or CPU processes with gloo.

    torchrun --nproc_per_node=2 examples/fsdp2/main.py                    # amp O1, bf16
    torchrun --nproc_per_node=2 examples/fsdp2/main.py --half-dtype fp16  # dynamic scale
    torchrun --nproc_per_node=2 examples/fsdp2/main.py --precision fsdp   # FSDP2 casts

Every transformer block and the whole model are sharded with ``fully_shard`` first, then
the optimizer is built (tritamp's FusedAdam steps each rank's shards), then
``amp.initialize``:

- ``--precision amp`` (default): amp O1 casts per op (autocast) on the fp32 sharded
  model; with fp16 the dynamic loss scale's overflow flag is agreed across the ranks
  (an overflow on one rank skips the step on every rank), without a host sync.
- ``--precision fsdp``: FSDP2's ``MixedPrecisionPolicy`` runs the forward and backward
  in the half dtype from the fp32 shards (which stay the master weights) and reduces
  gradients in fp32; amp O0 with a dynamic loss scale (fp16) or none (bf16).

The data is synthetic (each sequence repeats a random motif, so the next token is
predictable and the loss falls). ``--checkpoint DIR`` saves the model and optimizer
with torch.distributed.checkpoint at the end (and resumes from it when it exists).
"""
import argparse
import math
import os
import sys
import warnings

import torch
import torch.distributed as dist
from torch import nn

from tritamp import amp
from tritamp.optimizers import FusedAdam, clip_grad_norm_


class Block(nn.Module):
    """A pre-norm transformer block: causal self-attention and an MLP."""

    def __init__(self, width, heads):
        super().__init__()
        self.norm1 = nn.LayerNorm(width)
        self.attn = nn.MultiheadAttention(width, heads, batch_first=True)
        self.norm2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(),
                                 nn.Linear(4 * width, width))

    def forward(self, x, mask):
        h = self.norm1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class TinyLM(nn.Module):
    def __init__(self, vocab, width, heads, layers, seq):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.pos = nn.Parameter(torch.randn(1, seq, width) * 0.02)  # one row: uneven shards
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab)

    def forward(self, tokens):
        seq = tokens.shape[1]
        mask = torch.triu(torch.full((seq, seq), float("-inf"), device=tokens.device), 1)
        x = self.embed(tokens) + self.pos[:, :seq]
        for block in self.blocks:
            x = block(x, mask)
        return self.head(self.norm(x))


def batches(vocab, seq, batch, device, rank, steps, start=0):
    """Sequences that repeat a random motif of 4 tokens: each rank its own batches."""
    for step in range(start, start + steps):
        g = torch.Generator().manual_seed(1000 * step + rank)
        motif = torch.randint(0, vocab, (batch, 4), generator=g)
        tokens = motif.repeat(1, seq // 4 + 2)[:, :seq + 1]
        yield step, tokens[:, :-1].to(device), tokens[:, 1:].to(device)


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--precision", choices=("amp", "fsdp"), default="amp",
                    help="amp O1 (autocast) on fp32 shards, or FSDP2's MixedPrecisionPolicy")
    ap.add_argument("--half-dtype", choices=("bf16", "fp16"), default="bf16")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--batch-size", type=int, default=8, help="per rank")
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=64)
    ap.add_argument("--lr", type=float, default=1e-2)
    ap.add_argument("--clip", type=float, default=1.0, help="max gradient norm (0: off)")
    ap.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    ap.add_argument("--checkpoint", default=None,
                    help="folder for a torch.distributed.checkpoint (resumed when present)")
    args = ap.parse_args(argv)
    # (a negative --clip turned every gradient around: the loss climbed, nothing said)
    if not 0 <= args.clip < math.inf:
        ap.error(f"--clip must be a finite number >= 0 (0: off), got {args.clip}")
    for flag in ("batch_size", "seq", "width", "heads", "layers", "vocab"):
        if getattr(args, flag) < 1:
            ap.error(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if args.steps < 0:
        ap.error(f"--steps must be >= 0, got {args.steps}")
    return args


def main(argv=None):
    args = parse(argv)
    use_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if use_cuda:
        torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl" if use_cuda else "gloo")
    rank = dist.get_rank()
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    half = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.half_dtype]

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    torch.manual_seed(0)  # the same initial model on every rank
    model = TinyLM(args.vocab, args.width, args.heads, args.layers, args.seq).to(device)
    policy = (MixedPrecisionPolicy(param_dtype=half, reduce_dtype=torch.float32)
              if args.precision == "fsdp" else MixedPrecisionPolicy())
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)

    # 1. shard, 2. optimizer, 3. amp.initialize
    optimizer = FusedAdam(model.parameters(), lr=args.lr, weight_decay=0.01)
    if args.precision == "amp":
        model, optimizer = amp.initialize(model, optimizer, opt_level="O1", half_dtype=half,
                                          verbosity=0)
    else:  # FSDP2 casts; amp only scales the loss (fp16) or stays out of the way (bf16)
        model, optimizer = amp.initialize(
            model, optimizer, opt_level="O0",
            loss_scale="dynamic" if half == torch.float16 else 1.0, verbosity=0)

    start = 0
    # (a checkpoint is there once its metadata is: an empty or new folder starts afresh)
    if args.checkpoint and os.path.isfile(os.path.join(args.checkpoint, ".metadata")):
        start = load(args.checkpoint, model, optimizer)
        if rank == 0:
            print(f"resumed from {args.checkpoint} at step {start}")

    criterion = nn.CrossEntropyLoss()
    losses = []
    for step, tokens, targets in batches(args.vocab, args.seq, args.batch_size, device, rank,
                                          args.steps, start):
        logits = model(tokens)
        loss = criterion(logits.float().reshape(-1, args.vocab), targets.reshape(-1))
        optimizer.zero_grad()
        with amp.scale_loss(loss, optimizer) as scaled:
            scaled.backward()
        if args.clip:
            # the norm of the whole (sharded) gradients, unscaled: one all-reduce
            clip_grad_norm_(amp.master_params(optimizer), args.clip)
        optimizer.step()
        # the mean loss over the ranks, for the log only (this reads it on the host)
        value = loss.detach().float().reshape(1)
        dist.all_reduce(value)
        losses.append(float(value) / dist.get_world_size())
        if rank == 0 and (step % 5 == 0 or step == start + args.steps - 1):
            skipped = " (skipped: overflow)" if amp.last_step_skipped(optimizer) else ""
            print(f"step {step:4d}  loss {losses[-1]:.4f}{skipped}", flush=True)

    if args.checkpoint:
        save(args.checkpoint, model, optimizer, start + args.steps)
        if rank == 0:
            print(f"saved {args.checkpoint}")
    dist.barrier()  # every rank done with its collectives before the group goes
    dist.destroy_process_group()
    return losses


def save(folder, model, optimizer, step):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    model_sd, optim_sd = get_state_dict(model, optimizer)
    # (torch warns that it overwrites an existing checkpoint even when told to)
    warnings.filterwarnings("ignore", message="Detected an existing checkpoint")
    dcp.save({"model": model_sd, "optim": optim_sd, "amp": amp.state_dict(),
              "step": torch.tensor(step)},
             storage_writer=dcp.FileSystemWriter(folder, overwrite=True))


def load(folder, model, optimizer):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd, "amp": amp.state_dict(),
             "step": torch.tensor(0)}
    dcp.load(state, checkpoint_id=folder)
    set_state_dict(model, optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optim"])
    amp.load_state_dict(state["amp"])
    return int(state["step"])


if __name__ == "__main__":
    result = main()
    if result and not all(math.isfinite(v) for v in result):
        raise SystemExit("non-finite loss")
    # Leave without the interpreter's finalization: on CPU, gloo's worker threads may
    # still hold work objects whose tensors take the GIL during teardown, and a finished
    # process can abort ("terminate called without an active exception").
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
