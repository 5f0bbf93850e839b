"""Checks of a run's inputs that need the files themselves, made before Ray or any actor starts:
the model folder, its weights, the data files, and the response length against the model's
context. Numeric bounds are not here: the config models check those when the recipe loads.

Each check raises ``ValueError`` with what is wrong and which key or file to fix (the CLI prints
it and exits with status 2).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any

from tandem.config.dpo import PreferenceDataConfig
from tandem.config.models import DataConfig, GenerationConfig, PolicyConfig

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")
"""One of these makes a folder hold a tokenizer (fast, sentencepiece, or BPE vocab + merges)."""


def check_model_folder(path: Path, key: str = "policy.model_path") -> dict[str, Any]:
    """``path`` is a Hugging Face model folder: config.json, a tokenizer and readable
    safetensors (or .bin) weights. Returns the parsed config.json."""
    if not path.exists():
        raise ValueError(
            f"{key}: {path} does not exist (a local Hugging Face model folder is expected: "
            "config.json, tokenizer files, *.safetensors)"
        )
    if not path.is_dir():
        raise ValueError(f"{key}: {path} is a file; point it at the model's folder")
    missing = []
    if not (path / "config.json").is_file():
        missing.append("config.json")
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        missing.append(f"a tokenizer ({' or '.join(TOKENIZER_FILES)})")
    weights = sorted(path.glob("*.safetensors"))
    if not weights and not any(path.glob("*.bin")):
        missing.append("weights (*.safetensors)")
    if missing:
        raise ValueError(f"{key}: {path} is not a model folder; it has no {', '.join(missing)}")
    for file in weights:
        check_safetensors(file)
    try:
        config = json.loads((path / "config.json").read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{path / 'config.json'}: not valid JSON ({err.msg})") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path / 'config.json'}: expected a JSON object")
    return config


def check_safetensors(file: Path) -> None:
    """The file's header parses and its tensors cover the file (a truncated copy fails)."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(file), "numpy") as handle:  # "pt" would import torch
            handle.keys()
    except SafetensorError as err:
        raise ValueError(
            f"{file}: unreadable safetensors file ({err}); it is truncated or corrupt "
            "(an interrupted download or copy?)"
        ) from None


def check_data_files(data: DataConfig | PreferenceDataConfig) -> None:
    """Every configured data file exists and is not empty."""
    for key, path in (("data.train_path", data.train_path), ("data.eval_path", data.eval_path)):
        if path is None:
            continue
        if not path.is_file():
            raise ValueError(f"{key}: data file not found: {path}")
        if not path.read_bytes().strip():
            raise ValueError(f"{key}: data file {path} is empty")


def check_response_length(model_config: dict[str, Any], generation: GenerationConfig) -> int:
    """``generation.sampling.max_tokens`` leaves room for a prompt in the model's context.
    Returns the context length (``max_position_embeddings``), 0 when the config has none."""
    text_config = model_config.get("text_config") or {}  # vision-language models keep it there
    context = int(
        model_config.get("max_position_embeddings")
        or text_config.get("max_position_embeddings")
        or 0
    )
    max_tokens = generation.sampling.max_tokens
    if context and max_tokens >= context:
        raise ValueError(
            f"generation.sampling.max_tokens={max_tokens} leaves no room for a prompt: the "
            f"model's context (max_position_embeddings) is {context} tokens"
        )
    return context


def check_prompt_lengths(
    prompt_lengths: list[int], context: int, generation: GenerationConfig
) -> None:
    """The longest prompt plus ``max_tokens`` fits the model's context."""
    if not context or not prompt_lengths:
        return
    longest = max(prompt_lengths)
    max_tokens = generation.sampling.max_tokens
    if longest + max_tokens > context:
        raise ValueError(
            f"the longest prompt has {longest} tokens; with generation.sampling.max_tokens="
            f"{max_tokens} it exceeds the model's context of {context} tokens: lower max_tokens "
            f"to at most {context - longest} or shorten the prompts"
        )


def check_episode_length(max_tokens: int, context: int) -> None:
    """A multi-turn episode (``environment.max_tokens``) fits the model's context."""
    if context and max_tokens > context:
        raise ValueError(
            f"environment.max_tokens={max_tokens} exceeds the model's context of {context} "
            "tokens (max_position_embeddings): lower it"
        )


def check_lora_targets(policy: PolicyConfig, model_config: dict[str, Any]) -> None:
    """Every ``policy.lora.target_modules`` entry names modules of the model and the rank fits
    the projections it adapts (``trainer.lora.check_targets``): checked on its skeleton (built
    on the meta device from config.json: no weights read, nothing allocated)."""
    assert policy.lora is not None
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from tandem.trainer.lora import check_targets

    config = AutoConfig.for_model(**model_config)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    check_targets(policy.lora, skeleton)


def check_megatron_model(policy: PolicyConfig, model_config: dict[str, Any]) -> None:
    """policy.backend=megatron converts the model (a Qwen2/Llama-family decoder), and its
    tensor-parallel size divides the heads and the MLP width."""
    from tandem.config.megatron import unsupported

    problems = unsupported(model_config)
    if problems:
        raise ValueError(
            f"policy.backend=megatron cannot convert {policy.model_path}: {'; '.join(problems)}"
            " (set policy.backend=fsdp2 for this model)"
        )
    tp = policy.megatron.tensor_parallel_size
    sizes = {
        "num_attention_heads": model_config.get("num_attention_heads", 0),
        "intermediate_size": model_config.get("intermediate_size", 0),
    }
    uneven = [f"{key}={size}" for key, size in sizes.items() if size % tp]
    if uneven:
        raise ValueError(
            f"policy.megatron.tensor_parallel_size={tp} does not divide the model's "
            f"{', '.join(uneven)}: choose a divisor"
        )


def check_run_inputs(
    policy: PolicyConfig, generation: GenerationConfig, data: DataConfig | PreferenceDataConfig
) -> int:
    """All the checks of a run's inputs (model folder, data files, the reward's import, the
    response length); returns the model's context length."""
    from tandem.rewards.registry import resolve_reward

    model_config = check_model_folder(policy.model_path)
    warn_bf16_weights(policy)
    check_compiler(policy)
    if policy.lora is not None:
        check_lora_targets(policy, model_config)
    if policy.backend == "megatron":
        check_megatron_model(policy, model_config)
    check_data_files(data)
    if isinstance(data, DataConfig):
        resolve_reward(data.reward)
        images = data.task == "visual" or data.image_key is not None
        if images and "vision_config" not in model_config:
            raise ValueError(
                f"image prompts (data.task={data.task}, data.image_key={data.image_key}) need a "
                f"vision-language policy; policy.model_path={policy.model_path} is a "
                f"{model_config.get('model_type', 'text-only')} model (the embedded one: "
                "tandem.assets.VISUAL_MODEL_DIR)"
            )
        if images:
            check_image_generator(generation)
    return check_response_length(model_config, generation)


def check_compiler(policy: PolicyConfig) -> None:
    """``policy.compile`` on a machine without NVIDIA GPUs: Inductor builds the layers' kernels
    as C++ with ``$CXX`` (default g++), which must exist, or the first micro-batch fails deep in
    torch after the model has loaded."""
    from tandem.machine import nvidia_devices

    if not policy.compile or nvidia_devices():
        return
    compiler = os.environ.get("CXX", "g++")
    if shutil.which(compiler) is None:
        raise ValueError(
            f"policy.compile=true compiles the decoder layers into C++ on this CPU machine, and "
            f"its C++ compiler ({compiler}, from $CXX or the default g++) is not installed: "
            "install one (apt install g++) or set policy.compile=false"
        )


def warn_bf16_weights(policy: PolicyConfig) -> None:
    """Warn where AdamW updates weights kept in bfloat16: the FSDP2 trainer with
    ``policy.dtype=bfloat16`` and every weight trained (LoRA's adapters are fp32; Megatron keeps
    fp32 main parameters). An update below about 1/256 of its weight rounds away: on a random
    0.5B-shape model in bf16, 3 AdamW steps changed 1.9 % of the weights at lr 1e-6, 15 % at
    1e-5, 83 % at 1e-4 (``bench/bf16_updates.py``, docs/errors.md). Stochastic rounding
    (``policy.optimizer.bf16_stochastic_round``) keeps them in expectation: no warning then."""
    if policy.dtype != "bfloat16" or policy.backend != "fsdp2" or policy.lora is not None:
        return
    if policy.optimizer.bf16_stochastic_round:
        return
    logging.getLogger("tandem.preflight").warning(
        "warning: policy.dtype=bfloat16 trains weights kept in bfloat16, where an AdamW "
        "update smaller than about 1/256 of its weight rounds away (3 steps of a 0.5B-shape "
        "model changed 1.9 %% of its weights at lr 1e-6, 15 %% at 1e-5; this run's "
        "policy.optimizer.lr is %g). For float32 weights with bfloat16 compute: "
        "policy.dtype=float32 policy.mixed_precision=true; to keep bfloat16 weights with their "
        "updates kept in expectation: policy.optimizer.bf16_stochastic_round=true.",
        policy.optimizer.lr,
    )


def check_image_generator(generation: GenerationConfig) -> None:
    """Image prompts go to the vLLM generator only where torchvision imports
    (``vllm_images_refusal``); the transformers generator takes them anywhere."""
    from tandem.machine import generator_backend

    if generator_backend(generation) != "vllm":
        return
    refusal = vllm_images_refusal()
    if refusal is not None:
        picked = ", which picks vllm here" if generation.backend == "auto" else ""
        raise ValueError(f"generation.backend={generation.backend}{picked}: {refusal}")


def vllm_images_refusal() -> str | None:
    """Why this interpreter cannot run vLLM on a Qwen2-VL-family model (None: it can): vLLM's
    Qwen2-VL module imports transformers' image processor, which imports torchvision, and the
    project's lock installs none (PyPI's wheels are CUDA builds, which fail to import beside
    torch+cpu). The generator checks its own interpreter again (an isolated environment)."""
    from importlib.metadata import version

    from tandem.imports import import_error

    error = import_error("torchvision")
    if error is None:
        return None
    return (
        f"image prompts with the vLLM generator need torchvision, which does not import here "
        f"({error}): install the torchvision build matching torch {version('torch')} in the "
        "generator's environment, or set generation.backend=hf"
    )
