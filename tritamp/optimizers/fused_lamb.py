"""FusedLAMB: Apex's signature and defaults, a few Triton launches per dtype group."""

from tritamp.kernels._cpu_optim import take_grad_writes
from tritamp.kernels.l2norm import multi_tensor_l2norm_launch, multi_tensor_l2norm_prepare
from tritamp.kernels.lamb import lamb_launch, lamb_prepare

from ._base import FusedOptimizer


class _LambPlan:
    """A group's prepared LAMB sweep and the gradients it was given (the global norm's
    input), rebound together on the CPU path."""
    __slots__ = ("prepared", "grads")

    def __init__(self, prepared, grads):
        self.prepared = prepared
        self.grads = list(grads)

    @property
    def triton(self):
        return self.prepared.triton

    @property
    def rebindable(self):
        return self.prepared.rebindable

    def rebind(self, name, tensors):
        self.prepared.rebind(name, tensors)
        self.grads = list(tensors)

    def release(self, name):
        self.prepared.release(name)
        self.grads = None


class FusedLAMB(FusedOptimizer):
    """LAMB (You et al. 2019, "Large Batch Optimization for Deep Learning") on Triton.

    Apex's variant: gradients are first clipped by the global norm of all gradients of
    all groups (``max_grad_norm``, read from the constructor's defaults as Apex does;
    ``None`` or ``0`` turns clipping off), then Adam moments give an update ``u`` whose
    size is set per tensor by the trust ratio ``||p|| / ||u||``. As in Apex the ratio
    applies only to groups with a non-zero ``weight_decay`` unless ``use_nvlamb=True``,
    and falls back to 1 when either norm is zero. ``adam_w_mode=True`` (the default)
    adds the decay to the update; ``False`` adds it to the gradient (L2).

    State per parameter: ``step``, ``exp_avg``, ``exp_avg_sq`` (fp32). Everything stays on
    the device: the global norm, the per-tensor norms, the skip on ``found_inf`` (nothing
    changes, step counts included) and the unscale by ``grad_scale``. ``master_weights``
    (beyond Apex, as in FusedAdam) keeps fp32 masters of half parameters in
    ``state["master_param"]`` and writes the half parameter in the same pass.
    """

    def __init__(self, params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-6,
                 weight_decay=0.01, amsgrad=False, adam_w_mode=True, grad_averaging=True,
                 set_grad_none=True, max_grad_norm=1.0, use_nvlamb=False, master_weights=False):
        if amsgrad:
            raise RuntimeError("FusedLAMB does not support the AMSGrad variant.")
        self._check_lr(lr)
        self._check_betas(betas)
        self._check_nonneg("epsilon", eps)
        self._check_nonneg("weight_decay", weight_decay)
        if max_grad_norm is not None:
            self._check_nonneg("max_grad_norm", max_grad_norm)
        defaults = dict(lr=lr, bias_correction=bias_correction, betas=betas, eps=eps,
                        weight_decay=weight_decay, grad_averaging=grad_averaging,
                        max_grad_norm=max_grad_norm)
        super().__init__(params, defaults, set_grad_none=set_grad_none,
                         master_weights=master_weights)
        self.adam_w_mode = 1 if adam_w_mode else 0
        self.use_nvlamb = use_nvlamb

    _STATE_LIKE = ("exp_avg", "exp_avg_sq")
    _STATE_SCALARS = ("step",)

    def _prepare(self, group, targets, grads, copies, states):
        prepared = lamb_prepare(targets, grads, [s["exp_avg"] for s in states],
                                [s["exp_avg_sq"] for s in states], [s["step"] for s in states],
                                copies)
        return _LambPlan(prepared, grads)

    def _before_groups(self, plans, grad_scale):
        max_grad_norm = self.defaults["max_grad_norm"]
        live = [plan for plan in plans if plan is not None]
        if not (live and max_grad_norm):
            return dict(global_norm=None)
        # One norm over every gradient of every group, of the unscaled gradients; planned
        # once while every group keeps its plan. On the CPU path the plans keep no
        # gradient between steps: the norm takes this step's (rebind) and drops them.
        cached = getattr(self, "_norm_plan", None)
        grads = [g for plan in live for g in plan.grads]
        if cached is None or len(cached[0]) != len(live) \
                or any(a is not b for a, b in zip(cached[0], live)):
            cached = self._norm_plan = (live, multi_tensor_l2norm_prepare(grads))
        elif cached[1].rebindable:
            cached[1].rebind("tensors", grads)
        norm = multi_tensor_l2norm_launch(cached[1], scale=grad_scale)[0]
        if cached[1].rebindable:
            cached[1].release("tensors")
        return dict(global_norm=norm)

    def _launch(self, group, plan, grad_scale, found_inf, global_norm=None):
        plan, write_grads = take_grad_writes(plan)
        beta1, beta2 = group["betas"]
        lamb_launch(plan.prepared, lr=group["lr"], beta1=beta1, beta2=beta2, eps=group["eps"],
                    weight_decay=group["weight_decay"], adam_w_mode=bool(self.adam_w_mode),
                    grad_averaging=bool(group["grad_averaging"]),
                    bias_correction=bool(group["bias_correction"]),
                    use_nvlamb=bool(self.use_nvlamb), global_grad_norm=global_norm,
                    max_grad_norm=self.defaults["max_grad_norm"] or 0.0,
                    grad_scale=grad_scale, found_inf=found_inf, write_grads=write_grads)
