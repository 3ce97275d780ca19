"""SyncBatchNorm: batch statistics over every process of a group, on Triton kernels.

One training forward: local statistics (per-channel mean, m2, count) from the statistics
kernels, one ``all_gather`` of a packed ``2C + 1`` fp32 row per rank, Chan's merge (so
ranks may hold different batch sizes, even none), then one elementwise launch. One
backward: local ``(sum_dy, sum_dy_xmu)`` with the parameter gradients, one ``all_reduce``
of that packed ``2C`` tensor, then one elementwise launch for the input gradient.
Parameter gradients stay local, as in torch: DistributedDataParallel averages them.
Without an initialised process group, or with a group of one, nothing is communicated
and the layer is a BatchNorm.
"""
import numbers

import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable
from torch.nn.modules.batchnorm import _BatchNorm

from tritamp.kernels.syncbn import (syncbn_backward_input_prechecked,
                                    syncbn_backward_reduce_prechecked, syncbn_combine,
                                    syncbn_finalize, syncbn_forward, syncbn_stats)


_is_compiling = torch.compiler.is_compiling


class _Layout:
    """How an input maps onto the kernels' canonical views, and back.

    ``last``   channel is the last dimension (Apex's ``channel_last``, 2-D input): [M, C]
    ``dense``  channel is dimension 1 and memory is channels-last (torch's
               ``channels_last`` / ``channels_last_3d``, or any such permutation): [M, C]
               without a copy; outputs keep that memory format. A view that is not dense
               but whose strides torch reads as channels-last (a slice of such a tensor)
               is copied to that order, and its outputs are channels-last, as torch's
    ``first``  channel is dimension 1, anything else: [N, C, B] (contiguous copy if needed)
    """

    def __init__(self, x, channel_last):
        self.shape = x.shape
        nd = x.dim()
        if channel_last or nd == 2:
            self.kind, self.C = "last", x.shape[-1]
            return
        self.C = x.shape[1]
        self.perm = (0, *range(2, nd), 1)
        if not x.is_contiguous() and (x.permute(self.perm).is_contiguous()
                                      or self._channels_last_order(x)):
            self.kind = "dense"
            self.inv = tuple(self.perm.index(i) for i in range(nd))
            self.perm_shape = x.permute(self.perm).shape
        else:
            self.kind = "first"

    @staticmethod
    def _channels_last_order(x):
        """Whether torch would lay a copy of ``x`` out channels-last (``empty_like``'s
        preserve_format reads the strides of a tensor that is not dense; asked on the meta
        device, so nothing is allocated)."""
        if x.dim() not in (4, 5):
            return False
        fmt = torch.channels_last if x.dim() == 4 else torch.channels_last_3d
        return torch.empty_like(x, device="meta").is_contiguous(memory_format=fmt)

    def view(self, t):
        """``t`` (shaped like the input) as the canonical view; copies only if its memory
        is not already laid out that way."""
        if self.kind == "last":
            return t.contiguous().view(-1, self.C)
        if self.kind == "dense":
            return t.permute(self.perm).contiguous().view(-1, self.C)
        return t.contiguous().view(self.shape[0], self.C, self.shape[2:].numel())

    def empty(self, t):
        """A fresh tensor shaped like the input, laid out so that ``view`` of it is free
        (an empty input: laid out as it is, its memory format kept)."""
        if self.kind == "dense" or t.numel() == 0:
            return torch.empty_like(t)  # keeps the dense channels-last strides
        # (empty_like with an explicit format: row-major, at a third of torch.empty's cost)
        return torch.empty_like(t, memory_format=torch.contiguous_format)

    def restore(self, v):
        if self.kind == "dense":
            return v.view(self.perm_shape).permute(self.inv)
        return v.view(self.shape)


# torch's single-tensor all-gather (all_gather_into_tensor in older torch releases)
_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _all_gather_rows(row, group, world_size):
    """Every rank's packed statistics row, stacked [world, 2C + 1]: one collective into
    a flat output (the concatenated form, which every backend takes, whatever name the
    process group was given: "gloo", "cpu:gloo,cuda:nccl", torch's default)."""
    n = row.numel()
    out = torch.empty(world_size * n, dtype=row.dtype, device=row.device)
    try:
        _gather_single(out, row, group=group)
    except (RuntimeError, NotImplementedError):
        # a backend without the single-tensor gather (gloo in older torch releases;
        # raised before any rank communicates): one tensor per rank
        dist.all_gather(list(out.view(world_size, n).unbind(0)), row, group=group)
    return out.view(world_size, n)


# torch's names of the scalar types a BatchNorm buffer or parameter cannot be
_SCALAR_NAMES = {torch.int64: "Long", torch.int32: "Int", torch.int16: "Short",
                 torch.int8: "Char", torch.uint8: "Byte", torch.bool: "Bool",
                 torch.complex64: "ComplexFloat", torch.complex128: "ComplexDouble"}


def _dense_vector(t):
    """``t`` when it is a contiguous vector (the kernels' running statistics), else a
    contiguous vector copy of it (the caller copies an updated one back)."""
    if t is None or (t.dim() == 1 and t.is_contiguous()):
        return t
    return t.reshape(-1).contiguous()


class _OneValuePerChannel(ValueError):
    """The group's batch holds one value per channel (raised by every rank alike)."""


def _check_group_count(rows, input):
    """torch's BatchNorm refusal of a training batch with one value per channel, for the
    whole group's batch (the gathered rows' counts), before the running statistics are
    written."""
    if float(rows[:, -1].sum()) == 1.0:
        raise _OneValuePerChannel(
            "Expected more than 1 value per channel when training, got input size "
            f"{input.size()} on this rank and one value per channel over the whole "
            "process group (SyncBatchNorm normalises the group's batch)")


class SyncBatchnormFunction(torch.autograd.Function):
    """Autograd of one SyncBatchNorm call (see the module docstring for the data flow)."""

    @staticmethod
    def forward(ctx, input, z, weight, bias, running_mean, running_var, num_batches_tracked,
                eps, momentum, batch_stats, process_group, world_size, channel_last,
                fuse_relu):
        layout = _Layout(input, channel_last)
        x = layout.view(input)
        zv = layout.view(z) if z is not None else None
        if batch_stats:
            rows, shift = syncbn_stats(x)
            if world_size > 1:
                rows = _all_gather_rows(syncbn_combine(rows, shift), process_group, world_size)
                shift = None
                if 0 < layout.C and input.numel() <= layout.C:
                    # At most one value per channel here: the group's batch may hold one
                    # value per channel in all (its unbiased variance would be 0/0, a NaN
                    # running_var). Every rank of such a group takes this branch (each
                    # holds at most one), so all of them read the count and raise.
                    _check_group_count(rows, input)
            update = running_mean is not None
            mean, invstd, count = syncbn_finalize(
                rows, eps, running_mean if update else None, running_var if update else None,
                momentum, num_batches_tracked if update and momentum is None else None,
                shift=shift)
        else:
            # copies: a later training forward updates the buffers in place
            mean = running_mean.to(torch.float32, copy=True)
            invstd = (running_var.float() + eps).sqrt().reciprocal()
            count = None
        # Written through a view of the returned tensor: the output is no view itself, so
        # in-place ops after the layer (ReLU(inplace=True)) are allowed.
        y = layout.empty(input)
        syncbn_forward(x, mean, invstd, weight, bias, zv, fuse_relu, out=layout.view(y))
        # z only for the fused ReLU's mask: without it the backward never reads z
        ctx.traced = _is_compiling()
        if ctx.traced:
            # Dynamo traces this Function as one subgraph, whose saved tensors may not be
            # views of its inputs: the input itself, viewed again in the backward
            ctx.save_for_backward(input, z if fuse_relu else None, weight, bias, mean, invstd,
                                  count)
        else:
            ctx.save_for_backward(x, zv if fuse_relu else None, weight, bias, mean, invstd,
                                  count)
        ctx.layout = layout
        ctx.batch_stats = batch_stats
        ctx.group = process_group
        ctx.world_size = world_size
        ctx.fuse_relu = fuse_relu
        ctx.has_z = z is not None
        return y

    @staticmethod
    @once_differentiable  # (a second derivative raises instead of silently being zero)
    def backward(ctx, grad_output):
        x, zv, weight, bias, mean, invstd, count = ctx.saved_tensors
        layout = ctx.layout
        if ctx.traced:
            x = layout.view(x)
            zv = None if zv is None else layout.view(zv)
        dy = layout.view(grad_output)
        need_x, need_z, need_w, need_b = ctx.needs_input_grad[:4]
        need_z = need_z and ctx.has_z
        # (the forward checked x, z, weight and bias and made mean / invstd; autograd gives
        # grad_output the output's shape, dtype and device, and dy is its canonical view)
        sums, grad_weight, grad_bias = syncbn_backward_reduce_prechecked(
            dy, x, mean, invstd, weight, bias, zv, ctx.fuse_relu,
            need_weight_grad=need_w, need_bias_grad=need_b)
        if need_x and ctx.batch_stats and ctx.world_size > 1:
            # Only the input gradient needs the group's sums (every rank of a replicated
            # model agrees on needing it, so all of them enter this collective or none).
            dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=ctx.group)
        grad_input = grad_z = None
        if need_z and not ctx.fuse_relu:
            grad_z = grad_output  # z was added after the normalisation: its gradient is dy
        if need_x or (need_z and ctx.fuse_relu):
            dx, dz = syncbn_backward_input_prechecked(
                dy, x, mean, invstd, weight, sums if ctx.batch_stats else None, count, bias,
                zv, ctx.fuse_relu, need_dz=need_z and ctx.fuse_relu)
            grad_input = layout.restore(dx) if need_x else None
            if dz is not None:
                grad_z = layout.restore(dz)
        return (grad_input, grad_z, grad_weight, grad_bias,
                None, None, None, None, None, None, None, None, None, None)


class SyncBatchNorm(_BatchNorm):
    """Batch normalisation with statistics reduced over the processes of a group.

    Apex's ``apex.parallel.SyncBatchNorm``: same arguments, ``forward(input, z=None)``
    adds the residual ``z`` before the optional fused ReLU. Subclasses torch's
    ``_BatchNorm``, so ``state_dict`` keys, ``repr`` and amp's ``keep_batchnorm_fp32``
    treat it as a BatchNorm.

    Args:
        num_features: C, the channels of an input ``(N, C, ...)`` (``(N, ..., C)`` with
            ``channel_last``).
        eps, momentum, affine, track_running_stats: as in ``torch.nn.BatchNorm2d``;
            ``momentum=None`` gives the cumulative average.
        process_group: the group whose statistics are combined; ``None``: the default group.
        channel_last: the channel is the input's last dimension (Apex's meaning). Inputs in
            torch's ``channels_last`` memory format need no flag: they are detected.
        fuse_relu: apply ReLU to the output (after adding ``z``). The backward recomputes
            the ReLU's mask from the input and ``z``, so ``z`` is saved for it (and must not
            be changed in place before the backward; autograd says so if it is).
        bias: ``False`` for a weight without a bias (``affine=True``), as torch's
            BatchNorm's keyword-only ``bias``.

    Training mode normalises with the statistics of the whole group's batch and updates
    the running statistics with its unbiased variance; evaluation mode uses the running
    statistics (or, with ``track_running_stats=False``, the local batch's).
    """

    def __init__(self, num_features, eps=1e-5, momentum=0.1, affine=True,
                 track_running_stats=True, process_group=None, channel_last=False,
                 fuse_relu=False, device=None, dtype=None, *, bias=True):
        # (bias passed only when False: a torch without BatchNorm's bias says so itself)
        super().__init__(num_features, eps=eps, momentum=momentum, affine=affine,
                         track_running_stats=track_running_stats, device=device, dtype=dtype,
                         **({} if bias else {"bias": False}))
        self.process_group = process_group
        self.channel_last = channel_last
        self.fuse_relu = fuse_relu

    def _specify_process_group(self, process_group):
        self.process_group = process_group

    def _specify_channel_last(self, channel_last):
        self.channel_last = channel_last

    def _check_input_dim(self, input):
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def extra_repr(self):
        return (super().extra_repr() + f", channel_last={self.channel_last}"
                f", fuse_relu={self.fuse_relu}")

    def _check(self, input, z):
        self._check_input_dim(input)
        if input.dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise TypeError(f"SyncBatchNorm({self.num_features}): input is {input.dtype}; it "
                            "normalises float32, float16 and bfloat16 input (statistics in "
                            "float32): convert the input, or use torch.nn.SyncBatchNorm for "
                            "float64")
        last = self.channel_last or input.dim() == 2
        dim = input.dim() - 1 if last else 1
        if input.shape[dim] != self.num_features:
            hint = (" (2-D input is (N, C))" if input.dim() == 2 and not self.channel_last
                    else " (channel_last=True reads channels from the last dimension)" if last
                    else " (for (N, ..., C) input pass channel_last=True)")
            raise ValueError(f"SyncBatchNorm({self.num_features}): input of shape "
                             f"{tuple(input.shape)} has {input.shape[dim]} channels in "
                             f"dimension {dim}{hint}")
        # The parameters and buffers, before anything is written (torch's words): a
        # wrong-sized one was refused by the kernels only after the running statistics
        # had been updated.
        for name in ("weight", "bias", "running_mean", "running_var"):
            t = getattr(self, name)
            if t is None:
                continue
            if t.numel() != self.num_features:
                raise RuntimeError(f"{name} should contain {self.num_features} elements not "
                                   f"{t.numel()}")
            if t.device != input.device:
                raise RuntimeError(f"Expected all tensors to be on the same device, but found "
                                   f"at least two devices, {input.device} and {t.device}! "
                                   f"(SyncBatchNorm's {name}: move the module to the input's "
                                   "device)")
            if not t.is_floating_point():
                raise RuntimeError(f"expected scalar type Float but found "
                                   f"{_SCALAR_NAMES.get(t.dtype, t.dtype)} "
                                   f"(SyncBatchNorm's {name} is {t.dtype}: keep it floating "
                                   "point, e.g. float32)")
        momentum = self.momentum
        if momentum is not None and not isinstance(momentum, numbers.Real):
            # (a bool is a number to torch's batch_norm: True is a factor of 1.0)
            raise TypeError(f"batch_norm(): argument 'momentum' (position 7) must be float, "
                            f"not {type(momentum).__name__}")
        nbt = self.num_batches_tracked
        if self.training and self.track_running_stats and nbt is not None and (
                nbt.numel() != 1 or nbt.device != input.device or nbt.is_complex()):
            # (counted in place before the kernels read it: one of several elements was
            # advanced, then refused by torch, or read at its first element)
            raise ValueError(f"SyncBatchNorm: num_batches_tracked must be one element on "
                             f"{input.device}; got {nbt.dtype} of shape {tuple(nbt.shape)} "
                             f"on {nbt.device}")
        if z is not None and (z.shape != input.shape or z.dtype != input.dtype
                              or z.device != input.device):
            raise ValueError(f"SyncBatchNorm: z must match the input ({tuple(input.shape)}, "
                             f"{input.dtype}, {input.device}); got ({tuple(z.shape)}, "
                             f"{z.dtype}, {z.device})")

    def forward(self, input, z=None):
        self._check(input, z)
        factor = self.momentum
        if factor.__class__ is bool:
            factor = float(factor)
        if self.training and self.track_running_stats and factor is None \
                and self.num_batches_tracked is None:
            factor = 0.0  # torch's: a cumulative average with no count leaves the stats
        bn_training = self.training or (self.running_mean is None and self.running_var is None)
        world_size, group = 1, None
        if bn_training and self.training and dist.is_available() and dist.is_initialized():
            group = self.process_group if self.process_group is not None else dist.group.WORLD
            world_size = dist.get_world_size(group)
        if bn_training and world_size < 2 and input.numel() <= self.num_features:
            # (one value per channel needs numel == C; C = 0 counts the other dimensions)
            dim = input.dim() - 1 if self.channel_last or input.dim() == 2 else 1
            size = 1
            for i, n in enumerate(input.shape):
                if i != dim:
                    size *= n
            if size == 1:
                raise ValueError("Expected more than 1 value per channel when training, got "
                                 f"input size {input.size()}")
        if bn_training and self.eps <= 0.0:  # (torch's batch_norm, word for word)
            raise ValueError(f"batch_norm eps must be positive during training, but got "
                             f"{self.eps}")
        if self.eps < 0.0:
            raise ValueError(f"batch_norm eps must be non-negative, but got {self.eps}")
        # (an empty batch, on every rank: no statistics, and syncbn_finalize leaves the
        # running ones as they are; num_batches_tracked counts it, as torch does)
        track = self.training and self.track_running_stats
        weight, bias = self.weight, self.bias
        # (a strided view or another shape of C elements, as torch's BatchNorm takes: the
        # kernels read a dense vector; autograd carries the gradient back to the view)
        if weight is not None and (weight.dim() != 1 or not weight.is_contiguous()):
            weight = weight.reshape(-1).contiguous()
        if bias is not None and (bias.dim() != 1 or not bias.is_contiguous()):
            bias = bias.reshape(-1).contiguous()
        used = track or not bn_training
        running = [_dense_vector(self.running_mean) if used else None,
                   _dense_vector(self.running_var) if used else None]
        counted = track and self.num_batches_tracked is not None
        if counted:
            # (counted once nothing can be refused any more but the group's batch of one
            # value per channel, which only the gathered counts tell: uncounted below)
            self.num_batches_tracked.add_(1)
        try:
            out = SyncBatchnormFunction.apply(
                input, z, weight, bias, running[0], running[1],
                self.num_batches_tracked if track else None,
                self.eps, factor, bn_training, group, world_size, self.channel_last,
                self.fuse_relu)
        except _OneValuePerChannel:
            if counted:
                self.num_batches_tracked.sub_(1)
            raise
        if track:
            # a buffer updated through a dense copy (a strided or reshaped one) takes it
            for buf, dense in zip((self.running_mean, self.running_var), running):
                if dense is not None and dense is not buf:
                    buf.copy_(dense.view(buf.shape))
        return out
