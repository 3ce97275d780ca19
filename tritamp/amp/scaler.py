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
import numbers
import warnings
from collections.abc import Mapping

import torch

from tritamp import kernels as K

from . import overflow
from .state import _amp_state, logger

FLOOR_WARN_STEPS = 10
"""Consecutive overflowing steps at the minimum scale before the scaler warns."""

DEFAULT_MIN_LOSS_SCALE = 1.0
"""Floor of the dynamic scale when ``min_loss_scale`` is None (Megatron's and
DeepSpeed's default): a scale that keeps halving on non-finite gradients would reach 0
in fp32 and turn every gradient into NaN."""

_MAX_COUNT = 2 ** 24  # counters are exact fp32 integers below this


# -- argument checks ---------------------------------------------------------------------
# The names amp.initialize gives the scaler's arguments; LossScaler's own (Apex's) names
# follow in brackets where they differ. Callers with other names pass ``arg_names``.
_DEFAULT_NAMES = {
    "loss_scale": "loss_scale",
    "init_scale": "init_scale",
    "scale_factor": "growth_factor (scale_factor)",
    "scale_window": "growth_interval (scale_window)",
    "min_loss_scale": "min_loss_scale",
    "max_loss_scale": "max_loss_scale",
    "backoff_factor": "backoff_factor",
    "hysteresis": "hysteresis",
}


def _is_real(value):
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def check_number(label, value, fix):
    """``value`` as a float: a Python (or numpy) real number, or a one-element real
    tensor; bools are refused (``True`` is not a scale)."""
    if isinstance(value, torch.Tensor) and value.numel() == 1 \
            and not (value.is_complex() or value.dtype == torch.bool):
        value = value.item()
    if not _is_real(value):
        raise TypeError(f"{label} must be a real number, got {type(value).__name__} "
                        f"{value!r}; {fix}")
    return float(value)


def _count(label, value, low, fix):
    """``value`` as an int in ``[low, 2**24)`` (the device counters are exact fp32
    integers below 2**24); bools and floats are refused."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{label} must be an int, got {type(value).__name__} {value!r}; {fix}")
    value = int(value)
    if not low <= value < _MAX_COUNT:
        raise ValueError(f"{label} must be an int in [{low}, 2**24), got {value}; {fix}")
    return value


class ScalerArgs:
    """The checked settings of a :class:`LossScaler` (see :func:`check_scaler_args`)."""
    __slots__ = ("dynamic", "start", "growth_factor", "backoff_factor", "growth_interval",
                 "hysteresis", "min_scale", "max_scale")


def check_scaler_args(loss_scale="dynamic", init_scale=2.**16, scale_factor=2.,
                      scale_window=2000, min_loss_scale=None, max_loss_scale=2.**24,
                      backoff_factor=None, hysteresis=1, arg_names=None):
    """Check a loss scaler's arguments (LossScaler's signature) without building one.

    Returns a :class:`ScalerArgs`; raises ``TypeError`` for a value of the wrong type
    (bools included) and ``ValueError`` for one out of range, naming the argument (by
    ``arg_names`` where given), the value and the fix. The valid values:

    - ``loss_scale``: ``"dynamic"``, or a finite number > 0 (a static scale);
    - ``init_scale``: a finite number > 0, not below the floor (``min_loss_scale``, 1.0
      when None) when the scale is dynamic; above ``max_loss_scale`` it starts there;
    - ``scale_factor`` (growth factor): a finite number > 1;
    - ``backoff_factor``: None (``1 / scale_factor``) or a number in (0, 1);
    - ``scale_window`` (growth interval), ``hysteresis``: ints in [1, 2**24);
    - ``min_loss_scale``: None (a floor of 1.0) or a finite number > 0 (``arg_names``
      may map it to None: a floor the caller's user cannot set);
    - ``max_loss_scale``: None (no ceiling) or a number >= the floor (inf allowed).
    """
    names = dict(_DEFAULT_NAMES, **(arg_names or {}))
    n = names.__getitem__
    if isinstance(loss_scale, str):
        if loss_scale != "dynamic":
            raise ValueError(f"{n('loss_scale')} must be 'dynamic' or a number, got "
                             f"{loss_scale!r}; pass 'dynamic' for a dynamic scale or a finite "
                             "number > 0 such as 128.0 for a static one")
        dynamic, static = True, None
    else:
        dynamic = False
        static = check_number(n("loss_scale"), loss_scale,
                       "pass 'dynamic' or a finite number > 0 such as 128.0")
        if not (math.isfinite(static) and static > 0.0):
            raise ValueError(f"{n('loss_scale')} must be a finite number > 0, got {loss_scale!r}; "
                             "a static scale multiplies the loss: pass e.g. 128.0, or 'dynamic'")
    init = check_number(n("init_scale"), init_scale, "pass e.g. 2.**16 (the default)")
    if not (math.isfinite(init) and init > 0.0):
        raise ValueError(f"{n('init_scale')} must be a finite number > 0, got {init_scale!r}; "
                         "the dynamic scale starts there: pass e.g. 2.**16 (the default)")
    growth = check_number(n("scale_factor"), scale_factor, "pass e.g. 2.0 (the default)")
    if not (math.isfinite(growth) and growth > 1.0):
        raise ValueError(f"{n('scale_factor')} must be a finite number > 1, got {scale_factor!r}; "
                         "the scale is multiplied by it after the growth interval's clean "
                         "steps: pass e.g. 2.0 (the default)")
    if backoff_factor is None:
        backoff = 1.0 / growth
    else:
        backoff = check_number(n("backoff_factor"), backoff_factor, "pass e.g. 0.5 (the default)")
        if not 0.0 < backoff < 1.0:
            raise ValueError(f"{n('backoff_factor')} must be in (0, 1), got {backoff_factor!r}; "
                             "the scale is multiplied by it on an overflow: pass e.g. 0.5")
    interval = _count(n("scale_window"), scale_window, 1, "pass e.g. 2000 (the default)")
    hyst = _count(n("hysteresis"), hysteresis, 1,
                  "pass 1 (back off on every overflow, the default) or more")
    if min_loss_scale is None:
        min_scale = DEFAULT_MIN_LOSS_SCALE
    else:
        min_scale = check_number(n("min_loss_scale"), min_loss_scale,
                          "pass None for the default floor of 1.0, or a number > 0")
        if not (math.isfinite(min_scale) and min_scale > 0.0):
            raise ValueError(f"{n('min_loss_scale')} must be a finite number > 0, got "
                             f"{min_loss_scale!r}; a scale of 0 makes every unscaled gradient "
                             "inf/NaN: pass None for the default floor of 1.0, or a smaller "
                             "positive number")
    if max_loss_scale is None:
        max_scale = math.inf
    else:
        max_scale = check_number(n("max_loss_scale"), max_loss_scale,
                          "pass None for no ceiling, or a number > 0")
        if not max_scale > 0.0:  # NaN included
            raise ValueError(f"{n('max_loss_scale')} must be a number > 0, got "
                             f"{max_loss_scale!r}; pass None for no ceiling, or a number >= "
                             "the floor such as 2.**24 (the default)")
    if not max_scale >= min_scale:
        floor = "" if min_loss_scale is not None else " (the default floor when it is None)"
        raise ValueError(f"{n('max_loss_scale')} ({max_loss_scale!r}) must be >= "
                         f"{n('min_loss_scale')} ({min_scale!r}{floor}); pass a larger "
                         f"{n('max_loss_scale')} or a smaller {n('min_loss_scale')}")
    if dynamic and init < min_scale:
        if names["min_loss_scale"] is None:  # a fixed floor, not an argument of the caller
            floor, fix = f"the floor ({min_scale!r})", ""
        else:
            floor = f"{n('min_loss_scale')} ({min_scale!r}" + (
                ")" if min_loss_scale is not None else ", the default floor when it is None)")
            fix = f", or a smaller {n('min_loss_scale')}"
        raise ValueError(f"{n('init_scale')} ({init_scale!r}) is below {floor}; the dynamic "
                         f"scale never goes below its floor: pass {n('init_scale')} >= "
                         f"{min_scale!r}{fix}")
    args = ScalerArgs()
    args.dynamic = dynamic
    args.start = min(max_scale, init) if dynamic else static
    args.growth_factor = growth
    args.backoff_factor = backoff
    args.growth_interval = interval
    args.hysteresis = hyst
    args.min_scale = min_scale
    args.max_scale = max_scale
    return args


# -- checkpoints ----------------------------------------------------------------------------
_REQUIRED_KEYS = ("loss_scale", "unskipped")  # Apex's
_OPTIONAL_KEYS = ("hysteresis", "dynamic", "skipped", "floor_streak", "floor_warned")


def _saved_count(where, key, value):
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{where}: {key!r} must be an int, got {type(value).__name__} "
                        f"{value!r}; pass the dict amp.state_dict() saved")
    value = int(value)
    if value < 0:
        raise ValueError(f"{where}: {key!r} must be an int >= 0, got {value}; it counts "
                         "steps: pass the dict amp.state_dict() saved")
    return min(value, _MAX_COUNT)  # the device counters saturate there


def _saved_flag(where, key, value):
    if not isinstance(value, bool):
        raise TypeError(f"{where}: {key!r} must be a bool, got {type(value).__name__} "
                        f"{value!r}; pass the dict amp.state_dict() saved")
    return value


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
    at ``init_scale`` (``max_loss_scale`` if that is lower, as in Apex), multiplies by
    ``backoff_factor`` on overflow (after ``hysteresis`` overflows) and by
    ``scale_factor`` after ``scale_window`` clean steps, within
    ``[min_loss_scale, max_loss_scale]``. ``amp.initialize`` calls the last two
    ``growth_factor`` and ``growth_interval``.

    Every argument is checked before anything is built (:func:`check_scaler_args`); a
    refused value raises ``TypeError`` (not a number / not an int) or ``ValueError`` (out
    of range) naming the argument, the value and what to pass instead. ``arg_names``
    maps this signature's names to the caller's, for those messages.
    """

    def __init__(self, loss_scale="dynamic", init_scale=2.**16, scale_factor=2.,
                 scale_window=2000, min_loss_scale=None, max_loss_scale=2.**24,
                 backoff_factor=None, hysteresis=1, loss_id=0, overflow_process_group=None,
                 *, arg_names=None):
        args = check_scaler_args(loss_scale, init_scale, scale_factor, scale_window,
                                 min_loss_scale, max_loss_scale, backoff_factor, hysteresis,
                                 arg_names)
        self.dynamic = args.dynamic
        self.growth_factor = args.growth_factor
        self.backoff_factor = args.backoff_factor
        self.growth_interval = args.growth_interval
        self.hysteresis = args.hysteresis
        self.min_loss_scale = args.min_scale
        self.max_loss_scale = args.max_scale
        self.loss_id = loss_id
        self.overflow_process_group = overflow_process_group
        start = args.start
        state = torch.zeros(K.STATE_SIZE, dtype=torch.float32)
        state[K.SCALE] = start
        state[K.USED_SCALE] = start
        state[K.HYSTERESIS] = self.hysteresis
        self._state = state
        self._static_scale = start
        self._pending_reports = collections.deque()
        self._snapshots = []  # host buffers (pinned on CUDA) reused for the reports
        self._seen_skipped = 0.0
        self._floor_warned = False
        self._aliases = []  # optimizer stashes that refer to this scaler's slots
        # Records of optimizers' last steps (tritamp.contract.LastStep) whose flag is one of
        # this scaler's slots, and the number of dynamic updates so far: a record's flag is
        # its slot until the next update, then PREV_FOUND until the one after.
        self._records = set()
        self._updates = 0
        # Optimizer stashes in a delay_unscale chain whose gradients carry this scaler's
        # current scale: they copy it before anything rewrites it (AmpStash.keep_chain_scale).
        self._chains = []
        # Counts of non-finite gradient values (tritamp.amp.overflow.Ledger) the next skip
        # report may list, and its rate limit.
        self._ledgers = {}
        self._details = overflow.Details()
        # The overflow slot the next backward's check writes, and whether it is known to
        # be zero (each update zeroes the slot after the one it read: no launch to clear).
        self._slot = K.FOUND_INF
        self._next_clean = False
        self._make_snapshots()

    # -- device state -------------------------------------------------------------
    def follow_loss(self, loss, params, who, what="the loss"):
        """Move the state to ``loss``'s device (a model moved after set-up), after
        checking that device: the meta device (no data) or one none of ``params`` (an
        iterable of parameters, read only on a move) lies on is refused, before the state
        moves (a move there left it unusable, or away from the gradients)."""
        device = loss.device
        if self._state.device == device:
            return self._state
        if device.type == "meta":
            raise ValueError(f"{who}: {what} is on the meta device, which holds no data; "
                             "compute it from a model materialised on a real device "
                             "(module.to_empty(device=...), then initialise it)")
        devices = {p.device for p in params}
        if devices and device not in devices:
            raise ValueError(f"{who}: {what} is on {device} but the parameters are on "
                             f"{', '.join(sorted(map(str, devices)))}; compute the loss on "
                             "their device (move the output or the target there)")
        return self._to(device)

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

    # -- Apex's attributes that scripts set directly ---------------------------------
    # (NVIDIA's BERT scripts: amp._amp_state.loss_scalers[0]._loss_scale = 2**20)
    @property
    def _loss_scale(self):
        """Apex's attribute: the current scale as a float (synchronises)."""
        return self.loss_scale()

    @_loss_scale.setter
    def _loss_scale(self, value):
        """Set the scale of the next backward; a dynamic one within [min, max], as a
        loaded state_dict's."""
        self._replace_scale(value, "_loss_scale", "2.**20", within_bounds=True)

    def _replace_scale(self, value, label, example, within_bounds):
        """Make ``value`` (checked: a finite number > 0, named ``label`` in the errors)
        the current scale; a dynamic one brought within [min, max] if ``within_bounds``."""
        scale = check_number(label, value, f"pass a finite number > 0 such as {example}")
        if not (math.isfinite(scale) and scale > 0.0):
            raise ValueError(f"{label} must be a finite number > 0, got {value!r}; the "
                             f"loss is multiplied by it: pass e.g. {example}")
        if not self.dynamic:
            self._static_scale = scale
        elif within_bounds:
            scale = min(max(scale, self.min_loss_scale), self.max_loss_scale)
        self._hand_copies()  # (gradients left scaled by a static scale carry its slot)
        self._hand_chain_scales()
        self._state[K.SCALE] = scale

    def _hand_chain_scales(self):
        """Stashes whose delay_unscale gradients carry the current scale take a copy of
        it: the scale is about to be rewritten (their next scale_loss rescales them)."""
        for stash in self._chains:
            stash.keep_chain_scale(self)
        self._chains.clear()

    def _hand_copies(self):
        """Optimizers whose pending step reads this scaler's slots (the overflow flag, the
        scale their gradients carry) take their own copies: the slots are about to be
        reused or rewritten."""
        for stash in self._aliases:
            stash.detach_from(self)
        self._aliases.clear()

    @property
    def _max_loss_scale(self):
        """Apex's attribute: the ceiling of the dynamic scale (``max_loss_scale``)."""
        return self.max_loss_scale

    @_max_loss_scale.setter
    def _max_loss_scale(self, value):
        ceiling = check_number("_max_loss_scale", value, "pass a number >= the floor, or inf")
        if not ceiling >= self.min_loss_scale:
            raise ValueError(f"_max_loss_scale must be >= the floor ({self.min_loss_scale!r}), "
                             f"got {value!r}; pass a larger ceiling (inf for none)")
        self.max_loss_scale = ceiling

    @property
    def _min_loss_scale(self):
        """Apex's attribute: the floor of the dynamic scale (``min_loss_scale``)."""
        return self.min_loss_scale

    @_min_loss_scale.setter
    def _min_loss_scale(self, value):
        floor = check_number("_min_loss_scale", value, "pass a finite number > 0")
        if not (math.isfinite(floor) and 0.0 < floor <= self.max_loss_scale):
            raise ValueError(f"_min_loss_scale must be a finite number in (0, "
                             f"{self.max_loss_scale!r}], got {value!r}; a scale of 0 makes "
                             "every unscaled gradient inf or NaN")
        self.min_loss_scale = floor

    # -- one step -----------------------------------------------------------------
    def clear_overflow_state(self):
        """Zero the overflow slot before the gradients of a new backward are checked.

        Optimizers still pending on the old slots get their own copies first."""
        self._hand_copies()
        self._slot = K.other_found_slot(self._slot)
        if not self._next_clean:  # no update since the last check zeroed this slot
            # (two checks without an update: a last step's flag there would be lost)
            self._detach_records(lambda slot, update: slot == self._slot)
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
        self._hand_chain_scales()
        if self._records:  # flags of steps two updates old are not kept on the device
            self._detach_records(lambda slot, update: update < self._updates)
        K.scale_update(self._state, self.growth_factor, self.backoff_factor,
                       self.growth_interval, self.hysteresis, self.min_loss_scale,
                       self.max_loss_scale, self.dynamic, found_slot=self._slot)
        self._updates += 1
        self._next_clean = True
        self._queue_report()

    # -- the flags of optimizers' last steps (tritamp.contract.LastStep's owner protocol) --
    def track(self, record):
        """Keep ``record`` (a last step that read the current overflow slot) readable;
        returns its token."""
        self._records.add(record)
        return (self._slot, self._updates)

    def untrack(self, record):
        self._records.discard(record)

    def flag_of(self, token):
        """The 0-d device flag of the step ``token`` recorded: its slot until the next
        update, then the PREV_FOUND slot that update copied it into (no launch)."""
        slot, update = token
        age = self._updates - update
        if age == 0:
            return self._state[slot]
        if age == 1:
            return self._state[K.PREV_FOUND]
        raise AssertionError("a last-step record outlived the scaler's copy of its flag")

    def _detach_records(self, lost):
        for record in [r for r in self._records if lost(*r.token)]:
            record.detach_from(self)

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
            # Apex's text whatever happened to the scale (Apex's too said "reducing" at
            # its floor); what differs follows it, for the logs' parsers
            held = "" if scale < used else " (held: at its floor, or hysteresis)"
            more = "" if new_skips == 1 else f" ({new_skips} steps skipped since the last report)"
            logger.warning("Gradient overflow.  Skipping step, loss scaler %d reducing loss scale "
                           "to %s%s%s%s", self.loss_id, scale, held, more, self._overflowed())
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

    def note_ledger(self, ledger):
        """``ledger`` counts gradients this scaler's skip reports may name."""
        self._ledgers[id(ledger)] = ledger

    def _overflowed(self):
        """The names of the gradients that held inf/NaN since the last list (read from the
        device: this runs for a skip report only), at most once per DETAIL_INTERVAL_S."""
        if not self._ledgers or not self._details.due():
            return ""
        found = []
        for ledger in self._ledgers.values():
            found += ledger.take()
        self._ledgers.clear()
        return overflow.describe(found, overflow.rank()) if found else ""

    # -- checkpoints ------------------------------------------------------------------
    def _drain_reports(self):
        """Log every pending report, waiting for the copies still in flight (a
        checkpoint reads the device anyway): the host's warning state is then current."""
        while self._pending_reports:
            snap, event = self._pending_reports.popleft()
            event.synchronize()
            self._report(snap)

    def state_dict(self):
        """Apex's keys (``loss_scale``, ``unskipped``) and tritamp's: ``hysteresis``
        (overflows still tolerated), ``dynamic``, ``skipped`` (skipped steps so far),
        ``floor_streak`` (consecutive overflowing steps at the floor) and
        ``floor_warned`` (whether that streak was already warned about). Reads the
        device (a checkpoint is not on the hot path)."""
        self._drain_reports()
        s = self._state.cpu().tolist()
        return {"loss_scale": s[K.SCALE], "unskipped": int(s[K.UNSKIPPED]),
                "hysteresis": int(s[K.HYSTERESIS]), "dynamic": self.dynamic,
                "skipped": int(s[K.SKIPPED]), "floor_streak": int(s[K.FLOOR_STREAK]),
                "floor_warned": self._floor_warned}

    def check_state_dict(self, sd, where="the loss scaler's state dict"):
        """Check a :meth:`state_dict` (or an Apex ``loss_scalerN`` entry) without loading
        it; returns the values :meth:`load_state_dict` would load. ``loss_scale`` and
        ``unskipped`` are required, the other keys of :meth:`state_dict` optional, no
        other key is accepted. A dynamic scale outside ``[min_loss_scale,
        max_loss_scale]`` is brought inside (as ``init_scale`` is)."""
        if not isinstance(sd, Mapping):
            raise TypeError(f"{where} must be a dict such as {{'loss_scale': 65536.0, "
                            f"'unskipped': 0}}, got {type(sd).__name__}")
        missing = [k for k in _REQUIRED_KEYS if k not in sd]
        unexpected = [k for k in sd if k not in _REQUIRED_KEYS + _OPTIONAL_KEYS]
        if missing or unexpected:
            msgs = []
            if missing:
                msgs.append("Missing key(s): {}.".format(", ".join(f'"{k}"' for k in missing)))
            if unexpected:
                msgs.append("Unexpected key(s): {}.".format(
                    ", ".join(f'"{k}"' for k in unexpected)))
            raise RuntimeError(
                f"Error(s) in loading {where}: {' '.join(msgs)} A loss scaler's state holds "
                f"{', '.join(_REQUIRED_KEYS)} (Apex's) and optionally "
                f"{', '.join(_OPTIONAL_KEYS)}; pass the dict amp.state_dict() saved")
        raw = sd["loss_scale"]
        if not _is_real(raw):
            raise TypeError(f"{where}: 'loss_scale' must be a number, got {type(raw).__name__} "
                            f"{raw!r}; pass the dict amp.state_dict() saved")
        scale = float(raw)
        if not (math.isfinite(scale) and scale > 0.0):
            raise ValueError(f"{where}: 'loss_scale' must be a finite number > 0, got {raw!r}; "
                             "the checkpoint is damaged: load another, or leave the scaler as "
                             "initialize set it")
        if self.dynamic:
            scale = min(max(scale, self.min_loss_scale), self.max_loss_scale)
        values = {"loss_scale": scale,
                  "unskipped": _saved_count(where, "unskipped", sd["unskipped"])}
        for key in ("hysteresis", "skipped", "floor_streak"):
            if key in sd:
                values[key] = _saved_count(where, key, sd[key])
        for key in ("dynamic", "floor_warned"):
            if key in sd:
                values[key] = _saved_flag(where, key, sd[key])
        return values

    def load_state_dict(self, sd):
        """Restore a :meth:`state_dict` (or Apex's ``{"loss_scale", "unskipped"}``):
        checked first (:meth:`check_state_dict`), nothing changes on a refusal. Absent
        optional keys take a fresh scaler's values (full hysteresis, no floor streak);
        the skipped-step count then stays as it is."""
        self._load_checked(self.check_state_dict(sd))

    def _load_checked(self, values):
        """Write values returned by :meth:`check_state_dict` (cannot fail). Optimizers whose
        gradients wait, still scaled, for their step (or whose step waits on this
        backward's overflow flag) take copies of the slots first: a step after the load
        unscales by the scale the gradients carry, not the loaded one."""
        self._hand_copies()
        self._hand_chain_scales()
        self._detach_records(lambda slot, update: True)
        scale = values["loss_scale"]
        host = self._state.cpu().tolist()
        host[K.SCALE] = scale
        host[K.USED_SCALE] = scale
        host[K.UNSKIPPED] = values["unskipped"]
        host[K.HYSTERESIS] = values.get("hysteresis", self.hysteresis)
        host[K.SKIPPED] = values.get("skipped", host[K.SKIPPED])
        host[K.FLOOR_STREAK] = streak = values.get("floor_streak", 0)
        self._state.copy_(torch.tensor(host, dtype=torch.float32))
        if not self.dynamic:
            self._static_scale = scale
        # Reports queued before the load describe the state it replaced.
        self._pending_reports.clear()
        self._seen_skipped = float(host[K.SKIPPED])
        self._floor_warned = values.get("floor_warned", streak >= FLOOR_WARN_STEPS)
