"""Loss scalers of Apex's ``fp16_utils``, on tritamp's device-side scaler.

There is one scaler in tritamp: :class:`tritamp.amp.scaler.LossScaler`, whose scale,
growth tracker and overflow flag live on the device and are updated by one kernel.
Everything here drives it:

- :class:`OptimizerLossScaler` is the scaler :class:`~tritamp.fp16_utils.FP16_Optimizer`
  owns: amp's scaler reporting a skipped step with FP16_Optimizer's message.
- :class:`LossScaler` (static) and :class:`DynamicLossScaler` keep the legacy
  stand-alone API of ``apex.fp16_utils`` (``loss_scale`` property, ``has_overflow``,
  ``update_scale(overflow)``, ``backward``) for scripts that scale by hand.
"""
import logging

import torch

from tritamp import kernels as K
from tritamp.amp.scaler import LossScaler as _DeviceLossScaler
from tritamp.amp.scaler import check_number, check_scaler_args

from ._kept import KeptSweeps
from .fp16util import to_python_float

_CHECKS = KeptSweeps("has_overflow")  # the legacy scalers' overflow checks

logger = logging.getLogger("tritamp.fp16_utils")

__all__ = ["LossScaler", "DynamicLossScaler", "OptimizerLossScaler", "to_python_float"]


class OptimizerLossScaler(_DeviceLossScaler):
    """tritamp's amp scaler, reporting a skipped step as Apex's FP16_Optimizer did:
    ``OVERFLOW! Skipping step. Attempted loss scale: 65536.0, reducing to 32768.0``
    (logger ``tritamp.fp16_utils``, WARNING; ``report=False`` silences it).

    The report is read from a non-blocking copy of the device state once it has landed
    (as amp's are), so it never makes the host wait."""

    def __init__(self, loss_scale="dynamic", report=True, **kwargs):
        super().__init__(loss_scale, **kwargs)
        self.report = report

    def set_scale(self, value):
        """Replace the current scale (a Python number > 0, taken as it is: a dynamic one is
        not brought within the floor and ceiling)."""
        self._replace_scale(value, "loss_scale", "128.0", within_bounds=False)

    def _report(self, snapshot):
        values = snapshot.values()
        skipped = values[K.SKIPPED]
        new_skips = int(skipped - self._seen_skipped)
        if new_skips > 0 and self.report:
            scale, used = values[K.SCALE], values[K.USED_SCALE]
            more = "" if new_skips == 1 else f" ({new_skips} steps skipped since the last report)"
            if scale < used:
                logger.warning("OVERFLOW! Skipping step. Attempted loss scale: %s, reducing to %s%s",
                               used, scale, more)
            else:
                logger.warning("OVERFLOW! Skipping step. Attempted loss scale: %s, keeping it%s",
                               used, more)
        # Counted here, so amp's own skip message stays silent; its warning about a scale
        # stuck at the floor still applies.
        self._seen_skipped = skipped
        super()._report(snapshot)


def _count_arg(name, value, low=0):
    """An int attribute of the legacy scaler (not a bool), at least ``low``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"DynamicLossScaler.{name} must be an int >= {low}, got {value!r}")
    return value


def _found_inf_of(tensors):
    """A 0-d fp32 device flag, 1.0 when any tensor holds inf/NaN (one launch per dtype)."""
    tensors = [t for t in tensors if t is not None]
    if not tensors:
        return None
    found = torch.zeros((), dtype=torch.float32, device=tensors[0].device)
    _CHECKS.run(tensors, found_inf=found)
    return found


class _LegacyScaler:
    """Apex's stand-alone scaler API over a device-side scaler."""

    def __init__(self, scaler):
        self._scaler = scaler

    @property
    def loss_scale(self):
        """The current scale as a Python float (reads the device)."""
        return self._scaler.loss_scale()

    @property
    def cur_scale(self):
        """The current scale (Apex's attribute): reads the device; setting it replaces
        the scale (a finite number > 0), as scripts restoring a checkpoint do."""
        return self._scaler.loss_scale()

    @cur_scale.setter
    def cur_scale(self, value):
        self._scaler.set_scale(value)

    def has_overflow(self, params):
        """True when a gradient of ``params`` holds inf/NaN. One check launch per dtype
        group and one host read (this API returns a Python bool)."""
        found = _found_inf_of([p.grad for p in params])
        return False if found is None else bool(found)

    @staticmethod
    def _has_inf_or_nan(x):
        return bool(_found_inf_of([x]))

    def scale_gradient(self, module, grad_in, grad_out):
        return tuple(self.loss_scale * g for g in grad_in)

    def backward(self, loss, retain_graph=False):
        """``(loss * loss_scale).backward()``; the scale is read on the device."""
        scale = self._scaler.follow_loss(loss, (), "LossScaler.backward")[K.SCALE]
        (loss * scale).backward(retain_graph=retain_graph)

    def state_dict(self):
        return self._scaler.state_dict()

    def load_state_dict(self, state_dict):
        self._scaler.load_state_dict(state_dict)


class LossScaler(_LegacyScaler):
    """A static loss scale (Apex's ``fp16_utils.LossScaler(scale=1)``).

    Unlike Apex's, ``has_overflow`` really checks the gradients, so a script that skips
    on overflow skips with a static scale too; ``update_scale`` keeps the scale."""

    def __init__(self, scale=1):
        scale = check_number("scale", scale, "pass a finite number > 0 such as 128.0")
        super().__init__(OptimizerLossScaler(scale, report=False,
                                             arg_names={"loss_scale": "scale"}))

    def update_scale(self, overflow):
        pass


_LEGACY_NAMES = {"scale_factor": "scale_factor", "scale_window": "scale_window",
                 "min_loss_scale": None}


class DynamicLossScaler(_LegacyScaler):
    """Apex's ``fp16_utils.DynamicLossScaler``: start at ``init_scale``, divide by
    ``scale_factor`` on overflow (never below 1), multiply by it after ``scale_window``
    consecutive clean iterations. The scale lives on the device; ``update_scale``
    given a device tensor makes no host sync.

    As in Apex, ``scale_factor``, ``scale_window``, ``cur_iter``, ``last_overflow_iter``
    and ``cur_scale`` are attributes the next ``update_scale`` follows when a script sets
    them (checked: ``scale_factor`` a finite number > 1, ``scale_window`` an int >= 1).
    ``last_overflow_iter`` is recorded for overflows passed as bools; one passed as a
    device tensor is not read back, so it is not recorded there (the growth count on the
    device still restarts)."""

    def __init__(self, init_scale=2**32, scale_factor=2., scale_window=1000):
        super().__init__(OptimizerLossScaler("dynamic", report=False, init_scale=init_scale,
                                             scale_factor=scale_factor, scale_window=scale_window,
                                             min_loss_scale=1.0, max_loss_scale=None,
                                             arg_names=_LEGACY_NAMES))
        self._cur_iter = 0
        self._last_overflow_iter = -1

    @property
    def scale_factor(self):
        return self._scaler.growth_factor

    @scale_factor.setter
    def scale_factor(self, value):
        args = check_scaler_args("dynamic", scale_factor=value, arg_names=_LEGACY_NAMES)
        self._scaler.growth_factor = args.growth_factor
        self._scaler.backoff_factor = args.backoff_factor

    @property
    def scale_window(self):
        return self._scaler.growth_interval

    @scale_window.setter
    def scale_window(self, value):
        args = check_scaler_args("dynamic", scale_window=value, arg_names=_LEGACY_NAMES)
        self._scaler.growth_interval = args.growth_interval
        self._set_clean_count()

    @property
    def cur_iter(self):
        return self._cur_iter

    @cur_iter.setter
    def cur_iter(self, value):
        self._cur_iter = _count_arg("cur_iter", value)
        self._set_clean_count()

    @property
    def last_overflow_iter(self):
        return self._last_overflow_iter

    @last_overflow_iter.setter
    def last_overflow_iter(self, value):
        self._last_overflow_iter = _count_arg("last_overflow_iter", value, low=-1)
        self._set_clean_count()

    def _set_clean_count(self):
        """The device's count of clean iterations since the last growth or overflow, as
        Apex's rule reads it from the attributes: the next clean iteration grows the
        scale when ``(cur_iter - last_overflow_iter) % scale_window == 0``."""
        clean = (self._cur_iter - self._last_overflow_iter - 1) % self._scaler.growth_interval
        self._scaler._state[K.UNSKIPPED] = float(clean)

    def update_scale(self, overflow):
        """Advance the scale after an iteration; ``overflow`` is a bool, or a 0-d device
        tensor (then nothing is read back to the host)."""
        if isinstance(overflow, torch.Tensor):
            self._scaler.follow_loss(overflow, (), "update_scale", "overflow")
            self._scaler.found_inf.copy_((overflow != 0).reshape(()))
        else:
            self._scaler.found_inf.fill_(1.0 if overflow else 0.0)
            if overflow:
                self._last_overflow_iter = self._cur_iter
        self._scaler.update_scale()
        self._cur_iter += 1
