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
changes, step counts included, without a host sync. Driven by ``torch.amp.GradScaler``
the step also leaves the unscaled gradients in ``.grad``, as torch's fused optimizers
do (the kernels store the values they unscale anyway); under ``tritamp.amp`` the
step writes no gradient (at O1 amp unscaled them before the step; at O2 they stay
scaled: docs/grads-after-step.md).
"""
import collections
import functools
import math
import numbers
import operator
import warnings

import numpy as np
import torch
from torch.optim import optimizer as _torch_optimizer
from torch.optim.optimizer import required

from tritamp import compiled
from tritamp.contract import StepHandoff
from tritamp.sharding import (ShardReduce, any_dtensor, check_shards, is_dtensor, local,
                              locals_of, shard_index)
from tritamp.kernels.engine import (GradWrites, SweepCache, borrowed, check_amp_args,
                                    check_grads_writable, layout_key, memory_span,
                                    restride_like, row_labels, shares_memory, zero_grads_)

_data_ptr = torch.Tensor.data_ptr
_grad_of = operator.attrgetter("grad")
# state every optimizer may hold beside its own keys, shaped like the parameter: checked
# at load as its own keys are (a bool Kahan compensation loaded as 1.0 moved the weights)
_PARAM_SHAPED = ("master_param", "kahan_comp")

_is_not_none = functools.partial(operator.is_not, None)
_is_none = functools.partial(operator.is_, None)
_profiler_enabled = torch._C._autograd._profiler_enabled
_grad_enabled = torch.is_grad_enabled
_set_grad_enabled = torch._C._set_grad_enabled
# torch's global step hooks (register_optimizer_step_pre_hook / _post_hook): dicts that
# torch fills in place
_GLOBAL_PRE_HOOKS = _torch_optimizer._global_optimizer_pre_hooks
_GLOBAL_POST_HOOKS = _torch_optimizer._global_optimizer_post_hooks


def _dtype_name(dtype):
    return str(dtype).replace("torch.", "")


class _ParamLabels:
    """The names a sweep's refusals give its rows: ``<optimizer>'s
    param_groups[g]['params'][k]`` for the group's ``k``s in ``rows`` (made when read)."""
    __slots__ = ("owner", "group", "rows")

    def __init__(self, owner, group, rows):
        self.owner, self.group, self.rows = owner, group, rows

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return f"{self.owner}'s param_groups[{self.group}]['params'][{self.rows[i]}]"


def _other_real(value):
    """A real number of a type other than bool, int and float (a Fraction, numpy's
    float32): the checks take it, torch's foreach ops on the CPU path do not."""
    return isinstance(value, numbers.Real) and not isinstance(value, (int, float, torch.Tensor))


def _host_value(value):
    return float(value) if isinstance(value, torch.Tensor) or _other_real(value) else value


# Numbers every path reads as a launch argument (torch's foreach ops on the CPU path take
# no Fraction: the constructor reads other reals as floats, a group set later must not)
_PLAIN_REALS = (int, float, np.integer, np.floating)


def _real_option(value):
    """A number a launch can read: an int, a float or a numpy number, or a real
    one-element tensor (its element count and device are checked with the other
    tensors)."""
    if isinstance(value, torch.Tensor):
        return not value.is_complex() and value.dtype != torch.bool
    return isinstance(value, _PLAIN_REALS)


def _number_kinds(defaults):
    """{key: 0} for the options whose default is a number, {key: n} for those whose
    default is a tuple of n numbers (betas): what a launch reads as such."""
    kinds = {}
    for key, value in defaults.items():
        if isinstance(value, bool) or key == "params":
            continue
        if isinstance(value, numbers.Real) or key == "lr":
            kinds[key] = 0
        elif isinstance(value, tuple) and value and all(
                isinstance(v, numbers.Real) and not isinstance(v, bool) for v in value):
            kinds[key] = len(value)
    return kinds


def _check_number_option(name, gi, key, value, length):
    """``value`` of option ``key`` a number (``length`` 0) or a tuple of ``length``
    numbers, each a real Python number or a real one-element tensor; else TypeError."""
    if length == 0:
        if not _real_option(value):
            raise TypeError(f"{name}: param_groups[{gi}]['{key}'] is "
                            f"{type(value).__name__} {value!r}; it must be a real number (an "
                            "int, a float, a numpy number or a one-element real tensor), as "
                            "when the optimizer was built")
    elif not (isinstance(value, (tuple, list)) and len(value) == length
              and all(map(_real_option, value))):
        raise TypeError(f"{name}: param_groups[{gi}]['{key}'] is {value!r}; it must be "
                        f"a tuple of {length} real numbers (or one-element real "
                        "tensors), as when the optimizer was built")


def _host_hyperparameters(values):
    """``values`` (defaults or a parameter group, ``params`` left out) with every
    hyperparameter given as a one-element tensor read as a float, betas one by one; the
    learning rate stays as given (a tensor lr is read on the device)."""
    out = {}
    for key, value in values.items():
        if key in ("params", "lr"):
            if key == "lr":
                out[key] = float(value) if _other_real(value) else value
            continue
        if key == "seed" and isinstance(value, numbers.Integral) \
                and not isinstance(value, bool):
            # a numpy integer seed stays a whole number (as a float it was refused at every
            # step, and above 2**53 it lost bits)
            out[key] = int(value)
            continue
        if isinstance(value, (tuple, list)) and any(isinstance(v, torch.Tensor) or _other_real(v)
                                                    for v in value):
            value = type(value)(map(_host_value, value))
        out[key] = _host_value(value)
    return out


def _scalar_state(value, p):
    """A saved one-element value (a step count of any kind: int, float, tensor of any
    dtype and device) as a fresh 0-d fp32 tensor on ``p``'s device."""
    if isinstance(value, torch.Tensor):
        return value.detach().to(device=p.device, dtype=torch.float32, copy=True).reshape(())
    return torch.tensor(float(value), dtype=torch.float32, device=p.device)


def _describe(value):
    if isinstance(value, torch.Tensor):
        return f"a {_dtype_name(value.dtype)} tensor of shape {tuple(value.shape)}"
    return f"{type(value).__name__} {value!r}"


def _hook_step(func):
    """``func`` (a ``step``) with torch's step hooks, as ``Optimizer.profile_hook_step``
    gives it, but without entering a ``record_function`` on every call: that range is
    opened only while a profiler records, where torch's own wrapper runs. Under
    ``torch.compile`` the step traces to one custom op whose eager ``step()`` runs the
    hooks: the traced call runs ``func`` alone. Pre-hooks, post-hooks (global and per
    optimizer, in torch's order) and ``_optimizer_step_code`` run as in torch."""
    profiled = torch.optim.Optimizer.profile_hook_step(func)

    @functools.wraps(func)
    def wrapper(*args, **kwargs):
        if torch.compiler.is_compiling():
            # Traced: the step is one custom op whose eager step() runs the hooks (run
            # here too, they ran twice: a pre-hook that clips clipped twice)
            return func(*args, **kwargs)
        if _profiler_enabled():
            return profiled(*args, **kwargs)
        self = args[0]
        if _GLOBAL_PRE_HOOKS or self._optimizer_step_pre_hooks:
            for pre_hook in (*_GLOBAL_PRE_HOOKS.values(),
                             *self._optimizer_step_pre_hooks.values()):
                result = pre_hook(self, args, kwargs)
                if result is not None:
                    if isinstance(result, tuple) and len(result) == 2:
                        args, kwargs = result
                    else:
                        raise RuntimeError(f"{func} must return None or a tuple of "
                                           f"(new_args, new_kwargs), but got {result}.")
        out = func(*args, **kwargs)
        self._optimizer_step_code()
        if self._optimizer_step_post_hooks or _GLOBAL_POST_HOOKS:
            for post_hook in (*self._optimizer_step_post_hooks.values(),
                              *_GLOBAL_POST_HOOKS.values()):
                post_hook(self, args, kwargs)
        return out

    wrapper.hooked = True
    return wrapper


def _rounding_mode(name, stochastic_rounding, kahan_summation, master_weights, seed):
    """None, ``"stochastic"`` or ``"kahan"``: how bf16 parameters without fp32 masters are
    stored (tritamp/kernels/rounding.py). The flags are checked here, before anything is
    built."""
    for flag, value in (("stochastic_rounding", stochastic_rounding),
                        ("kahan_summation", kahan_summation)):
        if not isinstance(value, (bool, int)) or value not in (0, 1):
            raise TypeError(f"{name}: {flag} must be True or False, got "
                            f"{type(value).__name__} {value!r}")
    if stochastic_rounding and kahan_summation:
        raise ValueError(f"{name}: stochastic_rounding=True and kahan_summation=True are "
                         "mutually exclusive; pick one (docs/bf16-weights.md says when)")
    mode = "stochastic" if stochastic_rounding else "kahan" if kahan_summation else None
    if mode is not None and master_weights:
        flag = "stochastic_rounding" if stochastic_rounding else "kahan_summation"
        raise ValueError(f"{name}: {flag}=True is for bf16 parameters without fp32 master "
                         f"weights, but master_weights=True keeps fp32 masters (which need "
                         f"neither); pass master_weights=False or drop {flag}")
    if seed is not None:
        _check_seed(name, seed)
        if mode != "stochastic":
            raise ValueError(f"{name}: seed={seed} is the seed of stochastic rounding; pass "
                             "stochastic_rounding=True with it, or drop it")
    return mode


def _check_seed(name, seed, where=""):
    """Stochastic rounding's seed: an int in [0, 2**64) (the constructor's, a group's)."""
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
        raise TypeError(f"{name}: seed must be an int in [0, 2**64){where}, got "
                        f"{type(seed).__name__} {seed!r}")
    if not 0 <= seed < 2 ** 64:
        raise ValueError(f"{name}: seed must be in [0, 2**64){where}, got {seed}")


def _warn_drawn_seed_if_distributed(name):
    """Stochastic rounding without ``seed=`` in a process group of several processes:
    each draws its seed from its own generator, and replicas of a parameter (data
    parallel, HSDP) round apart unless every process seeded torch alike. Said, not
    fixed by a collective here (a constructor cannot know that every process builds the
    same optimizers)."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        warnings.warn(
            f"{name}(stochastic_rounding=True) without seed= in a process group of "
            f"{dist.get_world_size()} processes: each process draws the seed from its own "
            "torch generator, so replicas of a parameter (DistributedDataParallel, HSDP) "
            "round differently and drift apart unless every process called "
            "torch.manual_seed with the same value. Pass the same seed= on every process.",
            UserWarning, stacklevel=4)


def _draw_seed():
    """A seed for stochastic rounding, drawn once from torch's default generator (so
    ``torch.manual_seed`` makes it reproducible)."""
    return int(torch.randint(0, 2 ** 62, (), dtype=torch.int64))


# What a parameter's state holds before its first plan: at most the fp32 master its
# links made (master_weights).
_LINK_STATE = frozenset(("master_param",))
# A key a step's journal saw absent (see FusedOptimizer._journal)
_ABSENT = object()


def _versions(pairs):
    """{id(weight): (version counter, address)} of the weights of (weight, x) pairs."""
    return {id(w): (w._version, w.data_ptr()) for w, _ in pairs}


def _written(pairs, seen):
    """The (weight, x) pairs whose weight was written since ``seen`` (:func:`_versions`
    at the last step; None: nothing to compare with): its version counter or address
    moved."""
    if not seen:
        return
    for weight, x in pairs:
        last = seen.get(id(weight))
        if last is not None and (weight._version, weight.data_ptr()) != last:
            yield weight, x


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
                 "lazy_sources", "written", "sharded", "shards", "owned")

    def __init__(self, params, targets, copies, models, sharded=False):
        self.params = list(params)
        # DTensor parameters (FSDP2): the step updates their local shards, read again
        # from the parameters at every step (a parameter whose local tensor was replaced,
        # as fully_shard's reset does, rebuilds the links).
        self.sharded = sharded
        self.shards = locals_of(self.params) if sharded else None
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
        # (half weight, the optimizer's own fp32 master of it): master_weights=True rows
        self.owned = [(c, t) for t, c, m in zip(targets, copies, models)
                      if c is not None and m is None]


class FusedOptimizer(torch.optim.Optimizer):
    _step_supports_amp_scaling = True
    # per-parameter state created on first use, fp32: tensors shaped like the parameter,
    # and 0-d device tensors (step counts, NovoGrad's per-tensor second moment)
    _STATE_LIKE = ()
    _STATE_SCALARS = ()

    # what the fused sweeps update (state is fp32 whatever the parameter dtype)
    _PARAM_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
    # what to use instead for parameters of other dtypes (named in the error)
    _TORCH_ALTERNATIVE = None
    # whether a step reads norms of whole tensors (LAMB, NovoGrad): with DTensor
    # parameters they are reduced over the processes holding the other shards
    _NORMS_OF_WHOLE_TENSORS = False
    # how bf16 parameters without masters are stored: None (nearest), "stochastic", "kahan"
    _rounding = None
    # whether master_weights=True still leaves bf16 parameters without masters under
    # stochastic rounding or Kahan summation (FusedMixedPrecisionLamb's rule)
    _MASTERS_BY_DTYPE = False
    # (generation, master pairs' version) the rounding flags were last checked against
    _rounding_checked = None

    @property
    def stochastic_rounding(self):
        return self._rounding == "stochastic"

    @property
    def kahan_summation(self):
        return self._rounding == "kahan"

    def __init__(self, params, defaults, *, set_grad_none=True, capturable=False,
                 master_weights=False, stochastic_rounding=False, kahan_summation=False,
                 seed=None):
        self.capturable = capturable
        self._rounding = _rounding_mode(type(self).__name__, stochastic_rounding,
                                        kahan_summation,
                                        master_weights and not self._MASTERS_BY_DTYPE, seed)
        if self.stochastic_rounding:
            if seed is None:
                _warn_drawn_seed_if_distributed(type(self).__name__)
            defaults = dict(defaults, seed=_draw_seed() if seed is None else int(seed))
        super().__init__(params, _host_hyperparameters(defaults))
        self.set_grad_none = set_grad_none
        self.master_weights = master_weights
        self._generation = 0
        self._links_cache = {}
        self._plans = {}
        self.step_handoff = StepHandoff()  # what a driver hands each step (tritamp.contract)
        self._track_state()
        compiled.register(self)  # the handle a compiled step passes to its custom op

    def _patch_step_function(self):
        # torch's Optimizer wraps each class's step once (hooks, profiler range): the same
        # hooks here, the range only while a profiler records (see _hook_step)
        self._zero_grad_profile_name = f"Optimizer.zero_grad#{type(self).__name__}.zero_grad"
        if not getattr(type(self).step, "hooked", None):
            type(self).step = _hook_step(type(self).step)

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
        # Everything is checked before the group is added: a refused group changes nothing.
        if isinstance(param_group, dict):
            where = f" (parameter group {len(self.param_groups)})"
            params = param_group.get("params")
            if isinstance(params, torch.Tensor):
                params = [params]
            elif params is not None and not isinstance(params, set):
                params = param_group["params"] = list(params)
            if params is not None and not isinstance(params, set):
                self._check_param_dtypes(params, len(self.param_groups))
                self._check_listed_once(params, len(self.param_groups))
            for key, default in self.defaults.items():
                if default is required and key not in param_group:
                    # torch's message, and the fix
                    raise ValueError(
                        "parameter group didn't specify a value of required optimization "
                        f"parameter {key}{where}: give {type(self).__name__}(params, "
                        f"{key}=...) or a {key!r} in every parameter group"
                        + (" (the learning rate)" if key == "lr" else ""))
            self._check_hyperparameters(param_group, where)
            self._check_group_options(param_group, where)
            self._check_rule_keys(param_group, where)
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        for key, value in _host_hyperparameters(group).items():
            group[key] = value
        self._capturable_lr(group)
        self._bump()
        compiled.refresh(self)  # (the parameters a compiled step reads the gradients of)

    # -- hyperparameter checks ------------------------------------------------------------
    # torch.optim's messages; a hyperparameter given as a one-element tensor is read on
    # the host once, here (the learning rate stays a tensor: the kernels read it on the
    # device; the others become floats, the kernels take them as launch arguments).
    @staticmethod
    def _one_element(name, value, where=""):
        if isinstance(value, torch.Tensor):
            if value.is_meta:
                raise ValueError(f"Tensor {name} is on the meta device, which holds no "
                                 f"data{where}; give a number or a tensor on the parameters' "
                                 "device")
            if value.numel() != 1:
                raise ValueError(f"Tensor {name} must be 1-element, got shape "
                                 f"{tuple(value.shape)}{where}")
            if value.dtype == torch.bool or value.is_complex():
                raise TypeError(f"{name} must be a real number, got a {value.dtype} tensor{where}")
        elif isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise TypeError(f"{name} must be a float or a one-element tensor, got "
                            f"{type(value).__name__} {value!r}{where}")

    @staticmethod
    def _check_lr(lr, where=""):
        FusedOptimizer._one_element("lr", lr, where)
        if not 0.0 <= lr:  # NaN fails too
            raise ValueError(f"Invalid learning rate: {lr}{where}")

    @staticmethod
    def _check_betas(betas, where=""):
        if isinstance(betas, torch.Tensor) or not hasattr(betas, "__len__") or len(betas) != 2:
            raise TypeError(f"betas must be a pair (beta1, beta2), got {betas!r}{where}")
        for i in (0, 1):
            FusedOptimizer._one_element(f"betas[{i}]", betas[i], where)
            if not 0.0 <= betas[i] < 1.0:
                raise ValueError(f"Invalid beta parameter at index {i}: {betas[i]}{where}")

    @staticmethod
    def _check_nonneg(name, value, where=""):
        FusedOptimizer._one_element(name, value, where)
        if not 0.0 <= value:
            raise ValueError(f"Invalid {name} value: {value}{where}")

    def _check_hyperparameters(self, group, where=""):
        """The constructor's checks of every hyperparameter ``group`` sets (a group given
        to the constructor or to ``add_param_group``, or loaded from a state dict)."""
        if "lr" in group and group["lr"] is not required:
            self._check_lr(group["lr"], where)
        if "betas" in group:
            self._check_betas(group["betas"], where)
        for key, name in (("eps", "epsilon"), ("weight_decay", "weight_decay"),
                          ("momentum", "momentum"),
                          ("initial_accumulator_value", "initial_accumulator_value")):
            if key in group:
                self._check_nonneg(name, group[key], where)
        if group.get("max_grad_norm") is not None:  # (None turns LAMB's clipping off)
            self._check_nonneg("max_grad_norm", group["max_grad_norm"], where)

    def _check_group_options(self, group, where=""):
        """Group options this optimizer cannot honour (torch.optim's ``maximize``, ...):
        refused rather than ignored."""
        if group.get("maximize", False):
            raise ValueError(f"{type(self).__name__} does not support maximize=True{where}: "
                             "negate the loss instead")
        if "seed" in group and self._rounding == "stochastic":
            _check_seed(type(self).__name__, group["seed"], where)
        for flag, mode in (("stochastic_rounding", "stochastic"), ("kahan_summation", "kahan")):
            if flag in group and bool(group[flag]) != (self._rounding == mode):
                name = type(self).__name__
                raise ValueError(
                    f"{name}: a parameter group{where} says {flag}={group[flag]!r}, but "
                    f"{flag} is an option of the optimizer, {self._rounding == mode} for "
                    f"every group (the group's would be ignored): construct "
                    f"{name}(..., {flag}={bool(group[flag])}) for these parameters, or drop "
                    "the key")

    # (group key, attribute): a weight-decay rule the optimizer applies to every group,
    # which a group may name (torch.optim.Adam's per-group decoupled_weight_decay)
    _RULE_KEY = None

    def _check_rule_keys(self, group, where=""):
        """A group whose rule key says the other weight-decay rule than the optimizer's
        (with weight decay to apply) is refused: it would be ignored. (A checkpoint's is
        refused by :meth:`load_state_dict`, with its own message.)"""
        if self._RULE_KEY is None:
            return
        key, attr = self._RULE_KEY
        value, mine = group.get(key), bool(getattr(self, attr))
        if value is not None and bool(value) != mine and group.get("weight_decay", 0):
            name = type(self).__name__
            raise ValueError(
                f"{name}: a parameter group{where} says {key}={value!r} with "
                f"weight_decay={group.get('weight_decay')!r}, but this optimizer applies "
                f"{key}={mine} to every group (it would be ignored): construct "
                f"{name}(..., {attr}={not mine}) for it, or one {name} per rule, or drop "
                "the key")

    def _check_step_options(self, gi, group):
        """What the launches read of a group's options, checked for every group before any
        group is written (a refusal in a launch would come after earlier groups
        stepped): the options this optimizer refuses (set on ``param_groups`` after it was
        built), and hyperparameters given as tensors (one element, on the group's
        device)."""
        self._check_group_options(group, f" (param_groups[{gi}])")
        self._check_rule_keys(group, f" (param_groups[{gi}])")
        params = group["params"]
        device = params[0].device if params else None
        if group.get("lr", 0) is None:
            raise TypeError(f"{type(self).__name__}: param_groups[{gi}]['lr'] is None; set a "
                            "learning rate (a float, or a one-element tensor)")
        # Options read as numbers (their default is one: lr, eps, weight_decay, ...) or
        # tuples of numbers (betas) hold such values: set malformed on a later group after
        # the optimizer was built (betas=(0.9,), eps=None, lr=[0.1]), they failed inside
        # that group's launch after the earlier groups had stepped.
        kinds = self.__dict__.get("_number_kinds")
        if kinds is None:
            kinds = self._number_kinds = _number_kinds(self.defaults)
        name = type(self).__name__
        read = []
        for key, value in group.items():
            if key == "params":
                continue
            length = kinds.get(key)
            if length is not None:
                _check_number_option(name, gi, key, value, length)
            if isinstance(value, torch.Tensor):
                tensors = (value,)
            elif isinstance(value, (tuple, list)) and any(isinstance(v, torch.Tensor)
                                                          for v in value):
                tensors = [v for v in value if isinstance(v, torch.Tensor)]
            else:
                continue
            for t in tensors:
                if t.numel() != 1 or (device is not None and t.device != device):
                    raise ValueError(
                        f"{type(self).__name__}: param_groups[{gi}]['{key}'] "
                        f"{'is' if t is value else 'holds'} a tensor "
                        f"of shape {tuple(t.shape)} on {t.device}; a hyperparameter given as "
                        f"a tensor must have one element and be on the parameters' device "
                        f"({device}): use a float, or torch.tensor(value, device='{device}')")
            if key not in ("lr", "step"):
                read.append(key)
        # Tensors set on a group after it was built (betas, weight_decay, ...): read once
        # to the host here, as the constructor reads them (lr is read on the device; a
        # group's step count, FusedMixedPrecisionLamb's, stays a device tensor).
        if read:
            for key, value in _host_hyperparameters({k: group[k] for k in read}).items():
                group[key] = value

    def _check_param_dtypes(self, params, group_index):
        for i, p in enumerate(params):
            if isinstance(p, torch.Tensor) and p.requires_grad \
                    and p.dtype not in self._PARAM_DTYPES:
                name = type(self).__name__
                instead = (f"use {self._TORCH_ALTERNATIVE} for {_dtype_name(p.dtype)} "
                           "parameters, or cast the model to float32 (model.float())"
                           if self._TORCH_ALTERNATIVE else
                           "cast the model to float32 (model.float())")
                raise TypeError(
                    f"{name}: parameter {i} of parameter group {group_index} is "
                    f"{_dtype_name(p.dtype)} with shape {tuple(p.shape)}; {name} updates "
                    "float32, float16 and bfloat16 parameters (its state in float32): "
                    f"{instead}.")

    def _check_listed_once(self, params, group_index):
        """A tensor listed twice in one group is refused (torch.optim only warns): the
        group's step updates its tensors in one multi-tensor pass, which would update
        it twice on a CPU and, on a GPU, run two programs racing on it."""
        seen = {}
        for i, p in enumerate(params):
            if not isinstance(p, torch.Tensor):  # (torch.optim refuses it, with its message)
                continue
            first = seen.setdefault(id(p), i)
            if first != i:
                name = type(self).__name__
                raise ValueError(
                    f"{name}: parameter group {group_index} lists the same parameter twice "
                    f"(positions {first} and {i}, shape {tuple(p.shape)}); one step would "
                    "update it twice, and on a GPU two programs of its multi-tensor kernel "
                    "would race on it: list each parameter once")

    def _check_in_one_group(self, params, group_index):
        """A parameter in two groups (a group's list changed in place) is refused, as
        torch's add_param_group refuses it: each group's step would update it, with its
        own step count."""
        here = {id(p) for p in params}
        for gi, group in enumerate(self.param_groups):
            if gi == group_index or group["params"] is params:
                continue
            for i, p in enumerate(group["params"]):
                if id(p) in here:
                    raise ValueError(
                        f"{type(self).__name__}: some parameters appear in more than one "
                        f"parameter group (a tensor of shape {tuple(p.shape)} is in groups "
                        f"{min(gi, group_index)} and {max(gi, group_index)}); each group's "
                        "step would update it: keep each parameter in one group")

    def _check_no_overlap(self, gi, rows, targets, copies, states):
        """Nothing a group's step writes shares memory with anything else it writes:
        parameters that are overlapping views of one tensor, or two state entries that
        are one tensor (``state["exp_avg_sq"] = state["exp_avg"]``). One multi-tensor
        pass would update the shared elements once per view in an order of its own (on
        the CPU path a half parameter's fp32 copy written back last wins; on a GPU two
        programs race). Checked when a plan is prepared: the tensors' memory spans,
        sorted by address, and where two overlap, whether they share an element (views
        that interleave without sharing one, which the sweeps refuse as not dense, are
        left to that refusal)."""
        spans = []
        for r, i in enumerate(rows):
            if copies[r] is None:
                named = [(targets[r], f"parameter {i}")]
            elif targets[r] is self.param_groups[gi]["params"][i]:  # amp's master
                named = [(targets[r], f"parameter {i}"),
                         (copies[r], f"the half model copy of parameter {i}")]
            else:  # (master_weights: the target is state["master_param"], named once)
                named = [(targets[r], f"the fp32 master of parameter {i}"),
                         (copies[r], f"parameter {i}")]
            named += [(v, f"state[{k!r}] of parameter {i}") for k, v in states[r].items()
                      if isinstance(v, torch.Tensor) and k != "master_param"]
            for t, what in named:
                if t.numel() and t.data_ptr():  # (no memory: empty, or meta, refused later)
                    start, end = memory_span(t)
                    spans.append((start, end, what, t))
        spans.sort(key=operator.itemgetter(0))
        open_ = []  # the spans reaching past the current start
        for span in spans:
            open_ = [o for o in open_ if o[1] > span[0]]
            for o in open_:
                if shares_memory(o[3], span[3]):
                    raise ValueError(
                        f"{type(self).__name__}: in parameter group {gi}, {o[2]} (shape "
                        f"{tuple(o[3].shape)}) and {span[2]} (shape {tuple(span[3].shape)}) "
                        "share memory; one step would update the shared elements twice, in "
                        "an order of its own, and on a GPU two programs of its multi-tensor "
                        "kernel would race on them: give each its own memory (parameters "
                        "that are views of one tensor: p.data = p.data.clone() for each)")
            open_.append(span)

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

    # Attributes a pickle or a deep copy leaves out: caches, step plans and handles made
    # again after a load, and torch's hooks (which torch's own pickle leaves out too).
    _NOT_PICKLED = frozenset((
        "_links_cache", "_plans", "step_handoff", "_tritamp_step_handle",
        "_tritamp_step_params", "_tritamp_step_token", "_rounding_checked",
        "_weight_versions", "_comp_versions", "_step_journal", "_shard_reduce_cache",
        "_number_kinds",
        "_optimizer_step_pre_hooks", "_optimizer_step_post_hooks",
        "_optimizer_state_dict_pre_hooks", "_optimizer_state_dict_post_hooks",
        "_optimizer_load_state_dict_pre_hooks", "_optimizer_load_state_dict_post_hooks"))

    def __getstate__(self):
        # torch's (defaults, state, param_groups) and this optimizer's settings
        # (adam_w_mode, master_weights, the rounding mode, ...): without them an unpickled
        # or deep-copied optimizer could not step
        state = super().__getstate__()
        for k, v in self.__dict__.items():
            if k not in state and k not in self._NOT_PICKLED:
                state[k] = v
        return state

    def __setstate__(self, state):
        super().__setstate__(state)
        self._links_cache = {}
        self._plans = {}
        if not isinstance(getattr(self, "step_handoff", None), StepHandoff):
            self.step_handoff = StepHandoff()
        self._track_state()
        self._bump()
        compiled.register(self)

    # -- load_state_dict ------------------------------------------------------------------
    # Keys of a saved parameter group that hold per-parameter state here (Apex's FusedAdam,
    # FusedLAMB and FusedNovoGrad count steps per group), or that only a state dict holds:
    # taken into the parameters' state, then dropped from the loaded groups.
    _SAVED_ONLY_GROUP_KEYS = ("step",)

    def _saved_keys(self):
        """What a saved parameter state of this optimizer holds: the keys shaped like the
        parameter, the one-element keys, and those of them a saved state may lack (they
        start as on a first step). The others come all together or not at all."""
        return tuple(self._STATE_LIKE), tuple(self._STATE_SCALARS), ()

    def _unneeded_keys(self, saved_group):
        """Keys of :meth:`_saved_keys` a saved state may lack under the hyperparameters of
        ``saved_group`` (the ones it loads): what those settings never make."""
        return ()

    def load_state_dict(self, state_dict):
        """torch's ``load_state_dict``, and:

        - everything is checked before anything is loaded, so a refused state dict changes
          nothing: a state missing one of this optimizer's keys, a state tensor shaped unlike
          its parameter, a step count that is negative or not finite, hyperparameters that
          fail the constructor's checks, torch options this optimizer cannot honour;
        - step counts in every format become 0-d fp32 tensors on the parameter's device (the
          step never reads them on the host): torch's (an int or a float in older
          checkpoints, a tensor since) and Apex's (one count per parameter group);
        - state stays fp32 (torch would cast it to a half parameter's dtype), copied onto the
          parameter's device and into its memory layout (a checkpoint saved from a
          contiguous model may be loaded into a channels-last one: the sweep walks every
          tensor of a row in one storage order).
        """
        state_dict = state_dict.copy() if isinstance(state_dict, dict) else state_dict
        pre_hooks = getattr(self, "_optimizer_load_state_dict_pre_hooks", None)
        post_hooks = getattr(self, "_optimizer_load_state_dict_post_hooks", None)
        for hook in list((pre_hooks or {}).values()):
            result = hook(self, state_dict)
            if result is not None:
                state_dict = result
        loaded = self._check_state_dict(state_dict)
        # The hooks ran once, around the checked dict: torch's load must not run them again.
        self._optimizer_load_state_dict_pre_hooks = collections.OrderedDict()
        self._optimizer_load_state_dict_post_hooks = collections.OrderedDict()
        try:
            super().load_state_dict(state_dict)
        finally:
            if pre_hooks is not None:
                self._optimizer_load_state_dict_pre_hooks = pre_hooks
            if post_hooks is not None:
                self._optimizer_load_state_dict_post_hooks = post_hooks
        self._track_state()
        # The loaded masters and compensations go with the weights as they are now (or as
        # loaded next, model.load_state_dict): the weights written before this load are
        # not "written since the last step" (their loaded masters would be overwritten)
        self.__dict__.pop("_weight_versions", None)
        self.__dict__.pop("_comp_versions", None)
        scalars = self._saved_keys()[1]
        for p, values, dropped in loaded:
            st = self.state[p]
            for name in dropped:
                dict.pop(st, name, None)
            # torch cast the state to the parameter's dtype: the saved values are taken
            # instead (copied), fp32.
            for name, value in values.items():
                dict.__setitem__(st, name, _scalar_state(value, p) if name in scalars
                                 else self._restride_state(value, p,
                                                           self._state_dtype(name)))
        for group in self.param_groups:
            for key in self._SAVED_ONLY_GROUP_KEYS:
                group.pop(key, None)
            # a torch optimizer's groups lack some of our hyperparameters (bias_correction)
            for key, value in self.defaults.items():
                group.setdefault(key, value)
            self._capturable_lr(group)
        self._bump()
        for hook in list((post_hooks or {}).values()):
            hook(self)

    def _check_state_dict(self, state_dict):
        """Check a state dict against this optimizer, before anything is loaded. Returns,
        per parameter with a saved state, ``(param, {key: saved value}, keys to drop)``."""
        name = type(self).__name__
        if not isinstance(state_dict, dict):
            raise TypeError(f"{name}.load_state_dict expects a dict (an optimizer's "
                            f"state_dict()), got {type(state_dict).__name__}")
        for key in ("state", "param_groups"):
            if key not in state_dict:
                raise ValueError(
                    f"{name}.load_state_dict: the state dict has no {key!r} entry (it has "
                    f"{sorted(map(str, state_dict))}); pass what an optimizer's state_dict() "
                    "returned. Nothing was loaded.")
        groups, saved_groups = self.param_groups, state_dict["param_groups"]
        if len(groups) != len(saved_groups):
            raise ValueError("loaded state dict has a different number of parameter groups "
                             f"({len(saved_groups)} saved, {len(groups)} in this {name}). "
                             "Nothing was loaded.")
        for gi, (group, saved) in enumerate(zip(groups, saved_groups)):
            if len(group["params"]) != len(saved["params"]):
                raise ValueError(
                    "loaded state dict contains a parameter group that doesn't match the size "
                    f"of optimizer's group (group {gi}: {len(saved['params'])} parameters "
                    f"saved, {len(group['params'])} here). Nothing was loaded.")
        like, scalars, optional = self._saved_keys()
        keys = like + scalars
        saved_state = state_dict["state"]
        loaded = []
        stale = []  # parameters whose saved master is not fp32 (see below)
        first = 0
        for gi, (group, saved) in enumerate(zip(groups, saved_groups)):
            where = f" (parameter group {gi} of the state dict)"
            self._check_hyperparameters(saved, where)
            self._check_group_options(saved, where)
            self._check_saved_group(saved, gi)
            fill = self._saved_group_state(gi, first, group, saved, saved_state)
            unneeded = self._unneeded_keys(saved)
            for pos, (key, p) in enumerate(zip(saved["params"], group["params"])):
                index = first + pos
                st = saved_state.get(key)
                if st is None:
                    continue
                if not isinstance(st, dict):
                    raise TypeError(f"{name}.load_state_dict: the state of parameter {index} "
                                    f"is a {type(st).__name__}, expected a dict. Nothing was "
                                    "loaded.")
                st = dict(st)
                # torch before 2.0 saved momentum_buffer=None for SGD without momentum
                dropped = [k for k in like if k in st and st[k] is None]
                for k in dropped:
                    del st[k]
                own = set(st)
                present = [k for k in keys if k in st]
                if present:
                    for k, v in fill.get(pos, {}).items():
                        st.setdefault(k, v)
                    missing = [k for k in keys
                               if k not in st and k not in optional and k not in unneeded]
                    if missing:
                        raise ValueError(
                            f"{name}.load_state_dict: the state of parameter {index} has "
                            f"{', '.join(map(repr, present))} but no {missing[0]!r} (a {name} "
                            f"state holds {', '.join(map(repr, keys))}); the checkpoint is "
                            "incomplete or belongs to another optimizer. Nothing was loaded.")
                values = {}
                for k, v in st.items():
                    if k in scalars:
                        if k in own:
                            self._check_saved_scalar(
                                v, k, f"state {k!r} of parameter {index}")
                        values[k] = v
                    elif k in like or k in _PARAM_SHAPED:
                        if not isinstance(v, torch.Tensor) or not v.is_floating_point():
                            raise TypeError(
                                f"{name}.load_state_dict: state {k!r} of parameter {index} is "
                                f"{_describe(v)}, expected a floating-point tensor of shape "
                                f"{tuple(p.shape)}. Nothing was loaded.")
                        self._check_saved_shape(v, k, index, p)
                        self._check_saved_mesh(v, k, index, p)
                        if k == "master_param" and v.dtype != torch.float32:
                            # not a master this optimizer saved (they are fp32): one that
                            # went through another optimizer, which cast it to the
                            # parameter's dtype and never updated it. Dropped: the master
                            # starts from the loaded weights at the next step.
                            dropped.append(k)
                            stale.append((index, v.dtype))
                            continue
                        values[k] = v
                    elif isinstance(v, torch.Tensor) and v.is_floating_point():
                        if v.dim() > 0:
                            self._check_saved_shape(v, k, index, p)
                        values[k] = v
                loaded.append((p, values, dropped))
            first += len(group["params"])
        if stale:
            shown = ", ".join(f"{i} ({d})" for i, d in stale[:4])
            more = f" and {len(stale) - 4} more" if len(stale) > 4 else ""
            warnings.warn(
                f"{name}.load_state_dict: the saved 'master_param' of parameter(s) {shown}"
                f"{more} is not fp32, so it is not a master this optimizer saved: the "
                "checkpoint went through another optimizer (torch.optim keeps state it does "
                "not know, cast to the parameter's dtype, and never updates it). It was not "
                "loaded: each master starts from its parameter's loaded weights at the next "
                "step.", UserWarning, stacklevel=3)
        return loaded

    def _check_saved_shape(self, value, key, index, p):
        if value.is_meta:
            raise ValueError(
                f"{type(self).__name__}.load_state_dict: state {key!r} of parameter {index} "
                "is on the meta device, which holds no data; save the checkpoint from "
                "materialised state. Nothing was loaded.")
        if value.layout != torch.strided:
            raise ValueError(
                f"{type(self).__name__}.load_state_dict: state {key!r} of parameter {index} "
                f"is a {value.layout} tensor; optimizer state is dense (convert it with "
                ".to_dense()). Nothing was loaded.")
        if value.shape != p.shape:
            raise ValueError(
                f"{type(self).__name__}.load_state_dict: state {key!r} of parameter {index} "
                f"has shape {tuple(value.shape)} but the parameter has shape "
                f"{tuple(p.shape)}; the checkpoint belongs to another model or another "
                "parameter order. Nothing was loaded.")

    def _check_saved_mesh(self, value, key, index, p):
        """A DTensor state of a DTensor parameter: on the parameter's mesh (its placements
        may differ: the load redistributes it as the parameter)."""
        if is_dtensor(value) and is_dtensor(p) and value.device_mesh != p.device_mesh:
            raise ValueError(
                f"{type(self).__name__}.load_state_dict: state {key!r} of parameter {index} "
                f"is a DTensor on {value.device_mesh} but the parameter is on "
                f"{p.device_mesh}; load the state through torch.distributed.checkpoint's "
                "get_state_dict / set_state_dict for this model, or pass full tensors. "
                "Nothing was loaded.")

    def _check_saved_scalar(self, value, key, what):
        """A saved one-element value (a step count: finite and not negative)."""
        name = type(self).__name__
        if isinstance(value, torch.Tensor):
            if value.is_meta:
                raise ValueError(f"{name}.load_state_dict: {what} is on the meta device, "
                                 "which holds no data. Nothing was loaded.")
            if value.numel() != 1:
                raise ValueError(f"{name}.load_state_dict: {what} has shape "
                                 f"{tuple(value.shape)}, expected one element. Nothing was "
                                 "loaded.")
            if value.dtype == torch.bool or value.is_complex():
                raise TypeError(f"{name}.load_state_dict: {what} is a {value.dtype} tensor, "
                                "expected a real number. Nothing was loaded.")
            if key != "step":
                return
            host = value.item()  # read once, at load
        elif isinstance(value, numbers.Real) and not isinstance(value, bool):
            host = value
        else:
            raise TypeError(f"{name}.load_state_dict: {what} is {_describe(value)}, expected "
                            "a number or a one-element tensor. Nothing was loaded.")
        if key == "step" and not (math.isfinite(host) and host >= 0
                                  and float(host).is_integer()):
            # (torch saves its counts as float tensors: 3.0 is a count, 1.5 is none, and
            # an int32 group step would truncate it)
            raise ValueError(f"{name}.load_state_dict: {what} is {host}; a step count is a "
                             "whole number >= 0. Nothing was loaded.")

    def _check_saved_group(self, saved, gi):
        """Checks of a saved group beyond the constructor's (see FusedAdam)."""

    def _saved_group_state(self, gi, first, group, saved, saved_state):
        """State a saved group keeps for its parameters, by position in the group:
        ``{position: {key: value}}``, used where a parameter's own state lacks the key.
        Apex's FusedAdam, FusedLAMB and FusedNovoGrad keep ``group["step"]``, the steps the
        group has taken."""
        step = saved.get("step")
        if step is None or "step" not in self._saved_keys()[1]:
            return {}
        self._check_saved_scalar(step, "step", f"'step' of parameter group {gi}")
        return {pos: {"step": step} for pos in range(len(saved["params"]))}

    @staticmethod
    def _restride_state(value, p, dtype=torch.float32):
        """fp32 (or ``dtype``) copy of a state tensor on ``p``'s device, laid out as ``p``
        when it has ``p``'s shape (for a DTensor parameter: sharded as ``p``; a full
        tensor saved unsharded is split as ``p`` is)."""
        if is_dtensor(p) and value.shape == p.shape and value.dim() > 0:
            if is_dtensor(value):
                value = value.detach().to(device=p.device, dtype=dtype, copy=True)
                if tuple(value.placements) != tuple(p.placements):
                    # (the check refused another mesh) laid out as the parameter again
                    value = value.redistribute(p.device_mesh, p.placements)
                return value
            from torch.distributed.tensor import distribute_tensor
            return distribute_tensor(value.detach().to(device=p.device, dtype=dtype),
                                     p.device_mesh, p.placements)
        if value.shape == p.shape and value.dim() > 0:
            value = value.to(device=p.device)
            return restride_like(value, p, dtype=dtype)
        return value.to(device=p.device, dtype=dtype, copy=True)

    def _state_dtype(self, key):
        """The dtype state ``key`` is kept in: fp32, but bf16 for Kahan compensations (and
        for Adam's moments under ``state_dtype=torch.bfloat16``)."""
        return torch.bfloat16 if key == "kahan_comp" else torch.float32

    # -- the step: per group a cached plan, rebuilt only when its tensors change ---------------
    def _links(self, gi, group):
        """Per group, what each parameter's step reads and writes (:class:`_GroupLinks`),
        cached until the group's parameters, the optimizer's generation or the master
        pairs registered with its step handoff change. ``models[i]`` is the half model
        parameter of the fp32 master ``params[i]`` (``step_handoff.masters``: the step
        reads its gradient while the master has none, and writes it), else None."""
        cache = self._links_cache.get(gi)
        params = group["params"]
        pairs = self.step_handoff.masters
        gen = (self._generation, pairs.version)
        # (the list's elements, not only its length: one swapped in place, with
        # params[i] = p, is another parameter. A master replaced in the state changes
        # the plan's key, and a plan prepared makes its links again: _group_plan)
        if cache is not None and cache[0] == gen and len(cache[1].params) == len(params) \
                and all(map(operator.is_, cache[1].params, params)) \
                and (not cache[1].sharded or all(
                    map(operator.is_, cache[1].shards, locals_of(params)))):
            return cache[1]
        self._check_listed_once(params, gi)  # (a list changed in place: before any write)
        self._check_in_one_group(params, gi)
        targets, copies, models = [], [], []
        model_of = pairs.model_of
        sharded = any_dtensor(params)
        for p in params:
            model = model_of(p)
            if model is not None:
                targets.append(p)
                copies.append(model)
                models.append(model)
            elif self._keeps_master(p):
                self._journal_new(p)
                st = self.state[p]
                if "master_param" not in st:
                    master = (p.detach().to(torch.float32, copy=True) if is_dtensor(p)
                              else restride_like(p.detach(), p, dtype=torch.float32))
                    self._journal(st, "kahan_comp", "master_param")
                    comp = dict.pop(st, "kahan_comp", None)  # a Kahan optimizer's checkpoint:
                    if comp is not None:                     # the weight it stood for
                        master.add_(comp.to(torch.float32))
                    dict.__setitem__(st, "master_param", master)
                targets.append(local(st["master_param"]))
                copies.append(local(p))
                models.append(None)
            else:
                targets.append(local(p))
                copies.append(None)
                models.append(None)
        links = _GroupLinks(params, targets, copies, models, sharded)
        self._links_cache[gi] = (gen, links)
        return links

    def _keeps_master(self, p):
        """Whether the optimizer keeps an fp32 master of ``p`` in ``state["master_param"]``
        (``master_weights=True``: every half parameter)."""
        return self.master_weights and p.dtype != torch.float32

    def _group_grads(self, links, grad_scale):
        """This step's gradients, one per parameter (None kept in place), and where the
        masters' came from: None (their own), ``"models"`` (every master reads its
        model parameter's) or the rows that read the model parameter's. The origin is
        part of the plan's key: a master's own gradient (fp32) and its model
        parameter's (half) have the same shape and strides but not the same dtype."""
        if links.sharded:  # each rank steps its shards: the gradients' local tensors
            return locals_of(map(_grad_of, links.params)), None
        if links.model_rows and grad_scale is not None:
            # amp left this step's half gradients scaled for us to read directly (without
            # a grad_scale they are stale, not this step's): a master without a gradient
            # of its own reads its model parameter's.
            if not any(map(_is_not_none, map(_grad_of, links.masters))):
                return list(map(_grad_of, links.lazy_sources)), "models"
            grads = list(map(_grad_of, links.params))
            rows = []
            for i in links.model_rows:
                if grads[i] is None:
                    grads[i] = links.models[i].grad
                    rows.append(i)
            return grads, tuple(rows)
        return list(map(_grad_of, links.params)), None

    def _group_plan(self, gi, group, grad_scale, write_grads=False, fresh=None):
        """The prepared sweep of group ``gi`` for this step's gradients, or None when no
        parameter of the group has a gradient. Cache key: the gradients' addresses,
        strides, sizes and dtypes, one entry per parameter, the same of what the step
        writes (a parameter narrowed or recast through ``.data`` keeps its address; a
        gradient of another dtype can land at a freed one's address), the optimizer's
        generation and its state's epoch. ``write_grads``: the sweep must be
        able to write the unscaled gradients back (checked, refused otherwise).
        ``fresh`` (a list) receives the parameters whose state this call creates, for
        the caller to drop if the step is refused."""
        if not isinstance(self.state, _TrackedStates):  # replaced wholesale by the user
            self._track_state()
            self._bump()
        kept_links = self._links_cache.get(gi) if hasattr(self, "_links_cache") else None
        links, grads, ptrs, rest = self._plan_key(gi, group, grad_scale)
        key = (ptrs, rest)
        cache = self._plans.get(gi)
        if cache is None:
            cache = self._plans[gi] = SweepCache()
        elif cache.states is not None and list(map(_data_ptr, cache.states[0])) != cache.states[1]:
            # A state tensor's storage was swapped in place (state["exp_avg"].data = ...,
            # as offloading helpers do): the kept sweep would read and write the old one
            # (freed memory on a GPU). Prepared again, and checked.
            cache.prepared = None
        found = cache.get(key)
        if found is not None:
            if write_grads:
                check_grads_writable(found)
            return found
        found = cache.prepared
        if found is not None and cache.key[1] == rest and found.rebindable \
                and self._rebind(found, grads, ptrs):
            # Only the gradients' addresses changed (on a CPU they do every step; under
            # FSDP2 the gradients are new tensors): the validated sweep takes this step's
            # (the Triton path writes their addresses into its tables).
            cache.key = key
            return found
        if self._links_cache.get(gi) is kept_links:
            # A plan is prepared over links kept from before: they are made again (a
            # parameter recast through .data changes whether it keeps a master; the
            # rounding check reads them), and the key with them.
            self._links_cache.pop(gi, None)
            if self._rounding is not None:
                self._rounding_checked = None
                self._check_rounding()
            links, grads, ptrs, rest = self._plan_key(gi, group, grad_scale)
            key = (ptrs, rest)
        rows = [i for i, g in enumerate(grads) if g is not None]
        if not rows:
            return cache.put(key, None)
        params, targets, copies = links.params, links.targets, links.copies
        if links.sharded:
            check_shards(params, gi, type(self).__name__)
        rows_targets = [targets[i] for i in rows]
        if fresh is not None:
            # State made by this plan (or only the master its links made) is new.
            fresh.extend(params[i] for i in rows
                         if set(self.state.get(params[i], ())) <= _LINK_STATE)
        states = [self._state_for(params[i], targets[i], group) for i in rows]
        if links.sharded:  # DTensor state (sharded as its parameter): its local shards
            states = [{k: local(v) for k, v in st.items()} for st in states]
        self._check_no_overlap(gi, rows, rows_targets, [copies[i] for i in rows], states)
        # Borrowed gradients: the kept plan must not keep this step's gradients alive.
        # (The sweep's rows are the group's parameters with a gradient: a refusal names
        # the parameter as the user knows it, and the step.)
        with row_labels(_ParamLabels(type(self).__name__, gi, rows)):
            prepared = self._prepare(group, rows_targets, borrowed([grads[i] for i in rows]),
                                     [copies[i] for i in rows], states,
                                     **self._rounding_lists(gi, group, rows, rows_targets,
                                                            states, params))
        if write_grads:
            check_grads_writable(prepared)
        held = [v for st in states for v in st.values() if isinstance(v, torch.Tensor)]
        cache.states = (held, list(map(_data_ptr, held)))
        return cache.put(key, prepared)

    def _plan_key(self, gi, group, grad_scale):
        """(links, gradients, the gradients' addresses, the rest of the key) of group
        ``gi``'s plan for this step (see :meth:`_group_plan`)."""
        links = self._group_links(gi, group)
        grads, origin = self._group_grads(links, grad_scale)
        name = type(self).__name__
        # a sparse gradient is refused here, named (group, index) in torch's words
        ptrs, layout = layout_key(grads, op=name, name=f"param_groups[{gi}] gradient")
        rest = (layout, origin, layout_key(links.written, op=name,
                                           name=f"param_groups[{gi}] parameter"),
                self._generation, self.state.epoch.value, self._plan_depends_on(group),
                # (stochastic rounding's keys are made from the group's seed)
                group.get("seed") if self._rounding == "stochastic" else None)
        return links, grads, ptrs, rest

    @staticmethod
    def _rebind(prepared, grads, ptrs):
        """``prepared.rebind`` of this step's gradients (None left out), with their
        addresses from the cache key."""
        if any(map(_is_none, grads)):
            ptrs = [a for a, g in zip(ptrs, grads) if g is not None]
            grads = [g for g in grads if g is not None]
        return prepared.rebind("grads", grads, addresses=ptrs)

    def _group_links(self, gi, group):
        if not hasattr(self, "_links_cache"):  # unpickled, or a subclass skipped __init__
            self._links_cache = {}
            self._plans = {}
            self._generation = getattr(self, "_generation", 0)
        return self._links(gi, group)

    def _zero_state(self, p, target, dtype=torch.float32):
        """A new fp32 (or ``dtype``) state tensor of zeros for parameter ``p``, laid out as
        ``target``.
        For a DTensor parameter it is a DTensor sharded as the parameter (or its master),
        which torch.distributed.checkpoint saves and loads by shard; its local tensor is
        laid out as the target."""
        like = self.state[p].get("master_param", p) if is_dtensor(p) else target
        return torch.zeros_like(like, dtype=dtype, memory_format=torch.preserve_format)

    def _state_for(self, p, target, group):
        """The state of parameter ``p`` (created on first use: fp32, laid out as ``target``)."""
        st = self.state[p]
        # (what this changes is undone if the step is refused: see _journal)
        self._journal(st, *self._STATE_LIKE, *self._STATE_SCALARS, "kahan_comp",
                      "master_param")
        # Created with dict.__setitem__: a plan being built is not a change of state.
        for key in self._STATE_LIKE:
            if key not in st:
                dict.__setitem__(st, key, self._zero_state(p, target, self._state_dtype(key)))
        for key in self._STATE_SCALARS:
            if key not in st:
                dict.__setitem__(st, key, torch.zeros((), dtype=torch.float32,
                                                      device=target.device))
        kahan = self._rounding == "kahan" and target.dtype == torch.bfloat16
        if kahan and "kahan_comp" not in st:
            comp = self._zero_state(p, target, self._state_dtype("kahan_comp"))
            master = st.get("master_param")
            if master is not None and not self._keeps_master(p):
                # a masters optimizer's checkpoint: what the bf16 weight drops of its master,
                # rounded to nearest; truncated (as a step stores it) where a remainder just
                # under half an ulp rounded to half an ulp: weight + compensation was then a
                # tie that rounds to the weight's other neighbour (a skipped step on the CPU
                # path, which stores the split of weight + compensation, moved the weight)
                from tritamp.kernels.rounding import kahan_remainder_
                weight = local(p).detach()
                rest = local(master).to(torch.float32) - weight.to(torch.float32)
                near = rest.to(torch.bfloat16)
                moved = (weight.to(torch.float32) + near.to(torch.float32)).to(
                    torch.bfloat16) != weight
                local(comp).copy_(torch.where(moved, kahan_remainder_(rest.clone()).to(
                    torch.bfloat16), near))
            dict.__setitem__(st, "kahan_comp", comp)
        if not self._keeps_master(p):
            dict.pop(st, "master_param", None)  # loaded from a masters optimizer: not used
        if not kahan:
            dict.pop(st, "kahan_comp", None)  # loaded from a Kahan optimizer: not used
        return st

    def _journal(self, st, *keys):
        """Note ``st``'s values of ``keys`` before a step that is being validated changes
        them (a master made, a checkpoint's master or compensation converted or dropped):
        a refused step puts them back (:meth:`_step_groups`)."""
        journal = self.__dict__.get("_step_journal")
        if journal is not None:
            journal.extend((st, k, dict.get(st, k, _ABSENT)) for k in keys)

    def _journal_new(self, p):
        """Note that ``p`` has no state yet, before a step being validated makes one."""
        journal = self.__dict__.get("_step_journal")
        if journal is not None and p not in self.state:
            journal.append((None, p, _ABSENT))

    # -- bf16 parameters without masters: stochastic rounding, Kahan summation ---------------
    def _check_rounding(self):
        """With ``stochastic_rounding`` or ``kahan_summation``: refuse (ValueError, before
        anything changes) a step whose parameters include fp32 masters of amp's, or
        that has no bf16 parameter to act on. Checked again only when the parameters
        or amp's master pairs change."""
        pairs = self.step_handoff.masters
        key = (self._generation, pairs.version)
        if self._rounding_checked == key:
            return
        name = type(self).__name__
        flag = "stochastic_rounding" if self._rounding == "stochastic" else "kahan_summation"
        found = False
        for gi, group in enumerate(self.param_groups):
            links = self._group_links(gi, group)
            if links.model_rows:
                raise ValueError(
                    f"{name}: {flag}=True acts on bf16 parameters without fp32 masters, but "
                    f"amp gave this optimizer fp32 master weights (parameter group {gi}); "
                    "initialize with amp.initialize(..., opt_level='O2', "
                    "half_dtype=torch.bfloat16, master_weights=False). Nothing was changed.")
            found = found or any(t.dtype == torch.bfloat16 for t in links.targets)
        if not found:
            dtypes = sorted({_dtype_name(p.dtype) for g in self.param_groups
                             for p in g["params"]})
            raise ValueError(
                f"{name}: {flag}=True acts on bf16 parameters, but this optimizer has none "
                f"(its parameters are {', '.join(dtypes) or 'none'}); cast the model to "
                "bf16 (model.to(torch.bfloat16), or amp.initialize(..., opt_level='O2', "
                "half_dtype=torch.bfloat16, master_weights=False)), or drop the flag. "
                "Nothing was changed.")
        self._rounding_checked = key

    def _rounding_lists(self, gi, group, rows, targets, states, params):
        """The ``comps`` or ``keys`` list of a group's sweep (one entry per row, None for
        rows that are not bf16), as keyword arguments for :meth:`_prepare`. A key is made
        from the group's seed and the parameter's position among the optimizer's; for a
        DTensor parameter also from which shard this process holds
        (:func:`~tritamp.sharding.shard_index`: its element offsets are local)."""
        if self._rounding is None:
            return {}
        bf16 = [t.dtype == torch.bfloat16 for t in targets]
        if self._rounding == "kahan":
            return {"comps": [st["kahan_comp"] if b else None for st, b in zip(states, bf16)]}
        from tritamp.kernels.rounding import mix32, param_key
        first = sum(len(g["params"]) for g in self.param_groups[:gi])
        seed = int(group["seed"])
        picked = [i for i, b in zip(rows, bf16) if b]
        if not picked:
            return {"keys": None}
        device = targets[bf16.index(True)].device
        keys = []
        for i in picked:
            key, shard = param_key(seed, first + i), shard_index(params[i])
            keys.append(key if shard == 0 else mix32(key ^ mix32(shard)))
        made = torch.tensor(keys, dtype=torch.int64)
        made = iter(made.to(device).unbind(0))
        return {"keys": [next(made) if b else None for b in bf16]}

    def step(self, closure=None):
        """One fused step (see the module docstring), with autograd off. Under
        ``torch.compile`` the step is one custom op whose implementation is this eager
        step (:mod:`tritamp.compiled`)."""
        if torch.compiler.is_compiling():
            # (no grad-mode change in the graph: the op's eager step turns autograd off
            # itself, and a graph that raised between two grad-mode changes would leave
            # autograd off for the caller)
            return compiled.step(self, closure)
        # torch's LR schedulers check that optimizer.step() ran (they leave this step
        # unwrapped: see _wrapped_by_lr_sched below)
        self._opt_called = True
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        # torch.no_grad() without its context object (a few microseconds a step)
        if _grad_enabled():
            _set_grad_enabled(False)
            try:
                self._step_groups()
            finally:
                _set_grad_enabled(True)
        else:
            self._step_groups()
        return loss

    # torch's LR schedulers wrap an optimizer's step to note that it ran, unless it says it
    # does so itself (as this one does): their wrapper lives in a file Dynamo does not
    # trace, and would break a torch.compile(optimizer.step, fullgraph=True).
    step._wrapped_by_lr_sched = True

    def _step_groups(self):
        """The step itself, autograd off: every group's plan, validated before anything is
        written, then every group's launch."""
        handoff = self.step_handoff
        _, grad_scale, found_inf, write_grads = handoff.take(self)
        fresh = []
        journal = self._step_journal = []
        try:
            if self._rounding is not None:
                self._check_rounding()
            if self._NORMS_OF_WHOLE_TENSORS:
                self._shard_reduce()  # a set of parameters it cannot reduce over is refused
            for gi, group in enumerate(self.param_groups):
                self._check_step_options(gi, group)
            plans = [self._group_plan(gi, group, grad_scale, write_grads, fresh)
                     for gi, group in enumerate(self.param_groups)]
            # amp's scale and flag, before the masters follow their weights and before a
            # norm over the groups reads them (each launcher checks them again)
            for plan in plans:
                if plan is not None:
                    check_amp_args(getattr(plan, "prepared", plan).device,
                                   grad_scale=grad_scale, found_inf=found_inf)
        except Exception:
            handoff.reset()
            self._step_journal = None
            # a refused step leaves the state as it was: what validating it changed in
            # place is put back, and state it created is dropped, in any group
            for st, key, old in reversed(journal):
                if st is None:  # (a parameter that had no state)
                    dict.pop(self.state, key, None)
                elif old is _ABSENT:
                    dict.pop(st, key, None)
                else:
                    dict.__setitem__(st, key, old)
            for p in fresh:
                dict.pop(self.state, p, None)
            if fresh or journal:
                self._bump()  # plans and links that hold the dropped state
            raise
        self._step_journal = None
        launched = plans
        if write_grads:
            launched = [None if p is None else GradWrites(p) for p in plans]
        try:
            owned = self._owned_masters()
            if owned:
                self._masters_follow_written_weights(owned)
            comped = self._kahan_pairs() if self._rounding == "kahan" else ()
            if comped:
                self._comps_follow_written_weights(comped)
            extra = self._before_groups(plans, grad_scale)
            for gi, (group, prepared) in enumerate(zip(self.param_groups, plans)):
                if prepared is not None:
                    self._launch(group, launched[gi], grad_scale, found_inf, **extra)
                    if prepared.rebindable and not prepared.triton:
                        # A kept CPU sweep holds this step's gradients only while it runs.
                        prepared.release("grads")
                        cache = self._plans[gi]
                        cache.key = (None, cache.key[1])
            if owned:
                self._weight_versions = _versions(owned)
            if comped:
                self._comp_versions = _versions(comped)
        except BaseException:
            handoff.reset()  # no stale handoff for the next step
            raise
        handoff.stepped()

    def _owned_masters(self):
        """[(half weight, its fp32 master)] of the masters this optimizer keeps itself
        (``master_weights=True``), from the groups' current links."""
        if not self.master_weights:
            return ()
        owned = []
        for gi in range(len(self.param_groups)):
            cached = self._links_cache.get(gi)
            if cached is not None:
                owned.extend(cached[1].owned)
        return owned

    def _masters_follow_written_weights(self, owned):
        """A half weight written since the last step (``model.load_state_dict``, EMA
        weights copied in, a layer re-initialised: its version counter moved) becomes its
        master's value, so the step updates what was written instead of overwriting it
        with the stale master (Apex's masters did), and so does one given new storage
        (``p.data = t``). A write through ``.data`` into the same storage
        (``p.data.copy_(t)``) moves no counter and is not seen. Runs once the step is
        validated: a refused step leaves the masters as they were."""
        for weight, master in _written(owned, self.__dict__.get("_weight_versions")):
            master.copy_(weight)

    def _kahan_pairs(self):
        """[(bf16 weight, its Kahan compensation)] of the groups' current links."""
        pairs = []
        state = self.state
        for gi in range(len(self.param_groups)):
            cached = self._links_cache.get(gi)
            if cached is None:
                continue
            links = cached[1]
            for p, t, c in zip(links.params, links.targets, links.copies):
                if c is None and t.dtype == torch.bfloat16:
                    comp = dict.get(state, p, {}).get("kahan_comp")
                    if comp is not None:
                        pairs.append((t, local(comp)))
        return pairs

    def _comps_follow_written_weights(self, pairs):
        """A bf16 weight written since the last step (``model.load_state_dict``, a layer
        re-initialised, ``p.data = t``: its version counter or address moved) is exact as
        written: its compensation, which held what rounding dropped of the weight before,
        is zeroed (added to the new weight it moved it, by up to half an ulp of the old
        one). As for masters, a write through ``.data`` into the same storage is not seen.
        Runs once the step is validated."""
        for _, comp in _written(pairs, self.__dict__.get("_comp_versions")):
            comp.zero_()

    def _shard_reduce(self):
        """The :class:`~tritamp.sharding.ShardReduce` of this optimizer's DTensor
        parameters (None without them), kept while its parameters stay the same."""
        cached = getattr(self, "_shard_reduce_cache", None)
        if cached is None or cached[0] != self._generation:
            params = [p for group in self.param_groups for p in group["params"]]
            cached = (self._generation, ShardReduce.for_params(params, type(self).__name__))
            self._shard_reduce_cache = cached
        return cached[1]

    def _norm_reduce(self):
        """What the LAMB and NovoGrad sweeps call to reduce per-tensor norms across the
        shards (their ``norm_reduce``), or None."""
        reduce = self._shard_reduce()
        return None if reduce is None else reduce.reduce_

    def _plan_depends_on(self, group):
        """Hyperparameters that change what a group's plan holds (SGD: momentum or not)."""
        return None

    def _before_groups(self, plans, grad_scale):
        """Work over every group's gradients before the updates (LAMB's global norm);
        returns keyword arguments for _launch."""
        return {}

    def _prepare(self, group, targets, grads, copies, states, comps=None, keys=None):
        """Validate and plan one group's sweep (kept while its tensors stay the same).
        ``comps`` / ``keys``: the rows' Kahan compensations or stochastic rounding keys
        (None per row where they do not apply)."""
        raise NotImplementedError

    def _launch(self, group, prepared, grad_scale, found_inf):
        """One step of a group over its prepared sweep."""
        raise NotImplementedError
