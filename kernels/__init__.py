"""tritamp's Triton kernels: one op per file, each with a launcher and a ``*_ref``.

Nothing here compiles or touches CUDA at import time; kernels compile on first call.
This package knows nothing of opt levels or optimizers.
"""
from ._dispatch import elementwise_settings, interpreter_on, use_triton
from .axpby import multi_tensor_axpby, multi_tensor_axpby_ref, multi_tensor_scale, multi_tensor_scale_ref
from .check_unscale import (check_unscale, check_unscale_launch, check_unscale_prepare,
                            check_unscale_ref)
from .l2norm import multi_tensor_l2norm, multi_tensor_l2norm_ref
from .scale_update import (FLOOR_STREAK, FOUND_INF, FOUND_INF_NEXT, HYSTERESIS, PREV_FOUND, SCALE,
                           SKIPPED, STATE_SIZE, UNSKIPPED, USED_SCALE, other_found_slot,
                           scale_update, scale_update_ref)

__all__ = [
    "use_triton", "interpreter_on", "elementwise_settings",
    "check_unscale", "check_unscale_ref", "check_unscale_prepare", "check_unscale_launch",
    "multi_tensor_l2norm", "multi_tensor_l2norm_ref",
    "multi_tensor_scale", "multi_tensor_scale_ref", "multi_tensor_axpby", "multi_tensor_axpby_ref",
    "scale_update", "scale_update_ref",
    "SCALE", "UNSKIPPED", "HYSTERESIS", "FOUND_INF", "USED_SCALE", "SKIPPED", "FLOOR_STREAK",
    "FOUND_INF_NEXT", "PREV_FOUND", "STATE_SIZE", "other_found_slot",
]

from .syncbn import (syncbn_backward_input, syncbn_backward_input_ref,  # noqa: E402
                     syncbn_backward_reduce, syncbn_backward_reduce_ref, syncbn_combine,
                     syncbn_combine_ref, syncbn_finalize, syncbn_finalize_ref, syncbn_forward,
                     syncbn_forward_ref, syncbn_stats, syncbn_stats_ref)

__all__ += [
    "syncbn_stats", "syncbn_stats_ref", "syncbn_combine", "syncbn_combine_ref",
    "syncbn_finalize", "syncbn_finalize_ref", "syncbn_forward", "syncbn_forward_ref",
    "syncbn_backward_reduce", "syncbn_backward_reduce_ref",
    "syncbn_backward_input", "syncbn_backward_input_ref",
]
