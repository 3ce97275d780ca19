"""FusedNovoGrad: Apex's signature and defaults, three Triton launches per dtype group."""
import torch

from tritamp.kernels.novograd import novograd_launch, novograd_prepare

from ._base import FusedOptimizer


class FusedNovoGrad(FusedOptimizer):
    """NovoGrad (Ginsburg et al. 2019, "Stochastic Gradient Methods with Layer-wise
    Adaptive Moments") on Triton, Apex's variant.

    The second moment is one scalar per tensor: a running norm of its gradient, L2
    (``norm_type=2``) or max (``norm_type=0``), started at 0 (``init_zero=True``) or at
    the first step's norm. ``reg_inside_moment=False`` (the default) adds the weight
    decay to the update; ``True`` normalises the gradient and adds the decay before the
    momentum, as in the paper. ``grad_averaging`` scales the gradient by ``1 - beta1``
    in the momentum.

    State per parameter: ``step`` and ``exp_avg_sq`` (fp32 0-d tensors) and ``exp_avg``
    (fp32). Apex keeps ``step`` and ``exp_avg_sq`` per group (one tensor per dtype); here
    they belong to each parameter, so ``state_dict`` survives regrouping. Apex's state
    dicts load (their per-group values go to each parameter). ``grad_scale`` /
    ``found_inf`` are honoured on the device (on overflow nothing changes, step counts
    included); ``master_weights`` (beyond Apex, as in FusedAdam) keeps fp32 masters of
    half parameters.
    """

    def __init__(self, params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-8,
                 weight_decay=0.0, amsgrad=False, reg_inside_moment=False, grad_averaging=True,
                 norm_type=2, init_zero=False, set_grad_none=True, master_weights=False,
                 stochastic_rounding=False, kahan_summation=False, seed=None):
        if amsgrad:
            raise RuntimeError("FusedNovoGrad does not support the AMSGrad variant.")
        self._check_lr(lr)
        self._check_betas(betas)
        self._check_nonneg("epsilon", eps)
        self._check_nonneg("weight_decay", weight_decay)
        if norm_type not in (0, 2):
            raise ValueError(f"Invalid norm_type: {norm_type}; FusedNovoGrad supports 2 (L2 "
                             "norm) and 0 (infinity norm)")
        defaults = dict(lr=lr, bias_correction=bias_correction, betas=betas, eps=eps,
                        weight_decay=weight_decay, grad_averaging=grad_averaging,
                        norm_type=norm_type, init_zero=init_zero)
        super().__init__(params, defaults, set_grad_none=set_grad_none,
                         master_weights=master_weights, stochastic_rounding=stochastic_rounding,
                         kahan_summation=kahan_summation, seed=seed)
        self.moment_mode = 0 if reg_inside_moment else 1

    _STATE_LIKE = ("exp_avg",)
    _STATE_SCALARS = ("step", "exp_avg_sq")  # NovoGrad's second moment is one per tensor
    _NORMS_OF_WHOLE_TENSORS = True
    # Apex's FusedNovoGrad keeps the step count and the second moments per group
    _SAVED_ONLY_GROUP_KEYS = FusedOptimizer._SAVED_ONLY_GROUP_KEYS + ("exp_avg_sq",)

    def _check_group_options(self, group, where=""):
        super()._check_group_options(group, where)
        if group.get("amsgrad", False):
            raise ValueError(f"FusedNovoGrad does not support the AMSGrad variant (amsgrad=True"
                             f"{where})")
        if "norm_type" in group and group["norm_type"] not in (0, 2):
            raise ValueError(f"Invalid norm_type: {group['norm_type']}{where}; FusedNovoGrad "
                             "supports 2 (L2 norm) and 0 (infinity norm)")

    def _saved_group_state(self, gi, first, group, saved, saved_state):
        """Apex's layout: ``group["exp_avg_sq"] = [fp16 norms, fp32 norms]``, one per
        parameter of that dtype with a state, in the group's order."""
        fill = super()._saved_group_state(gi, first, group, saved, saved_state)
        norms = saved.get("exp_avg_sq")
        if norms is None:
            return fill
        where = f"FusedNovoGrad.load_state_dict: parameter group {gi} of the state dict"
        if isinstance(norms, torch.Tensor) or not isinstance(norms, (list, tuple)) \
                or len(norms) != 2 or not all(n is None or isinstance(n, torch.Tensor)
                                              for n in norms):
            raise ValueError(f"{where} has exp_avg_sq={norms!r}; Apex's FusedNovoGrad keeps a "
                             "pair [float16 norms, float32 norms]. Nothing was loaded.")
        rows = ([], [])
        for pos, key in enumerate(saved["params"]):
            exp_avg = (saved_state.get(key) or {}).get("exp_avg")
            if not isinstance(exp_avg, torch.Tensor):
                continue
            if exp_avg.dtype not in (torch.float16, torch.float32):
                raise ValueError(f"{where}: parameter {first + pos} has a {exp_avg.dtype} "
                                 "exp_avg; Apex's FusedNovoGrad kept float16 and float32 "
                                 "parameters only. Nothing was loaded.")
            rows[exp_avg.dtype == torch.float32].append(pos)
        for k, dtype in enumerate(("float16", "float32")):
            count = 0 if norms[k] is None else norms[k].numel()
            if count != len(rows[k]):
                raise ValueError(
                    f"{where} keeps {count} second-moment norms for {dtype} parameters "
                    f"(exp_avg_sq[{k}]) but has {len(rows[k])} {dtype} parameters with a "
                    "state: the checkpoint belongs to another model. Nothing was loaded.")
            for j, pos in enumerate(rows[k]):
                fill.setdefault(pos, {})["exp_avg_sq"] = norms[k].reshape(-1)[j]
        return fill

    def _prepare(self, group, targets, grads, copies, states, comps=None, keys=None):
        return novograd_prepare(targets, grads, [s["exp_avg"] for s in states],
                                [s["exp_avg_sq"] for s in states], [s["step"] for s in states],
                                copies, comps, keys)

    def _launch(self, group, prepared, grad_scale, found_inf):
        beta1, beta2 = group["betas"]
        novograd_launch(prepared, lr=group["lr"], beta1=beta1, beta2=beta2, eps=group["eps"],
                        weight_decay=group["weight_decay"],
                        reg_inside_moment=self.moment_mode == 0,
                        grad_averaging=bool(group["grad_averaging"]),
                        norm_type=group["norm_type"], init_zero=bool(group["init_zero"]),
                        bias_correction=bool(group["bias_correction"]),
                        grad_scale=grad_scale, found_inf=found_inf,
                        norm_reduce=self._norm_reduce())
