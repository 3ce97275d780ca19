"""tritamp: mixed-precision training for PyTorch on Triton kernels.

Apex's ``amp`` API without a build step: ``from tritamp import amp`` where a script had
``from apex import amp``; ``tritamp.optimizers``, ``tritamp.normalization``,
``tritamp.parallel`` and ``tritamp.fp16_utils`` stand for Apex's namesakes. Importing
tritamp compiles nothing and makes no CUDA call.
"""
import importlib.util as _importlib_util
import os as _os

# The Triton kernels live in the checkout's top-level kernels/ folder and are installed as
# tritamp.kernels (pyproject's package-dir). From a checkout that was never installed that
# name does not exist, and the first module that needs it would fail with a misleading
# circular-import error: say what to do instead.
if _importlib_util.find_spec(__name__ + ".kernels") is None:
    _root = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
    raise ImportError(f"tritamp is not installed (tritamp.kernels is missing): run "
                      f"`pip install -e .` in {_root}, then import tritamp again")
del _importlib_util, _os

from . import amp, fp16_utils, normalization, optimizers, parallel
from .amp import (LossScaler, disable_casts, float_function, half_function, initialize,
                  last_step_skipped, load_state_dict, master_params, nonfinite_gradients,
                  promote_function, register_float_function, register_half_function,
                  register_promote_function, scale_loss, state_dict)
from .convert import convert_to_amp

__version__ = "0.1.0"

__all__ = [
    "amp", "optimizers", "normalization", "parallel", "fp16_utils", "initialize", "scale_loss", "state_dict", "load_state_dict", "master_params",
    "disable_casts", "register_half_function", "register_float_function",
    "register_promote_function", "half_function", "float_function", "promote_function",
    "LossScaler", "last_step_skipped", "nonfinite_gradients", "convert_to_amp", "__version__",
]
