"""What initialize does to optimizers: fp32 master weights and a step that skips on
overflow.

Per optimizer a small state machine, kept in ``optimizer._amp_stash``:

    READY --scale_loss exit--> PENDING (gradients either unscaled, or still scaled with
          grad_scale recorded; with a dynamic scale, found_inf known on the device)
    PENDING --step()--> READY (stepped, or skipped when found_inf)

A static loss scale is never checked and never skips a step (Apex's rule: only a dynamic
scaler looks for overflows, since only it can act on one): PENDING then has no found_inf.

``delay_unscale=True`` adds SCALED (gradients accumulate scaled; step() refuses) until a
later ``scale_loss`` with ``delay_unscale=False`` unscales them.
"""
import collections
import functools
import itertools
import operator
import types

import torch

from tritamp import compiled
from tritamp import kernels as K
from tritamp.contract import LastStep, StepState, handoff_of
from tritamp.kernels.engine import (SharedMemoryError, SweepCache, borrowed, is_dense,
                                    layout_key, refuse_shared_rows, row_labels, sparse_error,
                                    zero_grads_)
from tritamp.sharding import is_dtensor, locals_of

_grad_of = operator.attrgetter("grad")
_shape_of = operator.attrgetter("shape")
_is_none = functools.partial(operator.is_, None)
_is_not_none = functools.partial(operator.is_not, None)
_no_grads = itertools.repeat(None)


# torch optimizers whose fused step, skipped on the device, leaves the state a first step
# starts from (tests/test_bad_input_amp.py holds them to it, bit for bit).
_SKIP_SAFE_TORCH_OPTIMIZERS = (torch.optim.Adam, torch.optim.AdamW)


def _clear_grads(params):
    """``p.grad = None`` for every parameter, iterated in C (no Python loop per tensor)."""
    collections.deque(map(setattr, params, itertools.repeat("grad"), _no_grads), maxlen=0)


from . import overflow
from .model import MASTER_ATTR
from .state import logger


class AmpStash:
    def __init__(self, optimizer, master_weights):
        self.master_weights = bool(master_weights)
        # the Properties of the amp.initialize call that prepared this optimizer (None for
        # FP16_Optimizer's): scale_loss refuses it once a later call replaced amp's state
        self.initialized_by = None
        self.supports_amp_scaling = bool(getattr(optimizer, "_step_supports_amp_scaling", False))
        # An optimizer that speaks tritamp's step contract (tritamp.contract) is handed
        # each step through its StepHandoff; it reads a master's gradient from the half
        # model parameter registered with it and writes that parameter in the same pass.
        self.handoff = handoff_of(optimizer)
        self.writes_model_copies = self.handoff is not None
        self.model_params = []    # half model parameters that have fp32 masters
        self.masters = []         # their masters, owned by the optimizer's param_groups
        self.master_grad_bufs = []  # persistent fp32 gradient storage of the masters
        self.plain_params = []    # parameters the optimizer updates directly
        self.plain_stash = []     # their gradients stashed while another loss backpropagates
        self.pending = False      # PENDING: scale_loss exited since the last step
        self.found_inf = None     # 0-d device tensor while PENDING (dynamic scale), else None
        self.grad_scale = None    # scale the plain gradients still carry, or None
        self.scaler = None        # the scaler whose slots found_inf / grad_scale alias
        self.params_have_scaled_gradients = False  # SCALED (delay_unscale)
        # SCALED: the scaler whose scale the gradients carry, and a copy of that scale
        # once the scaler rewrote it (None while it still holds it)
        self.chain_scaler = None
        self.chain_scale = None
        # (gradients, their version counters) as zero_grad(set_to_none=False) left them
        # zeroed, or None
        self.zeroed = None
        # zeroed half model gradients the backward does not reach reach the masters as
        # zeros (fp16_utils' FP16_Optimizer), not None (amp's O2)
        self.masters_take_zeroed = False
        # amp.master_params was read before the first backward (a list of the masters kept
        # from set-up, say): every exit then unscales into the masters' fp32 gradients, as
        # Apex's did, so that clipping such a list clips what the step uses
        self.master_grads_wanted = False
        self.backward_seen = False
        self._undo = None          # what prepare_backward changed (undo_prepare)
        self._sweeps = {}          # cached check/unscale sweeps, by purpose
        self.param_names = {}      # id(parameter) -> name, for the overflow warning
        self._count_key = None     # the layout key of the gradients this exit checked
        self._ledger = None        # counts of non-finite gradient values (overflow.Ledger)
        self.sharded = False       # DTensor parameters (FSDP2): checks read local shards
        # the overflow flag of the last step(): the handoff's record when there is one
        self.last_step = self.handoff.last_step if self.handoff is not None else LastStep()

    def _check_unscale(self, purpose, srcs, scale, found, dsts=None, adds=None, write=True,
                       key=None, rebind_on=None, addresses=None, check_adds=True):
        """check_unscale over a sweep prepared once and kept while the tensors keep their
        addresses, strides, sizes and dtypes (the steady state of a training loop
        rebuilds nothing).

        ``key`` (optional) says what the lists were gathered from, per parameter; by
        default the key holds every tensor's address, strides, shape and dtype (the
        lists may be subsets: a position is not tied to one parameter).
        ``rebind_on`` (optional, read-only checks and unscales in place) is the part of
        ``key`` without the addresses: when only those changed, a kept check takes the
        new sources instead of being prepared again; ``addresses`` are then the sources'
        (from the key)."""
        if not srcs:
            return
        if self.sharded and rebind_on is None:  # (the steady-state check's are local)
            srcs = locals_of(srcs)
            dsts = None if dsts is None else locals_of(dsts)
            adds = None if adds is None else locals_of(adds)
        if key is None:
            tensors = (*srcs, *(dsts or ()), *(adds or ()))
            # layout_key refuses a sparse gradient by name (it has no address to key on)
            key = (layout_key(tensors, op="amp"), tuple(map(_shape_of, tensors)))
            if write and dsts is not None and rebind_on is None:
                # An unscale into destinations (plus addends: a second backward into the
                # same step): when only addresses changed (on a CPU, and on a GPU whose
                # allocator hands the gradients other blocks, they do every step), the
                # kept sweep takes the new lists. Which rows alias (a destination at its
                # source's address, an addend at its destination's or its source's) is
                # part of what must not change.
                addresses = key[0][0]
                n = len(srcs)
                src_at, dst_at = addresses[:n], addresses[n:2 * n]
                aliases = tuple(map(operator.eq, src_at, dst_at))
                if adds is not None:
                    add_at = addresses[2 * n:]
                    aliases += (tuple(map(operator.eq, add_at, dst_at)),
                                tuple(map(operator.eq, add_at, src_at)))
                rebind_on = (key[0][1], key[1], aliases)
                key = (addresses,)
        if rebind_on is None:
            key = (key, None, len(srcs), dsts is None, adds is None, write)
        else:
            key = (key[0], rebind_on, len(srcs), dsts is None, adds is None, write)
        cache = self._sweeps.get(purpose)
        if cache is None:
            cache = self._sweeps[purpose] = SweepCache()
        prepared = cache.get(key)
        if prepared is None and rebind_on is not None and cache.prepared is not None \
                and cache.key[1:] == key[1:] and self._rebound(cache.prepared, srcs, dsts,
                                                               adds, write, addresses):
            # Only the gradients' addresses changed (on a CPU they do every step; under
            # FSDP2 the gradients are new tensors): the kept, validated check takes them.
            prepared = cache.prepared
            K.check_unscale_launch(prepared, scale=scale, found_inf=found,
                                   check_adds=check_adds)
            if prepared.triton:
                cache.key = key  # its tables now hold these addresses
            else:
                prepared.release()  # no gradient kept alive between steps
                cache.key = (None, *key[1:])
            return
        if prepared is None:
            # Borrowed tensors: the kept sweep must not keep this step's gradients alive.
            lent = borrowed(list(srcs) + list(dsts or ()) + list(adds or ()))
            n, m = len(srcs), len(dsts or ())
            try:
                made = K.check_unscale_prepare(
                    lent[:n], dsts=None if dsts is None else lent[n:n + m],
                    adds=None if adds is None else lent[n + m:], write=write)
            except SharedMemoryError:
                self._refuse_shared_by_name()
                raise
            prepared = cache.put(key, made)
        K.check_unscale_launch(prepared, scale=scale, found_inf=found, check_adds=check_adds)

    @staticmethod
    def _rebound(prepared, srcs, dsts, adds, write, addresses):
        """The kept sweep ``prepared`` rebound to this step's lists, if it can be."""
        if not write:
            return prepared.rebindable and prepared.rebind_sources(srcs, addresses)
        if dsts is None:  # unscaled in place: the sources are the destinations
            return prepared.rebindable_in_place and prepared.rebind_sources(srcs, addresses)
        return prepared.rebindable_writes and prepared.rebind_lists(srcs, dsts, addresses,
                                                                    adds=adds)

    # -- parameters -----------------------------------------------------------------
    def adopt_group(self, group, optimizer):
        params = group["params"]
        for i, p in enumerate(params):
            if not p.is_floating_point():
                raise TypeError(f"Optimizer's parameters must be floating point tensors; received "
                                f"{p.dtype}")
            if is_dtensor(p):
                self.sharded = True
            if self.master_weights and p.dtype != torch.float32 and p.requires_grad:
                master = p.detach().clone().float()
                master.requires_grad_(True)
                setattr(p, MASTER_ATTR, master)
                if self.handoff is not None:
                    self.handoff.masters.add(master, p)
                params[i] = master
                if p in optimizer.state:
                    optimizer.state[master] = optimizer.state.pop(p)
                self.model_params.append(p)
                self.masters.append(master)
                self.master_grad_bufs.append(None)
            else:
                self.plain_params.append(p)
                self.plain_stash.append(None)

    def adopt_added_group(self, group, optimizer, add_param_group):
        """:meth:`adopt_group` for a group given to ``add_param_group`` (the optimizer's
        own, called after it): when the optimizer refuses the group, the stash, the
        parameters' master attributes and the group's list are put back as they were, so
        that a corrected group can be added (left behind, each half parameter kept an
        orphan master and was refused as "already managed")."""
        params = group["params"]
        listed = list(params)
        held = [(p, getattr(p, MASTER_ATTR, None)) for p in listed]
        n_model, n_plain = len(self.model_params), len(self.plain_params)
        try:
            self.adopt_group(group, optimizer)  # (it refuses a non-float parameter midway)
            return add_param_group(group)
        except BaseException:
            del self.model_params[n_model:], self.masters[n_model:]
            del self.master_grad_bufs[n_model:]
            del self.plain_params[n_plain:], self.plain_stash[n_plain:]
            for p, master in held:
                made = getattr(p, MASTER_ATTR, None)
                if made is not None and made is not master and made in optimizer.state:
                    optimizer.state[p] = optimizer.state.pop(made)  # (adopt_group moved it)
                if master is None:
                    if hasattr(p, MASTER_ATTR):
                        delattr(p, MASTER_ATTR)
                else:
                    setattr(p, MASTER_ATTR, master)
            params[:] = listed
            group["params"] = params  # (the optimizer rebinds it to its own list first)
            raise

    def _master_grad_buf(self, i):
        buf = self.master_grad_bufs[i]
        if buf is None:
            buf = torch.empty_like(self.masters[i])
            self.master_grad_bufs[i] = buf
        return buf

    # -- aliasing of the scaler's slots ---------------------------------------------------
    def detach_from(self, scaler):
        """Own copies of the scaler slots before the scaler reuses them."""
        if self.scaler is scaler:
            if self.found_inf is not None:
                self.found_inf = self.found_inf.clone()
            if self.grad_scale is not None:
                self.grad_scale = self.grad_scale.clone()
            self.scaler = None

    def _drop_alias(self):
        if self.scaler is not None:
            try:
                self.scaler._aliases.remove(self)
            except ValueError:
                pass
            self.scaler = None

    def unscale_pending(self):
        """Unscale gradients left scaled for a fused step (the user asked for .grad, or
        another loss is about to add to them): plain ones in place, the half model
        gradients into the masters' fp32 gradients."""
        if self.grad_scale is None:
            return
        grads = [p.grad for p in self.plain_params if p.grad is not None]
        srcs, dsts = [], []
        for i, (p, m) in enumerate(zip(self.model_params, self.masters)):
            if p.grad is not None and m.grad is None:
                m.grad = self._master_grad_buf(i)
                srcs.append(p.grad)
                dsts.append(m.grad)
        self._check_unscale("pending", grads + srcs, self.grad_scale, None, dsts=grads + dsts)
        self.grad_scale = None

    # -- delay_unscale chains --------------------------------------------------------------
    def start_chain(self, scaler):
        """SCALED: the gradients carry ``scaler``'s current scale."""
        self.params_have_scaled_gradients = True
        if self.chain_scaler is not scaler:
            self.end_chain()
            self.chain_scaler = scaler
            scaler._chains.append(self)

    def keep_chain_scale(self, scaler):
        """``scaler`` is about to rewrite the scale these gradients carry: copy it."""
        if self.chain_scaler is scaler and self.chain_scale is None:
            self.chain_scale = scaler.scale.clone()

    def end_chain(self):
        scaler, self.chain_scaler, self.chain_scale = self.chain_scaler, None, None
        if scaler is not None:
            try:
                scaler._chains.remove(self)
            except ValueError:
                pass

    def rescale_chain(self, scaler):
        """A later backward of a delay_unscale chain, scaled by ``scaler``: gradients
        that carry another scale (another loss_id's scaler, or a scale rewritten since:
        amp.load_state_dict, an update by another optimizer's scale_loss) are brought to
        ``scaler``'s current one on the device, so that the exit unscales every one of
        them by the scale it carries. Nothing runs while the scale is the same."""
        old = self.chain_scale
        if old is None and self.chain_scaler is scaler:
            return
        if old is None:
            old = self.chain_scaler.scale
        ratio = scaler.scale / old
        grads = [p.grad for p in itertools.chain(self.model_params, self.plain_params)
                 if p.grad is not None]
        grads += [m.grad for m in self.masters if m.grad is not None]
        for g in grads:  # (a rare path: no multi-tensor launch kept for it)
            g.mul_(ratio)
        self.end_chain()
        self.chain_scaler = scaler
        scaler._chains.append(self)

    # -- around backward -------------------------------------------------------------
    def drop_carried_flag(self):
        """The start of a backward into fresh gradients (every scale_loss but the later
        ones of a delay_unscale chain): an overflow flag without a scale_loss since the
        last step was carried over a zero_grad; the gradients it was about are gone, this
        backward's decide."""
        if not self.pending:
            self.found_inf = None

    def prepare_backward(self):
        found = self.found_inf
        self.drop_carried_flag()
        self.unscale_pending()
        zeroed, self.zeroed = self.zeroed, None
        # what undo_prepare puts back if the backward raises (the plain gradients are in
        # plain_stash, or left in place below to be accumulated into)
        untouched = zeroed is not None and _untouched(zeroed, self.plain_params,
                                                      self.model_params)
        model_grads = list(map(_grad_of, self.model_params))
        self._undo = (found, zeroed, untouched, model_grads)
        if untouched:
            # zero_grad(set_to_none=False) left zeros that nothing has written since: the
            # backward accumulates into them and they count as this backward's own (checked
            # read-only, never unscaled into fp32 copies, no stash to add back). Written
            # since (a backward outside scale_loss), they are stashed below and added back
            # unscaled, as any earlier gradient, as Apex's stash does.
            if self.masters and not self.masters_take_zeroed:
                # ... except the half model gradients: Apex set every one to None before
                # the backward, so a parameter the backward does not reach has none, and
                # neither its master (the step leaves both alone; a zero gradient would
                # move them through momentum, weight decay or Adam's moments)
                _clear_grads(self.model_params)
            return
        if any(map(_is_not_none, model_grads)):  # (the steady state has none to clear)
            _clear_grads(self.model_params)  # fresh half gradients; the masters' accumulate
        self.plain_stash = list(map(_grad_of, self.plain_params))
        _clear_grads(self.plain_params)

    def undo_prepare(self):
        """The backward after :meth:`prepare_backward` raised: the gradients, the zeroed
        record and the flag as they were before it (what it moved from pending half
        gradients into the masters stays there: the same values, unscaled; the next
        backward clears those half gradients). Gradients the failed backward wrote
        into are dropped, or, where zeros were being accumulated into, zeroed again."""
        undo, self._undo = self._undo, None
        if undo is None:
            return
        found, zeroed, untouched, model_grads = undo
        collections.deque(map(setattr, self.model_params, itertools.repeat("grad"),
                              model_grads), maxlen=0)
        if untouched:
            # the backward was accumulating into zero_grad's zeros: those it wrote into
            # are zeroed again, and recorded as zeros again
            grads, versions = zeroed
            moved = [g for g, v in zip(grads, versions) if g is not None and g._version != v]
            if moved:
                zero_grads_(moved)
            zeroed = _versions(self.plain_params, self.model_params)
        else:
            collections.deque(map(setattr, self.plain_params, itertools.repeat("grad"),
                                  self.plain_stash), maxlen=0)
            self.plain_stash = [None] * len(self.plain_params)
        self.zeroed = zeroed
        self.found_inf = found

    def _refuse_sparse_by_name(self):
        """Raise layout_key's sparse-gradient refusal naming the parameter (its module
        path, as the skip warning names it) instead of an index into the exit's list."""
        for p in itertools.chain(self.model_params, self.plain_params):
            g = p.grad
            if g is not None and g.layout != torch.strided:
                name = self.param_names.get(id(p), f"a parameter of shape {list(p.shape)}")
                raise sparse_error("amp", f"the gradient of {name}", g) from None

    def _refuse_shared_by_name(self):
        """Raise the refusal of gradients that share memory naming the parameters (as the
        skip warning names them) instead of indices into the exit's lists, when it is
        two parameters' gradients that do (a gradient assigned to two parameters)."""
        params = [p for p in itertools.chain(self.model_params, self.plain_params)
                  if p.grad is not None]
        names = [self.param_names.get(id(p), f"a parameter of shape {list(p.shape)}")
                 for p in params]
        grads = [p.grad for p in params]
        with row_labels(names):
            refuse_shared_rows("amp", [("gradients", locals_of(grads) if self.sharded
                                        else grads, True)])

    def post_backward(self, scaler):
        """Check (and unscale) this backward's gradients; record what step() needs.

        Gradients left scaled for the step carry the scaler's current scale: a dynamic
        scale's update at this exit copies it into USED_SCALE before moving SCALE."""
        self._undo = None  # (the backward went through)
        carried = scaler.used_scale if scaler.dynamic else scaler.scale
        check = scaler.found_inf if scaler.dynamic else None  # a static scale is not checked
        self.backward_seen = True
        if (not self.pending
                and (not self.masters or (self.supports_amp_scaling and self.writes_model_copies
                                          and not self.master_grads_wanted))
                and not any(map(_is_not_none, self.plain_stash))
                and not any(map(_is_not_none, map(_grad_of, self.masters)))):
            # The steady state: every gradient is this backward's own. Without masters they
            # are unscaled in place as they are checked; with masters and an optimizer that
            # writes the half copies itself they are checked read-only and the step
            # unscales them as it reads them.
            grads = list(map(_grad_of, self.model_params))
            grads.extend(map(_grad_of, self.plain_params))
            if self.sharded:
                grads = locals_of(grads)
            # Keyed per parameter (None kept in place) by each gradient's address,
            # strides, size and dtype: a parameter recast or narrowed through .data may
            # get a gradient of another dtype or size at the old one's address. (A
            # sparse gradient is refused by name here.)
            try:
                key = layout_key(grads, op="amp")
            except RuntimeError:
                self._refuse_sparse_by_name()
                raise
            self._count_key = key  # (the key only: holding the gradients keeps them alive)
            own = not self.masters
            if check is not None or own:
                addresses = key[0]
                if any(map(_is_none, grads)):
                    addresses = [a for a, g in zip(addresses, grads) if g is not None]
                    grads = [g for g in grads if g is not None]
                if own:
                    # The parameters are their own masters (O0, O1, O3): their gradients
                    # are unscaled in place in the pass that checks them, as Apex's exit
                    # did, so .grad holds the true gradient from here on (clipping or
                    # reading model.parameters() sees it); the step reads them unscaled.
                    self._check_unscale("unscale_own", grads, scaler.scale, check,
                                        key=key, addresses=addresses, rebind_on=key[1])
                    self._pending(None)
                    return
                self._check_unscale("check", grads, None, check, write=False, key=key,
                                    rebind_on=key[1], addresses=addresses)
            self._pending(carried, scaler)
            return
        self._count_key = None
        master_fresh = []  # (index, half gradient) of masters without a gradient yet
        acc = []  # (gradient, destination, addend): a second loss into the same step
        for i, (p, m) in enumerate(zip(self.model_params, self.masters)):
            g = p.grad
            if g is None:
                continue
            if m.grad is None:
                master_fresh.append((i, g))
            else:
                acc.append((g, m.grad, m.grad))
        plain_fresh = []
        restore = []  # (parameter, stashed gradient) of parameters this backward missed
        for i, p in enumerate(self.plain_params):
            g, s = p.grad, self.plain_stash[i]
            if g is None:
                if s is not None:
                    restore.append((p, s))
            elif s is None:
                plain_fresh.append(g)
            else:
                acc.append((g, g, s))
        srcs = [g for _, g in master_fresh]
        # A sparse gradient is refused by name before anything below changes.
        checked = srcs + plain_fresh + [a[0] for a in acc]
        try:
            layout_key(locals_of(checked) if self.sharded else checked, op="amp")
        except RuntimeError:
            self._refuse_sparse_by_name()
            raise
        self.plain_stash = [None] * len(self.plain_params)
        for p, s in restore:
            p.grad = s
        # Leave the gradients scaled for the fused step only when they are all this
        # backward's, so one grad_scale describes every one of them; with masters only
        # if the optimizer reads the half gradients and writes the half copies itself.
        # A gradient put back from the stash (a backward outside scale_loss that this one
        # missed) is already unscaled: the step would divide it by the scale again.
        lazy = (self.supports_amp_scaling and not acc and not self.pending and not restore
                and bool(self.masters) and self.writes_model_copies
                and not self.master_grads_wanted)
        found, scale = check, scaler.scale
        if lazy:
            self._check_unscale("check_some", srcs + plain_fresh, None, found, write=False)
        else:
            dsts = []
            for i, _ in master_fresh:
                self.masters[i].grad = self._master_grad_buf(i)
                dsts.append(self.masters[i].grad)
            self._check_unscale("unscale", srcs + plain_fresh, scale, found,
                                dsts=dsts + plain_fresh)
        if acc:
            # The gradients added to are checked too (what the step reads is the sum): an
            # inf/NaN kept from a skipped step (no zero_grad since), or written by a
            # backward outside scale_loss, must not pass as clean. Those an earlier exit
            # of this step already checked are not (its verdict stands in the pending
            # flag; checked again, one overflow would back the scale off at every exit).
            acc_srcs, acc_dsts, acc_adds = zip(*acc)
            self._check_unscale("accumulate", list(acc_srcs), scale, found,
                                dsts=list(acc_dsts), adds=list(acc_adds),
                                check_adds=not self.pending)
        if not self.pending:
            self._pending(carried if lazy else None, scaler)

    def _pending(self, grad_scale, scaler=None):
        """PENDING: for gradients left scaled, the step reads the scale they carry on the
        device (and the overflow flag, once :meth:`take_overflow` has given it). The scale
        is the scaler's slot: the stash is its alias, so that the scaler hands it a copy
        before anything rewrites the slot (a load_state_dict)."""
        self.pending = True
        self.grad_scale = grad_scale
        if grad_scale is not None and scaler is not None and self.scaler is None:
            self._alias(scaler)

    def take_overflow(self, scaler):
        """The step's overflow flag, taken once every gradient of the backward was checked:
        those of every optimizer passed to the same ``scale_loss`` (Apex skips them all
        when any overflowed) and, with ``overflow_process_group``, the all-reduce. A flag
        from an earlier loss of the same step is combined with it (MAX on the device)."""
        if not scaler.dynamic:
            return  # a static scale is not checked
        found = scaler.found_inf
        if self.found_inf is None:
            self.found_inf = found  # the slot itself: it sees every check of this backward
            self._alias(scaler)
        elif self.scaler is not scaler:
            self.found_inf = torch.maximum(self.found_inf, found)
            self._drop_alias()  # an own tensor now, no longer a view of a scaler's slot

    def count_overflows(self, scaler):
        """Count each checked gradient's inf/NaN values into this optimizer's ledger when
        the step is being skipped: decided on the device (one launch that returns at once
        on a clean step; on a CPU the flag is read from host memory), so a clean step reads
        no gradient and nothing comes back to the host (tritamp.amp.overflow).

        The count follows this block's own flag (``scaler``'s), not the step's combined
        one: with several losses before one step, a clean loss's block counted the
        gradients an earlier loss had overflowed into the clean loss's scaler, whose next
        skip report then named them."""
        if self.found_inf is None:
            return
        found = scaler.found_inf
        key, self._count_key = self._count_key, None
        ledger = self._ledger
        triton = K.use_triton(found)
        if not triton and float(found.detach().numpy()) == 0.0:
            return  # the CPU path: a clean step (the flag is host memory) counts nothing
        if triton and key is not None and ledger is not None and ledger.key == key:
            ledger.launch(found)  # the steady state: the same gradients as last time
            scaler.note_ledger(ledger)
            return
        params = self.model_params + self.plain_params
        grads = list(map(_grad_of, params))
        if self.sharded:
            grads = locals_of(grads)
        if key is None:
            key = layout_key(grads)
        if ledger is None or len(ledger.names) != len(params):  # (a new param group)
            names = [self.param_names.get(id(p), "a parameter") for p in params]
            ledger = self._ledger = overflow.Ledger(names, found.device)
        if ledger.layout != key[1]:  # which gradients are there, and dense
            # (a non-dense gradient, of an expanded parameter, is left out of the counts)
            ledger.keep = [i for i, g in enumerate(grads) if g is not None and is_dense(g)]
            ledger.layout = key[1]
        if not ledger.keep:
            return
        ledger.count(grads, key, found, triton)
        scaler.note_ledger(ledger)

    def _alias(self, scaler):
        if self.scaler is scaler:
            return
        self._drop_alias()
        self.scaler = scaler
        scaler._aliases.append(self)

    # -- state created by a skipped step --------------------------------------------------
    def state_guarded(self, optimizer):
        """``optimizer.state`` when a step skipped on the device may leave state behind
        that it created and that a first step would not have left; None when nothing can:
        no overflow flag, a tritamp fused optimizer (it creates its state as a first step
        would and counts its steps on the device), or torch's fused Adam / AdamW (zeroed
        moments, and the step count taken back on the device when ``found_inf`` is set)."""
        if self.found_inf is None or handoff_of(optimizer) is not None \
                or type(optimizer) in _SKIP_SAFE_TORCH_OPTIMIZERS:
            return None
        state = getattr(optimizer, "state", None)
        return state if isinstance(state, dict) else None

    def drop_state_of_a_skipped_step(self, state, before):
        """After a step of a torch optimizer that reads ``found_inf`` on the device
        (``fused=True``): if the step created state (``before`` holds each entry's length
        as it was), it may have been skipped, and what it created is not what a first step
        leaves: torch's fused SGD allocates the momentum buffers with ``empty_like`` and
        the skipped kernel never writes them, so the next step would read garbage. Then,
        and only then (normally the first step), one host read says whether it was
        skipped; if so the entries and keys it created are dropped, so the next step is a
        first step again. Steps that create nothing read nothing. (torch's fused SGD
        decides on the host whether a step is its first, from buffers being None: no
        value written on the device could stand for "not yet".)"""
        after = list(map(len, state.values()))
        if after == before or not bool(self.found_inf):
            return
        params = list(state)
        for p in params[len(before):]:   # dict order: the entries this step created
            del state[p]
        for p, n in zip(params, before):
            entry = state[p]
            if len(entry) > n:           # keys this step added to an existing entry
                for k in list(entry)[n:]:
                    del entry[k]

    # -- after the update ---------------------------------------------------------------
    def master_to_model(self):
        if self.masters and not self.writes_model_copies:
            # Both lists hold one tensor per parameter, always the same parameter's.
            self._check_unscale("copy", self.masters, None, None, dsts=self.model_params,
                                key=(layout_key(self.masters), layout_key(self.model_params)))

    def finish_step(self):
        """After step() or zero_grad(): back to READY; the masters' gradients are spent
        (and gradients stashed by a backward whose update never came: FP16_Optimizer's
        ``update_master_grads=False``)."""
        _clear_grads(self.masters)
        if any(map(_is_not_none, self.plain_stash)):
            self.plain_stash = [None] * len(self.plain_params)
        self._undo = None
        self.zeroed = None
        self.pending = False
        self.found_inf = None
        self.grad_scale = None
        self._drop_alias()


def amp_step(old_step):
    """``optimizer.step`` under amp: ``old_step`` (the optimizer's own) driven through the
    step contract (tritamp's fused optimizers), torch's GradScaler protocol (torch's
    optimizers that declare ``_step_supports_amp_scaling``), or one host read of the
    overflow flag (every other optimizer, as in Apex); then the masters' copies and the
    return to READY.

    Without master weights the arguments (a closure, an optimizer's own keywords) go to
    ``old_step`` as in Apex, which patched only the master-weights step: where a skip
    may be pending the flag is read on the host first, and a closure with an overflow
    pending is refused with Apex's message, as Apex's skip was."""
    def step(self, *args, **kwargs):
        closure = args[0] if args else kwargs.get("closure")
        stash = self._amp_stash
        if closure is not None and stash.master_weights:
            raise RuntimeError("Currently, Amp does not support closure use with optimizers.")
        if torch.compiler.is_compiling():
            if args or kwargs:
                raise RuntimeError(
                    f"optimizer.step() got {len(args)} positional argument(s) and keywords "
                    f"{sorted(kwargs)} under torch.compile: amp's compiled step takes no "
                    "arguments (it runs the eager step as one custom op). "
                    "Call optimizer.step() inside the compiled region, or step eagerly.")
            # torch.compile(optimizer.step): one custom op that runs this eager step
            return compiled.step(self)
        # torch's LR schedulers: optimizer.step() was called, whether the step runs or is
        # skipped (their wrapper, when they wrapped the step before amp did, may not run)
        self._opt_called = True
        if stash.params_have_scaled_gradients:
            raise RuntimeError("optimizer.step() was called while the gradients are still scaled "
                               "from a backward with delay_unscale=True. Run the last backward of "
                               "the accumulation with amp.scale_loss(..., delay_unscale=False) "
                               "before optimizer.step().")
        if closure is not None:
            if stash.found_inf is not None or stash.grad_scale is not None:
                # A skip may be pending: decided on the host (one sync), as Apex's patched
                # skip was, before the closure runs a backward of its own. (Without masters
                # the gradients were unscaled at scale_loss's exit: none is left scaled.)
                if stash.grad_scale is not None or bool(stash.found_inf):
                    raise RuntimeError("Currently, Amp does not support closure use with "
                                       "optimizers.")
                stash.found_inf = None
            # A closure that runs scale_loss itself: its overflow is decided when it returns
            # (one host read), before the optimizer uses the gradients (torch's optimizers
            # call the closure before they update anything): refused then, nothing
            # stepped, the scale already reduced. Apex applied that step and refused the
            # next.
            args, kwargs = _with_checked_closure(stash, closure, args, kwargs)
        if stash.found_inf is None and stash.grad_scale is None:
            # Nothing to skip on and nothing left scaled: a static scale (never checked),
            # or no scale_loss since the last step (static 1.0 without masters).
            retval = old_step(*args, **kwargs)
            stash.master_to_model()
            stash.last_step.record(None, None)
            stash.finish_step()
            return retval
        stash.last_step.record(stash.found_inf, stash.scaler)
        handoff = stash.handoff
        if handoff is not None:
            # tritamp's contract: the step reads grad_scale / found_inf on the device (no
            # host sync), reads the masters' gradients from the half model parameters
            # where they have none and writes those parameters in the same pass.
            handoff.hand(StepState.UNSCALED if stash.grad_scale is None else StepState.SCALED,
                         grad_scale=stash.grad_scale, found_inf=stash.found_inf)
            try:
                retval = old_step(*args, **kwargs)
            finally:
                handoff.reset()
        elif stash.supports_amp_scaling:
            # torch's protocol: the step reads grad_scale/found_inf on the device.
            state = stash.state_guarded(self)
            before = None if state is None else list(map(len, state.values()))
            self.grad_scale = stash.grad_scale
            self.found_inf = stash.found_inf
            try:
                retval = old_step(*args, **kwargs)
            finally:
                del self.grad_scale
                del self.found_inf
            if before is not None:
                stash.drop_state_of_a_skipped_step(state, before)
            stash.master_to_model()  # masters unchanged on a skip: the copy is idempotent
        elif bool(stash.found_inf):  # one sync per step decides the skip, as in Apex
            retval = None
        else:
            retval = old_step(*args, **kwargs)
            stash.master_to_model()
        stash.finish_step()
        return retval
    # This step sets _opt_called itself: a scheduler made before amp.initialize (which
    # wrapped the step amp replaces) does not warn that optimizer.step() was overridden,
    # and one made after leaves it unwrapped (its wrapper would break a fullgraph
    # torch.compile of the step).
    step._wrapped_by_lr_sched = True
    return step


def _with_checked_closure(stash, closure, args, kwargs):
    """``(args, kwargs)`` of a step with ``closure`` replaced by one that refuses an
    overflow its own ``scale_loss`` found."""
    def checked():
        loss = closure()
        if stash.found_inf is not None and bool(stash.found_inf):
            # the step counts as skipped; its gradients are dropped with the pending flag,
            # so that a retry starts clean
            stash.last_step.record(stash.found_inf, stash.scaler)
            stash.finish_step()
            raise RuntimeError("Currently, Amp does not support closure use with optimizers. "
                               "(The closure's backward overflowed: the step stopped before "
                               "using its inf/NaN gradients, and the loss scale was reduced.)")
        return loss

    if args:
        return (checked, *args[1:]), kwargs
    return args, dict(kwargs, closure=checked)


def _new_zero_grad(old_zero_grad):
    def zero_grad(self, set_to_none=None):
        stash = self._amp_stash
        if set_to_none is None and stash.master_weights:
            # Apex's zero_grad with master weights: the model's gradients (half ones and
            # the fp32 parameters') zeroed in place, the masters' set to None.
            _clear_grads(stash.masters)
            zero_grads_([g for g in map(_grad_of, stash.plain_params) if g is not None])
            set_to_none = False
        elif set_to_none is None:
            old_zero_grad()  # the optimizer's own default (Apex's set_grad_none)
            set_to_none = True
        else:
            old_zero_grad(set_to_none=set_to_none)
        if set_to_none:
            _clear_grads(stash.model_params)
        else:
            zero_grads_([p.grad for p in stash.model_params if p.grad is not None])
        # Apex left a pending skip in place (its skip patch lasted until the next step):
        # a step right after a zero_grad that followed an overflowing scale_loss is
        # skipped (not taken on the zeros: momentum would move the weights, the fp32
        # parameters' at O2). The flag is copied on the device (the scaler reuses its
        # slot). The next backward drops it (the gradients it was about are gone; Apex's
        # skip outlived it and skipped that backward's clean step too).
        carried = None if stash.found_inf is None else stash.found_inf.clone()
        stash.finish_step()
        stash.found_inf = carried  # (not PENDING: the next backward drops it)
        # What the optimizer's own zero_grad did decides: gradients still present are zeros.
        # (their version counters: checked before the zeros are trusted)
        if any(map(_is_not_none, map(_grad_of, stash.plain_params))) or (
                not set_to_none and any(map(_is_not_none, map(_grad_of, stash.model_params)))):
            stash.zeroed = _versions(stash.plain_params, stash.model_params)
    return zero_grad


_version_of = operator.attrgetter("_version")


def _version_list(grads):
    try:
        return list(map(_version_of, grads))
    except AttributeError:  # a None among them
        return [None if g is None else g._version for g in grads]


def _versions(*param_lists):
    """(gradients, their version counters) of ``param_lists`` (None kept)."""
    grads = list(map(_grad_of, itertools.chain(*param_lists)))
    return grads, _version_list(grads)


def _untouched(recorded, *param_lists):
    """Whether every gradient of ``param_lists`` is the tensor :func:`_versions` recorded,
    unwritten since (an in-place accumulation or a write moves its version counter)."""
    grads, versions = recorded
    now = list(map(_grad_of, itertools.chain(*param_lists)))
    return (len(now) == len(grads) and all(map(operator.is_, now, grads))
            and _version_list(now) == versions)


def check_param_dtype(p, dtype, props, where, cast_note=""):
    """Refuse, by ``where``, a trainable optimizer parameter of ``dtype`` that amp cannot
    step as it is: with master weights anything but fp32 or a half dtype (its fp32 master
    would be less precise); without them a float64 one when gradients are unscaled (a
    dynamic scale, or a static one other than 1.0), which the check computes in fp32.
    Apex refused every parameter but fp32 and fp16."""
    if not p.requires_grad or dtype in (torch.float32, torch.float16, torch.bfloat16):
        return
    if props.master_weights:
        raise TypeError(
            f"Optimizer's parameters must be torch.float32 or a half dtype "
            f"(torch.float16, torch.bfloat16) with master_weights=True; received "
            f"{dtype} at {where}{cast_note}. Master weights are fp32, so a "
            f"{dtype} parameter would train through a less precise copy: convert "
            "it to float32, or pass master_weights=False.")
    if props.loss_scale != 1.0:
        raise TypeError(
            f"Optimizer's parameters must be torch.float32 or a half dtype "
            f"(torch.float16, torch.bfloat16) with loss_scale={props.loss_scale!r}; received "
            f"{dtype} at {where}{cast_note}. Its gradient would be unscaled and checked for "
            "overflow in float32: convert it to float32, or keep it in an optimizer that "
            "amp does not manage.")


def shared_master_message(p, dtype, first, where):
    """The refusal of a half parameter given to two optimizers under master weights."""
    return (f"amp with master weights: the parameter of shape {tuple(p.shape)} ({dtype}, "
            f"with an fp32 master) at {where} is also at {first}. Each optimizer would keep "
            "its own fp32 master of it and write it to the parameter, so one optimizer's "
            "updates would overwrite the other's (torch.optim, without masters, applies "
            "both; Apex lost one silently). Give each half parameter to one optimizer.")


def _new_add_param_group(old_add_param_group):
    def add_param_group(self, param_group):
        if not isinstance(param_group, dict):
            raise TypeError("param_group must be a dict")
        params = param_group["params"]
        if isinstance(params, torch.Tensor):
            param_group["params"] = [params]
        elif isinstance(params, set):
            raise TypeError("optimizer parameters need to be organized in ordered collections, but "
                            "the ordering of tensors in sets will change between runs. Please use a "
                            "list instead.")
        else:
            param_group["params"] = list(params)
        props = self._amp_stash.initialized_by
        index = len(self.param_groups)
        for j, p in enumerate(param_group["params"]):
            if isinstance(p, torch.Tensor) and p.is_floating_point():
                where = f"the new param_groups[{index}]['params'][{j}]"
                check_param_dtype(p, p.dtype, props, where)
                if self._amp_stash.master_weights and p.requires_grad \
                        and p.dtype != torch.float32 and hasattr(p, MASTER_ATTR):
                    raise ValueError(shared_master_message(
                        p, p.dtype, "an optimizer amp already manages", where))
        self._amp_stash.adopt_added_group(param_group, self, old_add_param_group)
        compiled.refresh(self)
    return add_param_group


def process_optimizer(optimizer, properties):
    if hasattr(optimizer, "_amp_stash"):
        raise RuntimeError("A given optimizer should only be passed through amp.initialize once. "
                           "Create a fresh optimizer over the model returned by initialize.")
    stash = AmpStash(optimizer, properties.master_weights)
    stash.initialized_by = properties
    for group in optimizer.param_groups:
        stash.adopt_group(group, optimizer)
    optimizer._amp_stash = stash
    # Recast any existing state to the dtype of the parameters it now belongs to.
    optimizer.load_state_dict(optimizer.state_dict())
    optimizer.step = types.MethodType(amp_step(optimizer.step), optimizer)
    compiled.register(optimizer)  # (torch's optimizers too: amp's step compiles as one op)
    optimizer.zero_grad = types.MethodType(_new_zero_grad(optimizer.zero_grad), optimizer)
    optimizer.add_param_group = types.MethodType(
        _new_add_param_group(optimizer.add_param_group), optimizer)
    logger.debug("amp: optimizer %s has %d master weights and %d plain parameters",
                 type(optimizer).__name__, len(stash.masters), len(stash.plain_params))
    return optimizer
