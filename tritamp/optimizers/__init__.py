"""tritamp.optimizers: Apex's fused optimizers on Triton kernels.

Each one subclasses ``torch.optim.Optimizer``, declares ``_step_supports_amp_scaling``
(``torch.amp.GradScaler`` and ``tritamp.amp`` pass ``grad_scale`` / ``found_inf`` on the
device) and updates every parameter of a dtype group in one launch (LAMB and NovoGrad:
a small fixed number, whatever the number of tensors).
"""
from .clip import clip_grad_norm_
from .fused_adagrad import FusedAdagrad
from .fused_adam import FusedAdam
from .fused_lamb import FusedLAMB, FusedMixedPrecisionLamb
from .fused_novograd import FusedNovoGrad
from .fused_sgd import FusedSGD

__all__ = ["FusedAdam", "FusedSGD", "FusedLAMB", "FusedMixedPrecisionLamb", "FusedAdagrad",
           "FusedNovoGrad", "clip_grad_norm_"]
