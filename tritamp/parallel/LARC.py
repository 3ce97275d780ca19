"""LARC: layer-wise adaptive rate control around any optimizer (Apex's ``apex.parallel.LARC``)."""
import math
import numbers
import operator

import torch

from tritamp.kernels import multi_tensor_l2norm
from tritamp.kernels.engine import (KeptByLayout, borrowed, is_dense, list_layout,
                                    refuse_shared_rows, row_labels)
from tritamp.kernels.l2norm import multi_tensor_l2norm_launch, multi_tensor_l2norm_prepare
from tritamp.kernels.larc import larc_rescale_launch, larc_rescale_prepare

_SWEPT = (torch.float32, torch.float16, torch.bfloat16)  # what the rescale sweep takes
_device_of = operator.attrgetter("device")


class _Kept:
    """The sweeps of one parameter list, kept across steps: the norms of the parameters
    and of the gradients, the per-parameter factor and decay vectors (written on the
    device at every step, at fixed addresses) and the rescale sweep that reads them.
    Gradients are borrowed (not kept alive) and rebound at every step."""
    __slots__ = ("p_norm", "g_norm", "factor", "decay", "one", "rescale")

    def __init__(self, params, grads, decay):
        lent = borrowed(grads)
        n = len(params)
        device = params[0].device
        # (parameters borrowed too: a kept entry does not keep a removed group's or a
        # replaced parameter's memory alive; the key holds their addresses)
        params = borrowed(params)
        self.p_norm = multi_tensor_l2norm_prepare(params)
        self.g_norm = multi_tensor_l2norm_prepare(lent)
        self.factor = torch.ones(n, dtype=torch.float32, device=device)
        self.one = self.factor[0].clone()  # the factor where LARC leaves a gradient alone
        self.decay = torch.zeros(n, dtype=torch.float32, device=device) if decay else None
        self.rescale = larc_rescale_prepare(params, lent, self.factor, self.decay)

    def rebind(self, grads, addresses):
        return (self.g_norm.rebindable and self.rescale.rebindable
                and self.g_norm.rebind("tensors", grads, addresses=addresses)
                and self.rescale.rebind("grads", grads, addresses=addresses))

    def release(self):
        """The CPU path's sweeps drop this step's gradients (the Triton path's hold none)."""
        if not self.rescale.triton:
            self.g_norm.release("tensors")
            self.rescale.release("grads")


_grad_of = operator.attrgetter("grad")


def _refuse_shared_across_groups(groups):
    """Refuse one gradient given to parameters of two groups (each group's plan refuses
    it within the group): every group's rewrite would scale it again. The gradients'
    byte spans are sorted per device (a tensor that is not contiguous spans from its
    first element to its last); only where two overlap are the tensors examined, and
    the pair named, by ``refuse_shared_rows``."""
    rows = [(g, index, k) for index, group in enumerate(groups)
            for k, g in enumerate(map(_grad_of, group["params"])) if g is not None]
    by_device = {}
    for row in rows:
        by_device.setdefault(row[0].device, []).append(row)
    for same in by_device.values():
        spans = []
        for g, _, _ in same:
            first = g.data_ptr()
            if g.is_contiguous():
                spans.append((first, first + g.nbytes))
            else:
                last = sum((n - 1) * st for n, st in zip(g.shape, g.stride()) if n)
                spans.append((first, first + (last + 1) * g.element_size()))
        spans.sort()
        reach = 0
        for first, end in spans:
            if first < reach:
                break
            reach = max(reach, end)
        else:
            continue
        with row_labels([f"param_groups[{i}]['params'][{k}]" for _, i, k in same]):
            refuse_shared_rows("LARC", [("gradients", [g for g, _, _ in same], True)])


class LARC:
    """Wrap ``optimizer`` so that each parameter's step uses an adaptive local learning rate
    (https://arxiv.org/abs/1708.03888)::

        local_lr = trust_coefficient * ||p|| / (||g|| + weight_decay * ||p|| + eps)

    ``clip=True`` uses ``min(local_lr, lr)`` (the wrapped optimizer's lr), ``clip=False``
    uses ``local_lr * lr``. As in Apex this is done by rewriting the gradients before the
    wrapped optimizer's step: ``g = (g + weight_decay * p) * factor``, the optimizer's own
    weight decay being switched off for that step (and restored after). Parameters whose
    weight or gradient norm is 0 are left as they are.

    Differences from Apex: the norms are computed in fp32 (one launch per dtype group for
    all of a group's parameters) and the zero-norm test runs on the device, so a step makes
    no host sync; ``step`` accepts a closure (run before the rewrite, as torch's optimizers
    run theirs before they read the gradients); a LARC pickles and deep-copies with its
    optimizer (Apex's forwarded ``__getstate__`` made the copy lose it).

    ``param_groups``, ``state``, ``defaults``, ``state_dict``, ``load_state_dict``,
    ``zero_grad`` and ``add_param_group`` are the wrapped optimizer's, which is ``.optim``.

    Example::

        optimizer = LARC(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    """

    def __init__(self, optimizer, trust_coefficient=0.02, clip=True, eps=1e-8):
        self._kept = {}
        if isinstance(optimizer, LARC):
            raise ValueError("LARC: the optimizer is already wrapped in LARC; wrap it once")
        if not hasattr(optimizer, "param_groups") or not hasattr(optimizer, "step"):
            raise TypeError(f"LARC wraps an optimizer (param_groups and step()); got "
                            f"{type(optimizer).__name__}")
        for name, value, low in (("trust_coefficient", trust_coefficient, "> 0"),
                                 ("eps", eps, ">= 0")):
            if isinstance(value, bool) or not isinstance(value, numbers.Real):
                raise TypeError(f"LARC: {name} must be a number {low}, got "
                                f"{type(value).__name__} {value!r}")
            if not math.isfinite(value) or (value <= 0 if low == "> 0" else value < 0):
                raise ValueError(f"LARC: {name} must be a finite number {low}, got {value}")
        self.optim = optimizer
        self.trust_coefficient = trust_coefficient
        self.eps = eps
        self.clip = clip

    def __repr__(self):
        return self.optim.__repr__()

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_kept"] = {}  # device tables and borrowed gradients: made again after a load
        return state

    def __setstate__(self, state):
        state.setdefault("_kept", {})
        self.__dict__.update(state)

    @property
    def state(self):
        return self.optim.state

    @property
    def defaults(self):
        return self.optim.defaults

    @property
    def param_groups(self):
        return self.optim.param_groups

    @param_groups.setter
    def param_groups(self, value):
        self.optim.param_groups = value

    def state_dict(self, *args, **kwargs):
        return self.optim.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict, *args, **kwargs):
        return self.optim.load_state_dict(state_dict, *args, **kwargs)

    def zero_grad(self, *args, **kwargs):
        return self.optim.zero_grad(*args, **kwargs)

    def add_param_group(self, param_group):
        return self.optim.add_param_group(param_group)

    def _factors(self, p_norm, g_norm, group, weight_decay):
        """(factor, keep) per parameter on the device: LARC's rate as a multiplier of the
        gradient, and whether it applies (both norms non-zero)."""
        factor = self.trust_coefficient * p_norm / (g_norm + p_norm * weight_decay + self.eps)
        if self.clip:
            # min(local_lr, lr) expressed as a multiplier of lr
            factor = torch.clamp(factor / group["lr"], max=1.0)
        return factor, (p_norm != 0) & (g_norm != 0)

    def _plan(self, index, group, weight_decay, moved):
        """The rewrites of group ``index``, validated (nothing written yet): a list of
        callables that apply them, one per device."""
        ps = [p for p in group["params"] if p.grad is not None]
        if not ps:
            return []
        devices = set(map(_device_of, ps))
        # the rates read these per group inside the rewrite: checked with the plans, so
        # that a bad value in a later group leaves every gradient as it was
        for name in ("lr", "weight_decay"):
            value = group.get(name, 0)
            if name == "lr" and self.clip and "lr" not in group:
                raise ValueError(f"LARC: param_groups[{index}] has no 'lr'; clip=True bounds "
                                 f"each rate by its group's lr: give the group one, or pass "
                                 f"clip=False")
            if not isinstance(value, (torch.Tensor, numbers.Real)) \
                    and (name == "weight_decay" or self.clip):
                # (the rates read them only inside the rewrite: a later group's raised
                # there once the earlier groups' gradients were rewritten)
                raise TypeError(
                    f"LARC: param_groups[{index}]['{name}'] is {type(value).__name__} "
                    f"{value!r}; give a number, or a real one-element tensor on the "
                    f"parameters' device ({ps[0].device})")
            if isinstance(value, torch.Tensor) and (
                    value.numel() != 1 or value.is_complex() or devices != {value.device}):
                raise ValueError(
                    f"LARC: param_groups[{index}]['{name}'] is a tensor of shape "
                    f"{tuple(value.shape)} ({value.dtype}) on {value.device}; give a number, "
                    f"or a real one-element tensor on the parameters' device "
                    f"({ps[0].device})")
        if len(devices) == 1:
            return [self._plan_list(index, devices.pop(), ps, group, weight_decay, moved)]
        by_device = {}
        for p in ps:
            by_device.setdefault(p.device, []).append(p)
        return [self._plan_list(index, device, same, group, weight_decay, moved)
                for device, same in by_device.items()]

    def _plan_list(self, index, device, ps, group, weight_decay, moved):
        """The norms and the rewrite as kept multi-tensor sweeps: per step two norm
        launches, a few small vector ops and one rescale launch per dtype group, whatever
        the number of parameters; nothing validated, planned or uploaded again while the
        parameters stay and only the gradients' addresses move. Lists the rescale sweep
        does not take (float64, parameters or gradients that are not dense) are
        rewritten per parameter (decided once per layout). Returns the callable that
        applies it (validated here: a refusal leaves every gradient as it was)."""
        grads = [p.grad for p in ps]
        addresses, layout, triton = list_layout(grads, op="LARC",
                                                name=f"param_groups[{index}] gradient")
        key = (list_layout(ps, op="LARC", name=f"param_groups[{index}] parameter")[:2],
               layout, weight_decay != 0)
        kept_by_layout = self._kept.get((index, device))
        if kept_by_layout is None:
            kept_by_layout = self._kept[(index, device)] = KeptByLayout(2)

        def refuse_shared():
            # Rows that share memory where a gradient is written (one gradient given to
            # two parameters would be rescaled twice), whichever rewrite runs; named by
            # the parameters' places in the group
            labels = [f"param_groups[{index}]['params'][{k}]"
                      for k, p in enumerate(group["params"])
                      if p.grad is not None and p.device == device]
            with row_labels(labels):
                refuse_shared_rows("LARC", [("parameters", ps, False), ("gradients", grads, True)],
                                   within_rows=True)

        def prepare():
            moved.append(index)
            refuse_shared()
            if all(p.dtype in _SWEPT and is_dense(p) for p in ps) \
                    and all(g.dtype in _SWEPT and is_dense(g) for g in grads):
                return _Kept(ps, grads, weight_decay != 0)
            return None  # the per-parameter rewrite, for this layout

        def rebind(kept, addresses):
            moved.append(index)
            if kept is None:  # (the per-parameter rewrite: checked again, nothing kept)
                refuse_shared()
                return True
            return kept.rebind(grads, addresses)  # (False for shared rows: prepared again)

        kept = kept_by_layout.get(addresses, key, triton, prepare, rebind)
        if kept is None:
            return lambda: self._adapt_each(ps, group, weight_decay)

        def apply():
            try:
                _, p_norm = multi_tensor_l2norm_launch(kept.p_norm, per_tensor=True)
                _, g_norm = multi_tensor_l2norm_launch(kept.g_norm, per_tensor=True)
                factor, keep = self._factors(p_norm, g_norm, group, weight_decay)
                torch.where(keep, factor, kept.one, out=kept.factor)
                if kept.decay is not None:
                    torch.mul(keep, weight_decay, out=kept.decay)  # 0 where left alone
                larc_rescale_launch(kept.rescale)
            finally:
                kept.release()
        return apply

    def _adapt_each(self, ps, group, weight_decay):
        """Tensors the rescale sweep does not take (float64, parameters or gradients that
        are not dense): the norms in one launch per dtype group, the rewrite per
        parameter."""
        _, p_norm = multi_tensor_l2norm([p.detach() for p in ps], per_tensor=True)
        _, g_norm = multi_tensor_l2norm([p.grad.detach() for p in ps], per_tensor=True)
        factor, keep = self._factors(p_norm, g_norm, group, weight_decay)
        factor = torch.where(keep, factor, 1.0)
        decay = torch.where(keep, weight_decay, 0.0) if weight_decay != 0 else None
        for i, p in enumerate(ps):
            if decay is not None:
                p.grad.add_(p * decay[i])
            p.grad.mul_(factor[i])

    def step(self, closure=None):
        """Rewrite the gradients, then the wrapped optimizer's step. A ``closure`` (which
        recomputes the loss and the gradients, as torch's optimizers take it) runs first,
        with gradients enabled, so that the rewrite applies to the gradients it leaves;
        the wrapped step is then called without it. Returns the closure's loss."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        weight_decays = []
        try:
            stash = getattr(self.optim, "_amp_stash", None)
            if stash is not None and stash.masters:
                # an optimizer amp prepared with fp32 masters (LARC built around it after
                # amp.initialize): gradients left scaled for a fused step are unscaled into
                # the masters' now, and every later exit unscales into them, so that the
                # rewrite sees them (it saw no gradient: the step ran without LARC)
                stash.master_grads_wanted = True
                stash.unscale_pending()
            groups = self.optim.param_groups
            if any(index >= len(groups) for index, _ in self._kept):
                # a group removed: its sweeps (and their scratch) go
                self._kept = {k: v for k, v in self._kept.items() if k[0] < len(groups)}
            # Every group's rewrite validated before any gradient is written (a refused
            # later group left the earlier ones rewritten: a retry applied LARC twice)
            plans = []
            with torch.no_grad():
                planned = 0  # (groups with a rewrite)
                moved = []  # (groups whose gradients are not the ones a kept plan checked)
                for index, group in enumerate(groups):
                    group_plans = self._plan(index, group, group.get("weight_decay", 0),
                                             moved)
                    plans.extend(group_plans)
                    planned += bool(group_plans)
                if planned > 1 and moved:
                    # (while every group's gradients stay where its kept plan checked
                    # them, so do the groups' overlaps)
                    _refuse_shared_across_groups(groups)
                for index, group in enumerate(groups):
                    # LARC applies the weight decay itself (inside the adaptive rate)
                    weight_decays.append(group.get("weight_decay", 0))
                    group["weight_decay"] = 0
                for apply in plans:
                    apply()
            self.optim.step()
            return loss
        finally:
            for group, weight_decay in zip(self.optim.param_groups, weight_decays):
                group["weight_decay"] = weight_decay
