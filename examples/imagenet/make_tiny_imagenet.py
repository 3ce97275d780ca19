"""Write a tiny ImageNet-style folder of generated JPEGs, so the examples run offline.

    python examples/imagenet/make_tiny_imagenet.py /tmp/tiny-imagenet
    python examples/imagenet/main_amp.py -a resnet18 -b 4 --crop-size 32 --val-resize 36 \
        --opt-level O2 --half-dtype bf16 --epochs 1 /tmp/tiny-imagenet

Layout (what ``torchvision.datasets.ImageFolder`` reads, as ImageNet's train/val folders)::

    ROOT/train/n00000000/train_0000.JPEG ...
    ROOT/val/n00000000/val_0000.JPEG ...

Each class has its own colour and stripe direction plus per-image noise and jitter, so a
network can learn to tell the classes apart. The same arguments always give the same
bytes (a seeded generator; PIL's JPEG encoder is deterministic).
"""
import argparse
import os

import numpy as np
from PIL import Image


def _class_style(c, rng):
    base = rng.integers(40, 216, size=3)
    horizontal = c % 2 == 0
    period = 4 + (c // 2) % 5
    return base, horizontal, period


def _image(size, style, rng):
    base, horizontal, period = style
    yy, xx = np.mgrid[0:size, 0:size]
    phase = rng.integers(0, period)
    coord = (yy if horizontal else xx) + phase
    stripes = ((coord // max(period // 2, 1)) % 2).astype(np.float32)
    img = base[None, None, :].astype(np.float32) + 50.0 * (stripes[..., None] - 0.5)
    img += rng.normal(0.0, 12.0, size=(size, size, 3))
    return Image.fromarray(np.clip(img, 0, 255).astype(np.uint8), mode="RGB")


def make_tiny_imagenet(root, classes=2, train_per_class=8, val_per_class=4, size=40, seed=0,
                       quality=90):
    """Create ``root/train`` and ``root/val``; returns ``root``. Existing files are replaced."""
    if classes < 1 or train_per_class < 1 or val_per_class < 1:
        raise ValueError("classes, train_per_class and val_per_class must all be >= 1")
    if size < 8:
        raise ValueError(f"size must be >= 8 pixels, got {size}")
    rng = np.random.default_rng(seed)
    styles = [_class_style(c, rng) for c in range(classes)]
    for split, count in (("train", train_per_class), ("val", val_per_class)):
        for c in range(classes):
            folder = os.path.join(root, split, f"n{c:08d}")
            os.makedirs(folder, exist_ok=True)
            for k in range(count):
                _image(size, styles[c], rng).save(os.path.join(folder, f"{split}_{k:04d}.JPEG"),
                                                  format="JPEG", quality=quality)
    return root


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("root", help="output folder (train/ and val/ are created inside)")
    p.add_argument("--classes", type=int, default=2)
    p.add_argument("--train-per-class", type=int, default=8)
    p.add_argument("--val-per-class", type=int, default=4)
    p.add_argument("--size", type=int, default=40, help="image side in pixels (default: 40)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    make_tiny_imagenet(args.root, args.classes, args.train_per_class, args.val_per_class,
                       args.size, args.seed)
    print(f"wrote {args.classes} classes x ({args.train_per_class} train + {args.val_per_class} "
          f"val) {args.size}x{args.size} JPEGs under {args.root}")


if __name__ == "__main__":
    main()
