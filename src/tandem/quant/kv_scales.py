"""FP8 KV-cache scales: calibrated on the trainer, sent to vLLM in its parameter names.

vLLM (checked against vllm 0.32.0) stores per-tensor scalars on each `Attention` layer:
`BaseKVCacheMethod.create_weights` (vllm/model_executor/layers/quantization/kv_cache.py) creates
`q_scale`, `k_scale`, `v_scale` (and `prob_scale`) as `KVCacheScaleParameter`s, scalar float32,
whose loader accepts shape `()` or `(1,)`. In Qwen2/Llama the attention layer is the `attn` child
of `self_attn`, so the loadable names are `model.layers.{i}.self_attn.attn.{q,k,v}_scale`; that is
the form `maybe_remap_kv_scale_name` (vllm/model_executor/model_loader/weight_utils.py) and
`QuantizationConfig.get_cache_scale_mapper` (.../quantization/base_config.py) map other
checkpoint spellings to, and leave untouched. A scale is the *dequantisation* multiplier: the
cache write divides by it (`key / k_scale` in
vllm/v1/attention/ops/triton_reshape_and_cache_flash.py), so scale = amax / 448 for e4m3.
vLLM only creates these parameters when the model has a quantisation config (e.g. FP8
weights); a missing q_scale falls back to k_scale.

What is measured, and why: vLLM caches k *after* RoPE. HF computes RoPE inside the attention
forward (no module to hook), so the hooks see k_proj's pre-RoPE output. RoPE rotates each pair of
channels (i, i + head_dim/2) (HF's `rotate_half` convention) by a position-dependent angle, which
keeps the pair's norm but moves it between the two elements. So each statistic for k (and q, which
vLLM also rotates) is taken over per-pair norms `hypot(x_i, x_{i+d/2})`: an upper bound on every
post-RoPE element at any position, tight when the angle aligns the pair with an axis (which happens
for the high-frequency pairs within a few tokens). v has no RoPE: plain absolute values.
"""

import math
import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from types import TracebackType
from typing import Any, Self

import torch
import torch.distributed as dist
from torch import nn

from tandem.quant.fp8 import FP8_E4M3_MAX

KINDS: tuple[str, ...] = ("q", "k", "v")
_ROTATED_KINDS = frozenset({"q", "k"})
_ATTENTION_RE = re.compile(r"(?:^|.*\.)layers\.(\d+)\.self_attn")

LayerKey = int | str
LayerScales = Mapping[LayerKey, Mapping[str, float]]


class KvScaleCalibrator:
    """Context manager collecting per-layer q/k/v absolute maxima for FP8 KV-cache scales.

    On entry it hooks the q/k/v projections of every `layers.{i}.self_attn` module; run the
    calibration forward passes inside the block. Per forward call and projection it takes the
    `percentile`-th percentile of the magnitudes (pair norms for q/k, see the module docstring;
    a random subsample of `max_samples` values when there are more), keeps the max over calls,
    on exit takes the max over data-parallel ranks (`all_reduce(MAX)` on `process_group` when
    torch.distributed is initialised, so every rank must exit the block) and multiplies by
    `margin`. `scales` then holds {layer: {"q": s, "k": s, "v": s}} with s = amax / 448; a layer
    whose amax is 0 gets 1.0 (vLLM's default).
    """

    def __init__(
        self,
        model: nn.Module,
        percentile: float = 99.9,
        margin: float = 1.1,
        *,
        head_dim: int | None = None,
        max_samples: int = 1 << 20,
        process_group: dist.ProcessGroup | None = None,
        seed: int = 0,
    ) -> None:
        if not 0.0 < percentile <= 100.0:
            raise ValueError(f"percentile must be in (0, 100], got {percentile}")
        if not (math.isfinite(margin) and margin > 0.0):
            raise ValueError(f"margin must be a positive finite factor (e.g. 1.1), got {margin}")
        if max_samples < 1:
            raise ValueError(f"max_samples must be >= 1, got {max_samples}")
        self.percentile = percentile
        self.margin = margin
        self.max_samples = max_samples
        self.process_group = process_group
        self.head_dim = head_dim if head_dim is not None else _infer_head_dim(model)
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE pairs, got {self.head_dim}")
        self._projections = _find_projections(model)
        self._seed = seed
        self._generators: dict[torch.device, torch.Generator] = {}
        self._amax: dict[tuple[int, str], torch.Tensor] = {}
        self._handles: list[torch.utils.hooks.RemovableHandle] = []
        self._scales: dict[int, dict[str, float]] | None = None

    def __enter__(self) -> Self:
        self._amax.clear()
        self._scales = None
        for (layer, kind), module in self._projections.items():
            self._handles.append(module.register_forward_hook(self._hook(layer, kind)))
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        if exc_type is None:
            self._scales = self._finalize()

    @property
    def scales(self) -> dict[int, dict[str, float]]:
        """Per-layer scales {layer_index: {"q", "k", "v"}}; available after the `with` block."""
        if self._scales is None:
            raise RuntimeError("read KvScaleCalibrator.scales after its `with` block has exited")
        return self._scales

    def _hook(self, layer: int, kind: str) -> Callable[[nn.Module, Any, torch.Tensor], None]:
        def hook(module: nn.Module, inputs: Any, output: torch.Tensor) -> None:
            statistic = self._statistic(_magnitudes(output, kind, self.head_dim))
            previous = self._amax.get((layer, kind))
            self._amax[(layer, kind)] = (
                statistic if previous is None else torch.maximum(previous, statistic)
            )

        return hook

    def _statistic(self, values: torch.Tensor) -> torch.Tensor:
        if self.percentile == 100.0:
            return values.amax()
        if values.numel() > self.max_samples:
            generator = self._generators.get(values.device)
            if generator is None:
                generator = torch.Generator(device=values.device).manual_seed(self._seed)
                self._generators[values.device] = generator
            index = torch.randint(
                values.numel(), (self.max_samples,), generator=generator, device=values.device
            )
            values = values[index]
        return torch.quantile(values, self.percentile / 100.0)

    def _finalize(self) -> dict[int, dict[str, float]]:
        if not self._amax:
            raise ValueError(
                "no forward pass ran inside KvScaleCalibrator; call the model on calibration "
                "batches inside the `with` block"
            )
        layers = sorted({layer for layer, _ in self._projections})
        device = next(iter(self._amax.values())).device
        table = torch.zeros(len(layers), len(KINDS), dtype=torch.float32, device=device)
        for (layer, kind), value in self._amax.items():
            table[layers.index(layer), KINDS.index(kind)] = value
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(table, op=dist.ReduceOp.MAX, group=self.process_group)
        scaled = table * self.margin / FP8_E4M3_MAX
        rows = torch.where(table > 0, scaled, torch.ones_like(scaled)).tolist()
        return {
            layer: dict(zip(KINDS, row, strict=True))
            for layer, row in zip(layers, rows, strict=True)
        }


def calibrate_kv_scales(
    model: nn.Module,
    batches: Iterable[Mapping[str, torch.Tensor]],
    percentile: float = 99.9,
    margin: float = 1.1,
    **kwargs: object,
) -> dict[int, dict[str, float]]:
    """Run `model(**batch)` for each batch under `KvScaleCalibrator` and return its scales."""
    calibrator = KvScaleCalibrator(model, percentile, margin, **kwargs)  # type: ignore[arg-type]
    with torch.no_grad(), calibrator:
        for batch in batches:
            model(**batch)
    return calibrator.scales


def _magnitudes(output: torch.Tensor, kind: str, head_dim: int) -> torch.Tensor:
    values = output.detach().to(torch.float32)
    if kind not in _ROTATED_KINDS:
        return values.abs().flatten()
    heads = values.reshape(-1, head_dim)
    half = head_dim // 2
    return torch.hypot(heads[:, :half], heads[:, half:]).flatten()


def _infer_head_dim(model: nn.Module) -> int:
    config = getattr(model, "config", None)
    head_dim = getattr(config, "head_dim", None)
    if head_dim is None and config is not None:
        hidden = getattr(config, "hidden_size", None)
        heads = getattr(config, "num_attention_heads", None)
        head_dim = hidden // heads if hidden and heads else None
    if not head_dim:
        raise ValueError(
            "cannot infer head_dim from model.config (needs head_dim, or hidden_size and "
            "num_attention_heads); pass KvScaleCalibrator(model, head_dim=...)"
        )
    return int(head_dim)


def _find_projections(model: nn.Module) -> dict[tuple[int, str], nn.Module]:
    projections: dict[tuple[int, str], nn.Module] = {}
    for name, module in model.named_modules():
        match = _ATTENTION_RE.fullmatch(name)
        if match is None:
            continue
        for kind in KINDS:
            child = getattr(module, f"{kind}_proj", None)
            if not isinstance(child, nn.Module):
                raise ValueError(f"{name} has no {kind}_proj; expected the HF Qwen2/Llama layout")
            projections[(int(match.group(1)), kind)] = child
    if not projections:
        raise ValueError(
            "found no 'layers.{i}.self_attn' modules with q_proj/k_proj/v_proj; "
            "KvScaleCalibrator supports HF Qwen2/Llama-style models"
        )
    return projections


def _layer_index(key: LayerKey, layer_prefix: str) -> int:
    if isinstance(key, int) and not isinstance(key, bool) and key >= 0:
        return key
    if isinstance(key, str):
        match = re.fullmatch(rf"{re.escape(layer_prefix)}\.(\d+)", key)
        if match is not None:
            return int(match.group(1))
    raise ValueError(
        f"malformed layer key {key!r}: use a non-negative int layer index (3) "
        f"or the module name '{layer_prefix}.3'"
    )


def kv_scale_names(
    layer_scales: LayerScales, layer_prefix: str = "model.layers"
) -> dict[str, torch.Tensor]:
    """Flatten per-layer scales into vLLM's names: `{prefix}.{i}.self_attn.attn.{q,k,v}_scale`.

    Layer keys are int indices or module names like `"model.layers.3"`; each value maps a subset
    of "q", "k", "v" to a positive finite float. Returns float32 scalar tensors on the CPU.
    """
    flat: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for key, per_kind in layer_scales.items():
        layer = _layer_index(key, layer_prefix)
        if layer in seen:
            raise ValueError(f"layer {layer} appears twice in the scales (as {key!r} and another)")
        seen.add(layer)
        unknown = set(per_kind) - set(KINDS)
        if unknown or not per_kind:
            raise ValueError(
                f"layer {key!r}: scale kinds must be a non-empty subset of {KINDS}, "
                f"got {sorted(per_kind)}"
            )
        for kind, value in per_kind.items():
            if not (math.isfinite(value) and value > 0.0):
                raise ValueError(f"layer {key!r} {kind}_scale must be positive finite, got {value}")
            name = f"{layer_prefix}.{layer}.self_attn.attn.{kind}_scale"
            flat[name] = torch.tensor(float(value), dtype=torch.float32)
    return flat


def append_kv_scales(
    stream: Iterable[tuple[str, torch.Tensor]],
    scales: LayerScales,
    device: torch.device | str = "cpu",
    layer_prefix: str = "model.layers",
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield the stream, then the KV-cache scale tensors (on `device`) in vLLM's names.

    The scales are validated now, before the stream is consumed.
    """
    flat = kv_scale_names(scales, layer_prefix)

    def chained() -> Iterator[tuple[str, torch.Tensor]]:
        yield from stream
        for name, value in flat.items():
            yield name, value.to(device)

    return chained()
