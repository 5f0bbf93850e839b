"""The ``policy.lora`` section (low-rank adapters trained with peft) and the checks that tie it
to the generators: which engines take adapters, the rank they are built for."""

from __future__ import annotations

from typing import Any, Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field

LINEAR_PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
"""Every linear projection of a Llama / Qwen2 / Mistral decoder layer (the LM head excluded)."""

VLLM_MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The ranks vLLM 0.32 builds an engine for (``LoRAConfig.max_lora_rank``); an adapter of a
smaller rank is padded to the next one."""


class LoraConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, validate_default=True)

    rank: int = Field(16, ge=1)
    """Rank r of every adapter (A is r x in, B is out x r)."""
    alpha: int = Field(32, ge=1)
    """Scale numerator: the adapter's update is (alpha / rank) * B @ A."""
    dropout: float = Field(0.0, ge=0, lt=1)
    """Dropout on the adapters' input while training (none at inference or for logprobs taken
    without gradients)."""
    target_modules: list[str] = Field(
        default_factory=lambda: list(LINEAR_PROJECTIONS), min_length=1
    )
    """Module names (last component, e.g. q_proj) that get adapters. Default: all linear
    projections of Llama / Qwen2 decoder layers. A name that no module of the model has is
    an error, and so is an empty list."""
    init: Literal["kaiming", "gaussian"] = "kaiming"
    """Initialisation of A (B starts at zero either way, so step 0 is the base model):
    kaiming-uniform (peft's default) or gaussian with std 1/rank."""
    offload_base: bool = True
    """Whether the trainer's offload (colocated memory phases) moves the frozen base weights
    with the adapters: True leaves 0 B of the trainer on the device; False moves only the
    adapters, their gradients and the optimizer state, and keeps the base weights and buffers
    on the device (no base copy each step, their bytes held through generation)."""


def vllm_lora_rank(rank: int) -> int:
    """The smallest ``max_lora_rank`` vLLM builds an engine for that holds ``rank``."""
    for allowed in VLLM_MAX_LORA_RANKS:
        if allowed >= rank:
            return allowed
    raise ValueError(
        f"policy.lora.rank={rank}: vLLM takes adapters of rank <= {VLLM_MAX_LORA_RANKS[-1]}; "
        "lower the rank or set refit.lora=merged"
    )


class Generation(Protocol):
    """What the check reads of the ``generation`` section (``config.models.GenerationConfig``;
    named by its fields here, so this module needs nothing of ``models``)."""

    @property
    def backend(self) -> str: ...

    @property
    def precision(self) -> str: ...

    @property
    def max_lora_rank(self) -> int | None: ...

    @property
    def sleep_level(self) -> int: ...

    @property
    def compile(self) -> bool | None: ...

    @property
    def model_fields_set(self) -> set[str]: ...

    def model_copy(self, *, update: Any = None, deep: bool = False) -> Any: ...


def check_lora_generation(
    lora: LoraConfig | None,
    generation: Generation,
    mode: str = "adapter",
    in_flight_refit: bool = False,
) -> Any:
    """With ``policy.lora`` and adapter refits (``mode``: ``refit.lora``, adapter where a run
    has no refit section), the generators must take adapters: raises ValueError naming the fix
    where they cannot. Returns ``generation`` with ``max_lora_rank`` (the rank the engine is
    built for) set when it was unset, and ``sleep_level`` 1 where it was left at its default
    (a copy): a refit sends no base weights, so a sleeping generator keeps them; and
    ``compile`` false where it would have followed ``policy.compile``."""
    if lora is None or mode != "adapter":
        return generation
    if generation.precision == "fp8":
        raise ValueError(
            "policy.lora with generation.precision=fp8: the FP8 engine takes no LoRA adapters; "
            "set refit.lora=merged (merge and send full weights) or generation.precision=bf16"
        )
    if generation.backend == "vllm":
        vllm_lora_rank(lora.rank)
        if in_flight_refit:
            raise ValueError(
                "policy.lora with algorithm.refit_mode=in_flight on vLLM: running requests keep "
                "the adapter they started with; use refit_mode=after_requests or refit.lora=merged"
            )
    if generation.compile:
        raise ValueError(
            "policy.lora with generation.compile: the compiled layers would compile again for "
            "each adapter a refit loads; set refit.lora=merged or generation.compile=false"
        )
    update: dict[str, Any] = {}
    if generation.compile is None:  # it would follow policy.compile
        update["compile"] = False
    if generation.sleep_level == 2:
        if "sleep_level" in generation.model_fields_set:
            raise ValueError(
                "generation.sleep_level=2 drops the generators' weights while the trainer "
                "works, and with policy.lora a refit sends the adapters only "
                "(refit.lora=adapter): the base weights would never come back; set "
                "generation.sleep_level=1 (the default with LoRA) or refit.lora=merged"
            )
        update["sleep_level"] = 1
    if generation.max_lora_rank is None:
        update["max_lora_rank"] = lora.rank
    elif generation.max_lora_rank < lora.rank:
        raise ValueError(
            f"generation.max_lora_rank={generation.max_lora_rank} is below policy.lora.rank="
            f"{lora.rank}; raise it or leave it unset (it follows the rank)"
        )
    return generation.model_copy(update=update) if update else generation
