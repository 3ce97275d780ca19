"""amp's ``state_dict`` and ``load_state_dict``: the loss scalers' state, Apex's format."""
import re
from collections import OrderedDict
from collections.abc import Mapping

from .state import _amp_state, logger

_ENTRY = re.compile(r"loss_scaler(0|[1-9][0-9]*)\Z")


def state_dict(destination=None):
    """Apex's format, ``{"loss_scaler0": {"loss_scale": float, "unskipped": int, ...}, ...}``:
    one entry per loss scaler, with tritamp's optional keys beside Apex's two (see
    :meth:`tritamp.amp.scaler.LossScaler.state_dict`)."""
    if destination is None:
        destination = OrderedDict()
    for idx, scaler in enumerate(_amp_state.loss_scalers):
        destination["loss_scaler%d" % idx] = scaler.state_dict()
    return destination


def load_state_dict(state_dict):
    """Restore the loss scalers saved by :func:`state_dict` (call after ``initialize``).

    Entries are matched by key: ``loss_scaler0`` goes to scaler 0, whatever the order of
    the dict. Every entry is checked (keys, types, ranges) before any scaler changes, so a
    refused checkpoint leaves them all as they were. As in Apex, a count that differs from
    ``num_losses`` is reported, an entry for a scaler that does not exist is skipped, a
    scaler without an entry keeps its state, and a key that is not ``loss_scalerN``
    raises. Apex's checkpoints (``loss_scale`` and ``unskipped`` only) load; the keys
    tritamp adds are optional."""
    check_state_dict(state_dict)()


def check_state_dict(state_dict):
    """Everything :func:`load_state_dict` checks, without changing anything; returns the
    function that then loads the checked values (it cannot fail). For a caller that loads
    amp's state together with other state and must refuse all of it or load all of it."""
    if _amp_state.opt_properties is None:
        raise RuntimeError("amp.load_state_dict was called before amp.initialize. Call "
                           "amp.initialize(model, optimizer, ...) first, then load the state.")
    if not isinstance(state_dict, Mapping):
        raise TypeError(f"amp.load_state_dict expects the dict amp.state_dict() returned, "
                        f"{{'loss_scaler0': {{...}}, ...}}, got {type(state_dict).__name__}")
    scalers = list(_amp_state.loss_scalers)
    nb = len(scalers)
    unexpected = [k for k in state_dict if not (isinstance(k, str) and _ENTRY.match(k))]
    if unexpected:
        raise RuntimeError("Error(s) in loading state_dict. Unexpected key(s) in state_dict: "
                           "{}. amp's state dict holds one entry per loss scaler, "
                           "'loss_scaler0' to 'loss_scaler{}'; pass the dict amp.state_dict() "
                           "saved.".format(", ".join('"{}"'.format(k) for k in unexpected),
                                           max(nb - 1, 0)))
    checked, skipped = [], []
    for key, entry in state_dict.items():
        idx = int(key[len("loss_scaler"):])
        if idx >= nb:
            skipped.append(idx)
            continue
        where = f"amp.load_state_dict: state_dict[{key!r}]"
        checked.append((scalers[idx], scalers[idx].check_state_dict(entry, where=where)))
    count = len(state_dict)

    def load():
        # Apex printed both whatever the verbosity: warnings, on logger tritamp.amp
        if count != nb:
            logger.warning("Warning: state_dict contains {} entries, while {} loss_scalers are "
                           "used".format(count, nb))
        for idx in sorted(skipped):
            logger.warning("Skipping loss_scaler[{}], since num_losses was set to {}".format(
                idx, nb))
        for scaler, values in checked:
            scaler._load_checked(values)
    return load
