"""Block-wise FP8 (e4m3) weight quantisation for the generator, in vLLM's checkpoint format.

vLLM's block-FP8 format (the DeepSeek-V3 "fp8 with weight_block_size" checkpoints), checked
against vllm 0.32.0:

- `Fp8LinearMethod.create_weights` (vllm/model_executor/layers/quantization/fp8.py) registers an
  `float8_e4m3fn` parameter `weight` of shape [out, in] and, when `weight_block_size` is set, a
  float32 parameter named `weight_scale_inv` ("The weight_scale_inv name is intentional for
  deepseekv3"), shaped [ceil(out / block_n), ceil(in / block_k)] by
  `create_fp8_scale_parameter` (vllm/model_executor/layers/quantization/utils/fp8_utils.py).
- Despite the name, `weight_scale_inv` is the *dequantisation* multiplier:
  `scaled_quantize` (vllm/model_executor/layers/quantization/utils/quant_utils.py) computes
  `scale = fp8_max / amax`, stores `q = x * scale` and returns `scale.reciprocal()` (= amax/448);
  `scaled_dequantize` rebuilds `q * x_s`, and `get_and_maybe_dequant_weights` applies it to
  `weight_scale_inv` of block-quantised `Fp8LinearMethod` layers.
- The generator's HF config must carry `quantization_config` with `quant_method: fp8` and
  `weight_block_size` (`Fp8Config.from_config`); `fp8_quantization_config` builds that dict.

Everything runs in float32 and works unchanged on `meta` tensors (shapes and dtypes only), so the
refit metadata comes from the very same code path.
"""

import re
from collections.abc import Iterable, Iterator, Sequence

import torch
import torch.nn.functional as F

FP8_DTYPE = torch.float8_e4m3fn
FP8_E4M3_MAX = 448.0
"""Largest finite e4m3fn value (1.75 * 2**8)."""

_INV_FP8_E4M3_MAX = 1.0 / FP8_E4M3_MAX

DEFAULT_BLOCK: tuple[int, int] = (128, 128)

DEFAULT_FP8_LINEAR_PATTERNS: tuple[str, ...] = (
    r"(?:.+\.)?layers\.\d+\.self_attn\.(?:q|k|v|o)_proj\.weight",
    r"(?:.+\.)?layers\.\d+\.mlp\.(?:gate|up|down)_proj\.weight",
)
"""Full-match regexes for the transformer blocks' projection weights (Qwen2/Llama names).

Embeddings, norms, biases and `lm_head` match none of them and stay in high precision, which is
also what vLLM expects: its `Fp8Config` only quantises `LinearBase` layers, and `lm_head` is a
`ParallelLMHead` (an embedding class)."""

SCALE_SUFFIX = ".weight_scale_inv"

WeightStream = Iterator[tuple[str, torch.Tensor]]


def _check_block(block: Sequence[int]) -> tuple[int, int]:
    if len(block) != 2 or any(int(b) <= 0 for b in block):
        raise ValueError(f"block must be two positive ints (rows, cols), e.g. (128, 128): {block}")
    return int(block[0]), int(block[1])


def _check_matrix(tensor: torch.Tensor, what: str) -> tuple[int, int]:
    if tensor.dim() != 2:
        raise ValueError(
            f"{what} must be a 2-D [out_features, in_features] matrix; got shape "
            f"{tuple(tensor.shape)} (only linear weights are block-quantised)"
        )
    return tensor.shape[0], tensor.shape[1]


def scale_shape(shape: Sequence[int], block: Sequence[int] = DEFAULT_BLOCK) -> tuple[int, int]:
    """Shape of the `weight_scale_inv` grid for a [rows, cols] weight: ceil-divided by block."""
    bm, bn = _check_block(block)
    return -(-int(shape[0]) // bm), -(-int(shape[1]) // bn)


def quantize_block_fp8(
    weight: torch.Tensor, block: Sequence[int] = DEFAULT_BLOCK
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise a [M, N] weight to e4m3 with one scale per `block` tile.

    Returns `(qweight, scale_inv)`: `qweight` is `float8_e4m3fn` of shape [M, N] on the weight's
    device; `scale_inv` is float32 of shape [ceil(M/bm), ceil(N/bn)] and is the dequantisation
    multiplier (`w ≈ q * scale_inv` per tile), i.e. `amax(tile) / 448` to one float32 rounding.
    Ragged edge tiles are padded with zeros logically (padding cannot raise the tile's amax). An
    all-zero tile gets scale 1.0 so nothing divides by zero; its codes are all zero. Non-finite
    inputs are not guarded (a NaN/inf weight means training already diverged).
    """
    bm, bn = _check_block(block)
    rows, cols = _check_matrix(weight, "weight")
    num_row_blocks, num_col_blocks = scale_shape((rows, cols), (bm, bn))
    padded = F.pad(
        weight.detach().to(torch.float32),
        (0, num_col_blocks * bn - cols, 0, num_row_blocks * bm - rows),
    )
    tiles = padded.view(num_row_blocks, bm, num_col_blocks, bn)
    amax = tiles.abs().amax(dim=(1, 3))
    # Multiply by a float32 reciprocal rather than divide by 448: CUDA rewrites division by a
    # scalar into exactly this, so CPU and CUDA give bit-identical scales (checked on an H200).
    scale_inv = torch.where(amax > 0, amax * _INV_FP8_E4M3_MAX, torch.ones_like(amax))
    # Divide (not multiply by a reciprocal) so the tile's amax lands on 448 up to one float32
    # rounding; the clamp absorbs that rounding, since e4m3fn has no inf to overflow into.
    scaled = (tiles / scale_inv[:, None, :, None]).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX)
    qweight = scaled.to(FP8_DTYPE).view(num_row_blocks * bm, num_col_blocks * bn)
    return qweight[:rows, :cols].contiguous(), scale_inv


def dequantize_block_fp8(
    qweight: torch.Tensor,
    scale_inv: torch.Tensor,
    block: Sequence[int] = DEFAULT_BLOCK,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Inverse of `quantize_block_fp8`: `q * scale_inv` per tile, computed in float32.

    Raises ValueError when `scale_inv`'s shape does not fit `qweight` and `block` (the usual
    cause is a block size different from the one used to quantise).
    """
    bm, bn = _check_block(block)
    rows, cols = _check_matrix(qweight, "qweight")
    expected = scale_shape((rows, cols), (bm, bn))
    if tuple(scale_inv.shape) != expected:
        raise ValueError(
            f"scale_inv has shape {tuple(scale_inv.shape)}, but a {rows}x{cols} weight with "
            f"block {(bm, bn)} needs {expected}; pass the block size used to quantise"
        )
    scales = scale_inv.to(torch.float32).repeat_interleave(bm, dim=0)[:rows]
    scales = scales.repeat_interleave(bn, dim=1)[:, :cols]
    return (qweight.to(torch.float32) * scales).to(dtype)


def is_fp8_linear_weight(name: str, patterns: Iterable[str] = DEFAULT_FP8_LINEAR_PATTERNS) -> bool:
    """True if `name` is a weight to quantise: it fully matches one of the regex `patterns`.

    The defaults select the attention (q/k/v/o) and MLP (gate/up/down) projection weights of the
    transformer blocks; embeddings, norms, biases and `lm_head` are left alone.
    """
    return any(re.fullmatch(pattern, name) for pattern in patterns)


def scale_name(weight_name: str) -> str:
    """`model.layers.0.mlp.up_proj.weight` -> `model.layers.0.mlp.up_proj.weight_scale_inv`."""
    if not weight_name.endswith(".weight"):
        raise ValueError(f"expected a parameter name ending in '.weight', got {weight_name!r}")
    return weight_name.removesuffix(".weight") + SCALE_SUFFIX


def quantize_weight_stream(
    stream: Iterable[tuple[str, torch.Tensor]],
    block: Sequence[int] = DEFAULT_BLOCK,
    patterns: Iterable[str] = DEFAULT_FP8_LINEAR_PATTERNS,
) -> WeightStream:
    """Quantise the selected linear weights of a weight stream, lazily, one tensor at a time.

    For each weight selected by `is_fp8_linear_weight(name, patterns)` yields `(name, qweight)`
    then `(<module>.weight_scale_inv, scale_inv)`; every other pair passes through unchanged.
    Works on `meta` tensors (the outputs are meta tensors of the right shape and dtype).
    """
    block = _check_block(block)
    patterns = tuple(patterns)
    for name, tensor in stream:
        if not is_fp8_linear_weight(name, patterns):
            yield name, tensor
            continue
        if not tensor.is_floating_point():
            raise ValueError(f"{name} is selected for FP8 but has dtype {tensor.dtype}")
        qweight, scale_inv = quantize_block_fp8(tensor, block)
        yield name, qweight
        yield scale_name(name), scale_inv


def dequantize_weight_stream(
    stream: Iterable[tuple[str, torch.Tensor]],
    block: Sequence[int] = DEFAULT_BLOCK,
    dtype: torch.dtype = torch.float32,
) -> WeightStream:
    """Receiver side: turn `(w, weight_scale_inv)` pairs back into high-precision weights.

    For a generator that cannot run FP8 kernels (CPU, the transformers fallback). FP8 weights are
    paired with their `weight_scale_inv` in either order; each pair yields one `(name, weight)` of
    `dtype`. Other tensors pass through unchanged. Raises ValueError for a weight without its
    scale (or a scale without its weight) by the end of the stream.
    """
    block = _check_block(block)
    pending_weights: dict[str, torch.Tensor] = {}
    pending_scales: dict[str, torch.Tensor] = {}
    for name, tensor in stream:
        if name.endswith(SCALE_SUFFIX):
            weight_name = name.removesuffix(SCALE_SUFFIX) + ".weight"
            if weight_name in pending_weights:
                q = pending_weights.pop(weight_name)
                yield weight_name, dequantize_block_fp8(q, tensor, block, dtype)
            else:
                pending_scales[weight_name] = tensor
        elif tensor.dtype == FP8_DTYPE:
            if name in pending_scales:
                yield name, dequantize_block_fp8(tensor, pending_scales.pop(name), block, dtype)
            else:
                pending_weights[name] = tensor
        else:
            yield name, tensor
    if pending_weights or pending_scales:
        raise ValueError(
            "FP8 stream ended with unpaired tensors: weights without scale "
            f"{sorted(pending_weights)}, scales without weight {sorted(pending_scales)}; "
            "the sender must emit '<module>.weight' and '<module>.weight_scale_inv' together"
        )


def fp8_quantization_config(block: Sequence[int] = DEFAULT_BLOCK) -> dict[str, object]:
    """The HF-config `quantization_config` under which vLLM loads this stream's weights.

    `activation_scheme: dynamic` because activations are quantised on the fly (no input scales
    are sent); `weight_block_size` must equal the `block` used by `quantize_weight_stream`.
    """
    bm, bn = _check_block(block)
    return {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [bm, bn]}
