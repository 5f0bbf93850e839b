"""Names of LoRA adapter tensors in a weight stream: peft's saved names
(``base_model.model.<module>.lora_A.weight`` and ``lora_B``), which the trainer sends, the
generators apply, ``PeftModel.from_pretrained`` and vLLM's adapter loader read. No torch here:
both sides of a refit import it."""

from __future__ import annotations

PEFT_PREFIX = "base_model.model."
"""What peft's saved adapter names put before the model's own module names."""

KINDS = ("lora_A", "lora_B")


def is_adapter_name(name: str) -> bool:
    """Whether a weight-stream name is an adapter tensor."""
    return name.startswith(PEFT_PREFIX) and name.endswith((".lora_A.weight", ".lora_B.weight"))


def adapter_name(module: str, kind: str) -> str:
    """The stream name of ``module``'s A (``kind="lora_A"``) or B (``"lora_B"``)."""
    return f"{PEFT_PREFIX}{module}.{kind}.weight"


def split_adapter_name(name: str) -> tuple[str, str]:
    """(module name, ``lora_A`` or ``lora_B``) of an adapter tensor's stream name."""
    if not is_adapter_name(name):
        raise ValueError(f"{name!r} is not a LoRA adapter tensor name")
    module, kind, _ = name[len(PEFT_PREFIX) :].rsplit(".", 2)
    return module, kind
