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
