"""``scale_loss``, ``disable_casts`` and ``master_params``."""
import contextlib
import numbers
import threading

import torch

from .state import _amp_state, logger


def _as_list(optimizers):
    if isinstance(optimizers, (list, tuple)):
        return list(optimizers)
    return [optimizers]


@contextlib.contextmanager
def scale_loss(loss, optimizers, loss_id=0, model=None, delay_unscale=False,
               delay_overflow_check=False):
    """Yield ``loss.float() * scale``; on exit check (and unscale) the gradients.

    The scale is a device tensor, the overflow check and the scale update run on the
    device: nothing here waits for the GPU. With a dynamic scale the ``step()`` of every
    optimizer passed here then skips the update when any gradient of the backward held
    inf/NaN, whichever optimizer owns it (Apex's rule; no sync for optimizers that
    declare ``_step_supports_amp_scaling``, one sync for others, as in Apex). A static
    scale is not checked and never skips a step, as in Apex (nothing could act on an
    overflow); with a static scale of 1.0 and no master weights the exit does nothing.

    ``delay_unscale=True`` leaves the gradients scaled (accumulation; a later
    ``scale_loss`` with ``delay_unscale=False`` unscales them).
    ``delay_overflow_check`` is accepted and ignored: the check, the skip and the scale's
    update run as without it. Apex documented it as a placeholder; its only effect there
    was to step on inf/NaN gradients without updating the scale.

    With a static scale of 1.0 and no master weights nothing is asked of ``optimizers``
    (Apex returned before looking at them): an optimizer built after ``initialize``, or
    None, is accepted there.
    """
    props = _amp_state.opt_properties
    if props is None:
        raise RuntimeError("Invoked 'with amp.scale_loss`, but internal Amp state has not been "
                           "initialized.  model, optimizer = amp.initialize(model, optimizer, "
                           "opt_level=...) must be called before `with amp.scale_loss`.")
    optimizers = _as_list(optimizers)
    for opt in optimizers:
        stash = getattr(opt, "_amp_stash", None)
        if stash is not None and stash.initialized_by is not props:
            raise RuntimeError(
                f"scale_loss got an optimizer ({type(opt).__name__}) that the current "
                "amp.initialize did not prepare: a later amp.initialize call replaced amp's "
                "properties and loss scalers (or the optimizer belongs to an FP16_Optimizer), "
                "so its gradients would be handled with another call's settings (an O2 "
                "optimizer's master weights would silently not be updated). Pass every model "
                "and optimizer to one amp.initialize call (as lists), or build a fresh "
                "optimizer and pass it to the new call.")
    if not props.enabled:
        yield loss
        return
    nb = len(_amp_state.loss_scalers)
    if isinstance(loss_id, bool) or not isinstance(loss_id, numbers.Integral):
        raise TypeError(f"loss_id must be an int (0 <= loss_id < num_losses={nb}), got "
                        f"{type(loss_id).__name__} {loss_id!r}")
    if not 0 <= loss_id < nb:
        raise ValueError(f"loss_id={loss_id!r} but initialize was called with "
                         f"num_losses={nb}; pass num_losses=N to "
                         "amp.initialize and 0 <= loss_id < N.")
    if not isinstance(loss, torch.Tensor):
        raise TypeError(f"scale_loss expects the loss as a torch.Tensor, got {type(loss).__name__}")
    scaler = _amp_state.loss_scalers[int(loss_id)]

    if not props.master_weights and scaler.static_one:
        yield loss.float()
        return
    for opt in optimizers:
        if not hasattr(opt, "_amp_stash"):
            raise RuntimeError(f"scale_loss got an optimizer ({type(opt).__name__}) that did not go "
                               "through amp.initialize. Pass the optimizer(s) returned by "
                               "amp.initialize(model, optimizer, ...).")

    scaler.poll_reports()
    scaler.follow_loss(loss, (p for opt in optimizers for g in opt.param_groups
                              for p in g["params"]), "scale_loss")
    prepared, dropped = [], []
    for opt in optimizers:
        stash = opt._amp_stash
        if not stash.params_have_scaled_gradients:
            if delay_unscale:
                # the first backward of an accumulation: its gradients stay scaled (Apex
                # prepared nothing here), but a flag carried over a zero_grad is dropped
                # as by any other scale_loss
                dropped.append((stash, stash.found_inf))
                stash.drop_carried_flag()
            else:
                stash.prepare_backward()
                prepared.append(stash)
        else:
            # a later backward of a delay_unscale chain: its gradients are brought to the
            # scale this backward uses, if they carry another one
            stash.rescale_chain(scaler)

    try:
        yield loss.float() * scaler.scale
    except BaseException:
        # The block raised (its backward, say): the gradients and flags as they were
        # before it, so that the failed step leaves nothing half done.
        for stash in prepared:
            stash.undo_prepare()
        for stash, found in dropped:
            stash.found_inf = found
        raise

    if delay_unscale:
        for opt in optimizers:
            opt._amp_stash.start_chain(scaler)
        return
    for opt in optimizers:
        opt._amp_stash.end_chain()
    if scaler.dynamic:
        scaler.clear_overflow_state()
    for opt in optimizers:
        opt._amp_stash.post_backward(scaler)
        opt._amp_stash.params_have_scaled_gradients = False
    if scaler.dynamic and scaler.overflow_process_group is not None:
        scaler.reduce_overflow()
    # Only now is the overflow flag final: every optimizer of this scale_loss skips when
    # any gradient of the backward overflowed, whichever optimizer it belongs to.
    for opt in optimizers:
        opt._amp_stash.take_overflow(scaler)
    if scaler.dynamic and _amp_state.verbosity > 0:  # names for the skip warning
        for opt in optimizers:
            opt._amp_stash.count_overflows(scaler)
    scaler.update_scale()


_casts = threading.local()  # .off: how many disable_casts blocks this thread is inside


def casts_disabled():
    """Whether this thread is inside :func:`disable_casts` (O1's patched forward then
    enters no autocast of its own)."""
    return getattr(_casts, "off", 0) > 0


@contextlib.contextmanager
def disable_casts():
    """Turn O1's casts (autocast and the registered functions) off inside the block, as
    Apex's did: a forward of an O1 model called inside it runs without autocast too.

    Safe at every opt level and before ``initialize``: it switches off autocast on the
    device types where it is currently on, and tells O1's patched forwards not to switch
    it on (per thread)."""
    on = [d for d in ("cpu", "cuda", "xpu", "mps") if _autocast_on(d)]
    _casts.off = getattr(_casts, "off", 0) + 1
    try:
        with contextlib.ExitStack() as stack:
            for device_type in on:
                stack.enter_context(torch.autocast(device_type, enabled=False))
            yield
    finally:
        _casts.off -= 1


def _autocast_on(device_type):
    try:
        return torch.is_autocast_enabled(device_type)
    except RuntimeError:  # a device type autocast does not know (meta, ...)
        return False


def master_params(optimizer):
    """Yield the parameters ``optimizer`` updates: the fp32 masters where it has them.

    Use it for gradient clipping after ``scale_loss`` exits. Gradients that were left
    scaled for a fused step are unscaled first, so what you clip is unscaled. Read before
    the first backward (a list of the masters kept from set-up), it makes every
    ``scale_loss`` exit unscale into the masters' gradients, as Apex's did, so that the
    kept list clips what the step uses."""
    _unscale_for_master_params(optimizer)
    for group in optimizer.param_groups:
        yield from group["params"]


@torch.compiler.disable
def _unscale_for_master_params(optimizer):
    """:func:`master_params`' work on amp's state, never traced: under torch.compile it
    runs eagerly where the region breaks (fullgraph=True refuses the region before it
    runs). Traced, its kept sweeps' addresses became symbolic and Dynamo failed in them
    on a recompile, after part of the region had run."""
    stash = getattr(optimizer, "_amp_stash", None)
    if stash is not None:
        if not stash.backward_seen and stash.masters and not stash.master_grads_wanted:
            stash.master_grads_wanted = True
            if stash.writes_model_copies:
                logger.info(
                    "amp: master_params read before the first backward: scale_loss will "
                    "unscale into the masters' fp32 gradients (as Apex did), so that a list "
                    "of them kept from here clips what the step uses. Iterate "
                    "amp.master_params(optimizer) after scale_loss instead to keep the fused "
                    "step reading the half gradients in one pass.")
        stash.unscale_pending()
