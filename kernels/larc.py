"""LARC's gradient rewrite (``tritamp.parallel.LARC``) over a list of tensors.

For every row ``i`` (a parameter ``p`` and its gradient ``g``), with ``decay`` and
``factor`` one fp32 value per row::

    g = (g + decay[i] * p) * factor[i]        (without decay: g = g * factor[i])

in fp32 whatever the dtypes, rounded once to the gradient's dtype. LARC computes the
per-row factor (its adaptive rate) and decay (the weight decay where the rate applies,
0 elsewhere) on the device; this sweep applies them in one launch per dtype group
instead of a Python loop of two or three ops per parameter.

``factor`` and ``decay`` are fp32 vectors with one value per row, on the tensors'
device. :func:`larc_rescale_prepare` writes the address of each of their elements into
the sweep's table once, so a kept sweep reads their values at every launch: the caller
writes this step's values into the same vectors (``out=``), and nothing is uploaded
or read back.

The parameters anchor each row's layout (dense, fp32/fp16/bf16, as an optimizer's); a
dense gradient laid out otherwise (another dimension order) is rewritten through a
dense copy in the parameter's layout, copied back after the launch; a gradient that is
not dense (a strided view) is refused, as every sweep that writes a gradient refuses
it (``LARC`` rewrites such lists one parameter at a time). :func:`larc_rescale_prepare` validates and plans
once; :func:`larc_rescale_launch` runs it (the gradients may be rebound to the next
step's: ``prepared.rebind("grads", grads)``).

The oracle (:func:`larc_rescale_ref`) runs the kernel's fp32 operations in its order:
the product, the sum, the product, one rounding. Compiled for a GPU, the compiler may
fuse the first product and the sum into one fused multiply-add (one rounding fewer);
the interpreter, the oracle and the production CPU path never do.

On the CPU without the interpreter :func:`larc_rescale_cpu` runs the same operations as
torch foreach ops per dtype group (fp32 scratch for half tensors, a big group in ranges
of whole tensors so that the scratch kept with the sweep is one range's): bit for bit
the oracle's.
"""
import torch
import triton
import triton.language as tl

from . import _cpu_optim
from ._multi_tensor import Column, GroupChunk, Sweep
from ._tl_utils import column, load_f32, scalar_ptr, store_cast, sweep_block

LARC_RESCALE = Sweep("larc_rescale", [
    Column("params", "param"),              # read; the row's layout anchor
    Column("grads", "grad", written=True),  # rewritten in place
    # one fp32 element of ``factor`` / ``decay`` per row: views of the caller's vectors,
    # which it writes at every step (so never moved into a buffer of the sweep's own)
    Column("factors", "scalar", rehome=False),
    Column("decays", "scalar", optional=True, rehome=False),
], writes=("grads",))
_P, _G, _F, _D = (LARC_RESCALE.col(n) for n in LARC_RESCALE.names)
_ROW = LARC_RESCALE.row_width


@triton.jit
def _larc_rescale_kernel(
    meta_ptr,        # int64 [n_tensors, 5]: the LARC_RESCALE columns' addresses, then numel
    blocks_ptr,      # int32 [n_blocks, 2]: tensor index, block index within that tensor
    counters_ptr,    # unused (the factors are read, never advanced)
    p_proto,         # a parameter of the group: carries the parameter element type
    g_proto,         # a gradient of the group: carries the gradient element type
    HAS_DECAYS: tl.constexpr,
    VEC: tl.constexpr,             # > 1: every address 16-byte aligned, numel % VEC == 0
    EMULATE_BF16_ROUNDING: tl.constexpr,  # interpreter only: see _tl_utils
    BLOCK: tl.constexpr,
):
    tensor, row, offs, mask = sweep_block(meta_ptr, blocks_ptr, meta_ptr, _ROW, False, VEC,
                                          BLOCK)
    # The row's scalars first: they are live across the element loads otherwise.
    factor = tl.load(scalar_ptr(row, _F))
    if HAS_DECAYS:
        decay = tl.load(scalar_ptr(row, _D))
    g_ptrs = column(row, _G, offs, g_proto, VEC)
    g = load_f32(g_ptrs, mask, EMULATE_BF16_ROUNDING)
    if HAS_DECAYS:
        p = load_f32(column(row, _P, offs, p_proto, VEC), mask, EMULATE_BF16_ROUNDING)
        g = g + decay * p
    store_cast(g_ptrs, g * factor, mask, EMULATE_BF16_ROUNDING)


def _vector(name, v, n, device, optional):
    """``v`` checked as an fp32 vector of ``n`` values on ``device``; its elements as
    one-element views (their addresses go in the table)."""
    if v is None and optional:
        return None
    if not isinstance(v, torch.Tensor) or v.layout != torch.strided:
        what = type(v).__name__ if not isinstance(v, torch.Tensor) else f"{v.layout} tensor"
        raise TypeError(f"larc_rescale: {name} is a {what}, expected a dense float32 "
                        f"tensor of {n} values (one per parameter): the sweep reads its "
                        "elements where they are")
    if v.dtype != torch.float32 or v.dim() != 1 or v.numel() != n or v.device != device:
        raise ValueError(
            f"larc_rescale: {name} is a {str(v.dtype).replace('torch.', '')} tensor of shape "
            f"{tuple(v.shape)} on {v.device}; expected a float32 vector of {n} values (one "
            f"per parameter) on {device}: torch.empty({n}, dtype=torch.float32, "
            f"device='{device}')")
    return list(v.unbind(0))


def larc_rescale_prepare(params, grads, factor, decay=None):
    """Validate and plan ``g = (g + decay * p) * factor`` over these lists (see the
    module docstring); pass the result to :func:`larc_rescale_launch`. Raises, naming
    the argument, before anything is written."""
    params, grads = list(params), list(grads)
    if len(grads) != len(params):
        raise ValueError(f"larc_rescale: grads has {len(grads)} tensors but params has "
                         f"{len(params)}; one gradient per parameter")
    n = len(params)
    if n and not isinstance(params[0], torch.Tensor):
        raise TypeError(f"larc_rescale: params[0] is a {type(params[0]).__name__}, expected a "
                        "tensor")
    if n:
        device = params[0].device
        factors = _vector("factor", factor, n, device, False)
        decays = _vector("decay", decay, n, device, True)
    else:
        factors, decays = [], (None if decay is None else [])
    return LARC_RESCALE.prepare(dict(params=params, grads=grads, factors=factors,
                                     decays=decays))


def larc_rescale_launch(prepared):
    """``g = (g + decay * p) * factor`` over a prepared sweep: one launch per dtype group
    (the production CPU path on a CPU)."""
    if prepared.n == 0:
        return
    if not prepared.triton:
        larc_rescale_cpu(prepared)
        return
    prepared.launch(_larc_rescale_kernel, ())


@torch.no_grad()
def larc_rescale(params, grads, factor, decay=None):
    """``grads[i] = (grads[i] + decay[i] * params[i]) * factor[i]`` in fp32, one rounding
    (``decay`` None: ``grads[i] * factor[i]``). ``factor`` / ``decay``: fp32 vectors of
    one value per parameter on the parameters' device, read there (no host sync). One
    launch per dtype group."""
    larc_rescale_launch(larc_rescale_prepare(params, grads, factor, decay))


# --- the production CPU path -------------------------------------------------------------

def larc_rescale_cpu(prepared):
    """The production CPU path of :func:`larc_rescale_launch`: per dtype group, torch
    foreach ops in the oracle's order (the product, the sum, the product), in fp32:
    half gradients and parameters go through fp32 scratch kept with the sweep (a big
    group one range of whole tensors at a time: the scratch is one range's), the result
    rounded once into the gradient. Bit for bit the oracle's."""

    def group(g):
        lists = g.lists
        if lists["params"][0].dtype == torch.float32 and lists["grads"][0].dtype == torch.float32:
            part(g)  # no scratch
            return
        ranges, span = g.chunks(_cpu_optim.CHUNK_ELEMENTS)
        if len(ranges) == 1:
            part(g)
            return
        for k, (a, b) in enumerate(ranges):
            part(GroupChunk(g, k, a, b, span))

    def part(g):
        params, grads, factors, decays = (g.lists["params"], g.lists["grads"],
                                          g.lists["factors"], g.lists["decays"])
        work = grads
        if grads[0].dtype != torch.float32:
            work = prepared.buffers(g, "g", grads)
            torch._foreach_copy_(work, grads)
        if decays is not None:
            ps = params
            if params[0].dtype != torch.float32:
                ps = prepared.buffers(g, "p", params)
                torch._foreach_copy_(ps, params)
            torch._foreach_add_(work, torch._foreach_mul(ps, decays))
        torch._foreach_mul_(work, factors)
        if work is not grads:
            torch._foreach_copy_(grads, work)

    prepared.run_cpu(group)


@torch.no_grad()
def larc_rescale_ref(params, grads, factor, decay=None):
    """Torch reference of :func:`larc_rescale`: per tensor, fp32 operations in the
    kernel's order, one rounding."""
    for i, (p, g) in enumerate(zip(params, grads)):
        x = g.float()
        if decay is not None:
            x = x + decay[i] * p.float()
        g.copy_(x * factor[i])
