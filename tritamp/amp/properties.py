"""Opt levels O0-O3 and their properties, with Apex's names, defaults and checks."""
import math
import numbers

import torch

from .state import _amp_state, warn_or_err

HALF_DTYPES = (torch.float16, torch.bfloat16)


_DTYPE_NAMES = {
    "fp16": "torch.float16", "float16": "torch.float16", "half": "torch.float16",
    "torch.float16": "torch.float16", "torch.half": "torch.float16",
    "bf16": "torch.bfloat16", "bfloat16": "torch.bfloat16", "torch.bfloat16": "torch.bfloat16",
    "fp32": "torch.float32", "float32": "torch.float32", "float": "torch.float32",
    "torch.float32": "torch.float32", "torch.float": "torch.float32",
}


def _dtype_hint(name, value):
    """For a dtype spelled as a string: which torch.dtype to pass instead."""
    spelled = _DTYPE_NAMES.get(value.strip().lower())
    if spelled is None:
        return f"pass a torch.dtype such as {name}=torch.float16, not a string"
    return f"pass {name}={spelled} (a torch.dtype, not a string)"


def _parse_bool(name, value):
    """Apex's rule: True, False, None, or the argparse strings 'True' / 'False'."""
    if value is None or isinstance(value, bool):
        return value
    expected = f"{name} must be a boolean, the string 'True' or 'False', or None"
    if isinstance(value, str):
        if value == "True":
            return True
        if value == "False":
            return False
        hint = ""
        if value.strip().lower() in ("true", "false"):
            hint = f" Did you mean '{value.strip().capitalize()}'?"
        raise ValueError(f"{expected}, found {name}={value!r}.{hint}")
    raise TypeError(f"{expected}, found {name}={value!r} of type {type(value).__name__}; "
                    f"pass {name}=True or {name}=False")


def _parse_loss_scale(value):
    """'dynamic', or a finite number > 0 (a number or a string such as '128.0')."""
    expected = "loss_scale must be 'dynamic' or a number (e.g. 128.0 or '128.0')"
    if isinstance(value, str):
        if value == "dynamic":
            return value
        try:
            number = float(value)
        except ValueError:
            hint = ""
            if value.strip().lower().startswith("dyn"):
                hint = " Did you mean 'dynamic'?"
            raise ValueError(f"{expected}, got {value!r}.{hint}") from None
    elif isinstance(value, bool):
        raise TypeError(f"{expected}, got {value!r} (a bool); pass loss_scale='dynamic' for a "
                        "dynamic scale or a number such as loss_scale=128.0 for a static one")
    elif isinstance(value, numbers.Real) or (isinstance(value, torch.Tensor)
                                             and value.numel() == 1
                                             and value.is_floating_point()):
        number = float(value)
    else:
        raise TypeError(f"{expected}, got {value!r} of type {type(value).__name__}")
    if not (math.isfinite(number) and number > 0):
        raise ValueError(f"loss_scale must be a finite number > 0, got {value!r}")
    return number


class Properties:
    """The options an opt level sets, routed through checks as in Apex."""

    def __init__(self):
        self.__dict__["options"] = {
            "enabled": False,
            "opt_level": None,
            "cast_model_type": None,
            "patch_torch_functions": False,
            "keep_batchnorm_fp32": None,
            "master_weights": None,
            "loss_scale": 1.0,
        }
        self.__dict__["half_dtype"] = torch.float16

    def __getattr__(self, name):
        options = self.__dict__["options"]
        if name in options:
            return options[name]
        raise AttributeError(f"'{type(self).__name__}' object has no attribute '{name}'")

    def __setattr__(self, name, value):
        options = self.__dict__["options"]
        if name not in options:
            self.__dict__[name] = value
            return
        if name == "cast_model_type":
            if self.opt_level == "O1" and value is not None and value is not False \
                    and value is not torch.float32:
                warn_or_err("O1 inserts casts around Torch functions rather than model weights, so "
                            "with O1, the model weights themselves should remain FP32. If you wish "
                            "to cast the model to a different type, use opt_level='O2' or 'O3'. "
                            f"cast_model_type was {value}")
            if value is not None and value is not False:
                check_dtype_arg("cast_model_type", value)
        elif name == "patch_torch_functions":
            value = _parse_bool(name, value)
            if self.opt_level != "O1" and value:
                warn_or_err("Currently, patch_torch_functions=True should only be set by "
                            "selecting opt_level='O1'.")
        elif name == "keep_batchnorm_fp32":
            if self.opt_level == "O1" and value is not None:
                warn_or_err("With opt_level O1, batchnorm functions are automatically patched to "
                            "run in FP32, so keep_batchnorm_fp32 should be None. "
                            f"keep_batchnorm_fp32 was {value}")
            value = _parse_bool(name, value)
        elif name == "master_weights":
            if self.opt_level == "O1" and value is not None:
                warn_or_err("It doesn't make sense to use master_weights with O1. With O1, your "
                            "model weights themselves should be FP32.")
            value = _parse_bool(name, value)
        elif name == "loss_scale":
            value = _parse_loss_scale(value)
        options[name] = value


class _OptLevel:
    def __init__(self, name, brief, cast_model_type, patch, keep_bn, master, loss_scale):
        self.name, self.brief = name, brief
        self.defaults = (cast_model_type, patch, keep_bn, master, loss_scale)

    def __call__(self, properties, half_dtype):
        cast, patch, keep_bn, master, loss_scale = self.defaults
        if cast == "half":
            cast = half_dtype
        if loss_scale == "dynamic" and half_dtype == torch.bfloat16:
            loss_scale = 1.0  # bf16 has fp32's range: nothing to scale
        properties.enabled = True
        properties.opt_level = self.name
        properties.cast_model_type = cast
        properties.patch_torch_functions = patch
        properties.keep_batchnorm_fp32 = keep_bn
        properties.master_weights = master
        properties.loss_scale = loss_scale
        properties.half_dtype = half_dtype
        return properties


opt_levels = {
    "O3": _OptLevel("O3", "O3:  Pure FP16 training.", "half", False, False, False, 1.0),
    "O2": _OptLevel("O2", "O2:  FP16 training with FP32 batchnorm and FP32 master weights.\n",
                    "half", False, True, True, "dynamic"),
    "O1": _OptLevel("O1", "O1:  Insert automatic casts around Pytorch functions and Tensor methods.\n",
                    None, True, None, None, "dynamic"),
    "O0": _OptLevel("O0", "O0:  Pure FP32 training.\n", torch.float32, False, None, False, 1.0),
}


_LEVELS_TEXT = "'O0', 'O1', 'O2', 'O3'"


def check_opt_level(opt_level):
    """A valid level passes; a string that is not one raises Apex's RuntimeError, any
    other type a TypeError (Apex's ``in`` test failed with 'unhashable type' on a list)."""
    if isinstance(opt_level, str):
        if opt_level in opt_levels:
            return
        hint = ""
        stripped = opt_level.strip().upper()
        fixed = "O" + stripped[1:] if stripped[:1] == "0" else stripped
        if fixed in opt_levels:
            hint = f" Did you mean {fixed}?"
        raise RuntimeError(
            f"Unexpected optimization level {opt_level}. Options are {_LEVELS_TEXT}.  Note "
            "that in `O0`, `O1`, etc., the prefix O is the letter O, not the number zero." + hint)
    hint = ""
    if isinstance(opt_level, int) and not isinstance(opt_level, bool) and 0 <= opt_level <= 3:
        hint = f" Did you mean opt_level='O{opt_level}'?"
    raise TypeError(f"Unexpected optimization level {opt_level!r} of type "
                    f"{type(opt_level).__name__}: opt_level must be one of the strings "
                    f"{_LEVELS_TEXT} (the letter O, then a digit)." + hint)


def check_dtype_arg(name, value, allowed=None):
    """``value`` must be a floating torch.dtype (one of ``allowed`` if given).

    A string (an argparse value, say) is a ValueError that names the dtype to pass; any
    other non-dtype a TypeError; a dtype outside the allowed ones a ValueError."""
    if allowed is None:
        expected = f"{name} must be a floating torch.dtype (torch.float16, torch.bfloat16, " \
                   "torch.float32)"
    else:
        expected = f"{name} must be " + " or ".join(str(d) for d in allowed)
    if isinstance(value, torch.dtype):
        if (allowed is None and value.is_floating_point) or (allowed and value in allowed):
            return
        raise ValueError(f"{expected}, got {value}")
    if isinstance(value, str):
        raise ValueError(f"{expected}, got the string {value!r}; {_dtype_hint(name, value)}")
    raise TypeError(f"{expected}, got {value!r} of type {type(value).__name__}")


def check_half_dtype(half_dtype, name="half_dtype"):
    check_dtype_arg(name, half_dtype, allowed=HALF_DTYPES)


__all__ = ["Properties", "opt_levels", "check_opt_level", "check_half_dtype", "check_dtype_arg",
           "_amp_state"]
