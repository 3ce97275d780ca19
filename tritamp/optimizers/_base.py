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
import collections
import functools
import operator
from itertools import chain

import torch

from tritamp.amp._model import MODEL_ATTR
from tritamp.kernels._multi_tensor import (SweepCache, borrowed, layout_key, restride_like,
                                           zero_grads_)

_data_ptr = torch.Tensor.data_ptr
_grad_of = operator.attrgetter("grad")
_is_not_none = functools.partial(operator.is_not, None)
_is_none = functools.partial(operator.is_, None)


class _Epoch:
    """A counter shared by an optimizer's per-parameter state dicts."""
    __slots__ = ("value",)

    def __init__(self):
        self.value = 0


class _TrackedState(dict):
    """A parameter's state dict that counts its changes in the optimizer's epoch: the
    cached step plans hold the state tensors, so replacing one (``opt.state[p]["exp_avg"]
    = t``, ``del``, ``clear``) must make the next step rebuild its plan."""
    __slots__ = ("epoch",)

    def _changed(self):
        epoch = getattr(self, "epoch", None)
        if epoch is not None:
            epoch.value += 1

    def __setitem__(self, key, value):
        dict.__setitem__(self, key, value)
        self._changed()

    def __delitem__(self, key):
        dict.__delitem__(self, key)
        self._changed()

    def clear(self):
        dict.clear(self)
        self._changed()

    def pop(self, *args):
        self._changed()
        return dict.pop(self, *args)

    def popitem(self):
        self._changed()
        return dict.popitem(self)

    def setdefault(self, key, default=None):
        self._changed()
        return dict.setdefault(self, key, default)

    def update(self, *args, **kwargs):
        dict.update(self, *args, **kwargs)
        self._changed()

    def __reduce__(self):  # pickles (and deep-copies) as the plain dict it holds
        return (dict, (dict(self),))


class _TrackedStates(collections.defaultdict):
    """``optimizer.state``: a parameter's state is a :class:`_TrackedState`."""

    def __init__(self, epoch, items=()):
        super().__init__(None)
        self.epoch = epoch
        for key, value in dict(items).items():
            dict.__setitem__(self, key, self._wrap(value))

    def _wrap(self, value):
        if isinstance(value, _TrackedState) and value.epoch is self.epoch:
            return value
        st = _TrackedState(value)
        st.epoch = self.epoch
        return st

    def __missing__(self, key):
        st = self._wrap({})
        dict.__setitem__(self, key, st)
        return st

    def __setitem__(self, key, value):
        dict.__setitem__(self, key, self._wrap(value))
        self.epoch.value += 1

    def __delitem__(self, key):
        dict.__delitem__(self, key)
        self.epoch.value += 1

    def clear(self):
        dict.clear(self)
        self.epoch.value += 1

    def pop(self, *args):
        self.epoch.value += 1
        return dict.pop(self, *args)

    def popitem(self):
        self.epoch.value += 1
        return dict.popitem(self)

    def update(self, *args, **kwargs):
        for key, value in dict(*args, **kwargs).items():
            dict.__setitem__(self, key, self._wrap(value))
        self.epoch.value += 1

    def __reduce__(self):
        return (collections.defaultdict, (dict, {k: dict(v) for k, v in self.items()}))


class _GroupLinks:
    """What each parameter of a group reads and writes in a step (see
    :meth:`FusedOptimizer._links`)."""
    __slots__ = ("params", "targets", "copies", "models", "model_rows", "masters",
                 "lazy_sources", "written")

    def __init__(self, params, targets, copies, models):
        self.params = list(params)
        self.targets = targets            # what the step updates: the parameter or a master
        self.copies = copies              # the half copy written in the same pass, or None
        self.models = models              # amp's model parameter of a master, or None
        self.model_rows = [i for i, m in enumerate(models) if m is not None]
        self.masters = [self.params[i] for i in self.model_rows]
        # Where each row's gradient comes from while amp leaves the half gradients scaled
        # for the step: the model parameter of a master, the parameter itself otherwise.
        self.lazy_sources = [p if m is None else m for p, m in zip(self.params, models)]
        # Everything the plan writes besides state (an address that moves, as with
        # p.data = ..., must rebuild the plan).
        self.written = targets + [c for c in copies if c is not None]


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
        self._generation = 0
        self._links_cache = {}
        self._plans = {}
        self._track_state()

    def _track_state(self):
        """Make ``self.state`` count its changes (see :class:`_TrackedState`)."""
        if not isinstance(self.state, _TrackedStates):
            self.state = _TrackedStates(_Epoch(), self.state)

    def state_dict(self):
        sd = super().state_dict()
        sd["state"] = {k: dict(v) for k, v in sd["state"].items()}  # plain dicts out
        return sd

    def _capturable_lr(self, group):
        """With capturable=True every group's lr is an fp32 tensor on its parameters'
        device, so a captured step reads it there (and may be changed in place)."""
        if getattr(self, "capturable", False) and group["params"]:
            device = group["params"][0].device
            group["lr"] = torch.as_tensor(group["lr"], dtype=torch.float32).to(device)

    def add_param_group(self, param_group):
        super().add_param_group(param_group)
        self._capturable_lr(self.param_groups[-1])
        self._bump()

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
        """Apex's default (``set_grad_none``) unless told; ``set_to_none=False`` zeroes the
        gradients with one foreach launch per (device, dtype)."""
        set_to_none = self.set_grad_none if set_to_none is None else set_to_none
        if set_to_none:
            for group in self.param_groups:
                for p in group["params"]:
                    p.grad = None
            return
        zero_grads_([p.grad for group in self.param_groups for p in group["params"]
                     if p.grad is not None])

    def _bump(self):
        """Something the cached step plans depend on changed: rebuild them at the next step."""
        self._generation = getattr(self, "_generation", 0) + 1

    def __setstate__(self, state):
        super().__setstate__(state)
        self._track_state()
        self._bump()

    def load_state_dict(self, state_dict):
        self._check_loaded_shapes(state_dict)
        super().load_state_dict(state_dict)
        self._track_state()
        # torch casts loaded state to each parameter's dtype, which would round the fp32
        # moments and master weight of a half parameter; the values are taken from the
        # saved dict instead (copied), fp32, on the parameter's device and in its memory
        # layout (a checkpoint saved from a contiguous model may be loaded into a
        # channels-last one: the sweep walks every tensor of a row in one storage order),
        # step counts included, so the step never reads them on the host.
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
                    self.state[p][name] = self._restride_state(value, p)
        self._bump()

    def _check_loaded_shapes(self, state_dict):
        """Refuse, before anything is loaded, state tensors shaped unlike their parameter
        (a checkpoint of another model): the sweep would read or write out of place."""
        saved = chain.from_iterable(g["params"] for g in state_dict.get("param_groups", []))
        params = chain.from_iterable(g["params"] for g in self.param_groups)
        for index, (key, p) in enumerate(zip(saved, params)):
            for name, value in state_dict.get("state", {}).get(key, {}).items():
                if isinstance(value, torch.Tensor) and value.dim() > 0 \
                        and value.shape != p.shape:
                    raise ValueError(
                        f"{type(self).__name__}.load_state_dict: state {name!r} of parameter "
                        f"{index} has shape {tuple(value.shape)} but the parameter has shape "
                        f"{tuple(p.shape)}; the checkpoint belongs to another model or another "
                        "parameter order. Nothing was loaded.")

    @staticmethod
    def _restride_state(value, p):
        """fp32 copy of a state tensor on ``p``'s device, laid out as ``p`` when it has
        ``p``'s shape (a 0-d count or NovoGrad's per-tensor moment stays as it is)."""
        if value.shape == p.shape and value.dim() > 0:
            value = value.to(device=p.device)
            return restride_like(value, p, dtype=torch.float32)
        return value.to(device=p.device, dtype=torch.float32, copy=True)

    # -- the step: per group a cached plan, rebuilt only when its tensors change ---------------
    def _links(self, gi, group):
        """Per group, what each parameter's step reads and writes (:class:`_GroupLinks`),
        cached until the group's parameters or the optimizer's generation change.
        ``models[i]`` is the half model parameter of amp's fp32 master ``params[i]``
        (whose gradient the step reads while the master has none), else None."""
        cache = self._links_cache.get(gi)
        params = group["params"]
        gen = self._generation
        if cache is not None and cache[0] is params and cache[1] == len(params) \
                and cache[2] == gen:
            return cache[3]
        targets, copies, models = [], [], []
        for p in params:
            model = getattr(p, MODEL_ATTR, None)
            if model is not None:
                targets.append(p)
                copies.append(model)
                models.append(model)
            elif self.master_weights and p.dtype != torch.float32:
                st = self.state[p]
                if "master_param" not in st:
                    dict.__setitem__(st, "master_param",
                                     restride_like(p.detach(), p, dtype=torch.float32))
                targets.append(st["master_param"])
                copies.append(p)
                models.append(None)
            else:
                targets.append(p)
                copies.append(None)
                models.append(None)
        links = _GroupLinks(params, targets, copies, models)
        self._links_cache[gi] = (params, len(params), gen, links)
        return links

    def _group_grads(self, links, grad_scale):
        if links.model_rows and grad_scale is not None:
            # amp left this step's half gradients scaled for us to read directly (without
            # a grad_scale they are stale, not this step's): a master without a gradient
            # of its own reads its model parameter's.
            if not any(map(_is_not_none, map(_grad_of, links.masters))):
                return list(map(_grad_of, links.lazy_sources))
            grads = list(map(_grad_of, links.params))
            for i in links.model_rows:
                if grads[i] is None:
                    grads[i] = links.models[i].grad
            return grads
        return list(map(_grad_of, links.params))

    def _group_plan(self, gi, group, grad_scale):
        """The prepared sweep of group ``gi`` for this step's gradients, or None when no
        parameter of the group has a gradient. Cache key: the gradients' addresses and
        strides, one entry per parameter (torch itself keeps a ``.grad``'s dtype, shape
        and device equal to its parameter's), the addresses of what the step writes, the
        optimizer's generation and its state's epoch."""
        if not isinstance(self.state, _TrackedStates):  # replaced wholesale by the user
            self._track_state()
            self._bump()
        links = self._group_links(gi, group)
        grads = self._group_grads(links, grad_scale)
        try:
            ptrs, strides = layout_key(grads)
        except RuntimeError:  # a sparse gradient has no data_ptr or strides
            if any(g is not None and g.is_sparse for g in grads):
                raise RuntimeError(f"{type(self).__name__} does not support sparse gradients, "
                                   "please consider SparseAdam instead") from None
            raise
        rest = (strides, tuple(map(_data_ptr, links.written)), self._generation,
                self.state.epoch.value, self._plan_depends_on(group))
        key = (ptrs, rest)
        cache = self._plans.get(gi)
        if cache is None:
            cache = self._plans[gi] = SweepCache()
        found = cache.get(key)
        if found is not None:
            return found
        found = cache.prepared
        if found is not None and cache.key[1] == rest and found.rebindable:
            # The CPU path keeps no device tables: only the gradients' addresses changed
            # (on a CPU they do every step), so the validated sweep takes this step's.
            if any(map(_is_none, grads)):
                grads = [g for g in grads if g is not None]
            found.rebind("grads", grads)
            cache.key = key
            return found
        rows = [i for i, g in enumerate(grads) if g is not None]
        if not rows:
            return cache.put(key, None)
        params, targets, copies = links.params, links.targets, links.copies
        rows_targets = [targets[i] for i in rows]
        fresh = [params[i] for i in rows if not self.state.get(params[i])]
        try:
            states = [self._state_for(params[i], targets[i], group) for i in rows]
            # Borrowed gradients: the kept plan must not keep this step's gradients alive.
            prepared = self._prepare(group, rows_targets, borrowed([grads[i] for i in rows]),
                                     [copies[i] for i in rows], states)
        except Exception:
            for p in fresh:  # a refused step leaves no state behind either
                dict.pop(self.state, p, None)
            raise
        return cache.put(key, prepared)

    def _group_links(self, gi, group):
        if not hasattr(self, "_links_cache"):  # unpickled, or a subclass skipped __init__
            self._links_cache = {}
            self._plans = {}
            self._generation = getattr(self, "_generation", 0)
        return self._links(gi, group)

    def _state_for(self, p, target, group):
        """The state of parameter ``p`` (created on first use: fp32, laid out as ``target``)."""
        st = self.state[p]
        # Created with dict.__setitem__: a plan being built is not a change of state.
        for key in self._STATE_LIKE:
            if key not in st:
                dict.__setitem__(st, key, torch.zeros_like(target, dtype=torch.float32,
                                                           memory_format=torch.preserve_format))
        for key in self._STATE_SCALARS:
            if key not in st:
                dict.__setitem__(st, key, torch.zeros((), dtype=torch.float32,
                                                      device=target.device))
        return st

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        grad_scale = getattr(self, "grad_scale", None)
        found_inf = getattr(self, "found_inf", None)
        plans = [self._group_plan(gi, group, grad_scale)
                 for gi, group in enumerate(self.param_groups)]
        extra = self._before_groups(plans, grad_scale)
        for gi, (group, prepared) in enumerate(zip(self.param_groups, plans)):
            if prepared is not None:
                self._launch(group, prepared, grad_scale, found_inf, **extra)
                if prepared.rebindable:
                    # A kept CPU sweep holds this step's gradients only while it runs.
                    prepared.release("grads")
                    cache = self._plans[gi]
                    cache.key = (None, cache.key[1])
        return loss

    def _plan_depends_on(self, group):
        """Hyperparameters that change what a group's plan holds (SGD: momentum or not)."""
        return None

    def _before_groups(self, plans, grad_scale):
        """Work over every group's gradients before the updates (LAMB's global norm);
        returns keyword arguments for _launch."""
        return {}

    def _prepare(self, group, targets, grads, copies, states):
        """Validate and plan one group's sweep (kept while its tensors stay the same)."""
        raise NotImplementedError

    def _launch(self, group, prepared, grad_scale, found_inf):
        """One step of a group over its prepared sweep."""
        raise NotImplementedError
