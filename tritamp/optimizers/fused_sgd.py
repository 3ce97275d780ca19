"""FusedSGD: Apex's signature and defaults, one Triton launch per dtype group."""
import math

import torch
from torch.optim.optimizer import required

from tritamp.kernels.sgd import sgd_launch, sgd_prepare

from ._base import FusedOptimizer


class FusedSGD(FusedOptimizer):
    """SGD with momentum, dampening, Nesterov and weight decay on Triton.

    Matches ``torch.optim.SGD`` and keeps its ``state_dict`` layout (``momentum_buffer``
    per parameter, fp32, plus a ``step`` count that torch ignores), so state dicts load
    either way, Apex's too. ``lr`` may be given per parameter group only, as in torch and
    Apex. ``wd_after_momentum`` applies weight decay after the momentum update (Apex).
    ``materialize_master_grads`` is accepted for Apex compatibility: tritamp never
    materialises master gradients on its fused path.
    """

    def __init__(self, params, lr=required, momentum=0, dampening=0, weight_decay=0,
                 nesterov=False, wd_after_momentum=False, materialize_master_grads=True,
                 set_grad_none=False, stochastic_rounding=False, kahan_summation=False,
                 seed=None):
        # lr may be given per parameter group only (torch and Apex accept that); a group
        # with no lr at all gets torch's "didn't specify a value of required optimization
        # parameter lr" from add_param_group.
        if lr is not required:
            self._check_lr(lr)
        self._check_nonneg("momentum", momentum)
        self._check_nonneg("weight_decay", weight_decay)
        self._check_dampening(dampening)
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ValueError("Nesterov momentum requires a momentum and zero dampening")
        defaults = dict(lr=lr, momentum=momentum, dampening=dampening,
                        weight_decay=weight_decay, nesterov=nesterov)
        super().__init__(params, defaults, set_grad_none=set_grad_none,
                         stochastic_rounding=stochastic_rounding,
                         kahan_summation=kahan_summation, seed=seed)
        self.wd_after_momentum = wd_after_momentum
        del materialize_master_grads  # Apex's keyword: accepted, nothing to materialise

    _TORCH_ALTERNATIVE = "torch.optim.SGD (fused=True or foreach=True)"

    @classmethod
    def _check_dampening(cls, value, where=""):
        # torch checks no dampening; a NaN or infinite one turns every weight NaN from the
        # second momentum step on: refused (any finite value is torch's to take)
        cls._one_element("dampening", value, where)
        if not math.isfinite(value):
            raise ValueError(f"Invalid dampening value: {value}{where}; dampening must be a "
                             "finite number (torch's default is 0)")

    def _check_hyperparameters(self, group, where=""):
        super()._check_hyperparameters(group, where)
        # the constructor's Nesterov rule, for a group added or loaded too (the keys it
        # lacks are the defaults')
        defaults = getattr(self, "defaults", {})
        get = lambda k, d: group.get(k, defaults.get(k, d))  # noqa: E731
        momentum, dampening = get("momentum", 0), get("dampening", 0)
        self._check_dampening(dampening, where)
        if get("nesterov", False) and (momentum <= 0 or dampening != 0):
            raise ValueError(f"Nesterov momentum requires a momentum and zero dampening; got "
                             f"momentum={momentum}, dampening={dampening}{where}")

    def _saved_keys(self):
        # torch.optim.SGD's and Apex's states hold the buffer alone: it has been used
        return ("momentum_buffer",), ("step",), ("step",)

    def _unneeded_keys(self, saved_group):
        # without momentum a state holds no buffer; under stochastic rounding it still
        # holds the step count the bits are drawn from
        return ("momentum_buffer",) if saved_group.get("momentum", 0) == 0 else ()

    def __setstate__(self, state):
        super().__setstate__(state)
        for group in self.param_groups:
            group.setdefault("nesterov", False)

    def _state_for(self, p, target, group):
        st = self.state[p]
        if group["momentum"] != 0:
            # Created with dict.__setitem__: a plan being built is not a change of state.
            if "momentum_buffer" not in st:
                # The buffer starts from the gradient of the first step actually taken:
                # the device step count (0 until then) decides, so a skipped first step
                # leaves the buffer unused.
                dict.__setitem__(st, "momentum_buffer", self._zero_state(p, target))
                dict.__setitem__(st, "step", torch.zeros((), dtype=torch.float32,
                                                         device=target.device))
            elif "step" not in st:  # state loaded from torch.optim.SGD: already started
                dict.__setitem__(st, "step", torch.ones((), dtype=torch.float32,
                                                        device=target.device))
        if self._rounding == "stochastic" and "step" not in st:
            # stochastic rounding draws its bits from the step count: kept without momentum
            dict.__setitem__(st, "step", torch.zeros((), dtype=torch.float32,
                                                     device=target.device))
        return super()._state_for(p, target, group)

    def load_state_dict(self, state_dict):
        super().load_state_dict(state_dict)
        # A buffer whose step count is 0 is unused (the first step sets it to the
        # gradient): hold it at zeros, the invariant the CPU path's single fused call
        # relies on. Read once here, never on a step.
        for st in self.state.values():
            step, buf = st.get("step"), st.get("momentum_buffer")
            if step is not None and buf is not None and float(step) == 0.0:
                buf.zero_()

    def _plan_depends_on(self, group):
        return group["momentum"] != 0

    def _prepare(self, group, targets, grads, copies, states, comps=None, keys=None):
        steps = [s["step"] for s in states] if group["momentum"] != 0 or keys else None
        if group["momentum"] == 0:
            return sgd_prepare(targets, grads, None, copies, steps, comps, keys)
        return sgd_prepare(targets, grads, [s["momentum_buffer"] for s in states], copies,
                           steps, comps, keys)

    def _launch(self, group, prepared, grad_scale, found_inf):
        sgd_launch(prepared, lr=group["lr"], momentum=group["momentum"],
                   dampening=group["dampening"], weight_decay=group["weight_decay"],
                   nesterov=group["nesterov"], wd_after_momentum=self.wd_after_momentum,
                   grad_scale=grad_scale, found_inf=found_inf)
