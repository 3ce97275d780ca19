"""Data of the ImageNet examples: the ImageFolder datasets and their transforms, uint8
collation, the (distributed) loaders and ``DevicePrefetcher``, which moves batches to the
device and normalises them there (on a side stream on CUDA)."""
import os
import sys
from functools import partial

import numpy as np
import torch
import torchvision.datasets as datasets
import torchvision.transforms as transforms

# ImageNet's channel statistics on the 0..255 scale: batches travel as uint8 and are
# normalised on the device.
MEAN = (0.485 * 255, 0.456 * 255, 0.406 * 255)
STD = (0.229 * 255, 0.224 * 255, 0.225 * 255)


def fast_collate(batch, channels_last=False):
    """PIL images -> one uint8 NCHW tensor (normalisation happens on the device).

    Stacking the HWC arrays gives NHWC memory, which is NCHW in channels-last layout;
    ``.contiguous()`` makes it plain NCHW unless channels-last was asked for.
    """
    arrays = np.stack([np.asarray(img, dtype=np.uint8) for img, _ in batch])
    if arrays.ndim == 3:                       # greyscale images from a custom loader
        arrays = np.repeat(arrays[..., None], 3, axis=-1)
    tensor = torch.from_numpy(arrays).permute(0, 3, 1, 2)
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    targets = torch.tensor([target for _, target in batch], dtype=torch.int64)
    return tensor.contiguous(memory_format=fmt), targets


def make_datasets(args):
    traindir = os.path.join(args.data, "train")
    valdir = os.path.join(args.data, "val")
    for d in (traindir, valdir):
        if not os.path.isdir(d):
            sys.exit(f"{d} is not a directory: DIR must hold train/ and val/, each with one "
                     f"folder of images per class (make_tiny_imagenet.py DIR writes a small one)")
    train_dataset = datasets.ImageFolder(traindir, transforms.Compose([
        transforms.RandomResizedCrop(args.crop_size),
        transforms.RandomHorizontalFlip(),
    ]))
    val_dataset = datasets.ImageFolder(valdir, transforms.Compose([
        transforms.Resize(args.val_resize),
        transforms.CenterCrop(args.crop_size),
    ]))
    if val_dataset.classes != train_dataset.classes:
        sys.exit(f"{traindir} and {valdir} must hold the same class folders")
    return train_dataset, val_dataset


def make_loaders(train_dataset, val_dataset, args, channels_last=False):
    train_sampler = val_sampler = None
    if args.distributed:
        train_sampler = torch.utils.data.distributed.DistributedSampler(train_dataset)
        val_sampler = torch.utils.data.distributed.DistributedSampler(val_dataset, shuffle=False)
    collate = partial(fast_collate, channels_last=channels_last)
    pin = args.device.type == "cuda"
    train_loader = torch.utils.data.DataLoader(
        train_dataset, batch_size=args.batch_size, shuffle=(train_sampler is None),
        num_workers=args.workers, pin_memory=pin, sampler=train_sampler, collate_fn=collate)
    val_loader = torch.utils.data.DataLoader(
        val_dataset, batch_size=args.batch_size, shuffle=False,
        num_workers=args.workers, pin_memory=pin, sampler=val_sampler, collate_fn=collate)
    return train_loader, val_loader, train_sampler


class DevicePrefetcher:
    """Yields (input, target) on the device, input normalised in ``dtype``.

    On CUDA the copy and normalisation of the next batch run on a side stream while the
    current one trains; elsewhere the batch is prepared when it is asked for.
    """

    def __init__(self, loader, device, dtype=torch.float32):
        self.loader = iter(loader)
        self.device = device
        self.dtype = dtype
        self.mean = torch.tensor(MEAN, device=device, dtype=dtype).view(1, 3, 1, 1)
        self.std = torch.tensor(STD, device=device, dtype=dtype).view(1, 3, 1, 1)
        self.stream = None
        if device.type == "cuda":
            self.stream = torch.cuda.Stream(device)
            # mean/std were written on the current stream; the side stream reads them.
            self.stream.wait_stream(torch.cuda.current_stream(device))
        self.next_batch = None
        self._preload()

    def _prepare(self, inp, target):
        inp = inp.to(self.device, non_blocking=True)
        target = target.to(self.device, non_blocking=True)
        # .to(dtype) keeps the memory format (channels-last stays channels-last).
        inp = inp.to(self.dtype).sub_(self.mean).div_(self.std)
        return inp, target

    def _preload(self):
        try:
            inp, target = next(self.loader)
        except StopIteration:
            self.next_batch = None
            return
        if self.stream is None:
            self.next_batch = self._prepare(inp, target)
        else:
            with torch.cuda.stream(self.stream):
                self.next_batch = self._prepare(inp, target)

    def __iter__(self):
        return self

    def __next__(self):
        if self.stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self.stream)
        batch = self.next_batch
        if batch is None:
            raise StopIteration
        if self.stream is not None:
            # The caching allocator must not hand these blocks back to the side stream
            # while the main stream still uses them.
            for t in batch:
                t.record_stream(torch.cuda.current_stream(self.device))
        self._preload()
        return batch
