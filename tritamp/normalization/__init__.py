"""Apex's ``apex.normalization`` on Triton kernels: FusedLayerNorm, FusedRMSNorm and the
mixed-dtype variants, with their functional forms."""
from .fused_layer_norm import (FusedLayerNorm, FusedLayerNormAffineFunction,
                               FusedLayerNormAffineMixedDtypesFunction, FusedLayerNormFunction,
                               FusedRMSNorm, FusedRMSNormAffineFunction,
                               FusedRMSNormAffineMixedDtypesFunction, FusedRMSNormFunction,
                               MixedFusedLayerNorm, MixedFusedRMSNorm, fused_layer_norm,
                               fused_layer_norm_affine, fused_rms_norm, fused_rms_norm_affine,
                               mixed_dtype_fused_layer_norm_affine,
                               mixed_dtype_fused_rms_norm_affine)

__all__ = [
    "FusedLayerNorm", "FusedRMSNorm", "MixedFusedLayerNorm", "MixedFusedRMSNorm",
    "fused_layer_norm_affine", "fused_layer_norm", "mixed_dtype_fused_layer_norm_affine",
    "fused_rms_norm_affine", "fused_rms_norm", "mixed_dtype_fused_rms_norm_affine",
    "FusedLayerNormAffineFunction", "FusedLayerNormFunction",
    "FusedLayerNormAffineMixedDtypesFunction", "FusedRMSNormAffineFunction",
    "FusedRMSNormFunction", "FusedRMSNormAffineMixedDtypesFunction",
]
