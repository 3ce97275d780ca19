"""FusedAdagrad: Apex's signature and defaults, one Triton launch per dtype group."""
from tritamp.kernels.adagrad import adagrad_launch, adagrad_prepare

from ._base import FusedOptimizer


class FusedAdagrad(FusedOptimizer):
    """Adagrad on Triton (Duchi et al., 2011), Apex's ``FusedAdagrad``.

    ``weight_decay`` is an L2 penalty added to the gradient (``torch.optim.Adagrad``'s
    rule) unless ``adagrad_w_mode=True``, which decays the weights decoupled from the
    gradient (AdamW-style): ``p -= lr * (g / (sqrt(sum) + eps) + weight_decay * p)``.

    The state keeps ``torch.optim.Adagrad``'s layout (``step`` and ``sum`` per parameter,
    fp32, on the parameter's device), so state dicts load either way; ``step`` counts the
    steps taken, a step skipped for overflow excluded. ``lr_decay`` is not supported (Apex
    has none): a state dict from ``torch.optim.Adagrad`` with ``lr_decay != 0`` or
    ``maximize=True`` is refused when loaded (and a group changed to either by hand, at
    the next step); Apex's state dicts (``sum`` alone) load with a count of 0.
    ``master_weights=True`` keeps an fp32 copy of half parameters in
    ``state["master_param"]`` and writes the half parameter in the same pass.
    ``grad_scale`` / ``found_inf`` (``torch.amp.GradScaler``, ``tritamp.amp``) are read on
    the device: unscaling is folded in and an overflow step changes nothing.
    """

    def __init__(self, params, lr=1e-2, eps=1e-10, weight_decay=0.0, set_grad_none=True,
                 adagrad_w_mode=False, master_weights=False, stochastic_rounding=False,
                 kahan_summation=False, seed=None):
        self._check_lr(lr)
        self._check_nonneg("epsilon", eps)
        self._check_nonneg("weight_decay", weight_decay)
        # lr_decay and initial_accumulator_value are torch.optim.Adagrad's group keys: kept
        # (at the only values supported) so a state dict of ours steps under torch's class.
        defaults = dict(lr=lr, eps=eps, weight_decay=weight_decay, lr_decay=0.0,
                        initial_accumulator_value=0.0)
        self.adagrad_w_mode = 1 if adagrad_w_mode else 0  # (the groups' keys are checked by it)
        super().__init__(params, defaults, set_grad_none=set_grad_none,
                         master_weights=master_weights, stochastic_rounding=stochastic_rounding,
                         kahan_summation=kahan_summation, seed=seed)

    _STATE_LIKE = ("sum",)
    _STATE_SCALARS = ("step",)  # created also for Apex state dicts, which kept no count
    _TORCH_ALTERNATIVE = "torch.optim.Adagrad (foreach=True)"

    def _saved_keys(self):
        return self._STATE_LIKE, self._STATE_SCALARS, ("step",)  # Apex's hold "sum" alone

    @staticmethod
    def _check_group(group, where=""):
        if group.get("lr_decay", 0.0) != 0:
            raise ValueError(f"FusedAdagrad does not support lr_decay (got {group['lr_decay']}"
                             f"{where}; Apex's FusedAdagrad has none): use a learning-rate "
                             "scheduler")
        if group.get("maximize", False):
            raise ValueError(f"FusedAdagrad does not support maximize=True{where}: negate the "
                             "loss")

    def _check_group_options(self, group, where=""):
        self._check_group(group, where)
        super()._check_group_options(group, where)  # (the stochastic-rounding seed)

    _RULE_KEY = ("adagrad_w_mode", "adagrad_w_mode")  # (see _check_rule_keys)

    # adagrad_w_mode, written into state_dict()'s groups
    _SAVED_ONLY_GROUP_KEYS = FusedOptimizer._SAVED_ONLY_GROUP_KEYS + ("adagrad_w_mode",)

    def state_dict(self):
        """torch.optim.Adagrad's layout; each group also says ``adagrad_w_mode``, so a
        FusedAdagrad of the other weight-decay rule refuses it (torch.optim.Adagrad has
        the L2 rule alone and ignores the key)."""
        sd = super().state_dict()
        for group in sd["param_groups"]:
            group["adagrad_w_mode"] = bool(self.adagrad_w_mode)
        return sd

    def _check_saved_group(self, saved, gi):
        mode = saved.get("adagrad_w_mode")
        if mode is None and "maximize" in saved:
            mode, source = False, "an L2 penalty (torch.optim.Adagrad's only rule)"
        else:
            source = (f"{'decoupled weight decay' if mode else 'an L2 penalty'} "
                      f"(adagrad_w_mode={bool(mode)})")
        if mode is not None and bool(mode) != bool(self.adagrad_w_mode) \
                and saved.get("weight_decay", 0.0) != 0:
            raise ValueError(
                f"FusedAdagrad.load_state_dict: parameter group {gi} of the state dict "
                f"applied weight_decay={saved['weight_decay']} as {source}, but this "
                f"FusedAdagrad has adagrad_w_mode={bool(self.adagrad_w_mode)}: construct "
                f"FusedAdagrad(..., adagrad_w_mode={bool(mode)}). Nothing was loaded.")

    # (the step checks every group's options, _check_group_options, before it plans or
    # launches any: nothing to check again here)
    def _prepare(self, group, targets, grads, copies, states, comps=None, keys=None):
        return adagrad_prepare(targets, grads, [s["sum"] for s in states], copies,
                               [s["step"] for s in states], comps, keys)

    def _launch(self, group, prepared, grad_scale, found_inf):
        adagrad_launch(prepared, lr=group["lr"], eps=group["eps"],
                       weight_decay=group["weight_decay"],
                       adagrad_w_mode=bool(self.adagrad_w_mode), grad_scale=grad_scale,
                       found_inf=found_inf)
