"""FusedAdam: Apex's signature and defaults, one Triton launch per dtype group."""
import torch

from tritamp.kernels.adam import adam_launch, adam_prepare

from ._base import FusedOptimizer


class FusedAdam(FusedOptimizer):
    """Adam / AdamW (``adam_w_mode=True``, the default, as in Apex) on Triton.

    Matches ``torch.optim.AdamW`` (or ``Adam`` with ``adam_w_mode=False``) and keeps its
    ``state_dict`` layout (``step``, ``exp_avg``, ``exp_avg_sq`` per parameter; state in
    fp32; each group says ``decoupled_weight_decay``), so state dicts load either way;
    Apex's (the step count kept per group) load too. ``master_weights=True`` keeps an
    fp32 copy of half parameters in ``state["master_param"]`` and writes the half
    parameter in the same pass.
    ``capturable=True`` keeps ``lr`` as a device tensor (safe under CUDA graphs).
    """

    def __init__(self, params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-8,
                 adam_w_mode=True, weight_decay=0.0, amsgrad=False, set_grad_none=True,
                 capturable=False, master_weights=False, stochastic_rounding=False,
                 kahan_summation=False, seed=None, state_dtype=None):
        if amsgrad:
            raise RuntimeError("FusedAdam does not support the AMSGrad variant.")
        self._check_lr(lr)
        self._check_betas(betas)
        self._check_nonneg("epsilon", eps)
        self._check_nonneg("weight_decay", weight_decay)
        defaults = dict(lr=lr, bias_correction=bias_correction, betas=betas, eps=eps,
                        weight_decay=weight_decay)
        if state_dtype not in (None, torch.float32, torch.bfloat16):
            raise ValueError(f"FusedAdam: state_dtype must be torch.float32 or torch.bfloat16 "
                             f"(the moments' dtype), got {state_dtype!r}")
        self.state_dtype = torch.float32 if state_dtype is None else state_dtype
        self.adam_w_mode = 1 if adam_w_mode else 0  # (the groups' keys are checked by it)
        super().__init__(params, defaults, set_grad_none=set_grad_none, capturable=capturable,
                         master_weights=master_weights, stochastic_rounding=stochastic_rounding,
                         kahan_summation=kahan_summation, seed=seed)

    _STATE_LIKE = ("exp_avg", "exp_avg_sq")
    _STATE_SCALARS = ("step",)
    _TORCH_ALTERNATIVE = "torch.optim.AdamW or torch.optim.Adam (fused=True or foreach=True)"
    # torch.optim.Adam's flag for adam_w_mode, written into state_dict()'s groups
    _SAVED_ONLY_GROUP_KEYS = FusedOptimizer._SAVED_ONLY_GROUP_KEYS + ("decoupled_weight_decay",)

    def state_dict(self):
        """torch's layout; each group also says ``decoupled_weight_decay`` (torch.optim.Adam's
        name for ``adam_w_mode``), so torch.optim.Adam and AdamW continue as this one."""
        sd = super().state_dict()
        for group in sd["param_groups"]:
            group["decoupled_weight_decay"] = bool(self.adam_w_mode)
        return sd

    def _check_group_options(self, group, where=""):
        super()._check_group_options(group, where)
        if group.get("amsgrad", False):
            raise ValueError(f"FusedAdam does not support the AMSGrad variant (amsgrad=True"
                             f"{where}): use torch.optim.Adam(amsgrad=True)")

    _RULE_KEY = ("decoupled_weight_decay", "adam_w_mode")  # (see _check_rule_keys)

    def _check_saved_group(self, saved, gi):
        decoupled = saved.get("decoupled_weight_decay")
        if decoupled is not None and bool(decoupled) != bool(self.adam_w_mode) \
                and saved.get("weight_decay", 0.0) != 0:
            source = "torch.optim.AdamW" if decoupled else "torch.optim.Adam"
            raise ValueError(
                f"FusedAdam.load_state_dict: parameter group {gi} of the state dict has "
                f"decoupled_weight_decay={bool(decoupled)} and weight_decay="
                f"{saved['weight_decay']} ({source}'s weight decay), but this FusedAdam has "
                f"adam_w_mode={bool(self.adam_w_mode)}: construct FusedAdam(..., "
                f"adam_w_mode={bool(decoupled)}). Nothing was loaded.")

    def _state_dtype(self, key):
        if key in self._STATE_LIKE:
            return getattr(self, "state_dtype", torch.float32)
        return super()._state_dtype(key)

    def _prepare(self, group, targets, grads, copies, states, comps=None, keys=None):
        return adam_prepare(targets, grads, [s["exp_avg"] for s in states],
                            [s["exp_avg_sq"] for s in states], [s["step"] for s in states],
                            copies, comps, keys)

    def _launch(self, group, prepared, grad_scale, found_inf):
        beta1, beta2 = group["betas"]
        adam_launch(prepared, lr=group["lr"], beta1=beta1, beta2=beta2, eps=group["eps"],
                    weight_decay=group["weight_decay"], adam_w_mode=bool(self.adam_w_mode),
                    bias_correction=bool(group["bias_correction"]), grad_scale=grad_scale,
                    found_inf=found_inf)
