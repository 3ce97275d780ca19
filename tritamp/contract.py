"""The step contract: what a loss scaler hands a fused optimizer for one step, and what
the optimizer reports back.

Every tritamp fused optimizer owns one :class:`StepHandoff` (``optimizer.step_handoff``).
A driver fills it before ``optimizer.step()``:

- ``tritamp.amp`` (as ``optimizer.step()`` begins, from what ``scale_loss`` recorded)
  hands the step its state (:class:`StepState`):
  ``SCALED`` when this backward's gradients still carry ``grad_scale`` (the step unscales
  them as it reads them), ``UNSCALED`` when amp already unscaled them; with a dynamic
  loss scale also ``found_inf``, the 0-d device flag of this backward's overflow check.
  Once, at ``amp.initialize`` (O2), amp registers its fp32 masters and the half model
  parameters they feed (:class:`MasterPairs`): the step reads a master's gradient from its
  model parameter while the master has none, and writes the model parameter in the same
  pass.
- ``torch.amp.GradScaler`` speaks torch's own protocol: it sets ``optimizer.grad_scale``
  and ``optimizer.found_inf`` before the step (the optimizer declares
  ``_step_supports_amp_scaling``). The optimizer turns that into the same handoff
  (:meth:`StepHandoff.take`): ``SCALED``, and ``write_grads=True`` because torch's fused
  optimizers leave the unscaled gradients in ``.grad``.

The optimizer reports back by moving the handoff to ``STEPPED``. Whether the step was
skipped is decided on the device, with no host sync: the step changed nothing where
``found_inf`` is non-zero (:attr:`StepHandoff.skipped` is that flag, or None when nothing
was checked). The driver then returns the handoff to ``READY`` (amp does, also when the
step raised); under torch's GradScaler it stays ``STEPPED`` until the next step.

torch's own optimizers have no handoff; ``tritamp.amp`` drives them through torch's
protocol (``grad_scale`` / ``found_inf`` attributes for ``fused=True`` ones, one host read
of ``found_inf`` for the others, as Apex did). See docs/step-contract.md.
"""
import enum

import torch

__all__ = ["StepState", "MasterPairs", "StepHandoff", "LastStep", "handoff_of"]


class StepState(enum.Enum):
    """Where one optimizer step stands (torch's GradScaler keeps an ``OptState`` alike)."""

    READY = "ready"
    """Nothing handed over: the step reads ``.grad`` as it is (unscaled, never skipped)."""
    SCALED = "scaled"
    """The gradients still carry ``grad_scale``; the step unscales them as it reads them."""
    UNSCALED = "unscaled"
    """The gradients were unscaled by the driver (into the masters' ``.grad`` at O2)."""
    STEPPED = "stepped"
    """The optimizer consumed the handoff (skipped on the device where ``found_inf`` != 0)."""


class MasterPairs:
    """fp32 master parameters (in the optimizer's ``param_groups``) and the half model
    parameters they feed, registered by ``tritamp.amp`` at O2. ``version`` moves on every
    change, so an optimizer may cache what it derives from the pairs."""

    __slots__ = ("_model_of", "version")

    def __init__(self):
        self._model_of = {}
        self.version = 0

    def add(self, master, model):
        """Pair fp32 ``master`` with the half ``model`` parameter it feeds."""
        if not isinstance(master, torch.Tensor) or not isinstance(model, torch.Tensor):
            raise TypeError(f"MasterPairs.add takes two tensors, got {type(master).__name__} "
                            f"and {type(model).__name__}")
        if master.dtype != torch.float32:
            raise TypeError(f"master must be float32, got {master.dtype}: the master is the "
                            "fp32 copy the optimizer updates")
        if master.shape != model.shape:
            raise ValueError(f"master of shape {tuple(master.shape)} cannot feed a model "
                             f"parameter of shape {tuple(model.shape)}")
        self._model_of[id(master)] = (master, model)
        self.version += 1

    def model_of(self, master):
        """The half model parameter ``master`` feeds, or None for any other tensor."""
        pair = self._model_of.get(id(master))
        return pair[1] if pair is not None and pair[0] is master else None

    def __len__(self):
        return len(self._model_of)

    def __iter__(self):
        """(master, model) pairs, in the order they were added."""
        return iter(list(self._model_of.values()))


class LastStep:
    """The overflow flag of an optimizer's last step.

    ``flag()`` is the 0-d device flag the step read (non-zero: it was skipped), or None
    when nothing was checked (it ran); ``skipped()`` reads it (a host sync).

    A driver that hands the step one of its own reusable slots (``tritamp.amp``'s loss
    scaler) records it with :meth:`record` and an ``owner``: the record then keeps the
    owner's token instead of the tensor, ``flag()`` asks ``owner.flag_of(token)``, and the
    owner calls :meth:`detach_from` (the record takes its own copy) before the flag could
    be lost. The scaler keeps a step's flag readable for one more update on the device
    (its ``PREV_FOUND`` slot), so a training loop pays no copy for this."""
    __slots__ = ("found_inf", "owner", "token")

    def __init__(self):
        self.found_inf = None
        self.owner = None
        self.token = None

    def record(self, found_inf, owner=None):
        """The last step read ``found_inf``, a slot of ``owner`` (or None: its own)."""
        if self.owner is not None:
            self.owner.untrack(self)
        self.found_inf = found_inf
        self.owner = owner if found_inf is not None else None
        self.token = None if self.owner is None else self.owner.track(self)

    def flag(self):
        """The 0-d device flag of the last step, or None."""
        if self.owner is None:
            return self.found_inf
        return self.owner.flag_of(self.token)

    def detach_from(self, owner):
        """``owner`` is about to lose the flag: keep a copy of it."""
        if self.owner is owner:
            self.found_inf = self.flag().clone()
            owner.untrack(self)
            self.owner = self.token = None

    def skipped(self):
        """Whether the last step was skipped (reads the device flag: a host sync)."""
        flag = self.flag()
        return flag is not None and bool(flag)


class StepHandoff:
    """What a driver hands an optimizer for one step (see the module docstring).

    Attributes: ``state`` (:class:`StepState`), ``grad_scale`` (0-d fp32 device tensor the
    gradients carry, with ``SCALED``; else None), ``found_inf`` (0-d device overflow flag
    or None: the step changes nothing where it is non-zero), ``write_grads`` (leave the
    unscaled gradients in ``.grad``: torch's GradScaler protocol), ``masters``
    (:class:`MasterPairs`), ``last_step`` (:class:`LastStep`: the flag the last step read,
    kept after :meth:`reset`)."""

    __slots__ = ("state", "grad_scale", "found_inf", "write_grads", "masters", "last_step")

    def __init__(self):
        self.state = StepState.READY
        self.grad_scale = None
        self.found_inf = None
        self.write_grads = False
        self.masters = MasterPairs()
        self.last_step = LastStep()

    def hand(self, state, grad_scale=None, found_inf=None, write_grads=False):
        """A driver hands the next step over. ``SCALED`` needs ``grad_scale``; ``UNSCALED``
        takes none; ``found_inf`` is optional (a static scale is never checked)."""
        if state is StepState.SCALED:
            if not isinstance(grad_scale, torch.Tensor):
                raise TypeError("StepState.SCALED needs grad_scale, the 0-d tensor the "
                                f"gradients carry; got {type(grad_scale).__name__}")
        elif state is StepState.UNSCALED:
            if grad_scale is not None:
                raise ValueError("StepState.UNSCALED gradients carry no scale: pass "
                                 "grad_scale=None, or hand StepState.SCALED")
        else:
            raise ValueError(f"a driver hands StepState.SCALED or StepState.UNSCALED, got "
                             f"{state}")
        if found_inf is not None and not isinstance(found_inf, torch.Tensor):
            raise TypeError(f"found_inf must be a device tensor or None, got "
                            f"{type(found_inf).__name__}")
        self.state = state
        self.grad_scale = grad_scale
        self.found_inf = found_inf
        self.write_grads = bool(write_grads)

    def take(self, optimizer):
        """The optimizer, at the start of its step: ``(state, grad_scale, found_inf,
        write_grads)``. A handoff filled by a driver is taken as it is; otherwise torch's
        protocol (``optimizer.grad_scale`` / ``optimizer.found_inf``, set by
        ``torch.amp.GradScaler``) is turned into one; otherwise ``READY``."""
        state = self.state
        if state is StepState.SCALED or state is StepState.UNSCALED:
            return state, self.grad_scale, self.found_inf, self.write_grads
        grad_scale = getattr(optimizer, "grad_scale", None)
        found_inf = getattr(optimizer, "found_inf", None)
        if grad_scale is not None:
            self.state, self.grad_scale, self.found_inf = StepState.SCALED, grad_scale, found_inf
            self.write_grads = True
            return StepState.SCALED, grad_scale, found_inf, True
        if found_inf is not None:  # torch's protocol after its own unscale_()
            self.state, self.grad_scale, self.found_inf = StepState.UNSCALED, None, found_inf
            self.write_grads = False
            return StepState.UNSCALED, None, found_inf, False
        self.state, self.grad_scale, self.found_inf, self.write_grads = \
            StepState.READY, None, None, False
        return StepState.READY, None, None, False

    def stepped(self):
        """The optimizer reports the step taken (skipped on the device where
        ``found_inf`` != 0). A flag handed by ``torch.amp.GradScaler`` (a new tensor every
        step) is recorded as the last step's; a driver that hands its own reusable slots
        (``tritamp.amp``) records its flag itself (:meth:`LastStep.record`)."""
        self.state = StepState.STEPPED
        if self.last_step.owner is None:
            self.last_step.found_inf = self.found_inf

    @property
    def skipped(self):
        """After ``STEPPED``: the 0-d device flag that says the step changed nothing
        (non-zero), or None when nothing was checked. Reading it on the host syncs."""
        return self.found_inf if self.state is StepState.STEPPED else None

    def reset(self):
        """Back to ``READY`` (the driver, once it has read the outcome)."""
        self.state = StepState.READY
        self.grad_scale = None
        self.found_inf = None
        self.write_grads = False

    def __repr__(self):
        return (f"StepHandoff(state={self.state.name}, grad_scale={self.grad_scale!r}, "
                f"found_inf={self.found_inf!r}, write_grads={self.write_grads}, "
                f"masters={len(self.masters)})")


def handoff_of(optimizer):
    """``optimizer``'s :class:`StepHandoff` when it speaks the contract (tritamp's fused
    optimizers, or a wrapper that exposes its inner optimizer's), else None."""
    h = getattr(optimizer, "step_handoff", None)
    return h if isinstance(h, StepHandoff) else None
