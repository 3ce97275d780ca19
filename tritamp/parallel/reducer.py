"""Reducer: gradient all-reduce on demand (Apex's ``apex.parallel.Reducer``)."""
import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from torch.nn import Module


def _collect(obj, out):
    """Tensors found in ``obj``: a tensor, or any nesting of iterables of tensors."""
    if torch.is_tensor(obj):
        out.append(obj)
        return
    try:
        items = iter(obj)
    except TypeError:
        return
    for item in items:
        _collect(item, out)


def _buckets(tensors):
    """Tensors grouped by (device, dtype), in first-seen order: one flat buffer each."""
    groups = {}
    for t in tensors:
        groups.setdefault((t.device, t.dtype), []).append(t)
    return list(groups.values())


def _flat_call(tensors, call):
    for bucket in _buckets(tensors):
        flat = _flatten_dense_tensors(bucket)
        call(flat)
        for t, synced in zip(bucket, _unflatten_dense_tensors(flat, bucket)):
            t.copy_(synced)


def _require_dist():
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("Reducer needs torch.distributed initialised: call "
                           "torch.distributed.init_process_group first")


class Reducer:
    """All-reduce and average gradients when asked, not during ``backward()``.

    ``Reducer(module)`` broadcasts the module's parameters from rank 0 at construction
    (every rank starts from the same weights) and ``reduce()`` averages the gradients of
    its parameters (those that have one) over the default group. ``Reducer(grads)``, with
    any nesting of lists of tensors, averages exactly those tensors; the caller keeps
    the parameters in sync (it may be built before ``init_process_group``: only
    ``reduce()`` communicates, as in Apex). One flat all-reduce per (device, dtype).

    Example (Apex's ``main_reducer.py``)::

        reducer = Reducer(model)
        loss.backward()
        reducer.reduce()
        optimizer.step()
    """

    def __init__(self, module_or_grads_list):
        if isinstance(module_or_grads_list, Module):
            _require_dist()  # (the broadcast; a list is only collected, as Apex's)
            self.module = module_or_grads_list
            self.grads = None
            with torch.no_grad():
                _flat_call([p.data for p in self.module.parameters()],
                           lambda flat: dist.broadcast(flat, 0))
        else:
            self.module = None
            self.grads = []
            _collect(module_or_grads_list, self.grads)

    def reduce(self):
        """Average the gradients over all ranks, in place."""
        _require_dist()
        if self.module is not None:
            grads = [p.grad.data for p in self.module.parameters() if p.grad is not None]
        else:
            grads = self.grads
        world_size = dist.get_world_size()

        def average(flat):
            dist.all_reduce(flat)
            flat.div_(world_size)

        with torch.no_grad():
            _flat_call(grads, average)
