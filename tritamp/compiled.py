"""An optimizer step under ``torch.compile``: one custom op, ``tritamp::optimizer_step``.

``torch.compile(optimizer.step, fullgraph=True)`` traces, for a tritamp fused optimizer
(and for any optimizer that went through ``amp.initialize``), one call of this op and
nothing else. Its implementation runs the optimizer's eager step: the same kept sweeps,
Triton launches on a GPU and the production CPU path on a CPU, amp's handoff of
``grad_scale`` / ``found_inf``, read on the device. So

- nothing of the step is traced: no ``.item()`` to break the graph, no hyperparameter
  baked into it. The learning rate stays a plain float in the parameter group, read by
  the step when it runs: an LR scheduler changing it every step causes no recompile;
- the graph holds one node: the op names the optimizer by a handle (an int) and
  mutates a one-element token tensor kept by the optimizer, so that the compiler keeps
  the call and orders it (its parameters and state are the optimizer's own, not
  graph values: read them after the compiled step returns, not inside the same
  compiled region);
- the eager step pays nothing for it: the op is entered only from compiled code;
- the op also takes the gradients the step reads, as the compiled code holds them. A
  compiled region may hand its writes to a gradient (a clip or a scaling before the step
  in the same region) to ``.grad`` only when it returns, after the op ran: where the
  compiled code holds a gradient in a buffer of its own, the op first copies it into
  ``.grad``, so the step reads the region's values. Under amp (whose own state the region
  also hands over only when it returns) and where a gradient was replaced or set to None,
  the op refuses instead: nothing is stepped, and the region's writes are not made.

:func:`register` gives an optimizer its handle and token; :func:`step` is what a step
calls while Dynamo traces it.
"""
import itertools
import operator
import weakref
from typing import Optional

import torch

from tritamp.sharding import local

__all__ = ["register", "refresh", "step", "optimizer_step"]

_OPTIMIZERS = weakref.WeakValueDictionary()  # handle -> optimizer
_HANDLES = itertools.count(1)


@torch.library.custom_op("tritamp::optimizer_step", mutates_args=("token",))
def optimizer_step(handle: int, token: torch.Tensor,
                   grads: list[Optional[torch.Tensor]]) -> None:
    """Run the eager ``step()`` of the optimizer registered under ``handle``, once
    ``grads`` (what the compiled code holds as the gradients of :func:`_grad_holders`)
    are the tensors ``.grad`` holds."""
    optimizer = _OPTIMIZERS.get(handle)
    if optimizer is None:
        raise RuntimeError(f"tritamp::optimizer_step: no optimizer has handle {handle} (it "
                           "was garbage-collected); compile the step of a live optimizer")
    _check_grads(optimizer, grads)
    optimizer.step()  # (which tells torch's LR schedulers that it ran)
    token.add_(1)


@optimizer_step.register_fake
def _(handle, token, grads):
    return None


_grad_of = operator.attrgetter("grad")


def _grad_holders(optimizer):
    """The tensors whose ``.grad`` a step reads: the optimizer's parameters, and amp's
    half model parameters whose gradients its masters read (O2)."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    stash = getattr(optimizer, "_amp_stash", None)
    if stash is not None:
        params += stash.model_params
    return params


def refresh(optimizer):
    """Keep the list of :func:`_grad_holders` that a compiled step reads the gradients of
    (``optimizer._tritamp_step_params``, changed in place: the compiled code's guards on
    it then compile the step anew) after the parameters changed (``add_param_group``,
    amp's masters)."""
    kept = getattr(optimizer, "_tritamp_step_params", None)
    if kept is not None:
        kept[:] = _grad_holders(optimizer)


def _check_grads(optimizer, grads):
    holders = _grad_holders(optimizer)
    kept = optimizer._tritamp_step_params
    if len(holders) != len(kept) or len(grads) != len(kept) \
            or not all(map(operator.is_, holders, kept)):
        kept[:] = holders  # (the next call compiles the step anew)
        raise RuntimeError(
            "tritamp::optimizer_step: the optimizer's parameters changed after its step "
            "was compiled (param_groups edited in place); nothing was stepped. Call the "
            "compiled step again: it compiles anew for the parameters it has now (or add "
            "parameters with optimizer.add_param_group, which says so at once).")
    if all(map(operator.is_, map(_grad_of, holders), grads)):
        return  # (the usual call: the compiled code hands .grad's own tensors)
    amp_driven = getattr(optimizer, "_amp_stash", None) is not None
    copies = []  # (made after every gradient was checked: a refusal writes nothing)
    for i, (p, g) in enumerate(zip(holders, grads)):
        now = p.grad
        if g is None and now is None:
            continue
        if g is not None and now is not None and g.shape == now.shape \
                and g.dtype == now.dtype:
            if local(g).data_ptr() == local(now).data_ptr():
                continue
            if not amp_driven:
                # the region wrote this gradient into a buffer of its own, handed to .grad
                # when it returns: step on the region's values (a copy on the device)
                copies.append((now, g))
                continue
        raise RuntimeError(
            f"tritamp::optimizer_step: the gradient of parameter {i} was changed earlier in "
            "the same compiled region (replaced or set to None, or, under amp, clipped, "
            "scaled or unscaled by amp.master_params): a compiled region hands such changes "
            "to .grad and to amp's state only when it returns, after the step. Nothing was "
            "stepped, and the region's writes were not made. Change the gradients in eager "
            "code or in a compiled region of their own, and compile the step by itself: "
            "torch.compile(optimizer.step).")
    for now, g in copies:
        now.copy_(g)


def register(optimizer):
    """Give ``optimizer`` the handle and token its compiled step passes to the op (once;
    again after unpickling, which drops them)."""
    if _OPTIMIZERS.get(getattr(optimizer, "_tritamp_step_handle", None)) is optimizer:
        refresh(optimizer)
        return
    handle = next(_HANDLES)
    _OPTIMIZERS[handle] = optimizer
    device = None
    for group in optimizer.param_groups:
        for p in group["params"]:
            device = p.device
            break
        if device is not None:
            break
    optimizer._tritamp_step_handle = handle
    optimizer._tritamp_step_token = torch.zeros(1, dtype=torch.int64, device=device)
    optimizer._tritamp_step_params = _grad_holders(optimizer)


def step(optimizer, closure=None):
    """What ``optimizer.step(closure)`` does while Dynamo traces it: the closure (traced
    as the caller's code), then one call of the op."""
    loss = None
    if closure is not None:
        with torch.enable_grad():
            loss = closure()
    # (the kept list, not param_groups: reading the groups would guard on their
    # learning rates, and a scheduler changing one would compile the step again)
    optimizer_step(optimizer._tritamp_step_handle, optimizer._tritamp_step_token,
                   [p.grad for p in optimizer._tritamp_step_params])
    return loss
