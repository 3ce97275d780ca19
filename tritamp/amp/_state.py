"""Process-wide amp state, as in Apex: one ``initialize`` configures the loss scalers
that ``scale_loss`` and ``state_dict`` then use."""
import logging

import torch

logger = logging.getLogger("tritamp.amp")


class AmpState:
    def __init__(self):
        self.opt_properties = None     # Properties once initialize has run
        self.loss_scalers = []
        self.verbosity = 1
        self.hard_override = False


_amp_state = AmpState()


def warn_or_err(msg):
    if _amp_state.hard_override:
        logger.warning("Warning:  %s", msg)
    else:
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
