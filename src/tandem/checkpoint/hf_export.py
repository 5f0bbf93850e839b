"""Export of a weight stream as a Hugging Face model folder (transformers and vLLM load it):
config.json, safetensors files (with an index when there are several), and every tokenizer
and generation file of the source folder."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from tandem.checkpoint.state import ONE_RANK, Ranks
from tandem.files import atomic_dir

SHARD_BYTES = 4 * 2**30
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
REGENERATED = ("config.json", "model.safetensors.index.json", "pytorch_model.bin.index.json")


def _write_weights(weights: Iterable[tuple[str, torch.Tensor]], folder: Path | None) -> None:
    """Streams the weights into files of at most ~SHARD_BYTES. Every rank takes part in the
    gathers behind ``weights``; only rank 0 (``folder`` set) has anything to write."""
    files: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in weights:
        if folder is None:
            continue
        nbytes = tensor.numel() * tensor.element_size()
        if files[-1] and size + nbytes > SHARD_BYTES:
            _save_part(files[-1], folder, len(files))
            files.append({})
            size = 0
        files[-1][name] = tensor.detach().cpu().contiguous()
        size += nbytes
    if folder is None:
        return
    if len(files) == 1:
        save_file(files[0], str(folder / "model.safetensors"), metadata={"format": "pt"})
        return
    _save_part(files[-1], folder, len(files))
    weight_map: dict[str, str] = {}
    for index, part in enumerate(files, start=1):
        final = f"model-{index:05d}-of-{len(files):05d}.safetensors"
        os.replace(folder / f"part-{index}.safetensors", folder / final)
        weight_map.update(dict.fromkeys(part, final))
    index_json = {"metadata": {}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index_json, indent=2))


def _save_part(part: dict[str, torch.Tensor], folder: Path, index: int) -> None:
    save_file(part, str(folder / f"part-{index}.safetensors"), metadata={"format": "pt"})
    for name in part:  # keep the names for the index, free the host memory
        part[name] = torch.empty(0)


def export_hf(
    path: Path,
    weights: Iterable[tuple[str, torch.Tensor]],
    config: Any,
    source_dir: Path,
    ranks: Ranks = ONE_RANK,
) -> None:
    """Writes ``path`` atomically (``files.atomic_dir``): the ``weights`` stream (Hugging Face
    names, full tensors), ``config`` (a transformers config, as it should be saved) and the
    other files of ``source_dir`` (tokenizer, generation config; not its weights). A
    collective when ``ranks`` is: every rank iterates ``weights``, rank 0 writes."""
    staging = atomic_dir(path) if ranks.rank == 0 else contextlib.nullcontext(None)
    with staging as tmp:
        _write_weights(weights, tmp)
        if tmp is not None:
            config.save_pretrained(tmp)
            for item in source_dir.iterdir():
                weight_file = item.name.endswith(WEIGHT_SUFFIXES)
                if item.is_file() and not weight_file and item.name not in REGENERATED:
                    shutil.copy2(item, tmp / item.name)
    ranks.barrier()


ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")


def export_adapter(
    path: Path,
    tensors: Iterable[tuple[str, torch.Tensor]],
    adapter_config: Any,
    source_dir: Path,
    ranks: Ranks = ONE_RANK,
) -> None:
    """Writes ``path`` atomically as a peft adapter folder: ``tensors`` (peft's saved names) in
    adapter_model.safetensors, ``adapter_config`` (a ``peft.LoraConfig``) as
    adapter_config.json, and the tokenizer files of ``source_dir``. A collective when ``ranks``
    is: every rank iterates ``tensors``, rank 0 writes."""
    staging = atomic_dir(path) if ranks.rank == 0 else contextlib.nullcontext(None)
    with staging as tmp:
        weights = {name: tensor.detach().cpu().contiguous() for name, tensor in tensors}
        if tmp is not None:
            save_file(weights, str(tmp / ADAPTER_FILES[1]), metadata={"format": "pt"})
            adapter_config.save_pretrained(str(tmp))
            for item in source_dir.iterdir():
                tokenizer_file = item.name.startswith(
                    ("tokenizer", "special_tokens", "vocab", "merges", "chat_template")
                )
                if item.is_file() and tokenizer_file and not item.name.endswith(WEIGHT_SUFFIXES):
                    shutil.copy2(item, tmp / item.name)
    ranks.barrier()
