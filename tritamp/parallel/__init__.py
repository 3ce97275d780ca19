"""tritamp.parallel: Apex's ``apex.parallel`` for multi-process training.

- :class:`SyncBatchNorm` on Triton statistics kernels (uneven per-rank batches,
  channels-last, 2-D to 5-D input, fp16/bf16 input), :func:`convert_syncbn_model`,
  :func:`create_syncbn_process_group`;
- :class:`Reducer` (gradient all-reduce on demand) and :class:`LARC`;
- ``DistributedDataParallel`` is torch's ``torch.nn.parallel.DistributedDataParallel``,
  re-exported so that ``from apex.parallel import DistributedDataParallel`` keeps working
  with one import changed. Its arguments are torch's, not Apex's (``device_ids``,
  ``bucket_cap_mb``, ...; Apex's ``delay_allreduce``, ``message_size`` etc. do not exist),
  and so is its default ``broadcast_buffers=True``: rank 0's buffers (BatchNorm running
  statistics) are copied to every rank before each forward, which Apex's never did; pass
  ``broadcast_buffers=False`` for Apex's behaviour;
- ``ReduceOp`` is ``torch.distributed.ReduceOp``, as in Apex.
"""
from torch.distributed import ReduceOp
from torch.nn.parallel import DistributedDataParallel

from .convert import convert_syncbn_model, create_syncbn_process_group
from .LARC import LARC
from .reducer import Reducer
from .sync_batchnorm import SyncBatchNorm, SyncBatchnormFunction

__all__ = ["SyncBatchNorm", "SyncBatchnormFunction", "convert_syncbn_model",
           "create_syncbn_process_group", "Reducer", "LARC", "DistributedDataParallel",
           "ReduceOp"]
