"""amp's ``state_dict`` and ``load_state_dict``: the loss scalers' state, Apex's format."""
from collections import OrderedDict

from ._state import _amp_state, maybe_print


def state_dict(destination=None):
    """Apex's format: ``{"loss_scaler0": {"loss_scale": float, "unskipped": int, ...}, ...}``."""
    if destination is None:
        destination = OrderedDict()
    for idx, scaler in enumerate(_amp_state.loss_scalers):
        destination["loss_scaler%d" % idx] = scaler.state_dict()
    return destination


def load_state_dict(state_dict):
    """Restore the loss scalers saved by :func:`state_dict` (call after ``initialize``)."""
    if _amp_state.opt_properties is None:
        raise RuntimeError("amp.load_state_dict was called before amp.initialize. Call "
                           "amp.initialize(model, optimizer, ...) first, then load the state.")
    nb = len(_amp_state.loss_scalers)
    if len(state_dict) != nb:
        maybe_print("Warning: state_dict contains {} entries, while {} loss_scalers are "
                    "used".format(len(state_dict), nb))
    unexpected = [k for k in state_dict if "loss_scaler" not in k]
    if unexpected:
        raise RuntimeError("Error(s) in loading state_dict. Unexpected key(s) in state_dict: "
                           "{}. ".format(", ".join('"{}"'.format(k) for k in unexpected)))
    for idx, key in enumerate(k for k in state_dict if "loss_scaler" in k):
        if idx > nb - 1:
            maybe_print("Skipping loss_scaler[{}], since num_losses was set to {}".format(idx, nb))
            break
        _amp_state.loss_scalers[idx].load_state_dict(state_dict[key])
