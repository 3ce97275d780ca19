"""Check/copy sweeps kept between calls of the fp16_utils helpers.

``model_grads_to_master_grads``, ``master_params_to_model_params`` and the legacy
scalers' ``has_overflow`` run every step of a manual mixed-precision loop. Each used the
one-shot ``check_unscale``: its lists validated, planned and its launch tables uploaded
at every call. Here the prepared sweep is kept per list layout (strides, shapes, dtypes,
device, path, which rows copy in place: :class:`~tritamp.kernels.engine.KeptByLayout`),
over borrowed tensors (none kept alive between calls); when only the addresses changed
(new gradient tensors every step) the kept sweep takes the new ones (``rebind``), as
amp's and the optimizers' do.
"""
import operator

from tritamp import kernels as K
from tritamp.kernels.engine import KeptByLayout, borrowed, list_layout

KEPT_MAX = 8  # list layouts kept (the least recently used goes first)


class KeptSweeps:
    """Prepared check/unscale sweeps by list layout (see the module docstring)."""

    def __init__(self, op):
        self.op = op
        self.kept = KeptByLayout(KEPT_MAX)

    def run(self, srcs, dsts=None, found_inf=None):
        """``check_unscale(srcs, None, found_inf, dsts=dsts, write=dsts is not None)``
        over a kept sweep: with ``dsts`` a copy (cast) of each source into its
        destination, without them a read-only check into ``found_inf``."""
        srcs = list(srcs)
        if not srcs:
            return
        dsts = None if dsts is None else list(dsts)
        write = dsts is not None
        tensors = srcs + (dsts or [])
        device = srcs[0].device
        if any(t.device != device for t in tensors):
            # (a rebind does not look at devices: the one-shot call refuses the mix, naming
            # the tensor, before anything is written)
            K.check_unscale(srcs, None, found_inf, dsts=dsts, write=write)
            return
        addresses, layout, triton = list_layout(tensors, op=self.op)
        n = len(srcs)
        in_place = (tuple(map(operator.eq, addresses[:n], addresses[n:])) if write
                    else None)

        def prepare():
            lent = borrowed(tensors)
            return K.check_unscale_prepare(lent[:n], dsts=lent[n:] if write else None,
                                           write=write)

        def rebind(prepared, addresses):
            if not write:
                return prepared.rebindable and prepared.rebind_sources(srcs, addresses)
            return prepared.rebindable_writes and prepared.rebind_lists(srcs, dsts,
                                                                        addresses)

        prepared = self.kept.get(addresses, layout + (n, write, in_place), triton,
                                 prepare, rebind)
        try:
            K.check_unscale_launch(prepared, scale=None, found_inf=found_inf)
        finally:
            if not prepared.triton:
                prepared.release()  # (the CPU path's lists: this call's tensors)
