"""The loss scaler: dynamic or static, its state on the device, no host syncs.

The scale, growth tracker, hysteresis tracker and overflow flag live in one fp32
device vector (layout in ``tritamp.kernels.scale_update``). ``scale_loss`` multiplies
the loss by a view of it, the check kernel writes its overflow slot, one
single-program kernel updates it. What Apex printed on a skipped step is logged from
a non-blocking copy of that vector once it has landed, so logging never stalls the
device.
"""
import collections
import math
import warnings

import torch

from tritamp import kernels as K

from ._state import _amp_state, logger

FLOOR_WARN_STEPS = 10
"""Consecutive overflowing steps at the minimum scale before the scaler warns."""

DEFAULT_MIN_LOSS_SCALE = 1.0
"""Floor of the dynamic scale when ``min_loss_scale`` is None (Megatron's and
DeepSpeed's default): a scale that keeps halving on non-finite gradients would reach 0
in fp32 and turn every gradient into NaN."""

_MAX_COUNT = 2 ** 24  # counters are exact fp32 integers below this


class _HostSnapshot:
    """A host buffer for the scaler's device state and a numpy view of it, made once.

    ``values()`` reads every slot in one call through numpy: reading host memory is not
    a device sync, and tensor ops would be seen by sync counters and torch function
    modes as host reads of device values."""
    __slots__ = ("tensor", "view")

    def __init__(self, pinned):
        self.tensor = torch.empty(K.STATE_SIZE, dtype=torch.float32, pin_memory=pinned)
        self.view = self.tensor.numpy()

    def values(self):
        return self.view.tolist()


class LossScaler:
    """Apex's ``LossScaler`` with its state on the device.

    ``loss_scale`` is ``"dynamic"`` or a number (static scale). Dynamic scaling starts
    at ``min(init_scale, max_loss_scale)``, multiplies by ``backoff_factor`` on overflow
    (after ``hysteresis`` overflows) and by ``growth_factor`` after ``growth_interval``
    clean steps, within ``[min_loss_scale, max_loss_scale]``.
    """

    def __init__(self, loss_scale="dynamic", init_scale=2.**16, scale_factor=2.,
                 scale_window=2000, min_loss_scale=None, max_loss_scale=2.**24,
                 backoff_factor=None, hysteresis=1, loss_id=0, overflow_process_group=None):
        self.dynamic = loss_scale == "dynamic"
        growth_factor = float(scale_factor)
        backoff_factor = 1.0 / growth_factor if backoff_factor is None else float(backoff_factor)
        if not growth_factor > 1.0:
            raise ValueError(f"growth_factor (scale_factor) must be > 1, got {growth_factor}")
        if not 0.0 < backoff_factor < 1.0:
            raise ValueError(f"backoff_factor must be in (0, 1), got {backoff_factor}")
        if not (isinstance(scale_window, int) and 0 < scale_window < _MAX_COUNT):
            raise ValueError(f"growth_interval (scale_window) must be an int in [1, 2**24), got {scale_window!r}")
        if not (isinstance(hysteresis, int) and 0 < hysteresis < _MAX_COUNT):
            raise ValueError(f"hysteresis must be an int in [1, 2**24), got {hysteresis!r}")
        min_scale = DEFAULT_MIN_LOSS_SCALE if min_loss_scale is None else float(min_loss_scale)
        max_scale = math.inf if max_loss_scale is None else float(max_loss_scale)
        if not min_scale > 0.0:
            raise ValueError(f"min_loss_scale must be > 0, got {min_loss_scale}; a scale of 0 "
                             "makes every unscaled gradient inf/NaN")
        if not max_scale >= min_scale:
            raise ValueError(f"max_loss_scale ({max_loss_scale}) must be >= min_loss_scale ({min_scale})")
        if self.dynamic:
            start = min(max_scale, float(init_scale))
        else:
            start = float(loss_scale)
            if not (math.isfinite(start) and start > 0.0):
                raise ValueError(f"a static loss_scale must be a finite number > 0, got {loss_scale!r}")
        self.growth_factor = growth_factor
        self.backoff_factor = backoff_factor
        self.growth_interval = scale_window
        self.hysteresis = hysteresis
        self.min_loss_scale = min_scale
        self.max_loss_scale = max_scale
        self.loss_id = loss_id
        self.overflow_process_group = overflow_process_group
        state = torch.zeros(K.STATE_SIZE, dtype=torch.float32)
        state[K.SCALE] = start
        state[K.USED_SCALE] = start
        state[K.HYSTERESIS] = hysteresis
        self._state = state
        self._static_scale = start
        self._pending_reports = collections.deque()
        self._snapshots = []  # host buffers (pinned on CUDA) reused for the reports
        self._seen_skipped = 0.0
        self._floor_warned = False
        self._aliases = []  # optimizer stashes that refer to this scaler's slots
        # The overflow slot the next backward's check writes, and whether it is known to
        # be zero (each update zeroes the slot after the one it read: no launch to clear).
        self._slot = K.FOUND_INF
        self._next_clean = False
        self._make_snapshots()

    # -- device state -------------------------------------------------------------
    def _to(self, device):
        if self._state.device != device:
            self._state = self._state.to(device)
            self._make_snapshots()
        return self._state

    @property
    def scale(self):
        """The scale for the next backward: a 0-d fp32 device tensor (no sync)."""
        return self._state[K.SCALE]

    @property
    def used_scale(self):
        """The scale the most recently checked gradients carry (0-d device tensor)."""
        return self._state[K.USED_SCALE]

    @property
    def found_inf(self):
        """1.0 when the most recently checked gradients held inf/NaN (0-d device tensor)."""
        return self._state[self._slot]

    def loss_scale(self):
        """The current scale as a Python float (synchronises; Apex's accessor)."""
        return float(self._state[K.SCALE])

    @property
    def static_one(self):
        """A static scale of 1.0: scale_loss has nothing to scale or check."""
        return not self.dynamic and self._static_scale == 1.0

    @property
    def _unskipped(self):
        return int(self._state[K.UNSKIPPED])

    # -- one step -----------------------------------------------------------------
    def clear_overflow_state(self):
        """Zero the overflow slot before the gradients of a new backward are checked.

        Optimizers still pending on the old slots get their own copies first."""
        for stash in self._aliases:
            stash.detach_from(self)
        self._aliases.clear()
        self._slot = K.other_found_slot(self._slot)
        if not self._next_clean:  # no update since the last check zeroed this slot
            self._state[self._slot].zero_()
        self._next_clean = False

    def reduce_overflow(self):
        """All-reduce (MAX) the overflow slot over ``overflow_process_group``, in place.

        An asynchronous collective on NCCL: the host does not wait for it."""
        if self.overflow_process_group is None:
            return
        import torch.distributed as dist
        dist.all_reduce(self._state[self._slot:self._slot + 1], op=dist.ReduceOp.MAX,
                        group=self.overflow_process_group)

    def update_scale(self):
        """Update the scale from the overflow slot on the device; no host sync.

        A static scale is never checked: the step counts as unskipped (Apex's
        ``_unskipped``), one in-place add, nothing to report."""
        if not self.dynamic:
            self._state[K.UNSKIPPED:K.UNSKIPPED + 1].add_(1.0)
            return
        K.scale_update(self._state, self.growth_factor, self.backoff_factor,
                       self.growth_interval, self.hysteresis, self.min_loss_scale,
                       self.max_loss_scale, self.dynamic, found_slot=self._slot)
        self._next_clean = True
        self._queue_report()

    # -- reporting without stalls ---------------------------------------------------
    def _make_snapshots(self):
        """The host buffers of the reports, made when the state moves to a device (never
        on the hot path): 4 in flight and one being read on CUDA, one on the CPU."""
        cuda = self._state.device.type == "cuda"
        self._snapshots = [_HostSnapshot(pinned=cuda) for _ in range(5 if cuda else 1)]

    def _snapshot(self):
        """A host buffer that no pending report is using."""
        in_flight = [snap for snap, _ in self._pending_reports]
        for snap in self._snapshots:
            if not any(snap is busy for busy in in_flight):
                return snap
        raise AssertionError("more reports in flight than snapshot buffers")

    def _queue_report(self):
        if self._state.device.type == "cuda":
            if len(self._pending_reports) >= 4:
                return  # the SKIPPED counter still lets a later report count every skip
            snap = self._snapshot()
            snap.tensor.copy_(self._state, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            self._pending_reports.append((snap, event))
            self.poll_reports()
        else:
            snap = self._snapshot()
            snap.tensor.copy_(self._state)
            self._report(snap)

    def poll_reports(self):
        """Log every report whose copy has landed; never waits."""
        while self._pending_reports and self._pending_reports[0][1].query():
            snap, _ = self._pending_reports.popleft()
            self._report(snap)

    def _report(self, snap):
        snapshot = snap.values()
        skipped = snapshot[K.SKIPPED]
        new_skips = int(skipped - self._seen_skipped)
        self._seen_skipped = skipped
        if new_skips > 0 and _amp_state.verbosity > 0:
            scale, used = snapshot[K.SCALE], snapshot[K.USED_SCALE]
            verb = "reducing loss scale to" if scale < used else "keeping loss scale at"
            more = "" if new_skips == 1 else f" ({new_skips} steps skipped since the last report)"
            logger.warning("Gradient overflow.  Skipping step, loss scaler %d %s %s%s",
                           self.loss_id, verb, scale, more)
        streak = snapshot[K.FLOOR_STREAK]
        if streak >= FLOOR_WARN_STEPS and not self._floor_warned:
            self._floor_warned = True
            warnings.warn(
                f"tritamp: loss scaler {self.loss_id} has stayed at its floor of "
                f"{self.min_loss_scale} for {int(streak)} consecutive overflowing steps, and "
                "every one of those steps was skipped. The gradients are inf/NaN whatever the "
                "scale: look for NaN/inf in the loss, the inputs or the forward pass, or lower "
                "the learning rate. If the gradients really need a smaller scale, pass a lower "
                "min_loss_scale to initialize.", RuntimeWarning, stacklevel=3)
        elif streak == 0:
            self._floor_warned = False

    # -- checkpoints ------------------------------------------------------------------
    def state_dict(self):
        s = self._state.cpu()
        return {"loss_scale": float(s[K.SCALE]), "unskipped": int(s[K.UNSKIPPED]),
                "hysteresis": int(s[K.HYSTERESIS]), "dynamic": self.dynamic}

    def load_state_dict(self, sd):
        scale = float(sd["loss_scale"])
        if not (math.isfinite(scale) and scale > 0):
            raise ValueError(f"loss_scale in the checkpoint must be a finite number > 0, got {scale}")
        unskipped = int(sd["unskipped"])
        hyst = int(sd.get("hysteresis", self.hysteresis))
        if not self.dynamic:
            self._static_scale = scale
        self._state[K.SCALE] = scale
        self._state[K.USED_SCALE] = scale
        self._state[K.UNSKIPPED] = unskipped
        self._state[K.HYSTERESIS] = hyst
        self._state[K.FLOOR_STREAK] = 0.0
