"""LoRA end to end on CPU with real peft and the transformers generator: what the optimizer
holds, the reference with adapters disabled, adapter-only refits (bytes in proportion to the
rank) and merged ones, generator/trainer agreement after either, resume, export, bad inputs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from lora_support import (
    MERGED_ATOL,
    PARITY_ATOL,
    logprob_gap,
    lora_policy,
    model_logprobs,
    refit,
    stream_bytes,
    train_batch,
    trainer_worker,
)

from tandem.adapters import is_adapter_name
from tandem.algorithms.losses import nll_loss
from tandem.assets import DEFAULT_MODEL_DIR
from tandem.cli import main
from tandem.cluster.actors import GeneratorWorker
from tandem.config import GrpoConfig
from tandem.config.models import GenerationConfig, PolicyConfig
from tandem.trainer import PolicyTrainer
from tandem.trainer.offload import move_state, offload_bytes

HF = GenerationConfig(backend="hf")


def test_the_optimizer_holds_the_adapters_and_the_base_stays_frozen() -> None:
    trainer = trainer_worker(lora_policy(rank=4), HF, steps=0).policy
    assert trainer.optimizer is not None
    held = {id(p) for group in trainer.optimizer.param_groups for p in group["params"]}
    named = dict(trainer.lm.named_parameters())
    assert held == {id(p) for name, p in named.items() if ".lora_" in name}
    base = {name: p.detach().clone() for name, p in named.items() if ".lora_" not in name}
    for _ in range(2):
        trainer.train(train_batch(), nll_loss)
    assert all(torch.equal(named[name], value) for name, value in base.items())
    assert any(not torch.equal(p, 0 * p) for n, p in named.items() if ".lora_B" in n)


def test_reference_logprobs_are_the_base_models_with_no_second_copy() -> None:
    worker = trainer_worker(lora_policy(), HF, with_reference=True)
    assert worker.reference is None
    base = PolicyTrainer(PolicyConfig(), trainable=False)
    batch = train_batch()
    reference = worker.reference_logprobs(batch)
    assert torch.allclose(reference, base.logprobs(batch), atol=1e-6, rtol=0)
    assert (worker.logprobs(batch) - reference).abs().max() > 0.1  # the adapters do move it


def test_an_adapter_refit_sends_bytes_in_proportion_to_the_rank() -> None:
    sizes = {}
    for rank in (4, 8, 16):
        sent, names = stream_bytes(trainer_worker(lora_policy(rank), HF, steps=0))
        assert names and all(is_adapter_name(name) for name in names)
        sizes[rank] = sent
    assert sizes[8] == 2 * sizes[4] and sizes[16] == 4 * sizes[4]
    merged, names = stream_bytes(trainer_worker(lora_policy(4), HF, "merged", steps=0))
    assert not any(is_adapter_name(name) for name in names)
    full = sum(
        p.numel() * 4 for p in PolicyTrainer(PolicyConfig(), trainable=False).lm.parameters()
    )
    assert merged == full  # fp32, the tied LM head left out as the embedding's alias
    assert sizes[16] < 0.25 * merged


@pytest.mark.parametrize(
    ("mode", "transport"),
    # each refit mode, each way to move it (the modes' payloads differ, not their transports)
    [("adapter", False), ("merged", True)],
    ids=["adapter-copy", "merged-colocated"],
)
def test_hf_generator_agrees_with_the_trainer_after_a_refit(mode: str, transport: bool) -> None:
    trainer = trainer_worker(lora_policy(), HF, mode)  # type: ignore[arg-type]
    generator = GeneratorWorker(HF, str(DEFAULT_MODEL_DIR))
    atol = PARITY_ATOL if mode == "adapter" else MERGED_ATOL
    before = logprob_gap(trainer, generator)
    refit(trainer, generator, 1, transport)
    assert before > 0.1 and logprob_gap(trainer, generator) <= atol
    trainer.train(train_batch(), nll_loss)  # a second refit of the same plan
    refit(trainer, generator, 2, transport)
    assert logprob_gap(trainer, generator) <= atol


def test_resume_continues_bit_for_bit_from_adapters_and_optimizer(tmp_path: Path) -> None:
    straight = trainer_worker(lora_policy(), HF).policy
    straight.save_checkpoint(tmp_path / "ckpt")
    from torch.distributed.checkpoint import FileSystemReader

    saved = FileSystemReader(str(tmp_path / "ckpt" / "shards")).read_metadata()
    model_keys = [k for k in saved.state_dict_metadata if k.startswith("model.")]
    assert model_keys and all(".lora_" in key for key in model_keys)  # no base weight
    resumed = PolicyTrainer(lora_policy())
    resumed.load_checkpoint(tmp_path / "ckpt")
    batch = train_batch()
    assert torch.equal(straight.logprobs(batch), resumed.logprobs(batch))
    assert straight.train(batch, nll_loss) == resumed.train(batch, nll_loss)
    for (name, x), (_, y) in zip(straight.iter_adapter(), resumed.iter_adapter(), strict=True):
        assert torch.equal(x, y), name


def test_export_loads_with_peft_and_merged_with_transformers(tmp_path: Path) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    trainer = trainer_worker(lora_policy(), HF).policy
    trainer.export_hf(tmp_path / "adapter")
    trainer.export_hf(tmp_path / "merged", merged=True)
    assert (tmp_path / "adapter" / "adapter_config.json").is_file()
    assert not (tmp_path / "adapter" / "model.safetensors").exists()
    batch = train_batch()
    ours = trainer.logprobs(batch)
    base = AutoModelForCausalLM.from_pretrained(str(DEFAULT_MODEL_DIR))
    adapted = PeftModel.from_pretrained(base, str(tmp_path / "adapter"))
    merged = AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged"))
    for model in (adapted, merged):
        assert (model_logprobs(model, batch) - ours).abs().max() <= PARITY_ATOL


def _cli_error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("error:") == 1, err
    return err


def test_bad_lora_inputs_exit_2_with_one_message(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = ["grpo", "-c", "grpo_arithmetic_lora", f"logging.run_dir={tmp_path}"]
    assert "rank" in _cli_error([*run, "policy.lora.rank=0"], capsys)
    err = _cli_error([*run, "policy.lora.target_modules=[q_proj,qq_proj]"], capsys)
    assert "qq_proj" in err and "q_proj" in err
    err = _cli_error([*run, "generation.precision=fp8"], capsys)
    assert "refit.lora=merged" in err
    # a rank above the narrowest adapted projection (the embedded model's k_proj: 64 outputs)
    # would allocate adapters out of all proportion (rank 100000 took 24 GB of host memory
    # before the kernel killed the run); a rank of that width itself is fine (checked below)
    err = _cli_error([*run, "policy.lora.rank=65"], capsys)
    assert "policy.lora.rank=65" in err and "k_proj" in err and "<= 64" in err
    assert "target_modules" in _cli_error([*run, "policy.lora.target_modules=[]"], capsys)
    assert not list(tmp_path.iterdir())  # refused before any run folder, Ray or worker


def test_rank_is_checked_against_the_narrowest_projection_it_adapts() -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    from tandem.config.lora import LoraConfig
    from tandem.trainer.lora import check_targets

    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(DEFAULT_MODEL_DIR))
    check_targets(LoraConfig(rank=64), skeleton)  # k_proj: 128 -> 64, a rank of its width
    check_targets(LoraConfig(rank=65, target_modules=["up_proj"]), skeleton)  # 128 -> 384
    with pytest.raises(ValueError, match=r"rank=129 exceeds the width of up_proj .*<= 128"):
        check_targets(LoraConfig(rank=129, target_modules=["up_proj"]), skeleton)


def test_merged_refits_need_no_adapter_support() -> None:
    config = GrpoConfig.model_validate(
        {"policy": {"lora": {}}, "generation": {"precision": "fp8"}, "refit": {"lora": "merged"}}
    )
    assert config.generation.max_lora_rank is None
    config = GrpoConfig.model_validate({"policy": {"lora": {"rank": 24}}})
    assert config.generation.max_lora_rank == 24


def test_adapter_refits_keep_the_generators_base_weights_through_a_sleep() -> None:
    """A deep sleep (generation.sleep_level=2, the default) drops a generator's weights for the
    next refit to bring back; adapter refits bring the adapters only, so with LoRA a sleeping
    generator keeps its base weights: level 1 by default, and 2 asked for is refused."""
    assert GrpoConfig.model_validate({}).generation.sleep_level == 2
    config = GrpoConfig.model_validate({"policy": {"lora": {}}})
    assert config.generation.sleep_level == 1
    merged = GrpoConfig.model_validate({"policy": {"lora": {}}, "refit": {"lora": "merged"}})
    assert merged.generation.sleep_level == 2  # full weights come with every refit
    with pytest.raises(ValueError, match="base weights would never come back"):
        GrpoConfig.model_validate({"policy": {"lora": {}}, "generation": {"sleep_level": 2}})


def _fsdp_rank(rank: int, world_size: int, out: str) -> None:
    """Trains the LoRA policy sharded over ``world_size`` gloo ranks (each its half of the
    batch: the gradients agree with one rank's to float rounding, which Adam scales by up to
    lr / eps = 20, hence 1e-5 below); rank 0 saves both refit streams and a checkpoint."""
    trainer = PolicyTrainer(lora_policy(), rank=rank, world_size=world_size)
    assert trainer.uses_fsdp
    batch = train_batch()
    shard = batch.select(slice(rank * 2, rank * 2 + 2))
    for _ in range(2):
        trainer.train(shard, nll_loss)
    adapter = dict(trainer.iter_adapter())
    merged = dict(trainer.iter_weights())
    trainer.save_checkpoint(Path(out) / "ckpt")
    if rank == 0:
        torch.save({"adapter": adapter, "merged": merged}, Path(out) / "streams.pt")


def test_fsdp2_shards_the_wrapped_model_and_trains_like_one_rank(tmp_path: Path) -> None:
    from test_trainer_support import spawn

    spawn(_fsdp_rank, 2, str(tmp_path))
    sharded = torch.load(tmp_path / "streams.pt", weights_only=True)
    one = PolicyTrainer(lora_policy())
    for _ in range(2):
        one.train(train_batch(), nll_loss)
    for name, tensor in one.iter_adapter():
        assert torch.allclose(sharded["adapter"][name], tensor, atol=1e-5), name
    for name, tensor in one.iter_weights():
        assert torch.allclose(sharded["merged"][name], tensor, atol=1e-5), name
    resumed = PolicyTrainer(lora_policy())  # a 2-rank checkpoint resumes on one rank
    resumed.load_checkpoint(tmp_path / "ckpt")
    for (name, x), (_, y) in zip(one.iter_adapter(), resumed.iter_adapter(), strict=True):
        assert torch.allclose(x, y, atol=1e-5), name


def test_offload_without_the_base_moves_adapters_gradients_and_optimizer_state_only() -> None:
    # the meta device stands in for a target that is not the host (as in test_offload.py)
    trainer = trainer_worker(lora_policy(offload_base=False), HF, steps=1).policy
    named = dict(trainer.lm.named_parameters())
    adapters = {name: p for name, p in named.items() if ".lora_" in name}
    frozen = {name: p for name, p in named.items() if ".lora_" not in name}
    batch = train_batch()
    logprobs, _ = trainer.model(batch.input_ids, batch.attention_mask)
    (-logprobs.sum()).backward()  # gradients exist, as between backward and step
    assert trainer.optimizer is not None
    moments = [v for s in trainer.optimizer.state.values() for v in s.values()]
    moved = offload_bytes(trainer.model, trainer.optimizer, trainable_only=True)
    adapter_bytes = sum(p.numel() * p.element_size() for p in adapters.values())
    assert 3 * adapter_bytes <= moved < 3 * adapter_bytes + 4096 * len(adapters)
    frozen_bytes = sum(p.numel() * p.element_size() for p in frozen.values())
    assert offload_bytes(trainer.model, trainer.optimizer) >= moved + frozen_bytes

    move_state(trainer.model, trainer.optimizer, torch.device("meta"), trainable_only=True)

    assert all(p.is_meta and p.grad is not None and p.grad.is_meta for p in adapters.values())
    assert all(m.is_meta for m in moments if m.dim() > 0 or m.device.type == "meta")
    assert all(not p.is_meta and p.grad is None for p in frozen.values())
    assert all(not b.is_meta for b in trainer.model.buffers())
    assert trainer._offloads_adapters_only
    assert not trainer_worker(lora_policy(), HF, steps=0).policy._offloads_adapters_only


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_activation_checkpointing_trains_the_adapters_alike(dropout: float) -> None:
    """Frozen embeddings give the first checkpointed layer no input that requires gradients;
    the adapters still train as without checkpointing (dropout: the recompute's masks)."""
    runs = []
    for checkpointing in (False, True):
        torch.manual_seed(0)
        config = lora_policy(dropout=dropout).model_copy(
            update={"activation_checkpointing": checkpointing}
        )
        trainer = PolicyTrainer(config)
        metrics = [trainer.train(train_batch(), nll_loss) for _ in range(2)]
        runs.append((metrics, dict(trainer.iter_adapter())))
    (plain_metrics, plain), (checkpointed_metrics, checkpointed) = runs
    assert plain_metrics == checkpointed_metrics
    assert plain.keys() == checkpointed.keys() and plain
    for name, tensor in plain.items():
        assert torch.equal(checkpointed[name], tensor), name
