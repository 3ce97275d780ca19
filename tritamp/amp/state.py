"""Process-wide amp state, as in Apex: one ``initialize`` configures the loss scalers
that ``scale_loss`` and ``state_dict`` then use."""
import logging
import weakref

import torch

logger = logging.getLogger("tritamp.amp")


class AmpState:
    def __init__(self):
        self.opt_properties = None     # Properties once initialize has run
        self.loss_scalers = []
        self.verbosity = 1
        self.optimizers = weakref.WeakSet()  # the optimizers of the last initialize


_amp_state = AmpState()


def loss_scalers():
    """The loss scalers of the last ``amp.initialize`` (one per loss; empty before it,
    or when amp is disabled)."""
    return list(_amp_state.loss_scalers)


def overflow_decided_locally():
    """Whether a ``scale_loss`` block has exited since the last step with a dynamic loss
    scale whose overflow flag was not reduced across ranks (no ``overflow_process_group``):
    the pending step's skip was then decided from this rank's gradients alone, and a
    reduction of the gradients across ranks after it would step on another rank's
    inf/NaN values (:class:`tritamp.parallel.Reducer` asks)."""
    if not any(s.dynamic and s.overflow_process_group is None
               for s in _amp_state.loss_scalers):
        return False
    for opt in list(_amp_state.optimizers):
        stash = getattr(opt, "_amp_stash", None)
        if stash is not None and stash.pending and stash.found_inf is not None:
            return True
    return False


def pending_with_masters():
    """The amp stashes (one per optimizer of the last ``initialize``) that keep fp32
    master weights and whose ``scale_loss`` exited since their last step: the step will
    read the masters' gradients (or, left to a fused step, the half ones still scaled).
    Every rank of a data-parallel run is in the same state here (:class:`tritamp.parallel.
    Reducer` asks)."""
    out = []
    for opt in list(_amp_state.optimizers):
        stash = getattr(opt, "_amp_stash", None)
        if stash is not None and stash.pending and stash.masters:
            out.append(stash)
    return out


def reset():
    """Forget the last ``amp.initialize``: no properties, no scalers, verbosity 1 (models
    and optimizers it processed keep what it did to them)."""
    _amp_state.opt_properties = None
    _amp_state.loss_scalers = []
    _amp_state.verbosity = 1
    _amp_state.optimizers = weakref.WeakSet()


def warn_or_err(msg):
    """Apex's refusal of an inconsistent configuration (Apex's hidden ``hard_override``,
    which turned it into a warning, is not kept)."""
    raise RuntimeError(msg)


def _is_rank0():
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return dist.get_rank() == 0
    return True


def maybe_print(msg, rank0=False):
    """Apex's informational output, through ``logging`` (logger ``tritamp.amp``)."""
    if _amp_state.verbosity > 0 and (not rank0 or _is_rank0()):
        logger.info(msg)
