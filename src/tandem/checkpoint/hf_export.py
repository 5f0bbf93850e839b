"""Export of the trainer's weights as a Hugging Face model folder (transformers and vLLM load
it): config.json, safetensors files (with an index when there are several), and every tokenizer
and generation file of the source folder."""

from __future__ import annotations

import copy
import json
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from safetensors.torch import save_file

if TYPE_CHECKING:
    from tandem.trainer.policy_trainer import PolicyTrainer

SHARD_BYTES = 4 * 2**30
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
REGENERATED = ("config.json", "model.safetensors.index.json", "pytorch_model.bin.index.json")


def _write_weights(trainer: PolicyTrainer, folder: Path, dtype: torch.dtype | None) -> None:
    """Streams the gathered weights into files of at most ~SHARD_BYTES (all ranks take part in
    the gathers; only rank 0 has anything to write)."""
    files: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in trainer.iter_weights(dtype):
        nbytes = tensor.numel() * tensor.element_size()
        if files[-1] and size + nbytes > SHARD_BYTES:
            _save_part(files[-1], folder, len(files))
            files.append({})
            size = 0
        files[-1][name] = tensor.detach().cpu().contiguous()
        size += nbytes
    if trainer.rank != 0:
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


def export_hf(trainer: PolicyTrainer, path: Path, dtype: torch.dtype | None = None) -> None:
    """Writes ``path`` atomically (``<path>.tmp``, then a rename). A collective under FSDP2;
    rank 0 writes."""
    tmp = path.with_name(path.name + ".tmp")
    if trainer.rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    _write_weights(trainer, tmp, dtype)
    if trainer.rank == 0:
        config = copy.deepcopy(trainer.lm.config)
        config.use_cache = trainer.hf_use_cache
        if dtype is not None:
            config.dtype = dtype
        config.save_pretrained(tmp)
        source = Path(trainer.config.model_path)
        for item in source.iterdir():
            weights = item.name.endswith(WEIGHT_SUFFIXES)
            if item.is_file() and not weights and item.name not in REGENERATED:
                shutil.copy2(item, tmp / item.name)
        shutil.rmtree(path, ignore_errors=True)
        os.replace(tmp, path)
    if trainer.uses_fsdp and dist.is_initialized():
        dist.barrier()
