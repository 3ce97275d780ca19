"""tritamp.fp16_utils: Apex's legacy ``fp16_utils`` API on tritamp's scaler and kernels.

``FP16_Optimizer`` wraps an optimizer over a half (fp16 or bf16) model with fp32 master
weights and loss scaling; the helpers below build half models and master parameter lists
by hand. New code should prefer ``tritamp.amp`` (``opt_level="O2"``), which this package
shares its machinery with.
"""
from .fp16_optimizer import FP16_Optimizer
from .fp16util import (BN_convert_float, FP16Model, clip_grad_norm, convert_module, convert_network,
                       master_params_to_model_params, model_grads_to_master_grads, network_to_half,
                       prep_param_lists, to_python_float, tofp16)
from .loss_scaler import DynamicLossScaler, LossScaler

__all__ = [
    "FP16_Optimizer", "BN_convert_float", "network_to_half", "prep_param_lists",
    "model_grads_to_master_grads", "master_params_to_model_params", "tofp16", "to_python_float",
    "clip_grad_norm", "convert_module", "convert_network", "FP16Model", "LossScaler",
    "DynamicLossScaler",
]
