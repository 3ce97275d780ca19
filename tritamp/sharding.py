"""DTensor parameters (FSDP2's ``fully_shard``): what a tritamp step needs of them.

A fused step updates each rank's local shard: the sweeps take the local tensors of
DTensor parameters, gradients and state (:func:`local`), and the state a step creates
for a DTensor parameter is a DTensor laid out as the parameter (so
``torch.distributed.checkpoint`` saves and loads it sharded). What needs more than the
local shard goes through :class:`ShardReduce`: the per-tensor and global norms of
FusedLAMB, FusedNovoGrad and ``clip_grad_norm_`` are summed (or maxed) over the mesh
dimensions the parameters are sharded on, and amp agrees on the overflow flag over the
mesh (:func:`overflow_group`).
"""
import sys


def _dtensor_class():
    """torch's DTensor class once ``torch.distributed.tensor`` has been imported (no
    tensor can be a DTensor before), else None: importing it here would add half a
    second to ``import tritamp``."""
    module = sys.modules.get("torch.distributed.tensor")
    return None if module is None else getattr(module, "DTensor", None)


def is_dtensor(t):
    cls = _dtensor_class()
    return cls is not None and isinstance(t, cls)


def any_dtensor(tensors):
    cls = _dtensor_class()
    return cls is not None and any(isinstance(t, cls) for t in tensors)


def local(t):
    """The local tensor of a DTensor (the tensor itself, which in-place updates reach);
    anything else as it is."""
    cls = _dtensor_class()
    return t._local_tensor if cls is not None and isinstance(t, cls) else t


def locals_of(tensors):
    """:func:`local` of each tensor, None kept in place."""
    cls = _dtensor_class()
    if cls is None:
        return list(tensors)
    return [t._local_tensor if isinstance(t, cls) else t for t in tensors]


def _shard_dims(t, what):
    """The mesh dimensions a DTensor is sharded on; a Partial placement is refused (its
    local values are partial sums, not a shard of the tensor)."""
    from torch.distributed.tensor.placement_types import Partial
    dims = []
    for d, placement in enumerate(t.placements):
        if isinstance(placement, Partial):
            raise ValueError(
                f"{what} is a DTensor with placements {tuple(t.placements)}: a Partial "
                "placement holds partial sums, not a shard. Reduce it first "
                "(t.redistribute(placements=[Shard(0)] or [Replicate()])), as FSDP2's "
                "fully_shard does for the gradients it reduce-scatters.")
        if placement.is_shard():
            dims.append(d)
    return tuple(dims)


def shard_index(t):
    """Which shard of a DTensor this process holds, as one number: 0 for a plain tensor
    (or a DTensor replicated everywhere), else 1 + its position along the mesh dimensions
    ``t`` is sharded over. Processes holding replicas of the same shard get the same
    number. What stochastic rounding mixes into a parameter's key, so that the shards of
    one parameter draw independent bits and its replicas the same ones."""
    if not is_dtensor(t):
        return 0
    mesh = t.device_mesh
    coord = mesh.get_coordinate()
    if coord is None:
        return 0
    index, sharded = 0, False
    for dim, placement in enumerate(t.placements):
        if placement.is_shard():
            index = index * mesh.size(dim) + coord[dim]
            sharded = True
    return index + 1 if sharded else 0


def check_shards(params, group_index, op):
    """Refuse (``ValueError``) a DTensor parameter with a Partial placement (its local
    values are partial sums, not a shard), or whose gradient is not laid out as the
    parameter (a plain tensor, another mesh, other placements): the step updates each
    local shard from the local gradient."""
    for i, p in enumerate(params):
        g = p.grad
        if g is None or not is_dtensor(p):
            continue
        # a Partial parameter: each rank would step its partial sum as if it were a shard
        _shard_dims(p, f"{op}: param_groups[{group_index}] parameter {i}")
        if not is_dtensor(g) or g.device_mesh != p.device_mesh \
                or tuple(g.placements) != tuple(p.placements):
            got = (f"placements {tuple(g.placements)}" if is_dtensor(g)
                   else f"a plain {type(g).__name__}")
            raise ValueError(
                f"{op}: param_groups[{group_index}] parameter {i} is a DTensor with "
                f"placements {tuple(p.placements)} but its gradient has {got}: each rank "
                "steps its shard from the matching shard of the gradient. Redistribute the "
                "gradient as the parameter (p.grad = p.grad.redistribute(p.device_mesh, "
                "p.placements)) before the step. Nothing was changed.")


class ShardReduce:
    """Sums (or maxima) over the ranks that hold the shards of one set of parameters:
    the process groups of the mesh dimensions they are sharded on. Every DTensor of the
    set must share one mesh and be sharded on the same dimensions; a set that mixes
    DTensors and plain tensors is refused (a plain tensor's norm would be counted once
    per rank). ``for_params`` returns None for a set without DTensors, or sharded over
    one rank only (the local tensors are then whole)."""
    __slots__ = ("groups",)

    def __init__(self, groups):
        self.groups = groups

    @classmethod
    def for_params(cls, params, op):
        params = [p for p in params if p is not None]
        if not any_dtensor(params):
            return None
        mesh = dims = None
        for i, p in enumerate(params):
            if not is_dtensor(p):
                raise ValueError(
                    f"{op}: tensor {i} (shape {tuple(p.shape)}) is a plain tensor among "
                    "DTensors; its norm would be summed over the ranks as if it were a "
                    "shard. Shard every parameter of the model with fully_shard (or keep "
                    f"the plain ones in a separate {op}).")
            p_dims = _shard_dims(p, f"{op}: tensor {i}")
            if mesh is None:
                mesh, dims = p.device_mesh, p_dims
            elif p.device_mesh != mesh or p_dims != dims:
                raise ValueError(
                    f"{op}: tensor {i} is sharded on mesh dimensions {p_dims} of "
                    f"{p.device_mesh}, tensor 0 on {dims} of {mesh}; the norms here are "
                    "reduced over one set of ranks. Use one fully_shard mesh for every "
                    f"parameter of this {op}.")
        import torch.distributed as dist
        # a dimension of one rank holds the whole tensor: nothing to reduce over it
        groups = tuple(g for g in (mesh.get_group(d) for d in dims)
                       if dist.get_world_size(g) > 1)
        return cls(groups) if groups else None

    def reduce_(self, t, op):
        """``t`` summed (``op="sum"``) or maxed (``"max"``) over the shard groups, in
        place (asynchronous on NCCL)."""
        import torch.distributed as dist
        how = dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM
        for group in self.groups:
            dist.all_reduce(t, op=how, group=group)
        return t

    def norm(self, local_norm):
        """The L2 norm of sharded tensors from the local shards' norm (a 0-d tensor)."""
        sq = local_norm.float() * local_norm.float()
        return self.reduce_(sq.reshape(1), "sum").reshape(()).sqrt()


def overflow_group(params):
    """The process group over which amp agrees on the overflow flag for sharded
    parameters: the group of a one-dimensional mesh, the world for a mesh that spans it;
    None without DTensors, or on a mesh of one rank (nothing to agree on). Other meshes
    need ``overflow_process_group`` given."""
    meshes = {p.device_mesh for p in params if is_dtensor(p)}
    if not meshes or all(mesh.size() == 1 for mesh in meshes):
        return None
    if len(meshes) == 1:
        mesh = next(iter(meshes))
        if mesh.ndim == 1:
            return mesh.get_group()
        import torch.distributed as dist
        if mesh.size() == dist.get_world_size():
            return dist.group.WORLD
    raise ValueError(
        "amp.initialize: the model's DTensor parameters live on "
        f"{', '.join(map(str, meshes))}; amp cannot tell which ranks must agree on a "
        "skipped step. Pass overflow_process_group=<a process group over every rank that "
        "holds a shard> to amp.initialize.")
