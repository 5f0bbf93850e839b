"""LoRA adapters on the transformers generator's model, through peft.

A refit of a LoRA policy (``refit.lora=adapter``) sends each adapted module's A and B (peft's
saved names, B already scaled by alpha / rank: ``trainer.lora.adapter_tensors``). The first such
refit injects peft's LoRA layers into the model (``peft.inject_adapter_in_model``: the rank from
A's shape, the modules from the names, alpha = rank so the scale is 1); every refit then copies
A and B into them. The generator computes what the trainer does, ``base(x) + B(A(x))``, and
keeps its base weights as loaded: no merged copy to keep or undo. On a CPU the base layers stay
oneDNN-packed (``PackedLinear`` is an ``nn.Linear`` that peft wraps like any other).

The injected A and B lie back to back in one allocation, in the stream's order
(``tensors.pack_parameters``), as the trainer keeps its own: a refit of them is one copy per run
(``copy_tensors`` in this process, ``TargetRuns`` through a transport), and the targets of a
stream's names are looked up once.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import nn

from tandem.adapters import split_adapter_name
from tandem.tensors.copies import copy_tensors, pack_parameters
from tandem.tensors.packed import PackedStream, PackedTarget

ADAPTER = "tandem"
"""peft's name of the generator's one adapter."""


class PeftAdapter:
    """The LoRA layers injected into ``model`` and where each stream name lands."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.rank: int | None = None
        self.modules: tuple[str, ...] = ()
        self._params: dict[str, torch.Tensor] = {}
        self._packed = PackedTarget()
        """Where a ``PackedStream`` lands at once (its layout checked once)."""
        self._loaded: tuple[list[str], list[torch.Tensor]] = ([], [])
        """The names of the last stream ``load`` took and their targets."""

    def targets(self, metas: Sequence[tuple[str, Any]]) -> list[torch.Tensor]:
        """The tensor each ``(name, tensor_or_meta)`` of an adapter stream is copied into (only
        shapes are read), injecting the LoRA layers at the first call."""
        modules = tuple(dict.fromkeys(split_adapter_name(name)[0] for name, _ in metas))
        rank = next(int(m.shape[0]) for n, m in metas if split_adapter_name(n)[1] == "lora_A")
        if self.rank is None:
            self._inject(modules, rank, [name for name, _ in metas])
        elif (modules, rank) != (self.modules, self.rank):
            raise ValueError(
                f"adapter refit of rank {rank} over {len(modules)} modules; the generator took "
                f"rank {self.rank} over {len(self.modules)} at its first adapter refit"
            )
        out = []
        for name, meta in metas:
            target = self._params.get(name)
            if target is None or target.shape != meta.shape:
                raise ValueError(f"adapter refit: {name!r} {tuple(meta.shape)} fits no LoRA layer")
            out.append(target)
        return out

    def _inject(self, modules: tuple[str, ...], rank: int, names: list[str]) -> None:
        """peft's layers on ``modules``, their A and B laid out in the order of ``names``
        (the stream's)."""
        from peft import LoraConfig, inject_adapter_in_model

        config = LoraConfig(r=rank, lora_alpha=rank, target_modules=list(modules), bias="none")
        inject_adapter_in_model(config, self.model, adapter_name=ADAPTER)
        self.model.requires_grad_(False)
        found = {}
        for module in modules:
            layer: Any = self.model.get_submodule(module)
            for kind in ("lora_A", "lora_B"):
                weight = getattr(layer, kind)[ADAPTER].weight
                found[f"base_model.model.{module}.{kind}.weight"] = weight
        self._params = {name: found[name] for name in names if name in found}
        self._params.update(found)  # any the stream did not name (targets() then refuses it)
        params = list(self._params.values())
        pack_parameters(params, params[0].device)
        self.rank, self.modules = rank, modules

    @torch.no_grad()
    def load(self, stream: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy a whole adapter stream into the LoRA layers (injecting them the first time), in
        as few copies as the two layouts allow: a ``PackedStream`` laid out as these layers
        (``trainer.lora.Adapters.scaled_copy`` in this process) in one, looked at once per
        layout; any other stream by ``copy_tensors`` (one copy per run of tensors that lie back
        to back in this order)."""
        if isinstance(stream, PackedStream) and self.rank is not None:
            flat = self._packed.target(list(self._params), list(self._params.values()), stream)
            if flat is not None:
                stream.write_into(flat)
                return
        items = list(stream)
        names = [name for name, _ in items]
        if names != self._loaded[0]:  # another stream than the last: look its targets up
            self._loaded = (names, self.targets(items))
        copy_tensors(self._loaded[1], [tensor for _, tensor in items])
