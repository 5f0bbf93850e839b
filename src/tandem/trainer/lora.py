"""LoRA on the trainer's model through peft: wrapping, and the adapters as named tensors.

``wrap_lora`` injects peft's LoRA layers into the Hugging Face model in place (the model object
stays the one the trainer shards and computes with) and returns the ``PeftModel`` around it,
which owns the adapter config and ``disable_adapter()``. Every other function reads the layers
peft injected: the adapters in peft's saved names (``base_model.model.<module>.lora_A.weight``,
what ``PeftModel.from_pretrained`` and vLLM's adapter loader read) and the weights with the
adapters merged in, in the base model's Hugging Face names.

Tensors are read through ``gather`` (the trainer's ``full_tensor``: a collective for an FSDP2
shard), one at a time, so no rank holds more than one layer's full weight. A plain module (one
rank) keeps its adapters back to back in one allocation, in the order a refit streams them, so an
adapter refit copies them in a handful of kernels (``Adapters.scaled_copy``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from tandem.adapters import KINDS, adapter_name
from tandem.config.lora import LoraConfig
from tandem.tensors.copies import span
from tandem.tensors.packed import Layout, PackedStream, Placement, layout_of

ADAPTER = "default"
"""peft's name of the one adapter the trainer trains."""

_WRAPPED = "_checkpoint_wrapped_module."
"""The activation-checkpoint wrapper's attribute, left out of module names."""

INIT_SEED = 0
"""Seed of the adapters' initialisation (A; B starts at zero)."""

Gather = Callable[[torch.Tensor], torch.Tensor]


def module_names(model: nn.Module) -> set[str]:
    """The last component of every module's name (``q_proj``, ``mlp``...)."""
    return {name.rsplit(".", 1)[-1] for name, _ in model.named_modules() if name}


def check_targets(config: LoraConfig, model: nn.Module) -> None:
    """Every ``target_modules`` entry names modules of ``model`` (peft itself only fails when
    none does), and the rank is at most the width of the narrowest projection it adapts (a
    rank beyond ``min(in_features, out_features)`` adds parameters, not capacity)."""
    names = module_names(model)
    missing = [target for target in config.target_modules if target not in names]
    if missing:
        linear_like = sorted(n for n in names if n.endswith(("proj", "fc1", "fc2", "dense")))
        raise ValueError(
            f"policy.lora.target_modules: {missing} name no module of the model; its "
            f"projections are {linear_like or sorted(names)}"
        )
    widths = {
        name.rsplit(".", 1)[-1]: min(module.in_features, module.out_features)
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear) and name.rsplit(".", 1)[-1] in config.target_modules
    }
    narrowest = min(widths.items(), key=lambda item: item[1], default=None)
    if narrowest is not None and config.rank > narrowest[1]:
        raise ValueError(
            f"policy.lora.rank={config.rank} exceeds the width of {narrowest[0]} "
            f"({narrowest[1]} features, the narrowest projection adapted): a rank above it adds "
            f"parameters, not capacity; set policy.lora.rank <= {narrowest[1]}"
        )


def wrap_lora(lm: nn.Module, config: LoraConfig) -> Any:
    """Inject LoRA layers into ``lm`` (in place: base weights frozen, adapters trainable) and
    return the ``PeftModel`` that wraps it."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    check_targets(config, lm)
    peft_config = PeftLoraConfig(
        r=config.rank,
        lora_alpha=config.alpha,
        lora_dropout=config.dropout,
        target_modules=list(config.target_modules),
        init_lora_weights=True if config.init == "kaiming" else "gaussian",
        bias="none",
        task_type="CAUSAL_LM",
    )
    # The same A on every rank (FSDP2 shards each rank's own copy) and in every run: seeded,
    # without touching the caller's random state.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(INIT_SEED)
        return get_peft_model(lm, peft_config, adapter_name=ADAPTER)


def lora_layers(lm: nn.Module) -> dict[str, Any]:
    """The layers peft injected, by module name (without wrapper prefixes), in model order."""
    from peft.tuners.lora import LoraLayer

    return {
        name.replace(_WRAPPED, ""): module
        for name, module in lm.named_modules()
        if isinstance(module, LoraLayer)
    }


class Adapters:
    """The adapters of the LoRA layers peft injected into ``lm``, in the order a refit streams
    them (every layer's A, then every layer's B, the layers in model order), found once: built
    after the model is parallelised, its parameters stay the same objects (offload and onload
    swap their data in place; FSDP2 keeps its sharded parameters), so no refit walks the
    model's modules again. The B's come last so that the part a refit scales is one span."""

    def __init__(self, lm: nn.Module) -> None:
        layers = lora_layers(lm)
        self.names = [adapter_name(name, kind) for kind in KINDS for name in layers]
        self.params: list[torch.Tensor] = [
            getattr(layer, kind)[ADAPTER].weight for kind in KINDS for layer in layers.values()
        ]
        scalings = {float(layer.scaling[ADAPTER]) for layer in layers.values()}
        if len(scalings) > 1:  # policy.lora has one rank and one alpha
            raise ValueError(f"LoRA layers of several scalings {sorted(scalings)}: one expected")
        self.scaling = scalings.pop() if scalings else 1.0
        """alpha / rank, by which every B is scaled for a refit."""
        self._placement = Placement()
        self._packed: tuple[Layout, int, int] | None = None
        """``_plan()`` for the parameters as ``_placement`` last found them."""

    def metadata(
        self, dtype: torch.dtype | None = None
    ) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
        """(name, full shape, dtype) of every tensor ``tensors`` yields; no communication."""
        return [
            (name, tuple(param.shape), dtype or param.dtype)
            for name, param in zip(self.names, self.params, strict=True)
        ]

    def tensors(
        self, gather: Gather, scaled: bool, dtype: torch.dtype | None = None
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Every A then every B in peft's saved names, gathered one at a time. ``scaled``: B
        times alpha / rank, so a receiver applies ``B @ A`` as it is, whatever alpha was
        (refits); unscaled is what peft saves (exports)."""
        first_b = len(self.params) // 2
        for i, (name, param) in enumerate(zip(self.names, self.params, strict=True)):
            tensor = gather(param)
            if scaled and i >= first_b:
                tensor = tensor * self.scaling
            yield name, tensor if dtype is None else tensor.to(dtype)

    def scaled_copy(
        self, device: torch.device, dtype: torch.dtype | None = None
    ) -> PackedStream | None:
        """What ``tensors(scaled=True)`` yields, as one ``PackedStream``, when the parameters
        lie back to back on ``device`` in stream order (``tensors.pack_parameters``; onload
        keeps them so): the A's copied and the B's multiplied by the scaling, each in one call
        that also casts (when ``dtype`` differs), instead of a copy and a multiply per tensor,
        written where the receiver asks (``PackedStream.write_into``). None when they do not
        lie so (FSDP2 shards). The layout is worked out again only when they lie otherwise
        relative to each other, not when an onload moved them alike."""
        _, alike = self._placement.same(self.params)
        if not alike:  # laid out anew or never looked at
            self._packed = self._plan()
        first = self.params[0]
        if self._packed is None or first.device != device:
            return None
        layout, split, numel = self._packed
        flat = torch.empty(0, dtype=first.dtype, device=device)
        flat.set_(first.untyped_storage(), first.storage_offset(), (numel,), (1,))
        scaling = self.scaling

        def write(out: torch.Tensor) -> None:
            out[:split].copy_(flat[:split])
            # in the parameters' dtype and rounded once to the dtype sent, as ``tensors`` does
            torch.mul(flat[split:], scaling, out=out[split:])

        return PackedStream(self.names, layout, write, numel, dtype or flat.dtype, device)

    def _plan(self) -> tuple[Layout, int, int] | None:
        """The adapters' layout in the span they lie in, the element where the first B starts,
        and the span's length: ``scaled_copy``'s inputs."""
        found = span(self.params)
        if found is None:
            return None
        flat, offsets = found
        return layout_of(self.params, offsets), offsets[len(offsets) // 2], flat.numel()


def base_name(name: str) -> str | None:
    """The base model's name of a state-dict entry of the wrapped model; None for adapters."""
    if ".lora_" in name:
        return None
    return name.replace(".base_layer.", ".")


def merged_tensors(
    lm: nn.Module, state: Iterator[tuple[str, torch.Tensor]], gather: Gather
) -> Iterator[tuple[str, torch.Tensor]]:
    """The base model's weights (full, in its Hugging Face names) with every adapter merged in:
    ``W + scaling * B @ A``, computed wider than W and rounded once. ``state``: the wrapped
    model's (name, tensor) pairs (``weights.hf_state``).

    A generator computing with merged weights rounds differently from the trainer, which
    computes ``W x + scaling * B (A x)``: after three steps at lr 2e-2 on the embedded model
    (fp32) the transformers generator's logprobs were 1.2e-5 from the trainer's, against
    3.8e-6 after an adapter refit (``tests/unit/test_lora.py``)."""
    layers = lora_layers(lm)
    for name, tensor in state:
        plain = base_name(name)
        if plain is None:
            continue
        full = gather(tensor)
        module = name.rsplit(".base_layer.", 1)[0] if ".base_layer." in name else None
        if module in layers and name.endswith(".weight"):
            layer = layers[module]
            a = gather(layer.lora_A[ADAPTER].weight)
            b = gather(layer.lora_B[ADAPTER].weight)
            # wider than W (float32 weights in float64, bf16 in float32), rounded once
            wide = torch.float64 if full.dtype == torch.float32 else torch.float32
            delta = (b.to(wide) @ a.to(wide)) * layer.scaling[ADAPTER]
            if getattr(layer, "fan_in_fan_out", False):
                delta = delta.T
            full = (full.to(wide) + delta).to(full.dtype)
        yield plain, full


def merged_metadata(
    state: Iterator[tuple[str, torch.Tensor]], dtype: torch.dtype | None = None
) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """(name, shape, dtype) of every tensor ``merged_tensors`` yields; no communication."""
    out = []
    for name, tensor in state:
        plain = base_name(name)
        if plain is not None:
            out.append((plain, tuple(tensor.shape), dtype or tensor.dtype))
    return out


def adapter_config(peft_model: Any) -> Any:
    """The adapter's ``peft.LoraConfig`` (what ``adapter_config.json`` holds)."""
    return peft_model.peft_config[ADAPTER]
