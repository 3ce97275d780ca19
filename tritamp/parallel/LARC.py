"""LARC: layer-wise adaptive rate control around any optimizer (Apex's ``apex.parallel.LARC``)."""
import torch

from tritamp.kernels import multi_tensor_l2norm


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
    no host sync; ``step`` accepts a closure; a LARC pickles and deep-copies with its
    optimizer (Apex's forwarded ``__getstate__`` made the copy lose it).

    ``param_groups``, ``state``, ``defaults``, ``state_dict``, ``load_state_dict``,
    ``zero_grad`` and ``add_param_group`` are the wrapped optimizer's, which is ``.optim``.

    Example::

        optimizer = LARC(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    """

    def __init__(self, optimizer, trust_coefficient=0.02, clip=True, eps=1e-8):
        if isinstance(optimizer, LARC):
            raise ValueError("LARC: the optimizer is already wrapped in LARC; wrap it once")
        if not hasattr(optimizer, "param_groups") or not hasattr(optimizer, "step"):
            raise TypeError(f"LARC wraps an optimizer (param_groups and step()); got "
                            f"{type(optimizer).__name__}")
        if trust_coefficient <= 0:
            raise ValueError(f"LARC: trust_coefficient must be > 0, got {trust_coefficient}")
        if eps < 0:
            raise ValueError(f"LARC: eps must be >= 0, got {eps}")
        self.optim = optimizer
        self.trust_coefficient = trust_coefficient
        self.eps = eps
        self.clip = clip

    def __repr__(self):
        return self.optim.__repr__()

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

    @torch.no_grad()
    def _adapt(self, group, weight_decay):
        params = [p for p in group["params"] if p.grad is not None]
        by_device = {}
        for p in params:
            by_device.setdefault(p.device, []).append(p)
        for ps in by_device.values():
            _, p_norm = multi_tensor_l2norm([p.detach() for p in ps], per_tensor=True)
            _, g_norm = multi_tensor_l2norm([p.grad.detach() for p in ps], per_tensor=True)
            factor = self.trust_coefficient * p_norm / (g_norm + p_norm * weight_decay + self.eps)
            if self.clip:
                # min(local_lr, lr) expressed as a multiplier of lr
                factor = torch.clamp(factor / group["lr"], max=1.0)
            keep = (p_norm != 0) & (g_norm != 0)
            factor = torch.where(keep, factor, 1.0)
            decay = torch.where(keep, weight_decay, 0.0) if weight_decay != 0 else None
            for i, p in enumerate(ps):
                if decay is not None:
                    p.grad.add_(p * decay[i])
                p.grad.mul_(factor[i])

    def step(self, closure=None):
        weight_decays = []
        try:
            for group in self.optim.param_groups:
                # LARC applies the weight decay itself (inside the adaptive rate)
                weight_decay = group.get("weight_decay", 0)
                weight_decays.append(weight_decay)
                group["weight_decay"] = 0
                self._adapt(group, weight_decay)
            return self.optim.step() if closure is None else self.optim.step(closure)
        finally:
            for group, weight_decay in zip(self.optim.param_groups, weight_decays):
                group["weight_decay"] = weight_decay
