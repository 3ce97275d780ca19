"""Launch plans for kernels that sweep a list of tensors in one launch.

A plan is a device table of (address, ..., numel) per tensor and a
block -> (tensor, block-within-tensor) map, as in Triton's grouped-GEMM tutorial.
Plans are cached on the tensors' addresses and sizes, so a training loop whose
gradients keep their storage uploads nothing after the first step.
"""
from collections import OrderedDict

import numpy as np
import torch

_PLAN_CACHE_SIZE = 64
_plans: "OrderedDict[tuple, Plan]" = OrderedDict()



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
    """The cached launch plan for ``srcs`` (and their ``dsts`` / ``adds``; None = unused):
    rows of (src address, dst address, addend address, numel)."""
    return plan_columns([srcs, dsts, adds], block)


def plan_columns(columns, block: int) -> Plan:
    """The cached launch plan for parallel lists of tensors.

    ``columns[0]`` gives the sizes; a column that is None repeats ``columns[0]``. The
    table has one row per tensor: the address in each column, then the numel."""
    first = columns[0]
    columns = [first if c is None else c for c in columns]
    key = (block,) + tuple(tuple(t.data_ptr() for t in c) for c in columns) \
        + (tuple(t.numel() for t in first),)
    found = _plans.get(key)
    if found is not None:
        _plans.move_to_end(key)
        return found
    device = first[0].device
    # Built with numpy: host arithmetic on host data, nothing read back from a device.
    meta = np.array(list(zip(*key[1:])), dtype=np.int64).reshape(len(first), len(columns) + 1)
    per_tensor = (meta[:, -1] + block - 1) // block
    total = int(per_tensor.sum())
    starts = np.cumsum(per_tensor) - per_tensor
    tensor_idx = np.repeat(np.arange(len(first), dtype=np.int32), per_tensor)
    block_idx = (np.arange(total, dtype=np.int64) - np.repeat(starts, per_tensor)).astype(np.int32)
    blocks = np.ascontiguousarray(np.stack([tensor_idx, block_idx], axis=1))
    result = Plan(_upload(torch.from_numpy(meta), device), _upload(torch.from_numpy(blocks), device),
                  total)
    _plans[key] = result
    if len(_plans) > _PLAN_CACHE_SIZE:
        _plans.popitem(last=False)
    return result


def check_lists(op, params, fp32=(), **lists):
    """Every list given (None = absent) holds one tensor per parameter; the lists named
    in ``fp32`` (optimizer state) are float32."""
    n = len(params)
    for name, other in lists.items():
        if other is not None and len(other) != n:
            raise ValueError(f"{op}: {name} has {len(other)} tensors but params has {n}; "
                             "every list needs the same length, one tensor per parameter")
    for name in fp32:
        if lists[name] is not None and any(t.dtype != torch.float32 for t in lists[name]):
            raise ValueError(f"{op}: {name} must be float32 (optimizer state is kept in fp32)")


def dtype_groups(params, grads, copies):
    """Indices of the non-empty parameters grouped by (device, parameter dtype, gradient
    dtype, copy dtype or None): one launch each."""
    groups = {}
    for i, p in enumerate(params):
        if p.numel() == 0:
            continue
        key = (p.device, p.dtype, grads[i].dtype, None if copies is None else copies[i].dtype)
        groups.setdefault(key, []).append(i)
    return groups


def clear_plans():
    _plans.clear()
