"""What every tritamp fused optimizer shares: gathering the tensors of a step, the
``grad_scale`` / ``found_inf`` contract, master weights and state that stays fp32.

Each parameter resolves to (target, gradient, copy):

- a plain parameter updates itself from its ``.grad``;
- with ``master_weights=True`` a half parameter's fp32 master lives in
  ``state["master_param"]``; the kernel updates the master and writes the half
  parameter in the same pass;
- under ``tritamp.amp`` (O2) the parameter is amp's fp32 master and is linked to the
  half model parameter: the gradient is read from the model parameter when the master
  has none (still scaled: the kernel unscales it), and the model parameter is written
  in the same pass. No master gradient is ever materialised on that path.

The step reads ``self.grad_scale`` and ``self.found_inf`` (set by ``torch.amp.GradScaler``
or ``tritamp.amp``) on the device: unscaling is folded in, and on overflow nothing
changes, step counts included, without a host sync.
"""
from itertools import chain

import torch

from tritamp.amp._model import MODEL_ATTR


class FusedOptimizer(torch.optim.Optimizer):
    _step_supports_amp_scaling = True
    _tritamp_writes_model_copies = True
    # per-parameter state created on first use, fp32: tensors shaped like the parameter,
    # and 0-d device tensors (step counts, NovoGrad's per-tensor second moment)
    _STATE_LIKE = ()
    _STATE_SCALARS = ()

    def __init__(self, params, defaults, *, set_grad_none=True, capturable=False,
                 master_weights=False):
        self.capturable = capturable
        super().__init__(params, defaults)
        self.set_grad_none = set_grad_none
        self.master_weights = master_weights

    def _capturable_lr(self, group):
        """With capturable=True every group's lr is an fp32 tensor on its parameters'
        device, so a captured step reads it there (and may be changed in place)."""
        if getattr(self, "capturable", False) and group["params"]:
            device = group["params"][0].device
            group["lr"] = torch.as_tensor(group["lr"], dtype=torch.float32).to(device)

    def add_param_group(self, param_group):
        super().add_param_group(param_group)
        self._capturable_lr(self.param_groups[-1])

    # -- hyperparameter checks ------------------------------------------------------------
    @staticmethod
    def _check_lr(lr):
        if not isinstance(lr, torch.Tensor) and not 0.0 <= lr:
            raise ValueError(f"Invalid learning rate: {lr}")

    @staticmethod
    def _check_betas(betas):
        if not 0.0 <= betas[0] < 1.0:
            raise ValueError(f"Invalid beta parameter at index 0: {betas[0]}")
        if not 0.0 <= betas[1] < 1.0:
            raise ValueError(f"Invalid beta parameter at index 1: {betas[1]}")

    @staticmethod
    def _check_nonneg(name, value):
        if not 0.0 <= value:
            raise ValueError(f"Invalid {name} value: {value}")

    # -- zero_grad / state --------------------------------------------------------------------
    def zero_grad(self, set_to_none=None):
        super().zero_grad(set_to_none=self.set_grad_none if set_to_none is None else set_to_none)

    def load_state_dict(self, state_dict):
        super().load_state_dict(state_dict)
        # torch casts loaded state to each parameter's dtype, which would round the fp32
        # moments and master weight of a half parameter; the values are taken from the
        # saved dict instead (copied), fp32, on the parameter's device, step counts
        # included, so the step never reads them on the host.
        for group in self.param_groups:
            # a torch optimizer's groups lack some of our hyperparameters (bias_correction)
            for key, value in self.defaults.items():
                group.setdefault(key, value)
            self._capturable_lr(group)
        saved = chain.from_iterable(g["params"] for g in state_dict["param_groups"])
        params = chain.from_iterable(g["params"] for g in self.param_groups)
        for key, p in zip(saved, params):
            for name, value in state_dict["state"].get(key, {}).items():
                if isinstance(value, torch.Tensor) and value.is_floating_point():
                    self.state[p][name] = value.to(device=p.device, dtype=torch.float32,
                                                   copy=True)

    # -- gathering a step's tensors ------------------------------------------------------------
    def _resolve(self, p):
        """(target, gradient, copy) of parameter ``p``; gradient None means no update."""
        model = getattr(p, MODEL_ATTR, None)
        if model is not None:
            grad = p.grad
            if grad is None and getattr(self, "grad_scale", None) is not None:
                # amp left this step's half gradients scaled for us to read directly;
                # without a grad_scale they are stale, not this step's.
                grad = model.grad
            return p, grad, model
        if self.master_weights and p.dtype != torch.float32:
            st = self.state[p]
            if "master_param" not in st:
                st["master_param"] = p.detach().clone().float()
            return st["master_param"], p.grad, p
        return p, p.grad, None

    def _gather(self, group):
        """The group's parameters with gradients, as (param, target, grad, copy) tuples."""
        out = []
        for p in group["params"]:
            target, grad, copy = self._resolve(p)
            if grad is None:
                continue
            if grad.is_sparse:
                raise RuntimeError(f"{type(self).__name__} does not support sparse gradients, "
                                   "please consider SparseAdam instead")
            out.append((p, target, grad, copy))
        return out

    @staticmethod
    def _split_by_copy(items):
        """Items with a copy and without: one kernel call each (one launch per dtype group)."""
        with_copy = [it for it in items if it[3] is not None]
        without = [it for it in items if it[3] is None]
        return [x for x in (with_copy, without) if x]

    def _state_for(self, p, target):
        st = self.state[p]
        for key in self._STATE_LIKE:
            if key not in st:
                st[key] = torch.zeros_like(target, dtype=torch.float32)
        for key in self._STATE_SCALARS:
            if key not in st:
                st[key] = torch.zeros((), dtype=torch.float32, device=target.device)
        return st

    def _columns(self, items, with_state=True):
        """(targets, gradients, copies or None, states or None) of a step's items."""
        copies = [c for _, _, _, c in items] if items[0][3] is not None else None
        states = [self._state_for(p, t) for p, t, _, _ in items] if with_state else None
        return [t for _, t, _, _ in items], [g for _, _, g, _ in items], copies, states

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        grad_scale = getattr(self, "grad_scale", None)
        found_inf = getattr(self, "found_inf", None)
        gathered = [(group, self._gather(group)) for group in self.param_groups]
        extra = self._before_groups(gathered, grad_scale)
        for group, items in gathered:
            for part in self._split_by_copy(items):
                self._step_group(group, part, grad_scale, found_inf, **extra)
        return loss

    def _before_groups(self, gathered, grad_scale):
        """Work over every group's gradients before the updates (LAMB's global norm);
        returns keyword arguments for _step_group."""
        return {}

    def _step_group(self, group, items, grad_scale, found_inf):
        raise NotImplementedError
