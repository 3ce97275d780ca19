"""Opt levels O0-O3 and their properties, with Apex's names, defaults and checks."""
import torch

from ._state import _amp_state, warn_or_err

HALF_DTYPES = (torch.float16, torch.bfloat16)


def _parse_bool(name, value):
    if value == "True":
        return True
    if value == "False":
        return False
    if value is True or value is False or value is None:
        return value
    raise ValueError(f"{name} must be a boolean, the string 'True' or 'False', or None, "
                     f"found {name}={value!r}")


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
            if value not in (None, False) and not (isinstance(value, torch.dtype)
                                                   and value.is_floating_point):
                raise ValueError(f"cast_model_type must be a floating torch.dtype (torch.float16, "
                                 f"torch.bfloat16, torch.float32) or None, got {value!r}")
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
            if value != "dynamic":
                try:
                    value = float(value)
                except (TypeError, ValueError):
                    raise ValueError(f"loss_scale must be 'dynamic' or a number (e.g. 128.0 or "
                                     f"'128.0'), got {value!r}") from None
                if not value > 0 or value != value or value == float("inf"):
                    raise ValueError(f"loss_scale must be a finite number > 0, got {value!r}")
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


def check_opt_level(opt_level):
    if opt_level in opt_levels:
        return
    hint = ""
    if isinstance(opt_level, str):
        fixed = opt_level.strip().upper().replace("0", "O", 1) if opt_level.strip()[:1] == "0" \
            else opt_level.strip().upper()
        if fixed in opt_levels:
            hint = f" Did you mean {fixed}?"
    raise RuntimeError(
        f"Unexpected optimization level {opt_level}. Options are 'O0', 'O1', 'O2', 'O3'.  Note "
        "that in `O0`, `O1`, etc., the prefix O is the letter O, not the number zero." + hint)


def check_half_dtype(half_dtype):
    if half_dtype not in HALF_DTYPES:
        raise ValueError(f"half_dtype must be torch.float16 or torch.bfloat16, got {half_dtype!r}")


__all__ = ["Properties", "opt_levels", "check_opt_level", "check_half_dtype", "_amp_state"]
