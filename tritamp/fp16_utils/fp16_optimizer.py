"""``FP16_Optimizer``: Apex's legacy wrapper for a half model, fp32 master weights and
loss scaling, on the machinery ``tritamp.amp`` uses at O2.

The wrapper owns no second implementation: the fp32 masters, the check-and-unscale of
the half gradients into them, the skip and the master -> model copy are amp's optimizer
stash (``tritamp.amp.optimizer``), and the scale lives in amp's device-side scaler.
One backward and one step therefore cost what an amp O2 step costs:

    backward(loss)   (loss.float() * scale).backward(); one launch per dtype group checks
                     the half gradients for inf/NaN and writes the unscaled fp32 master
                     gradients; one launch updates the scale on the device
    step()           skips when the gradients overflowed (weights, masters and optimizer
                     state unchanged); otherwise steps the masters and copies them into
                     the half model in one launch per dtype group

The skip decision costs one host read per step, as in Apex, unless the wrapped optimizer
reads ``found_inf`` on the device (``_step_supports_amp_scaling``: tritamp's fused
optimizers, torch's ``fused=True`` Adam/AdamW/SGD); then a step makes no host sync.
"""
import logging
import types
import weakref
from collections.abc import Mapping

import torch

from tritamp import kernels as K
from tritamp.amp.optimizer import AmpStash, _versions, amp_step
from tritamp.amp.scaler import check_number
from tritamp.kernels.engine import zero_grads_
from tritamp.parallel.LARC import LARC

from .fp16util import clip_grad_norm
from .loss_scaler import OptimizerLossScaler

logger = logging.getLogger("tritamp.fp16_utils")

_PARAM_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_DYNAMIC_LOSS_ARGS = ("init_scale", "scale_factor", "scale_window", "min_loss_scale",
                      "max_loss_scale", "backoff_factor", "hysteresis")
# The scaler's argument names as a refusal names them to FP16_Optimizer's caller.
_DYNAMIC_NAMES = {k: f"dynamic_loss_args[{k!r}]" for k in _DYNAMIC_LOSS_ARGS}
_DYNAMIC_NAMES["scale_factor"] += " (the growth_factor)"
_DYNAMIC_NAMES["scale_window"] += " (the growth_interval)"
_STATIC_NAMES = {"loss_scale": "static_loss_scale"}


class FP16_Optimizer:
    """Wrap ``init_optimizer`` (built over a half model's parameters; a torch optimizer,
    or a :class:`~tritamp.parallel.LARC` around one, as Apex's LARC docs show) with fp32
    master weights and a static or dynamic loss scale.

    ``static_loss_scale`` is used unless ``dynamic_loss_scale=True``; ``dynamic_loss_args``
    is a dict of ``init_scale`` (2**16), ``scale_factor`` (2.), ``scale_window`` (2000),
    ``min_loss_scale`` (1.0), ``max_loss_scale`` (2**24), ``backoff_factor``
    (1/scale_factor), ``hysteresis`` (1). Parameters may be fp16, bf16 (the half dtype is
    read from each parameter) or fp32 (updated directly), on any device.

    Use ``optimizer.backward(loss)`` in place of ``loss.backward()``, then ``step()``.
    """

    def __init__(self, init_optimizer, static_loss_scale=1.0, dynamic_loss_scale=False,
                 dynamic_loss_args=None, verbose=True):
        if not isinstance(init_optimizer, (torch.optim.Optimizer, LARC)):
            raise TypeError(f"FP16_Optimizer wraps a torch.optim.Optimizer (or a "
                            f"tritamp.parallel.LARC around one), got "
                            f"{type(init_optimizer).__name__}")
        if hasattr(init_optimizer, "_amp_stash"):
            raise RuntimeError("This optimizer is already managed by FP16_Optimizer or "
                               "amp.initialize; build a fresh optimizer over the model's "
                               "parameters and wrap that one.")
        for group in init_optimizer.param_groups:
            for p in group["params"]:
                if p.requires_grad and p.dtype not in _PARAM_DTYPES:
                    raise TypeError("Wrapped parameters must be either float16, bfloat16 or "
                                    f"float32 tensors. Received {p.dtype} with {tuple(p.size())}")
        # Everything that can be refused is checked before the optimizer changes.
        inner = getattr(init_optimizer, "optim", init_optimizer)  # (a LARC's optimizer)
        flag = next((f for f in ("stochastic_rounding", "kahan_summation")
                     if getattr(inner, f, False) is True), None)
        if flag is not None:
            # (amp.initialize refuses it up front too: accepted here, every step refused)
            raise ValueError(
                f"FP16_Optimizer keeps fp32 master weights, but the wrapped "
                f"{type(inner).__name__} has {flag}=True, which stores bf16 weights without "
                "fp32 masters: drop the flag, or use the optimizer on its own over the bf16 "
                "model (without FP16_Optimizer). Nothing was changed.")
        self._dynamic_loss_args = self._check_dynamic_args(dynamic_loss_args)
        self.verbose = verbose
        self.dynamic_loss_scale = bool(dynamic_loss_scale)
        if self.dynamic_loss_scale:
            self.loss_scaler = self._dynamic_scaler()
        else:
            # a number: the string "dynamic" would make the static scale a dynamic one
            self.loss_scaler = OptimizerLossScaler(
                check_number("static_loss_scale", static_loss_scale,
                      "pass a finite number > 0, or dynamic_loss_scale=True"),
                arg_names=_STATIC_NAMES)

        self.optimizer = init_optimizer
        stash = AmpStash(init_optimizer, master_weights=True)
        # Apex's FP16_Optimizer copied zero_grad's zeros to the masters (an unused branch
        # still steps, with momentum and weight decay); amp's O2 dropped them
        stash.masters_take_zeroed = True
        # ... and always unscaled into the masters' fp32 gradients (its
        # update_master_grads): a loop that clips over fp32_from_fp16_groups, or a LARC
        # around the wrapper, reads them between backward and step (left to a fused step
        # to unscale, they were None there, and the clipping did nothing)
        stash.master_grads_wanted = True
        for i, group in enumerate(init_optimizer.param_groups):
            self.maybe_print("FP16_Optimizer processing param group {}:".format(i))
            for p in group["params"]:
                if p.requires_grad:
                    self.maybe_print("FP16_Optimizer received {} with {}".format(p.dtype, p.size()))
            stash.adopt_group(group, init_optimizer)
        init_optimizer._amp_stash = stash
        self._stash = stash
        self._amp_step = amp_step(init_optimizer.step)
        # A group added later (to the wrapper or to the optimizer itself) gets its fp32
        # masters and its unscale as the constructor's groups do: left out of the stash,
        # its half gradients were stepped still carrying the loss scale.
        init_optimizer.add_param_group = types.MethodType(
            _adopting_add_param_group(init_optimizer.add_param_group, weakref.ref(self)),
            init_optimizer)
        self._collect_groups()

        # Recast any existing per-parameter state onto the fp32 masters.
        init_optimizer.load_state_dict(init_optimizer.state_dict())

        self._overflow_flag = None        # device flag of the last checked gradients
        self._backward_pending = False    # scaled gradients not yet moved to the masters
        self._fresh_grads = False         # a backward since the last step or zero_grad
        self.first_closure_call_this_step = True
        self.clip_grad_norm = clip_grad_norm

    def _collect_groups(self):
        stash = self._stash
        self.fp16_groups, self.fp32_from_fp16_groups, self.fp32_from_fp32_groups = [], [], []
        model_of = {id(m): p for m, p in zip(stash.masters, stash.model_params)}
        for group in self.optimizer.param_groups:
            half, masters, plain = [], [], []
            for p in group["params"]:
                model = model_of.get(id(p))
                if model is not None:
                    half.append(model)
                    masters.append(p)
                elif p.requires_grad:
                    plain.append(p)
            self.fp16_groups.append(half)
            self.fp32_from_fp16_groups.append(masters)
            self.fp32_from_fp32_groups.append(plain)
        self.all_fp16_params = [p for g in self.fp16_groups for p in g]
        self.all_fp32_from_fp16_params = [p for g in self.fp32_from_fp16_groups for p in g]
        self.all_fp32_from_fp32_params = [p for g in self.fp32_from_fp32_groups for p in g]

    def add_param_group(self, param_group):
        """Add a param group to the wrapped optimizer: its half parameters get fp32
        masters (and its gradients the unscale) as the constructor's groups do."""
        return self.optimizer.add_param_group(param_group)

    def _dynamic_scaler(self):
        return OptimizerLossScaler("dynamic", arg_names=_DYNAMIC_NAMES, **self._dynamic_loss_args)

    @staticmethod
    def _check_dynamic_args(args):
        args = dict(args or {})
        unknown = sorted(set(args) - set(_DYNAMIC_LOSS_ARGS))
        if unknown:
            raise TypeError(f"dynamic_loss_args got unknown key(s) {unknown}; the keys are "
                            f"{list(_DYNAMIC_LOSS_ARGS)}")
        return args

    def maybe_print(self, msg):
        if self.verbose:
            logger.info(msg)

    def __getstate__(self):
        raise RuntimeError("FP16_Optimizer should be serialized using state_dict().")

    def __setstate__(self, state):
        raise RuntimeError("FP16_Optimizer should be deserialized using load_state_dict().")

    # -- gradients ----------------------------------------------------------------------
    def zero_grad(self, set_grads_to_None=False):
        """Zero (or drop, ``set_grads_to_None=True``) the gradients of the masters, the
        fp32 parameters and the half model parameters."""
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        if set_grads_to_None:
            for p in params + self.all_fp16_params:
                p.grad = None
        else:
            # detached as torch's Optimizer.zero_grad does: a gradient that is a view (DDP's
            # gradient_as_bucket_view) cannot be detached in place
            zero_grads_([p.grad for p in params + self.all_fp16_params
                        if p.grad is not None])
        stash = self._stash
        stash.finish_step()
        self._fresh_grads = False
        if not set_grads_to_None:
            # The zeros stay the next backward's own (recorded with their versions): a
            # parameter that backward does not reach still gets a zero master gradient,
            # so momentum and weight decay still move it, as in Apex.
            stash.zeroed = _versions(stash.plain_params, stash.model_params)
        self._backward_pending = False

    def backward(self, loss, update_master_grads=True, retain_graph=False):
        """``(loss.float() * loss_scale).backward()``, then (``update_master_grads``) the
        unscaled fp32 master gradients. With ``update_master_grads=False`` the scaled
        gradients of several backward calls accumulate until :meth:`update_master_grads`."""
        if not isinstance(loss, torch.Tensor):
            raise TypeError(f"FP16_Optimizer.backward expects the loss as a torch.Tensor, got "
                            f"{type(loss).__name__}")
        scaler = self.loss_scaler
        scaler.poll_reports()
        scaler.follow_loss(loss, (p for g in self.optimizer.param_groups for p in g["params"]),
                           "FP16_Optimizer.backward")
        prepared = not self._backward_pending
        if prepared:
            self._stash.prepare_backward()
            self._backward_pending = True
        try:
            (loss.float() * scaler.scale).backward(retain_graph=retain_graph)
        except BaseException:
            # (a loss without a graph, a graph already freed): the gradients as they were
            if prepared:
                self._stash.undo_prepare()
                self._backward_pending = False
            raise
        self._fresh_grads = True
        if update_master_grads:
            self.update_master_grads()

    def update_master_grads(self):
        """Check the gradients of the backward calls since the last update for inf/NaN
        and add them, unscaled, to the fp32 master gradients; update the loss scale.
        All on the device. Called by :meth:`backward` unless ``update_master_grads=False``;
        a second call with nothing new in between does nothing."""
        stash, scaler = self._stash, self.loss_scaler
        if not self._backward_pending and stash.pending:
            return
        scaler._to(self._device())
        if scaler.dynamic:
            scaler.clear_overflow_state()
        stash.post_backward(scaler)
        stash.take_overflow(scaler)
        self._backward_pending = False
        # Own copy: the scaler's slot is reused by the next backward. A static scale is
        # not checked (Apex's static LossScaler never reports an overflow).
        self._overflow_flag = None if stash.found_inf is None else stash.found_inf.clone()
        scaler.update_scale()

    def _device(self):
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                return p.device
        return torch.device("cpu")

    def _require_updated(self, what):
        if self._backward_pending:
            raise RuntimeError(f"FP16_Optimizer.{what} was called after "
                               "backward(loss, update_master_grads=False): the gradients are "
                               "still scaled. Call optimizer.update_master_grads() first.")

    # -- the step -----------------------------------------------------------------------------
    def step(self, closure=None):
        """Step the fp32 masters and copy them into the half model, or skip (nothing
        changes) when the gradients from :meth:`backward` held inf/NaN.

        With a ``closure`` (which must call ``optimizer.backward(loss)``), an overflowing
        evaluation is repeated at the reduced scale until its gradients are finite."""
        if torch.compiler.is_compiling():
            # torch.compile(optimizer.step): the wrapper's step runs eagerly (a graph
            # break; fullgraph=True refuses before anything runs). Traced, amp's step ran
            # the wrapped optimizer's own step as one custom op, without the overflow
            # skip: an overflowing step wrote inf/NaN into the weights.
            return _eager_step(self, closure)
        self._require_updated("step()")
        if closure is not None:
            return self._step_with_closure(closure)
        if not self._fresh_grads:
            # No backward since the last step or zero_grad: nothing to step on (the
            # masters' gradients are spent; the fp32 parameters' are the last step's, or
            # zero_grad's zeros, which would move them through momentum and weight
            # decay). (torch's schedulers: the step was called.)
            self.optimizer._opt_called = True
            return None
        self._fresh_grads = False
        return self._amp_step(self.optimizer)

    def _step_with_closure(self, closure):
        stash = self._stash
        self._fresh_grads = False  # (spent by this step, whatever the closure does)
        if self.overflow:
            # A backward() before this call overflowed: skipped, the closure not run, as
            # Apex's step returned before it
            logger.warning("OVERFLOW! Skipping step. Attempted loss scale: %s, reducing to %s",
                           float(self.loss_scaler.used_scale), float(self.loss_scaler.scale))
            stash.last_step.record(self._overflow_flag)
            stash.finish_step()
            return None

        def wrapped_closure():
            if self.first_closure_call_this_step:
                self.first_closure_call_this_step = False
            else:
                # The optimizer moved the masters since the last evaluation.
                stash.master_to_model()
            temp_loss = closure()
            while self.overflow:  # the closure protocol needs the answer on the host
                scaler = self.loss_scaler
                attempted, scale = float(scaler.used_scale), float(scaler.scale)
                if not scaler.dynamic or attempted <= scaler.min_loss_scale:
                    raise RuntimeError(
                        "FP16_Optimizer: the closure's gradients are inf/NaN at a loss scale of "
                        f"{attempted}, which cannot go lower (static, or at min_loss_scale). Look "
                        "for inf/NaN in the loss or the forward pass, or lower the learning rate.")
                logger.warning("OVERFLOW within closure! Skipping step. Attempted loss scale: %s, "
                               "reducing to %s", attempted, scale)
                temp_loss = closure()
            self._require_updated("step(closure)")
            stash.unscale_pending()
            return temp_loss

        try:
            retval = self.optimizer.step(wrapped_closure)
            stash.master_to_model()
        finally:
            self.first_closure_call_this_step = True
            self._fresh_grads = False  # (the closure's backward calls are this step's)
        stash.finish_step()
        return retval

    def clip_master_grads(self, max_norm, norm_type=2):
        """Clip the fp32 gradients the optimizer will use; returns their total norm as a
        0-d device tensor, or -1 (same tensor form) when the gradients overflowed.

        The L2 norm runs on tritamp's multi-tensor kernels and nothing is read back to
        the host: on overflow the step is skipped anyway, so the clip need not be."""
        self._require_updated("clip_master_grads()")
        self._stash.unscale_pending()
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        total = self.clip_grad_norm(params, max_norm, norm_type)
        if self._overflow_flag is None:
            return total
        total = total.to(self._overflow_flag.device)
        return torch.where(self._overflow_flag != 0, torch.full_like(total, -1.0), total)

    def inspect_master_grad_data(self):
        """The fp32 master gradients per param group (None in an overflow state)."""
        if self.overflow:
            logger.warning("Warning:  calling FP16_Optimizer.inspect_master_grad_data while in an "
                           "overflow state.  Gradients are currently invalid (may be inf, nan, or "
                           "stale).  Returning None.")
            return None
        self._require_updated("inspect_master_grad_data()")
        self._stash.unscale_pending()
        return [[None if p.grad is None else p.grad.data for p in group["params"]]
                for group in self.optimizer.param_groups]

    # -- overflow, loss scale, state ---------------------------------------------------------
    @property
    def overflow(self):
        """True when the most recently checked gradients held inf/NaN (reads the device)."""
        return False if self._overflow_flag is None else bool(self._overflow_flag)

    @overflow.setter
    def overflow(self, value):
        """Apex's attribute, which its step read: True skips the next step, False lets it
        run (the flag the step reads on the device is replaced)."""
        self._overflow_flag = torch.tensor(1.0 if value else 0.0, device=self._device())
        stash = self._stash
        stash._drop_alias()
        stash.found_inf = self._overflow_flag.clone()

    def _get_loss_scale(self):
        return self.loss_scaler.loss_scale()

    def _set_loss_scale(self, value):
        self.loss_scaler.set_scale(value)

    loss_scale = property(_get_loss_scale, _set_loss_scale,
                          doc="The current loss scale as a Python float (reads the device).")

    def _get_state(self):
        return self.optimizer.state

    def _set_state(self, value):
        self.optimizer.state = value

    state = property(_get_state, _set_state)

    def _get_param_groups(self):
        return self.optimizer.param_groups

    def _set_param_groups(self, value):
        self.optimizer.param_groups = value

    param_groups = property(_get_param_groups, _set_param_groups)

    def state_dict(self):
        """Apex's keys: ``loss_scaler`` (a plain dict here, not a pickled object),
        ``dynamic_loss_scale``, ``overflow``, ``first_closure_call_this_step``,
        ``optimizer_state_dict`` and ``fp32_from_fp16`` (the fp32 master weights)."""
        return {
            "loss_scaler": self.loss_scaler.state_dict(),
            "dynamic_loss_scale": self.dynamic_loss_scale,
            "overflow": self.overflow,
            "first_closure_call_this_step": self.first_closure_call_this_step,
            "optimizer_state_dict": self.optimizer.state_dict(),
            "fp32_from_fp16": [[m.detach() for m in group] for group in self.fp32_from_fp16_groups],
        }

    def load_state_dict(self, state_dict):
        """Restore a :meth:`state_dict`: scaler, optimizer state and the fp32 masters
        themselves (the half model is refreshed from them, so nothing is lost to rounding)."""
        # Every entry checked before anything loads (the flags were read last, after the
        # optimizer, the scaler and the masters had been replaced)
        for key in ("fp32_from_fp16", "loss_scaler", "optimizer_state_dict"):
            if key not in state_dict:
                raise ValueError(f"FP16_Optimizer.load_state_dict: the state dict has no "
                                 f"{key!r} entry; pass what FP16_Optimizer.state_dict() "
                                 "returned. Nothing was loaded.")
        flags = {}
        for key, default in (("dynamic_loss_scale", self.dynamic_loss_scale),
                             ("overflow", False), ("first_closure_call_this_step", True)):
            value = state_dict.get(key, default)
            if isinstance(value, torch.Tensor) and value.numel() == 1 \
                    and not value.is_meta and not value.is_complex():
                value = bool(value)  # (one value: a saved flag tensor)
            if not isinstance(value, (bool, int)) or value not in (0, 1):
                raise TypeError(f"FP16_Optimizer.load_state_dict: state_dict[{key!r}] is "
                                f"{type(value).__name__} {value!r:.60}, expected True or "
                                "False. Nothing was loaded.")
            flags[key] = bool(value)
        saved_masters = state_dict["fp32_from_fp16"]
        if len(saved_masters) != len(self.fp32_from_fp16_groups) or any(
                len(s) != len(c) for s, c in zip(saved_masters, self.fp32_from_fp16_groups)):
            raise ValueError("the checkpoint's fp32_from_fp16 master lists do not match this "
                             "optimizer's param groups; build the model and optimizer as they "
                             "were when the checkpoint was saved")
        for gi, (saved_group, group) in enumerate(zip(saved_masters, self.fp32_from_fp16_groups)):
            for i, (saved, current) in enumerate(zip(saved_group, group)):
                if not isinstance(saved, torch.Tensor) or saved.layout != torch.strided \
                        or not saved.is_floating_point() or saved.shape != current.shape \
                        or saved.device.type == "meta":
                    what = f"a {type(saved).__name__}"
                    if isinstance(saved, torch.Tensor):
                        what = (f"a {str(saved.dtype).replace('torch.', '')} tensor of shape "
                                f"{tuple(saved.shape)}"
                                + ("" if saved.layout == torch.strided else f" ({saved.layout})")
                                + (f" on {saved.device}" if saved.device.type == "meta" else ""))
                    raise ValueError(
                        f"FP16_Optimizer.load_state_dict: state_dict['fp32_from_fp16'][{gi}][{i}] "
                        f"is {what}, expected a dense floating-point tensor of "
                        f"shape {tuple(current.shape)} (the fp32 master of that parameter); "
                        "build the model and optimizer as they were when the checkpoint was "
                        "saved. Nothing was loaded.")
        dynamic = flags["dynamic_loss_scale"]
        scaler = self.loss_scaler
        if dynamic != scaler.dynamic:  # the checkpoint's mode wins, as in Apex
            scaler = (self._dynamic_scaler() if dynamic
                      else OptimizerLossScaler(1.0, arg_names=_STATIC_NAMES))
        # Checked before anything changes; torch's load_state_dict checks before it loads.
        scaler_values = scaler.check_state_dict(_scaler_state(state_dict["loss_scaler"]),
                                                where="state_dict['loss_scaler']")
        self.optimizer.load_state_dict(state_dict["optimizer_state_dict"])
        self.loss_scaler = scaler
        self.dynamic_loss_scale = dynamic
        scaler._load_checked(scaler_values)
        with torch.no_grad():
            for current_group, saved_group in zip(self.fp32_from_fp16_groups, saved_masters):
                for current, saved in zip(current_group, saved_group):
                    current.copy_(saved)
        if self.all_fp16_params:
            K.check_unscale([m.detach() for m in self.all_fp32_from_fp16_params], None, None,
                            dsts=[p.detach() for p in self.all_fp16_params])
        self._stash.finish_step()
        self._backward_pending = False
        self._fresh_grads = False
        self.overflow = flags["overflow"]
        self.first_closure_call_this_step = flags["first_closure_call_this_step"]


@torch.compiler.disable
def _eager_step(fp16_optimizer, closure):
    return fp16_optimizer.step(closure)


def _adopting_add_param_group(old_add_param_group, wrapper_ref):
    """The wrapped optimizer's ``add_param_group``, adopting the new group into the
    wrapper's stash first (fp32 masters for its half parameters); checked before
    anything changes, and taken back if the optimizer refuses the group."""
    def add_param_group(self, param_group):
        wrapper = wrapper_ref()
        if wrapper is None:
            return old_add_param_group(param_group)
        if not isinstance(param_group, dict):
            raise TypeError(f"param_group must be a dict, got {type(param_group).__name__}")
        params = param_group["params"]
        if isinstance(params, torch.Tensor):
            params = [params]
        elif isinstance(params, set):
            raise TypeError("optimizer parameters need to be organized in ordered collections, "
                            "but the ordering of tensors in sets will change between runs. "
                            "Please use a list instead.")
        else:
            params = list(params)
        wrapped = set(map(id, wrapper.all_fp16_params))
        for j, p in enumerate(params):
            where = f"the new param group's params[{j}]"
            if not isinstance(p, torch.Tensor) or not p.is_floating_point():
                what = p.dtype if isinstance(p, torch.Tensor) else type(p).__name__
                raise TypeError(f"FP16_Optimizer.add_param_group: {where} is {what}; "
                                "parameters must be float16, bfloat16 or float32 tensors")
            if p.requires_grad and p.dtype not in _PARAM_DTYPES:
                raise TypeError("Wrapped parameters must be either float16, bfloat16 or "
                                f"float32 tensors. Received {p.dtype} with {tuple(p.size())} "
                                f"({where})")
            if id(p) in wrapped:
                raise ValueError(f"FP16_Optimizer.add_param_group: {where} is already in "
                                 "another parameter group (through its fp32 master); a "
                                 "parameter belongs to one group")
        # (refused by the optimizer: the stash is put back as it was)
        result = wrapper._stash.adopt_added_group(dict(param_group, params=params), self,
                                                  old_add_param_group)
        wrapper._collect_groups()
        return result
    return add_param_group


def _scaler_state(saved):
    """The scaler dict of a checkpoint; an Apex checkpoint holds the scaler object."""
    if isinstance(saved, Mapping):
        return saved
    scale = saved.loss_scale() if callable(getattr(saved, "loss_scale", None)) else \
        getattr(saved, "_loss_scale", getattr(saved, "cur_scale", None))
    if scale is None:
        raise TypeError(f"cannot read a loss scale from the checkpoint's loss_scaler "
                        f"({type(saved).__name__})")
    return {"loss_scale": float(scale), "unskipped": int(getattr(saved, "_unskipped", 0))}
