"""FP8 generation helpers: block-wise weight quantisation and KV-cache scales. Pure torch."""

from tandem.quant.fp8 import (
    DEFAULT_BLOCK,
    DEFAULT_FP8_LINEAR_PATTERNS,
    FP8_DTYPE,
    FP8_E4M3_MAX,
    dequantize_block_fp8,
    dequantize_weight_stream,
    fp8_quantization_config,
    is_fp8_linear_weight,
    quantize_block_fp8,
    quantize_weight_stream,
    scale_name,
    scale_shape,
)
from tandem.quant.kv_scales import (
    KvScaleCalibrator,
    append_kv_scales,
    calibrate_kv_scales,
    kv_scale_names,
)

__all__ = [
    "DEFAULT_BLOCK",
    "DEFAULT_FP8_LINEAR_PATTERNS",
    "FP8_DTYPE",
    "FP8_E4M3_MAX",
    "KvScaleCalibrator",
    "append_kv_scales",
    "calibrate_kv_scales",
    "dequantize_block_fp8",
    "dequantize_weight_stream",
    "fp8_quantization_config",
    "is_fp8_linear_weight",
    "kv_scale_names",
    "quantize_block_fp8",
    "quantize_weight_stream",
    "scale_name",
    "scale_shape",
]
