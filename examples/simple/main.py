"""The three-line change from plain PyTorch to tritamp's amp, runnable on CPU or GPU.

    python examples/simple/main.py --opt-level O2 --half-dtype bf16

The lines marked 1-3 are all that differ from a plain PyTorch training loop (and from
the same script written against Apex, the import and ``half_dtype``, which Apex's
``initialize`` did not have: it chooses bf16).
"""
import argparse

import torch
import torch.nn as nn

from tritamp import amp  # 1. was: from apex import amp


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--opt-level", default="O1", choices=["O0", "O1", "O2", "O3"])
    p.add_argument("--half-dtype", default="fp16", choices=["fp16", "bf16"])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args(argv)
    half = torch.float16 if args.half_dtype == "fp16" else torch.bfloat16

    torch.manual_seed(0)
    device = torch.device(args.device)
    model = nn.Sequential(nn.Linear(32, 64), nn.LayerNorm(64), nn.ReLU(), nn.Linear(64, 4)).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    # 2. one call after building the model and optimizer
    model, optimizer = amp.initialize(model, optimizer, opt_level=args.opt_level, half_dtype=half,
                                      verbosity=0)

    x = torch.randn(256, 32, device=device)
    y = (x[:, :4] > 0).long().argmax(1)
    losses = []
    for step in range(args.steps):
        loss = nn.functional.cross_entropy(model(x), y)
        optimizer.zero_grad()
        with amp.scale_loss(loss, optimizer) as scaled_loss:  # 3. was: loss.backward()
            scaled_loss.backward()
        optimizer.step()
        losses.append(loss.item())
        if step % 5 == 0 or step == args.steps - 1:
            print(f"step {step:3d}  loss {losses[-1]:.4f}")
    return losses


if __name__ == "__main__":
    main()
