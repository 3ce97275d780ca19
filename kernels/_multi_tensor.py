"""Launch plans for kernels that sweep a list of tensors in one launch.

A plan is a device table of (address, address, address, numel) per tensor and a
block -> (tensor, block-within-tensor) map, as in Triton's grouped-GEMM tutorial.
Plans are cached on the tensors' addresses and sizes, so a training loop whose
gradients keep their storage uploads nothing after the first step.
"""
from collections import OrderedDict

import torch

_PLAN_CACHE_SIZE = 64
_plans: "OrderedDict[tuple, Plan]" = OrderedDict()

META_COLUMNS = 4  # src address, dst address, addend address, numel


class Plan:
    __slots__ = ("meta", "blocks", "n_blocks")

    def __init__(self, meta, blocks, n_blocks):
        self.meta = meta          # int64 [n_tensors, 4] on the tensors' device
        self.blocks = blocks      # int32 [n_blocks, 2]: tensor index, block index in it
        self.n_blocks = n_blocks


def _upload(array: torch.Tensor, device: torch.device) -> torch.Tensor:
    if device.type == "cuda":
        return array.pin_memory().to(device, non_blocking=True)
    return array.to(device)


def plan(srcs, dsts, adds, block: int) -> Plan:
    """The cached launch plan for ``srcs`` (and their ``dsts`` / ``adds``; None = unused)."""
    dsts = srcs if dsts is None else dsts
    adds = srcs if adds is None else adds
    key = (block,
           tuple(t.data_ptr() for t in srcs),
           tuple(t.data_ptr() for t in dsts),
           tuple(t.data_ptr() for t in adds),
           tuple(t.numel() for t in srcs))
    found = _plans.get(key)
    if found is not None:
        _plans.move_to_end(key)
        return found
    device = srcs[0].device
    meta = torch.tensor(list(zip(key[1], key[2], key[3], key[4])), dtype=torch.int64)
    numels = meta[:, 3]
    per_tensor = (numels + block - 1) // block
    total = int(per_tensor.sum())
    tensor_idx = torch.repeat_interleave(torch.arange(len(srcs), dtype=torch.int32), per_tensor)
    starts = torch.cumsum(per_tensor, 0) - per_tensor
    block_idx = torch.arange(total, dtype=torch.int64) - torch.repeat_interleave(starts, per_tensor)
    blocks = torch.stack([tensor_idx, block_idx.to(torch.int32)], dim=1).contiguous()
    result = Plan(_upload(meta, device), _upload(blocks, device), total)
    _plans[key] = result
    if len(_plans) > _PLAN_CACHE_SIZE:
        _plans.popitem(last=False)
    return result


def clear_plans():
    _plans.clear()
