"""The trainer on image prompts: chunked logprobs with pixels against an unchunked forward of
each row alone, images that follow their rows through micro-batches and ranks, gradients that
reach the vision tower, and FSDP2 over 2 gloo ranks wrapping its blocks."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from test_trainer_support import spawn, token_nll

from tandem.assets import VISUAL_MODEL_DIR
from tandem.config.models import OptimizerConfig, PolicyConfig
from tandem.data.batch import TrainBatch, right_padded
from tandem.data.images import ImagePrompt, VisionProcessor
from tandem.data.visual import scenes
from tandem.trainer import PolicyTrainer


def _prompts(count: int) -> list[ImagePrompt]:
    from transformers import AutoTokenizer

    processor = VisionProcessor(VISUAL_MODEL_DIR, AutoTokenizer.from_pretrained(VISUAL_MODEL_DIR))
    return [processor("How many shapes?", [s.draw()]) for s in scenes(count, 5, held_out=False)]


def image_batch(count: int = 6) -> TrainBatch:
    """``count`` image prompts with responses of different lengths."""
    rows = [(p, [*b"123"[: 1 + i % 3], 256]) for i, p in enumerate(_prompts(count))]
    return right_padded(rows, pad_token_id=256)


def reference_logprobs(batch: TrainBatch) -> torch.Tensor:
    """Each row alone, unpadded, through transformers' own forward (its multimodal rotary
    positions) and a full log-softmax."""
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(VISUAL_MODEL_DIR).eval()
    assert batch.images is not None
    out = torch.zeros(batch.input_ids.shape)
    for row in range(batch.num_sequences):
        length = int(batch.attention_mask[row].sum())
        ids = batch.input_ids[row : row + 1, :length]
        images = batch.images.rows[row]
        assert images is not None
        with torch.no_grad():
            logits = model(  # its own multimodal positions, from the token types
                input_ids=ids,
                pixel_values=images.pixel_values,
                image_grid_thw=images.image_grid_thw,
                mm_token_type_ids=(ids == model.config.image_token_id).int(),
            ).logits.float()
        picked = logits[0, :-1].log_softmax(-1).gather(-1, ids[0, 1:, None])[:, 0]
        out[row, 1:length] = picked
    return out


def _config(**kwargs: Any) -> PolicyConfig:
    optimizer = OptimizerConfig(lr=1e-2, eps=1e-3)
    return PolicyConfig(model_path=VISUAL_MODEL_DIR, optimizer=optimizer, **kwargs)


@pytest.mark.parametrize("micro_batch_size", [1, 4, 6])
def test_chunked_logprobs_with_pixels_match_each_row_alone(micro_batch_size: int) -> None:
    batch = image_batch()
    trainer = PolicyTrainer(
        _config(micro_batch_size=micro_batch_size, logprob_chunk_size=3, packing=True)
    )
    got = trainer.logprobs(batch)
    assert (got - reference_logprobs(batch)).abs().max() <= 1e-5


def test_rows_keep_their_own_images() -> None:
    """Swapping two rows' images changes those rows' logprobs and no other's."""
    batch = image_batch(4)
    trainer = PolicyTrainer(_config(micro_batch_size=2))
    before = trainer.logprobs(batch)
    assert batch.images is not None
    index = batch.images.index
    index[0], index[3] = index[3], index[0]
    after = trainer.logprobs(batch)
    changed = ((after - before).abs() * batch.loss_mask).amax(-1) > 1e-4
    assert changed.tolist() == [True, False, False, True]


def test_training_moves_the_vision_tower() -> None:
    batch = image_batch(4)
    trainer = PolicyTrainer(_config(micro_batch_size=2))
    visual = trainer.lm.model.visual
    before = {n: p.detach().clone() for n, p in visual.named_parameters()}
    metrics = trainer.train(batch, token_nll)
    assert metrics["grad_norm"] > 0
    moved = [n for n, p in visual.named_parameters() if not torch.equal(p, before[n])]
    assert any(n.startswith("blocks.") for n in moved) and any("merger" in n for n in moved)
    names = [name for name, _ in trainer.iter_weights()]
    assert (
        "model.visual.merger.mlp.0.weight" in names
        and "model.visual.blocks.1.mlp.up_proj.weight" in names
    )


def test_activation_checkpointing_recomputes_the_vision_blocks_too() -> None:
    """Checkpointed decoder layers and vision blocks give the same loss and step, and the
    weights keep their Hugging Face names."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    batch = image_batch(4)
    plain = PolicyTrainer(_config(micro_batch_size=2))
    checkpointed = PolicyTrainer(_config(micro_batch_size=2, activation_checkpointing=True))
    blocks = checkpointed.lm.model.visual.blocks
    assert all(isinstance(block, CheckpointWrapper) for block in blocks)
    a, b = plain.train(batch, token_nll), checkpointed.train(batch, token_nll)
    assert b["loss"] == pytest.approx(a["loss"], abs=1e-6)
    assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-5)
    trained = dict(plain.iter_weights())
    for name, tensor in checkpointed.iter_weights():
        assert (trained[name] - tensor).abs().max() <= 1e-6, name


def test_checkpointed_vision_blocks_train_a_frozen_towers_adapters() -> None:
    """LoRA freezes the tower, so the blocks' inputs need not require gradients; the
    checkpointed blocks (torch's reentrant checkpoint) must still give the tower's adapters
    theirs: the same step as without checkpointing, and the tower's adapters moved."""
    from tandem.config.lora import LoraConfig

    batch = image_batch(4)
    lora = LoraConfig(rank=4, alpha=8, target_modules=("qkv", "q_proj", "v_proj"))

    def trained(checkpointing: bool) -> dict[str, torch.Tensor]:
        trainer = PolicyTrainer(
            _config(micro_batch_size=2, lora=lora, activation_checkpointing=checkpointing)
        )
        trainer.train(batch, token_nll)
        named = trainer.model.named_parameters()
        return {n.replace("_checkpoint_wrapped_module.", ""): p.detach().clone() for n, p in named}

    plain, checkpointed = trained(False), trained(True)
    tower = [n for n in plain if ".visual." in n and "lora_B" in n]
    assert tower and all(plain[n].abs().max() > 0 for n in tower)  # B starts at zero
    for name, tensor in checkpointed.items():
        assert (plain[name] - tensor).abs().max() <= 1e-6, name


def _rank(rank: int, world_size: int, out: str) -> None:
    from torch.distributed.fsdp import FSDPModule

    batch = image_batch(4)
    trainer = PolicyTrainer(_config(micro_batch_size=1), rank, world_size)
    visual = trainer.lm.model.visual
    wrapped = all(isinstance(b, FSDPModule) for b in visual.blocks) and isinstance(
        visual, FSDPModule
    )
    shard = batch.select(slice(0, 3) if rank == 0 else slice(3, 4))
    logprobs = trainer.logprobs(shard)
    trainer.train(shard, token_nll)
    weights = dict(trainer.iter_weights())
    if rank == 0:
        torch.save({"wrapped": wrapped, "logprobs": logprobs, "weights": weights}, out)


@pytest.mark.slow
def test_fsdp2_over_two_ranks_wraps_the_vision_blocks_and_trains_like_one(
    tmp_path: Path,
) -> None:
    out = tmp_path / "rank0.pt"
    spawn(_rank, 2, str(out))
    result = torch.load(out)
    assert result["wrapped"]
    batch = image_batch(4)
    single = PolicyTrainer(_config(micro_batch_size=1))
    assert (result["logprobs"] - single.logprobs(batch.select(slice(0, 3)))).abs().max() <= 1e-5
    single.train(batch, token_nll)
    for name, tensor in single.iter_weights():
        assert (result["weights"][name] - tensor).abs().max() <= 1e-5, name


def test_an_image_token_in_a_response_is_text() -> None:
    """A sampled response may hold the image or vision-start token: the row's images fill
    only its prompt's image tokens, so the forward runs and the prompt's logprobs are those of
    the same row with an ordinary response (the model is causal)."""
    prompts = _prompts(2)
    odd = right_padded([(p, [259, 257, 259, 256]) for p in prompts], pad_token_id=256)
    plain = right_padded([(p, [49, 50, 51, 256]) for p in prompts], pad_token_id=256)
    trainer = PolicyTrainer(_config(micro_batch_size=2))
    got, expected = trainer.logprobs(odd), trainer.logprobs(plain)
    width = len(prompts[0])
    assert torch.allclose(got[:, :width], expected[:, :width], atol=1e-6)
    assert bool(torch.isfinite(got).all()) and bool((got[:, width : width + 4] < 0).all())


def test_samples_of_one_prompt_share_their_positions(monkeypatch: pytest.MonkeyPatch) -> None:
    """The multimodal positions are computed once per distinct row (token types of the real
    tokens, images): two prompts of the same tokens and other images, three samples each of
    two lengths, are four rows for ``get_rope_index``; the logprobs stay each row's alone."""
    from transformers.models.qwen2_5_vl import modeling_qwen2_5_vl

    model_class = modeling_qwen2_5_vl.Qwen2_5_VLModel
    original = model_class.get_rope_index
    calls: list[int] = []

    def spy(self: Any, input_ids: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        calls.append(len(input_ids))
        return original(self, input_ids, *args, **kwargs)

    responses = [[49, 256], [49, 50, 256], [51, 256]]
    batch = right_padded([(p, r) for p in _prompts(2) for r in responses], pad_token_id=256)
    trainer = PolicyTrainer(_config(micro_batch_size=6))
    monkeypatch.setattr(model_class, "get_rope_index", spy)
    got = trainer.logprobs(batch)
    monkeypatch.undo()
    assert calls == [4]
    assert (got - reference_logprobs(batch)).abs().max() <= 1e-5


@pytest.mark.parametrize("mixed_precision", [False, True])
def test_the_tower_runs_once_per_distinct_image_under_fsdp_casts(mixed_precision: bool) -> None:
    """3 prompts x 4 samples in micro-batches of 8: the tower sees each micro-batch's distinct
    images once. Under mixed precision FSDP2 casts the forward's inputs by rebuilding every
    dataclass; sharing kept by object identity alone gave each row its own copy, and the tower
    ran once per row (16 images of 1024 patches a micro-batch in the 3B GPU profile, not 2)."""
    from torch.distributed.utils import _apply_to_tensors

    prompts = _prompts(3)
    rows = [(p, [*b"12", 256]) for p in prompts for _ in range(4)]
    batch = right_padded(rows, pad_token_id=256)
    assert batch.images is not None
    cast = _apply_to_tensors(lambda t: t.to(torch.bfloat16), batch.images)
    assert len({id(r) for r in cast.rows}) == 3 and cast.index == batch.images.index
    trainer = PolicyTrainer(_config(micro_batch_size=8, mixed_precision=mixed_precision))
    patches: list[int] = []
    tower = trainer.lm.model.visual
    tower.register_forward_pre_hook(lambda module, args: patches.append(args[0].shape[0]))
    trainer.train(batch, token_nll)
    expected = []
    for mb, _ in trainer._micro_batches(batch):
        assert mb.batch.images is not None
        expected.append(sum(d.pixel_values.shape[0] for d in mb.batch.images.distinct))
    assert patches == expected
    assert sum(expected) < sum(r.pixel_values.shape[0] for r in batch.images.rows)
