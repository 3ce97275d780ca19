"""FusedLAMB and FusedMixedPrecisionLamb: Apex's signatures and defaults, a few Triton
launches per dtype group."""
import numbers

import torch

from tritamp import compiled
from tritamp.kernels.engine import borrowed, take_grad_writes
from tritamp.kernels.l2norm import multi_tensor_l2norm_launch, multi_tensor_l2norm_prepare
from tritamp.kernels.lamb import lamb_launch, lamb_prepare

from ._base import FusedOptimizer


class _LambPlan:
    """A group's prepared LAMB sweep and what the global norm needs of its gradients:
    the tensors (``grads``: borrowed ones from the prepare, this step's on the CPU path
    after a rebind, None on the Triton path after a rebind, which keeps no gradient
    alive), their addresses (``ptrs``), and a count of rebinds (``gen``) that tells the
    kept norm sweep to take new addresses."""
    __slots__ = ("prepared", "grads", "ptrs", "gen")

    def __init__(self, prepared, grads):
        self.prepared = prepared
        self.grads = list(grads)
        self.ptrs = [g.data_ptr() for g in self.grads]
        self.gen = 0

    @property
    def triton(self):
        return self.prepared.triton

    @property
    def rebindable(self):
        return self.prepared.rebindable

    def rebind(self, name, tensors, addresses=None):
        tensors = list(tensors)
        if not self.prepared.rebind(name, tensors, addresses=addresses):
            return False
        # The Triton path keeps none of them, even for the step (a step refused after
        # this rebind must not keep them alive): the norm needs only their addresses,
        # or, prepared again, takes the group's current gradients (_norm_prepare).
        self.grads = None if self.prepared.triton else tensors
        self.ptrs = (list(addresses) if addresses is not None
                     else [t.data_ptr() for t in tensors])
        self.gen += 1
        return True

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
                 set_grad_none=True, max_grad_norm=1.0, use_nvlamb=False, master_weights=False,
                 stochastic_rounding=False, kahan_summation=False, seed=None):
        if amsgrad:
            raise RuntimeError("FusedLAMB does not support the AMSGrad variant.")
        self._lamb_init(params, dict(lr=lr, bias_correction=bias_correction, betas=betas,
                                     eps=eps, weight_decay=weight_decay,
                                     grad_averaging=grad_averaging,
                                     max_grad_norm=max_grad_norm),
                        adam_w_mode=adam_w_mode, use_nvlamb=use_nvlamb,
                        set_grad_none=set_grad_none, master_weights=master_weights,
                        stochastic_rounding=stochastic_rounding,
                        kahan_summation=kahan_summation, seed=seed)

    def _check_group_options(self, group, where=""):
        super()._check_group_options(group, where)
        if group.get("amsgrad", False):
            raise ValueError(f"{type(self).__name__} does not support the AMSGrad variant "
                             f"(amsgrad=True{where})")

    def _lamb_init(self, params, defaults, *, adam_w_mode, use_nvlamb, set_grad_none,
                   master_weights, capturable=False, stochastic_rounding=False,
                   kahan_summation=False, seed=None):
        self._check_lr(defaults["lr"])
        self._check_betas(defaults["betas"])
        self._check_nonneg("epsilon", defaults["eps"])
        self._check_nonneg("weight_decay", defaults["weight_decay"])
        if defaults["max_grad_norm"] is not None:
            self._check_nonneg("max_grad_norm", defaults["max_grad_norm"])
        FusedOptimizer.__init__(self, params, defaults, set_grad_none=set_grad_none,
                                capturable=capturable, master_weights=master_weights,
                                stochastic_rounding=stochastic_rounding,
                                kahan_summation=kahan_summation, seed=seed)
        self.adam_w_mode = 1 if adam_w_mode else 0
        self.use_nvlamb = use_nvlamb

    _STATE_LIKE = ("exp_avg", "exp_avg_sq")
    _STATE_SCALARS = ("step",)
    _NORMS_OF_WHOLE_TENSORS = True

    def _prepare(self, group, targets, grads, copies, states, comps=None, keys=None):
        prepared = lamb_prepare(targets, grads, [s["exp_avg"] for s in states],
                                [s["exp_avg_sq"] for s in states], [s["step"] for s in states],
                                copies, comps, keys)
        return _LambPlan(prepared, grads)

    def _before_groups(self, plans, grad_scale):
        max_grad_norm = self.defaults["max_grad_norm"]
        live = [plan for plan in plans if plan is not None]
        reduce = self._shard_reduce()
        norm_reduce = self._norm_reduce()  # (the seam the compile report substitutes)
        if not (live and max_grad_norm):
            return dict(global_norm=None, norm_reduce=norm_reduce)
        # One norm over every gradient of every group, of the unscaled gradients; planned
        # once while every group keeps its plan. When a group's plan took new gradients
        # (rebind), the norm's kept sweep takes them too: on the CPU path this step's
        # tensors (dropped after the launch), on the Triton path their addresses.
        cached = getattr(self, "_norm_plan", None)
        gens = tuple(plan.gen for plan in live)
        if cached is None or len(cached[0]) != len(live) \
                or any(a is not b for a, b in zip(cached[0], live)):
            cached = self._norm_plan = (live, self._norm_prepare(plans, grad_scale), gens)
        elif cached[1].triton:
            if cached[2] != gens:
                ptrs = [a for plan in live for a in plan.ptrs]
                if not (cached[1].rebindable
                        and cached[1].rebind("tensors", [None] * len(ptrs), addresses=ptrs)):
                    # (an address off its kernel's alignment, or a staged copy)
                    cached = (live, self._norm_prepare(plans, grad_scale), gens)
                self._norm_plan = cached = (live, cached[1], gens)
        elif cached[1].rebindable:
            cached[1].rebind("tensors", [g for plan in live for g in plan.grads])
        elif cached[2] != gens:  # (CPU path, a staged copy: this step's gradients anew)
            cached = self._norm_plan = (live, self._norm_prepare(plans, grad_scale), gens)
        norm = multi_tensor_l2norm_launch(cached[1], scale=grad_scale)[0]
        if not cached[1].triton and cached[1].rebindable:
            cached[1].release("tensors")
        if reduce is not None:  # sharded: the norm of the whole gradients
            norm = reduce.norm(norm)
        return dict(global_norm=norm, norm_reduce=norm_reduce)

    def _norm_prepare(self, plans, grad_scale):
        """The global norm's sweep over this step's gradients of every group with a plan,
        in the plans' row order; borrowed, so the kept sweep keeps none alive. A plan
        rebound on the Triton path (it keeps no tensor) gives the group's current
        gradients: this step's key says they are at its addresses."""
        grads = []
        for gi, plan in enumerate(plans):
            if plan is None:
                continue
            if plan.grads is not None:
                grads.extend(plan.grads)
            else:
                group = self.param_groups[gi]
                step_grads, _ = self._group_grads(self._group_links(gi, group), grad_scale)
                grads.extend(g for g in step_grads if g is not None)
        return multi_tensor_l2norm_prepare(borrowed(grads))

    def _launch(self, group, plan, grad_scale, found_inf, global_norm=None, norm_reduce=None):
        plan, write_grads = take_grad_writes(plan)
        beta1, beta2 = group["betas"]
        lamb_launch(plan.prepared, lr=group["lr"], beta1=beta1, beta2=beta2, eps=group["eps"],
                    weight_decay=group["weight_decay"], adam_w_mode=bool(self.adam_w_mode),
                    grad_averaging=bool(group["grad_averaging"]),
                    bias_correction=bool(group["bias_correction"]),
                    use_nvlamb=bool(self.use_nvlamb), global_grad_norm=global_norm,
                    max_grad_norm=self.defaults["max_grad_norm"] or 0.0,
                    grad_scale=grad_scale, found_inf=found_inf, write_grads=write_grads,
                    norm_reduce=norm_reduce)


_HALF = (torch.float16, torch.bfloat16)


def _check_step(step, where=""):
    """A step count given to the constructor or in a parameter group: an integer >= 0
    (or a one-element integer tensor), as Apex's ``torch.tensor([step], dtype=torch.int)``
    takes it."""
    value = step
    if isinstance(step, torch.Tensor):
        if step.numel() != 1:  # (a ValueError, as torch's and the loaded step's shape checks)
            raise ValueError(f"step must be a one-element integer tensor, got shape "
                             f"{tuple(step.shape)}{where}")
        if step.is_floating_point() or step.is_complex() or step.dtype == torch.bool:
            raise TypeError(f"step must be an integer or a one-element integer tensor, got a "
                            f"{str(step.dtype).replace('torch.', '')} tensor of shape "
                            f"{tuple(step.shape)}{where}")
        value = int(step.reshape(()).item())  # once, at construction
    elif isinstance(step, bool) or not isinstance(step, numbers.Integral):
        raise TypeError(f"step must be an integer (the number of steps already taken), got "
                        f"{type(step).__name__} {step!r}{where}")
    if value < 0:
        raise ValueError(f"Invalid step value: {value}{where}; the number of steps already "
                         "taken is >= 0")
    return int(value)


class FusedMixedPrecisionLamb(FusedLAMB):
    """Apex's ``FusedMixedPrecisionLamb``: :class:`FusedLAMB` for fp16/bf16 parameters,
    with fp32 state and fp32 master weights, and the learning rate and step count kept
    as device tensors (no host value is read on a step).

    - ``reduced_precision_dtype`` (``torch.float16`` or ``torch.bfloat16``): the
      parameters of that dtype get an fp32 master in ``state["master_param"]``, made on
      the first step (after a DDP broadcast, as in Apex), updated by the step, which
      writes the half parameter from it in the same pass; parameters of other dtypes are
      updated directly. ``None`` (the default): every fp16/bf16 parameter gets a master
      (Apex updated them in their own dtype, with state in that dtype; tritamp's state is
      fp32 always).
    - ``group["lr"]`` is an fp32 tensor on the parameters' device (one per group; change
      it in place, or let a scheduler do it). ``group["step"]`` is an int32 tensor of shape
      ``(1,)`` on that device, Apex's group step count: it starts at ``step`` and advances
      on the device by 1 per step taken, by 0 on a skipped one. Each parameter's state also
      keeps its own count (``state["step"]``, started from the group's, as FusedLAMB's): the
      bias correction reads it, so the two agree unless a parameter has no gradient on
      some steps (it then counts its own steps, as torch's optimizers do).
    - Driven with ``grad_scale`` / ``found_inf`` (``torch.amp.GradScaler`` or
      ``tritamp.amp``): the global norm clips the unscaled gradients, and a skipped step
      changes nothing, step counts included. Under ``torch.amp.GradScaler`` ``.grad``
      holds the unscaled gradient after the step.
    - ``amsgrad=True`` raises, as in Apex. ``state_dict`` holds Apex's layout (per
      parameter ``exp_avg``, ``exp_avg_sq``; ``step`` and ``lr`` in the groups) plus the
      per-parameter ``step`` and ``master_param``; Apex's checkpoints load (each
      parameter's count from its group's, masters made from the parameters).
    """

    _SAVED_ONLY_GROUP_KEYS = ()  # the group step count is this optimizer's own
    _MASTERS_BY_DTYPE = True  # bf16 parameters keep no master under rounding (_keeps_master)

    def __init__(self, params, lr=1e-3, step=0, bias_correction=True, betas=(0.9, 0.999),
                 eps=1e-6, weight_decay=0.01, amsgrad=False, adam_w_mode=True,
                 grad_averaging=True, max_grad_norm=1.0, use_nvlamb=False,
                 reduced_precision_dtype=None, stochastic_rounding=False, kahan_summation=False,
                 seed=None):
        if amsgrad:
            raise RuntimeError("FusedMixedPrecisionLamb does not support the AMSGrad variant.")
        step = _check_step(step)
        if reduced_precision_dtype is not None:
            if not isinstance(reduced_precision_dtype, torch.dtype):
                raise TypeError("reduced_precision_dtype must be torch.float16, "
                                "torch.bfloat16 or None, got "
                                f"{type(reduced_precision_dtype).__name__} "
                                f"{reduced_precision_dtype!r}")
            if reduced_precision_dtype not in _HALF:
                raise ValueError("reduced_precision_dtype must be torch.float16, "
                                 f"torch.bfloat16 or None, got {reduced_precision_dtype}: "
                                 "it names the parameters that get fp32 master weights")
        if (stochastic_rounding or kahan_summation) and reduced_precision_dtype == torch.bfloat16:
            flag = "stochastic_rounding" if stochastic_rounding else "kahan_summation"
            raise ValueError(
                f"FusedMixedPrecisionLamb: {flag}=True is for bf16 parameters without fp32 "
                "masters, but reduced_precision_dtype=torch.bfloat16 gives them fp32 masters; "
                "pass reduced_precision_dtype=None (bf16 parameters then keep no master) or "
                f"drop {flag}")
        self.reduced_precision_dtype = reduced_precision_dtype
        self._lamb_init(params, dict(lr=lr, step=step, bias_correction=bias_correction,
                                     betas=betas, eps=eps, weight_decay=weight_decay,
                                     grad_averaging=grad_averaging,
                                     max_grad_norm=max_grad_norm),
                        adam_w_mode=adam_w_mode, use_nvlamb=use_nvlamb, set_grad_none=True,
                        master_weights=True, capturable=True,
                        stochastic_rounding=stochastic_rounding,
                        kahan_summation=kahan_summation, seed=seed)

    @staticmethod
    def _group_step(step, group):
        """``step`` (a number or a one-element tensor) as a fresh int32 tensor of shape
        (1,) on the group's device."""
        device = group["params"][0].device if group["params"] else None
        if isinstance(step, torch.Tensor):
            return step.detach().reshape(1).to(device=device, dtype=torch.int32, copy=True)
        return torch.tensor([int(step)], dtype=torch.int32, device=device)

    def add_param_group(self, param_group):
        from_defaults = isinstance(param_group, dict) and "lr" not in param_group
        if isinstance(param_group, dict) and "step" in param_group:
            _check_step(param_group["step"], f" (parameter group {len(self.param_groups)})")
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        if from_defaults and isinstance(group["lr"], torch.Tensor):
            group["lr"] = group["lr"].clone()  # groups never share one lr tensor
        group["step"] = self._group_step(group["step"], group)

    def load_state_dict(self, state_dict):
        super().load_state_dict(state_dict)
        saved = state_dict["param_groups"]
        for group, saved_group in zip(self.param_groups, saved):
            if saved_group.get("step") is not None:  # (None: no count, as the checks read it)
                step = group["step"]
            else:
                # Another optimizer's checkpoint (FusedLAMB's): the group has taken as many
                # steps as its parameters' counts say (read once, at load).
                counts = [float(self.state[p]["step"]) for p in group["params"]
                          if "step" in self.state.get(p, ())]
                step = int(max(counts)) if counts else self.defaults["step"]
            group["step"] = self._group_step(step, group)

    def _check_step_options(self, gi, group):
        super()._check_step_options(gi, group)
        # The group's count, set by hand after the optimizer was built: a number (Apex's
        # ``group['step'] += ...`` takes one) becomes the group's int32 device tensor here,
        # before anything is written (left as it was, the count's update after the
        # launches failed, with the weights already stepped).
        step = group.get("step")
        if not isinstance(step, torch.Tensor):
            group["step"] = self._group_step(
                _check_step(step, f" (param_groups[{gi}]['step'])"), group)

    def _keeps_master(self, p):
        if p.dtype not in _HALF:
            return False
        if self._rounding is not None and p.dtype == torch.bfloat16:
            return False  # stored stochastically rounded or compensated instead
        return self.reduced_precision_dtype is None or p.dtype == self.reduced_precision_dtype

    def _state_for(self, p, target, group):
        st = self.state[p]
        if "step" not in st:
            # A parameter's count starts from its group's (the constructor's step, or an
            # Apex checkpoint's group count): a device copy, no host read.
            dict.__setitem__(st, "step", group["step"].reshape(()).to(
                device=target.device, dtype=torch.float32, copy=True))
        return super()._state_for(p, target, group)

    def step(self, closure=None):
        if torch.compiler.is_compiling():  # one custom op runs this eager step
            # (outside no_grad: a graph that raised between two grad-mode changes would
            # leave autograd off for the caller; the op's eager step turns it off itself)
            return compiled.step(self, closure)
        # FusedOptimizer's step itself: FusedLAMB.step may be the class's hooked step
        # (torch's step hooks), which this step, hooked in turn, must not run twice
        loss = FusedOptimizer.step(self, closure)
        # Apex's group counts: +1 per step taken, +0 on a skipped one, on the device.
        with torch.no_grad():
            steps = [group["step"] for group in self.param_groups]
            found_inf = self.step_handoff.skipped
            if found_inf is None:
                torch._foreach_add_(steps, 1)
            else:
                torch._foreach_add_(steps, found_inf.reshape(()).eq(0).to(torch.int32))
        return loss

    step._wrapped_by_lr_sched = True  # (see FusedOptimizer.step)
