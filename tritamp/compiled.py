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
- the eager step pays nothing for it: the op is entered only from compiled code.

:func:`register` gives an optimizer its handle and token; :func:`step` is what a step
calls while Dynamo traces it.
"""
import itertools
import weakref

import torch

__all__ = ["register", "step", "optimizer_step"]

_OPTIMIZERS = weakref.WeakValueDictionary()  # handle -> optimizer
_HANDLES = itertools.count(1)


@torch.library.custom_op("tritamp::optimizer_step", mutates_args=("token",))
def optimizer_step(handle: int, token: torch.Tensor) -> None:
    """Run the eager ``step()`` of the optimizer registered under ``handle``."""
    optimizer = _OPTIMIZERS.get(handle)
    if optimizer is None:
        raise RuntimeError(f"tritamp::optimizer_step: no optimizer has handle {handle} (it "
                           "was garbage-collected); compile the step of a live optimizer")
    optimizer.step()  # (which tells torch's LR schedulers that it ran)
    token.add_(1)


@optimizer_step.register_fake
def _(handle, token):
    return None


def register(optimizer):
    """Give ``optimizer`` the handle and token its compiled step passes to the op (once;
    again after unpickling, which drops them)."""
    if _OPTIMIZERS.get(getattr(optimizer, "_tritamp_step_handle", None)) is optimizer:
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


def step(optimizer, closure=None):
    """What ``optimizer.step(closure)`` does while Dynamo traces it: the closure (traced
    as the caller's code), then one call of the op."""
    loss = None
    if closure is not None:
        with torch.enable_grad():
            loss = closure()
    optimizer_step(optimizer._tritamp_step_handle, optimizer._tritamp_step_token)
    return loss
