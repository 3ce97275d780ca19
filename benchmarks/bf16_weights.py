"""bf16 weights without fp32 masters: memory per parameter and loss, beside O2 with masters.

    python -m benchmarks.bf16_weights                  # CPU or the first GPU, 300 steps
    python -m benchmarks.bf16_weights --steps 1000 --json benchmarks/out/bf16_weights.json

An MLP (``--width``, 3 layers) learns a fixed random teacher's labels on synthetic
inputs with ``FusedAdam`` (AdamW) under ``amp.initialize(opt_level="O2",
half_dtype=torch.bfloat16)``, once per mode:

- ``O2 masters``: fp32 master weights (the default), moments fp32;
- ``bf16 nearest``: ``master_weights=False``, updates rounded to nearest;
- ``bf16 stochastic``: ``master_weights=False``, ``stochastic_rounding=True``;
- ``bf16 kahan``: ``master_weights=False``, ``kahan_summation=True``;
- ``bf16 stochastic, bf16 moments``: also ``state_dtype=torch.bfloat16``.

Each row reports the bytes per parameter of the weights and the optimizer state, counted
from the tensors themselves (model weights, masters, moments, compensations; gradients
and step counts left out): 2 + 4 + 8 = 14 with masters, 10 stochastic, 12 Kahan, 6 with
bf16 moments. Then the loss after ``--steps`` steps (the mean over the last 20 steps'
batches), its ratio to the masters run, and the median ms per step. The learning rate
(``--lr``, default 3e-4) leaves most updates below half a bf16 ulp of the weights: the
setting where dropping the masters matters.
"""
import argparse
import json
import os
import statistics
import sys
import time

import torch
from torch import nn

MODES = {
    "O2 masters": (dict(master_weights=True), {}),
    "bf16 nearest": (dict(master_weights=False), {}),
    "bf16 stochastic": (dict(master_weights=False), dict(stochastic_rounding=True, seed=0)),
    "bf16 kahan": (dict(master_weights=False), dict(kahan_summation=True)),
    "bf16 stochastic, bf16 moments": (dict(master_weights=False),
                                      dict(stochastic_rounding=True, seed=0,
                                           state_dtype=torch.bfloat16)),
}
EXPECTED_BYTES = {"O2 masters": 14, "bf16 nearest": 10, "bf16 stochastic": 10,
                  "bf16 kahan": 12, "bf16 stochastic, bf16 moments": 6}


def _mlp(width, classes=10):
    return nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
                         nn.Linear(width, classes))


def _data(width, device, classes=10, n=4096):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(n, width, generator=gen)
    teacher = torch.randn(width, classes, generator=gen)
    y = (x @ teacher).argmax(1)
    return x.to(device), y.to(device)


def bytes_per_param(model, optimizer):
    """(weights + optimizer state bytes) / number of model parameters: every distinct
    tensor the model's parameters, the optimizer's groups (amp's masters) and its state
    hold, counted once (0-d step counts left out)."""
    seen = {}

    def add(t):
        if isinstance(t, torch.Tensor) and t.dim() > 0:
            seen[(t.data_ptr(), t.dtype)] = t.numel() * t.element_size()

    for p in model.parameters():
        add(p)
    for group in optimizer.param_groups:
        for p in group["params"]:
            add(p)
    for st in optimizer.state.values():
        for v in st.values():
            add(v)
    n = sum(p.numel() for p in model.parameters())
    return sum(seen.values()) / n


def run_mode(mode, args, device):
    from tritamp import amp
    from tritamp.optimizers import FusedAdam
    init_kw, opt_kw = MODES[mode]
    torch.manual_seed(0)
    model = _mlp(args.width).to(device)
    opt = FusedAdam(model.parameters(), lr=args.lr, weight_decay=0.01, **opt_kw)
    model, opt = amp.initialize(model, opt, opt_level="O2", half_dtype=torch.bfloat16,
                                loss_scale=1.0, verbosity=0, **init_kw)
    x, y = _data(args.width, device)
    gen = torch.Generator().manual_seed(1)
    losses, times = [], []
    for _ in range(args.steps):
        idx = torch.randint(0, len(x), (args.batch_size,), generator=gen).to(device)
        t0 = time.perf_counter()
        loss = nn.functional.cross_entropy(model(x[idx]).float(), y[idx])
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        losses.append(loss.detach())
    tail = torch.stack(losses[-20:]).float().mean().item()
    return dict(mode=mode, bytes_per_param=bytes_per_param(model, opt),
                expected_bytes=EXPECTED_BYTES[mode], loss=tail,
                ms_per_step=1e3 * statistics.median(times[len(times) // 5:] or times))


def format_table(rows):
    base = next(r["loss"] for r in rows if r["mode"] == "O2 masters")
    lines = ["| mode | bytes/param (weights + state) | loss | loss / masters | ms/step |",
             "|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['mode']} | {r['bytes_per_param']:.2f} | {r['loss']:.4f} | "
                     f"{r['loss'] / base:.3f} | {r['ms_per_step']:.2f} |")
    return "\n".join(lines)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    ap.add_argument("--json", default=None, help="also write the rows here ('-': stdout)")
    args = ap.parse_args(argv)
    # (a batch of 0 or a width of 0 ran: nan losses, or bytes per parameter of the biases)
    for flag in ("steps", "width", "batch_size"):
        if getattr(args, flag) < 1:
            ap.error(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if not (args.lr > 0 and args.lr != float("inf")):
        ap.error(f"--lr must be a finite number > 0, got {args.lr}")
    if args.threads is not None and args.threads < 0:
        ap.error(f"--threads must be >= 0, got {args.threads}")
    return args


def main(argv=None):
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    rows = [run_mode(mode, args, device) for mode in MODES]
    print(f"FusedAdam (AdamW), O2 bf16, MLP width {args.width}, batch {args.batch_size}, "
          f"lr {args.lr}, {args.steps} steps on {device}")
    print(format_table(rows))
    if args.json:
        text = json.dumps(dict(device=str(device), steps=args.steps, width=args.width,
                               lr=args.lr, rows=rows), indent=2)
        if args.json == "-":
            print(text)
        else:
            os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
            with open(args.json, "w") as f:
                f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
