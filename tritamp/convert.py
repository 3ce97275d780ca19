"""``convert_to_amp``: ColossalAI-style mixed-precision configuration on tritamp.

ColossalAI configured mixed precision with a dict, ``fp16=dict(mode=..., ...)``, and
``convert_to_amp(model, optimizer, criterion, mode, amp_config)`` returned the model, an
optimizer wrapper with ``backward(loss)`` / ``step()`` and the criterion. Its three
modes each map onto one ``tritamp.amp.initialize`` call (one policy, one device-side
scaler), so the returned objects train like any tritamp model and optimizer:

    mode     ColossalAI                                  tritamp
    "apex"   apex.amp.initialize(**config)               amp.initialize(**config) (O1 default)
    "torch"  autocast forward + torch GradScaler         O1: autocast forward, dynamic scaler
    "naive"  model.half(), fp32 masters, dynamic scaler  O2: half model (BatchNorm too), fp32
             with hysteresis (2), growth every 1000      masters, hysteresis 2, growth 1000
"""
import collections.abc
import math
import numbers

import torch
import torch.nn as nn

from . import amp
from .amp.state import loss_scalers
from .amp.checkpoint import check_state_dict as check_amp_state_dict
from .amp.scaler import check_scaler_args
from .optimizers.clip import clip_grad_norm_

__all__ = ["convert_to_amp", "AmpOptimizer", "AutocastLoss"]

MODES = ("apex", "torch", "naive")

# keys every mode accepts: the scaler settings of amp.initialize, and the half dtype
_SCALER_KEYS = ("init_scale", "growth_factor", "backoff_factor", "growth_interval", "hysteresis")
_APEX_KEYS = ("enabled", "opt_level", "cast_model_type", "patch_torch_functions",
              "keep_batchnorm_fp32", "master_weights", "loss_scale", "cast_model_outputs",
              "num_losses", "verbosity", "min_loss_scale", "max_loss_scale", "half_dtype"
              ) + _SCALER_KEYS
_TORCH_KEYS = ("enabled", "verbosity", "half_dtype", "min_loss_scale") + _SCALER_KEYS
_NAIVE_KEYS = ("initial_scale", "min_scale", "max_scale", "dynamic_grad_scale", "verbose",
               "clip_grad_norm", "keep_batchnorm_fp32", "half_dtype") + _SCALER_KEYS


def _mode_name(mode):
    name = getattr(mode, "value", mode)  # ColossalAI's AMP_TYPE enum carries the string
    if isinstance(name, str) and name.lower() in MODES:
        return name.lower()
    raise ValueError(f"mode must be one of {MODES} (or ColossalAI's AMP_TYPE), got {mode!r}")


def _check_keys(mode, config, allowed):
    unknown = sorted(set(config) - set(allowed))
    if unknown:
        raise TypeError(f"convert_to_amp(mode={mode!r}) got unknown config key(s) {unknown}; "
                        f"this mode accepts {sorted(allowed)}")


def _apex_kwargs(config):
    kwargs = dict(config)
    kwargs.setdefault("opt_level", "O1")  # apex.amp.initialize's default, as ColossalAI passed it
    return kwargs, 0.0


def _check_bool(mode, name, value):
    if not isinstance(value, bool):
        raise TypeError(f"convert_to_amp(mode={mode!r}): {name} must be True or False, got "
                        f"{type(value).__name__} {value!r}")


def _torch_kwargs(config):
    kwargs = dict(config)
    if "enabled" in kwargs:
        _check_bool("torch", "enabled", kwargs["enabled"])
    # torch.amp.GradScaler: always dynamic (bf16 too), no ceiling, defaults 2**16 / 2 / 0.5 / 2000
    kwargs.update(opt_level="O1", loss_scale="dynamic", max_loss_scale=None)
    return kwargs, 0.0


def _naive_kwargs(config):
    config = dict(config)
    if "initial_scale" in config and "init_scale" in config:
        raise TypeError("convert_to_amp(mode='naive'): pass initial_scale or init_scale, not both")
    init_name = "init_scale" if "init_scale" in config else "initial_scale"
    init_scale = config.pop("initial_scale", config.pop("init_scale", 2.**16))
    dynamic = config.pop("dynamic_grad_scale", True)
    if not isinstance(dynamic, bool):
        raise TypeError(f"convert_to_amp(mode='naive'): dynamic_grad_scale must be True or "
                        f"False, got {type(dynamic).__name__} {dynamic!r}")
    verbose = config.pop("verbose", False)
    _check_bool("naive", "verbose", verbose)
    hysteresis = config.pop("hysteresis", 2)
    if isinstance(hysteresis, bool) or not isinstance(hysteresis, numbers.Integral):
        raise TypeError(f"convert_to_amp(mode='naive'): hysteresis must be an int >= 0, got "
                        f"{type(hysteresis).__name__} {hysteresis!r}; pass e.g. 2 (the default)")
    if hysteresis < 0:
        raise ValueError(f"convert_to_amp(mode='naive'): hysteresis must be an int >= 0, got "
                         f"{hysteresis}; pass e.g. 2 (the default)")
    min_scale, max_scale = config.pop("min_scale", None), config.pop("max_scale", None)
    if not dynamic:
        # ColossalAI's ConstantGradScaler: the scale stays where it starts, and the naive
        # optimizer still checks every step and skips an overflowing one. A dynamic scale
        # held between a floor and a ceiling at its start does that (a static loss_scale
        # is not checked: an overflow's inf/NaN were stepped into the weights).
        min_scale = max_scale = init_scale
    kwargs = dict(
        opt_level="O2",
        # NaiveAMPModel runs model.half(): BatchNorm in half too, unless asked otherwise
        keep_batchnorm_fp32=config.pop("keep_batchnorm_fp32", False),
        loss_scale="dynamic",
        init_scale=init_scale,
        growth_factor=config.pop("growth_factor", 2.),
        backoff_factor=config.pop("backoff_factor", 0.5),
        growth_interval=config.pop("growth_interval", 1000),
        # ColossalAI backs off once hysteresis overflows are counted; 0 behaves as 1
        hysteresis=max(1, int(hysteresis)),
        min_loss_scale=min_scale,
        max_loss_scale=max_scale,
        verbosity=1 if verbose else 0,
        half_dtype=config.pop("half_dtype", torch.float16),
    )
    # The scale settings under ColossalAI's names, checked before anything is built.
    check_scaler_args(kwargs["loss_scale"], init_scale, kwargs["growth_factor"],
                      kwargs["growth_interval"], kwargs["min_loss_scale"],
                      kwargs["max_loss_scale"], kwargs["backoff_factor"], kwargs["hysteresis"],
                      arg_names={"loss_scale": init_name, "init_scale": init_name,
                                 "scale_factor": "growth_factor",
                                 "scale_window": "growth_interval",
                                 "min_loss_scale": "min_scale", "max_loss_scale": "max_scale"})
    clip = config.pop("clip_grad_norm", 0.0)
    if isinstance(clip, bool) or not isinstance(clip, numbers.Real):
        raise TypeError(f"convert_to_amp(mode='naive'): clip_grad_norm must be a number >= 0 "
                        f"(0 disables clipping), got {type(clip).__name__} {clip!r}")
    if not (math.isfinite(clip) and clip >= 0.0):
        raise ValueError(f"convert_to_amp(mode='naive'): clip_grad_norm must be a finite number "
                         f">= 0 (0 disables clipping), got {clip!r}")
    return kwargs, float(clip)


_MODE_TABLE = {
    "apex": (_APEX_KEYS, _apex_kwargs),
    "torch": (_TORCH_KEYS, _torch_kwargs),
    "naive": (_NAIVE_KEYS, _naive_kwargs),
}


def convert_to_amp(model, optimizer, criterion=None, mode=None, amp_config=None, **config):
    """Set up mixed precision from a ColossalAI-style configuration.

    ``mode`` is ``"apex"`` (the default), ``"torch"`` or ``"naive"`` (or ColossalAI's
    ``AMP_TYPE``); the configuration comes as keyword arguments, as ``amp_config`` (a
    dict, ColossalAI's calling convention), or both. A ``mode`` key inside it is read
    too, so ``convert_to_amp(model, optimizer, criterion, **fp16)`` takes ColossalAI's
    ``fp16=dict(mode=..., ...)`` as it is. Returns ``(model, optimizer, criterion)``:
    the model prepared by ``tritamp.amp.initialize``, an :class:`AmpOptimizer` with
    ``backward(loss)``, ``step()``, ``zero_grad()`` and ``clip_grad_norm(model, max_norm)``,
    and the criterion (wrapped to run under autocast in ``"torch"`` mode, as ColossalAI's
    ``TorchAMPLoss``). Like ``initialize``, it configures the process's loss scalers:
    call it once per training setup.
    """
    if amp_config is not None and not isinstance(amp_config, collections.abc.Mapping):
        raise TypeError(f"convert_to_amp: amp_config must be a dict of settings (ColossalAI's "
                        f"fp16 config), got {type(amp_config).__name__} {amp_config!r}; pass "
                        "e.g. amp_config=dict(mode='torch'), or the settings as keywords")
    config = {**(amp_config or {}), **config}
    config_mode = config.pop("mode", None)
    if mode is not None and config_mode is not None and _mode_name(mode) != _mode_name(config_mode):
        raise ValueError(f"convert_to_amp got mode={mode!r} and a config with mode={config_mode!r}; "
                         "pass one of them")
    mode = mode if mode is not None else config_mode if config_mode is not None else "apex"
    mode = _mode_name(mode)
    if isinstance(optimizer, AmpOptimizer):
        raise TypeError("convert_to_amp got an optimizer convert_to_amp already returned; "
                        "convert a model and optimizer once (build a fresh optimizer to "
                        "convert again)")
    if isinstance(optimizer, (list, tuple)) or not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError("convert_to_amp takes one torch.optim.Optimizer; for several models and "
                        "optimizers call tritamp.amp.initialize directly")
    allowed, to_kwargs = _MODE_TABLE[mode]
    _check_keys(mode, config, allowed)
    kwargs, clip = to_kwargs(config)
    model, optimizer = amp.initialize(model, optimizer, **kwargs)
    enabled = kwargs.get("enabled", True)
    if mode == "torch" and criterion is not None and enabled:
        criterion = AutocastLoss(criterion, dtype=kwargs.get("half_dtype", torch.float16))
    # torch's GradScaler and ColossalAI's naive optimizer check, unscale and move the
    # scale once per step(), whatever number of backward passes accumulated into it
    return model, AmpOptimizer(optimizer, clip_grad_norm=clip,
                               per_step=mode in ("torch", "naive")), criterion


class AmpOptimizer:
    """The optimizer ``convert_to_amp`` returns: ColossalAI's optimizer-wrapper interface
    over an optimizer prepared by ``tritamp.amp.initialize``.

    ``backward(loss)`` runs ``amp.scale_loss``; ``step()`` clips the fp32 master gradients
    first when a ``clip_grad_norm`` was configured (naive mode) and skips on overflow;
    ``optim`` is the optimizer itself (hand it to LR schedulers). ``state_dict()`` holds
    the optimizer's state and the loss scalers' (key ``"amp"``).

    ``per_step`` (the torch and naive modes): as torch's GradScaler and ColossalAI's
    naive optimizer, the gradients of every ``backward`` before a ``step()`` accumulate
    scaled, and the check, the unscale and the scale's update run once, at the step (or
    at a clip before it); otherwise (the apex mode) at each backward, as Apex's
    ``scale_loss`` exit did.
    """

    def __init__(self, optim, clip_grad_norm=0.0, per_step=False):
        self.optim = optim
        self.max_norm = float(clip_grad_norm)
        self.per_step = bool(per_step)
        self._scaled = False  # per_step: backward passes wait, scaled, for the step
        self._no_loss = None  # per_step: the zero "loss" of the step's scale_loss, kept

    # -- the optimizer's own interface ---------------------------------------------------
    @property
    def param_groups(self):
        return self.optim.param_groups

    @property
    def defaults(self):
        return self.optim.defaults

    @property
    def state(self):
        return self.optim.state

    @property
    def parameters(self):
        return [p for group in self.optim.param_groups for p in group["params"]]

    def add_param_group(self, *args, **kwargs):
        return self.optim.add_param_group(*args, **kwargs)

    def zero_grad(self, *args, **kwargs):
        self.optim.zero_grad(*args, **kwargs)

    def state_dict(self):
        sd = dict(self.optim.state_dict())
        sd["amp"] = amp.state_dict()
        return sd

    def load_state_dict(self, state_dict):
        state_dict = dict(state_dict)
        amp_state = state_dict.pop("amp", None)
        load_amp = None
        if amp_state is not None and loss_scalers():
            load_amp = check_amp_state_dict(amp_state)  # refused before anything loads
        self.optim.load_state_dict(state_dict)
        if load_amp is not None:
            load_amp()

    # -- mixed precision ---------------------------------------------------------------------
    def backward(self, loss, retain_graph=False):
        """``loss.backward()`` through ``amp.scale_loss``: scaled, checked, unscaled (with
        ``per_step``, checked and unscaled at the step, with every other backward's)."""
        with amp.scale_loss(loss, self.optim, delay_unscale=self.per_step) as scaled_loss:
            scaled_loss.backward(retain_graph=retain_graph)
        if self.per_step:
            self._scaled = True

    def _unscale(self):
        """``per_step``: check and unscale what the backward passes since the last step
        left scaled, and move the scale, once (a ``scale_loss`` block without a backward
        of its own)."""
        if not self._scaled:
            return
        self._scaled = False
        if self._no_loss is None:
            device = next((p.device for g in self.optim.param_groups for p in g["params"]),
                          torch.device("cpu"))
            self._no_loss = torch.zeros((), device=device)
        with amp.scale_loss(self._no_loss, self.optim):
            pass

    def step(self, *args, **kwargs):
        """Clip (when configured), then step; skipped when the gradients overflowed."""
        self._unscale()
        if self.max_norm > 0.0:
            clip_grad_norm_(amp.master_params(self.optim), self.max_norm)
        return self.optim.step(*args, **kwargs)

    def clip_grad_norm(self, model, max_norm):
        """Clip the gradients the optimizer will use (fp32 masters, unscaled) to
        ``max_norm``; returns the total norm as a device tensor (no host sync).

        With a ``clip_grad_norm`` configured (naive mode) ``step()`` clips, and this
        accepts only that same value, as ColossalAI's naive optimizer did, returning None
        (the clipping happens in the step). A refused value is refused before the step's
        pending unscale: the gradients and the loss scaler stay as they were."""
        if self.max_norm > 0.0 and float(max_norm) != self.max_norm:
            raise RuntimeError("This optimizer clips gradients during step() (clip_grad_norm="
                               f"{self.max_norm} in the amp config), so clip_grad_norm("
                               f"max_norm={max_norm}) is not allowed. Drop one of the two.")
        self._unscale()
        if self.max_norm > 0.0:
            return None
        if max_norm > 0:
            return clip_grad_norm_(amp.master_params(self.optim), max_norm)
        return None

    def clip_grad_by_norm(self, max_norm, norm_type=2.0, error_if_nonfinite=False):
        """``clip_grad_norm_`` over the master parameters (unscaled first)."""
        self._unscale()
        return clip_grad_norm_(amp.master_params(self.optim), max_norm, norm_type,
                               error_if_nonfinite=error_if_nonfinite)

    @property
    def loss_scale(self):
        """The current loss scale as a Python float (reads the device)."""
        scalers = loss_scalers()
        return scalers[0].loss_scale() if scalers else 1.0


def _device_type(args, kwargs):
    for v in list(args) + list(kwargs.values()):
        if isinstance(v, torch.Tensor):
            return v.device.type
    return "cpu"


class AutocastLoss(nn.Module):
    """A criterion run under ``torch.autocast`` with the half dtype (ColossalAI's
    ``TorchAMPLoss``). ``loss`` is the wrapped criterion."""

    def __init__(self, loss, dtype=torch.float16):
        super().__init__()
        self.loss = loss
        self.dtype = dtype

    def forward(self, *args, **kwargs):
        with torch.autocast(_device_type(args, kwargs), dtype=self.dtype):
            return self.loss(*args, **kwargs)
