"""Which gradients overflowed: per-parameter counts gathered on skipped steps only.

At ``scale_loss``'s exit, once the overflow flag is final, amp launches
:func:`tritamp.kernels.overflow.count_nonfinite` over the gradients it checked: every
program reads the flag and returns at once on a clean step, so only a skipped step makes
the second pass that counts each gradient's inf/NaN values (on a CPU the flag is read
from host memory and nothing is launched on a clean step). The counts accumulate on the
device in a :class:`Ledger` (one per optimizer and gradient layout) until the loss
scaler's skip report reads them: that report already knows the step was skipped, so the
read (a host sync) happens on skipped steps only, at most once every
:data:`DETAIL_INTERVAL_S` seconds.

:func:`nonfinite_gradients` answers the same question on demand for any optimizer's
current ``.grad`` (a host sync), naming parameters by module path when amp knows them
and by ``param_groups[g][i]`` with their shape otherwise.
"""
import time

import torch

from tritamp.kernels.overflow import count_nonfinite, count_nonfinite_launch, \
    count_nonfinite_prepare
from tritamp.kernels.engine import borrowed
from tritamp.sharding import locals_of

__all__ = ["Ledger", "nonfinite_gradients", "DETAIL_INTERVAL_S", "MAX_NAMES"]

DETAIL_INTERVAL_S = 10.0  # at most one list of names per scaler in this many seconds
MAX_NAMES = 8             # names in one warning (the rest are counted)


def _model_of(stash):
    """{id(fp32 master): the half model parameter it feeds} of an amp stash (or None)."""
    return {} if stash is None else dict(zip(map(id, stash.masters), stash.model_params))


class Ledger:
    """Device counts of non-finite values, one per parameter an optimizer's amp stash
    checks (``names``), for its whole life: whichever gradients are present, the counts
    land at their parameter's position, so nothing counted is lost when the set of
    gradients changes. The sweep that fills them covers the present, dense gradients
    (positions ``keep``, decided under ``layout``) and is prepared again when they move
    (kept under their addresses, ``key``)."""
    __slots__ = ("names", "keep", "layout", "counts", "prepared", "key")

    def __init__(self, names, device):
        self.names = names
        self.keep = None
        self.layout = None  # the gradients' strides (None where absent): what keep follows
        self.counts = torch.zeros(len(names), dtype=torch.int32, device=device)
        self.prepared = None
        self.key = None

    def count(self, grads, key, found_inf, triton):
        """Add this step's counts of ``grads`` (the full checked list, under layout key
        ``key``). On the Triton path the device decides (nothing on a clean step); the
        CPU path is called on a skipped step only (the caller read the flag)."""
        kept = [grads[i] for i in self.keep]
        if triton:
            if self.key != key and not self._rebound(kept, key):
                # borrowed: the sweep does not keep the gradients alive (the key holds
                # their addresses)
                self.prepared = count_nonfinite_prepare(borrowed(kept), self.keep)
            self.key = key
            self.launch(found_inf)
        else:
            count_nonfinite(kept, self.counts, found_inf, self.keep)

    def _rebound(self, kept, key):
        """The kept sweep over this step's gradients when only their addresses changed
        (the same layout, so the same positions, shapes and dtypes): their addresses go
        into its tables, nothing is validated or planned again. On a GPU the gradients
        land at other addresses every step; without this the count was prepared anew at
        every step the skip warning was enabled for (verbosity 1, the default)."""
        prepared = self.prepared
        if prepared is None or self.key is None or self.key[1] != key[1] \
                or not prepared.prepared.rebindable:
            return False
        addresses = [key[0][i] for i in self.keep]
        if not prepared.prepared.rebind("srcs", kept, addresses=addresses):
            return False  # (an address off the alignment its kernel was specialised for)
        prepared.lists["srcs"] = None  # (no reference kept between steps)
        return True

    def launch(self, found_inf):
        """The prepared count over the same gradients as the last :meth:`count`."""
        count_nonfinite_launch(self.prepared, self.counts, found_inf)

    def take(self):
        """[(name, count)] of the gradients with non-finite values since the last take
        (reads the device), and zero the counts."""
        counts = self.counts.tolist()
        if any(counts):
            self.counts.zero_()
        return [(n, c) for n, c in zip(self.names, counts) if c]


def param_names(models, optimizers):
    """{id(parameter): name}: module paths over ``models`` (``model1.`` prefixes when there
    are several), else ``param_groups[g][i] (shape [..])`` of the optimizer that holds it
    (an fp32 master stands for its half model parameter)."""
    names = {}
    for i, model in enumerate(models):
        prefix = f"model{i}." if len(models) > 1 else ""
        for name, p in model.named_parameters():
            names.setdefault(id(p), prefix + name)
    for opt in optimizers:
        model_of = _model_of(getattr(opt, "_amp_stash", None))
        for g, group in enumerate(opt.param_groups):
            for i, p in enumerate(group["params"]):
                holder = model_of.get(id(p), p)
                names.setdefault(id(holder), f"param_groups[{g}][{i}] (shape {list(p.shape)})")
    return names


def describe(found, rank):
    """The part of the skip warning that names what overflowed."""
    found = sorted(found, key=lambda nc: -nc[1])
    shown = ", ".join(f"{n} ({c} value{'s' if c != 1 else ''})" for n, c in found[:MAX_NAMES])
    more = f", and {len(found) - MAX_NAMES} more" if len(found) > MAX_NAMES else ""
    return f"; non-finite gradients on rank {rank}: {shown}{more}"


def rank():
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return 0


class Details:
    """A scaler's rate limit on the lists of names."""
    __slots__ = ("last",)

    def __init__(self):
        self.last = None

    def due(self):
        now = time.monotonic()
        if self.last is not None and now - self.last < DETAIL_INTERVAL_S:
            return False
        self.last = now
        return True


@torch.no_grad()
def nonfinite_gradients(optimizer):
    """[(name, count)] of the parameters of ``optimizer`` whose ``.grad`` holds inf or NaN
    values now, most first. Names are module paths when the optimizer went through
    ``amp.initialize``, else ``param_groups[g][i] (shape [..])``. Reads every gradient
    and the counts back to the host: a debugging call (after a skipped step, before
    ``zero_grad``), not one for every step. With DTensor gradients (FSDP2) each rank
    counts its own shards, as the skip warning does."""
    stash = getattr(optimizer, "_amp_stash", None)
    names = getattr(stash, "param_names", None) or {}
    model_of = _model_of(stash)
    named, grads = [], []
    for g, group in enumerate(optimizer.param_groups):
        for i, p in enumerate(group["params"]):
            model = model_of.get(id(p))  # an fp32 master's half model parameter
            holder = p if p.grad is not None or model is None else model
            if holder.grad is None:
                continue
            name = names.get(id(model if model is not None else p)) or \
                f"param_groups[{g}][{i}] (shape {list(p.shape)})"
            named.append(name)
            grads.append(holder.grad)
    if not grads:
        return []
    counts = torch.stack([(~torch.isfinite(x)).sum() for x in locals_of(grads)]).tolist()
    return sorted(((n, c) for n, c in zip(named, counts) if c), key=lambda nc: -nc[1])
