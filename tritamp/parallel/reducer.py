"""Reducer: gradient all-reduce on demand (Apex's ``apex.parallel.Reducer``)."""
import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from torch.nn import Module

from tritamp.amp.model import master_of
from tritamp.amp.state import overflow_decided_locally, pending_with_masters


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


def _host_group():
    """A group over every rank that all-reduces CPU tensors: the default one where its
    backend takes them (gloo, or a device:backend list naming gloo for the CPU), else a
    gloo group made now (collective: every rank constructs its Reducer)."""
    backend = str(dist.get_backend())
    if "gloo" in backend or dist.get_world_size() == 1:
        return None
    return dist.new_group(backend="gloo")


_NOT_AFTER_AMP = (
    "Reducer.reduce() was called after an amp.scale_loss block exited and before the "
    "optimizer step, with a dynamic loss scale: amp has already decided on this rank alone "
    "whether the step overflowed, so another rank's inf/NaN gradients would reach this "
    "rank through the reduction and be stepped on (and the ranks' loss scales would part). "
    "Call reducer.reduce() inside the scale_loss block, right after backward() (amp then "
    "checks the averaged gradients when the block exits), or pass "
    "overflow_process_group=torch.distributed.group.WORLD to amp.initialize (every rank "
    "then skips when any overflowed). Nothing was reduced.")


_LIST_AFTER_MASTERS = (
    "Reducer.reduce() over a list of tensors was called after an amp.scale_loss block "
    "exited and before the step, with fp32 master weights (O2): the step reads the "
    "masters' gradients, which the list does not hold, so the ranks would step on their "
    "own gradients and part. Call reducer.reduce() inside the scale_loss block, right "
    "after backward(), or build the Reducer from the model (Reducer(model) then averages "
    "the masters' gradients). Nothing was reduced.")


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
            self._flags_group = _host_group()
        else:
            self.module = None
            self.grads = []
            _collect(module_or_grads_list, self.grads)
            for i, t in enumerate(self.grads):
                # (an integer tensor was all-reduced in place, then refused by the average's
                # division: left summed over the ranks; a sparse one failed to flatten)
                if t.layout != torch.strided or not (t.is_floating_point() or t.is_complex()):
                    kind = t.dtype if t.layout == torch.strided else t.layout
                    raise TypeError(f"Reducer averages dense floating-point tensors; tensor "
                                    f"{i} (shape {tuple(t.shape)}) is {kind}: leave it out "
                                    "of the list")

    def reduce(self):
        """Average the gradients over all ranks, in place.

        Module mode: the parameters that have a gradient on any rank; a rank where one has
        none contributes zeros and receives the average (as DistributedDataParallel does
        for a parameter one rank did not use), and a parameter without a gradient on every
        rank keeps none. Which parameters have one is all-reduced first (a flag each, on
        the host: nothing waits for a GPU), so every rank reduces the same tensors."""
        _require_dist()
        world_size = dist.get_world_size()
        if world_size > 1 and overflow_decided_locally():
            raise RuntimeError(_NOT_AFTER_AMP)
        # After a scale_loss exit with master weights the step reads the masters'
        # gradients (unscaled into them at the exit, or left scaled in the half ones for
        # a fused step, which is moved into them here): those are averaged, on every rank
        # alike (a stash's state after an exit is the same on every rank).
        stashes = pending_with_masters() if world_size > 1 else []
        if stashes and self.module is None:
            raise RuntimeError(_LIST_AFTER_MASTERS)
        for stash in stashes:
            stash.unscale_pending()
        if self.module is not None:
            grads = self._module_grads(world_size, masters=bool(stashes))
        else:
            grads = self.grads

        def average(flat):
            dist.all_reduce(flat)
            flat.div_(world_size)

        with torch.no_grad():
            _flat_call(grads, average)

    def _module_grads(self, world_size, masters=False):
        """The gradients of the parameters that have one on any rank (zeros made where
        this rank has none), in the module's parameter order; with ``masters``, a half
        parameter's fp32 master stands for it."""
        params = list(self.module.parameters())
        if masters:
            params = [p if master_of(p) is None else master_of(p) for p in params]
        if world_size == 1:
            return [p.grad.data for p in params if p.grad is not None]
        flags = torch.tensor([p.grad is not None for p in params], dtype=torch.int32)
        dist.all_reduce(flags, group=getattr(self, "_flags_group", None))
        grads = []
        for p, anywhere in zip(params, flags.tolist()):
            if not anywhere:
                continue
            if p.grad is None:
                p.grad = torch.zeros_like(p, memory_format=torch.preserve_format)
            grads.append(p.grad.data)
        return grads
