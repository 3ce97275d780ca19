"""tritamp.amp: Apex's ``amp`` API (``from tritamp import amp``)."""
from .checkpoint import load_state_dict, state_dict
from .frontend import initialize
from .handle import disable_casts, master_params, scale_loss
from .lists import (float_function, half_function, promote_function, register_float_function,
                    register_half_function, register_promote_function)
from .scaler import LossScaler
from .overflow import nonfinite_gradients
from .skips import last_step_skipped
from . import state as _state

_amp_state = _state._amp_state  # Apex's module attribute (scripts reach the scalers through it)

__all__ = [
    "initialize", "scale_loss", "state_dict", "load_state_dict", "master_params",
    "disable_casts", "register_half_function", "register_float_function",
    "register_promote_function", "half_function", "float_function", "promote_function",
    "LossScaler", "last_step_skipped", "nonfinite_gradients",
]
