"""Whether a step was skipped: :func:`last_step_skipped`."""
from tritamp.contract import handoff_of

from .state import _amp_state

__all__ = ["last_step_skipped"]


def _record_of(optimizer):
    stash = getattr(optimizer, "_amp_stash", None)
    if stash is not None:
        return stash.last_step
    handoff = handoff_of(optimizer)
    if handoff is not None:
        return handoff.last_step
    return None


def last_step_skipped(optimizer=None):
    """Whether the last ``optimizer.step()`` was skipped because its gradients overflowed.

    ``optimizer``: one passed to ``amp.initialize`` (any optimizer), or a tritamp fused
    optimizer driven by ``torch.amp.GradScaler``. ``None``: whether the last step of any
    optimizer the last ``amp.initialize`` processed was skipped.

    The skip is decided on the device; answering reads the overflow flag the step used, so
    this call synchronises with the device (call it when you need the answer, not on
    every step). A step that checked nothing (a static loss scale, or a step without a
    scaler) was not skipped; an optimizer that has not stepped yet has not skipped."""
    if optimizer is None:
        optimizers = list(_amp_state.optimizers)
        if not optimizers:
            raise RuntimeError("last_step_skipped(): the last amp.initialize processed no optimizer; "
                               "pass the optimizer, e.g. last_step_skipped(optimizer)")
        return any(_record_of(o).skipped() for o in optimizers)
    record = _record_of(optimizer)
    if record is None:
        raise TypeError(
            f"last_step_skipped: a {type(optimizer).__name__} keeps no record of its steps; "
            "pass an optimizer returned by amp.initialize, or a tritamp fused optimizer "
            "(tritamp.optimizers) driven by torch.amp.GradScaler")
    return record.skipped()
