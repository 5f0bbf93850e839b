"""FSDP2 over 2 gloo ranks against one plain rank on the same global batch.

Tolerances: fp32 throughout; 2 ranks sum the same per-token terms in another order, so losses
agree to rel 1e-5 and weights after AdamW steps to 1e-5 absolute.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from test_trainer_support import make_batch, policy, spawn, token_nll, write_tiny_qwen2
from torch.distributed.tensor import DTensor

from tandem.trainer import PolicyTrainer, parallelize, policy_trainer
from tandem.trainer.offload import _fsdp_params, move_state

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from aten_calls import AtenCalls

# 7 rows: rank 0 gets 5 (3 micro-batches of 2), rank 1 gets 2 (1, padded with 2 fillers)
SHARDS = (slice(0, 5), slice(5, 7))


def _identity_after_move(trainer: PolicyTrainer) -> dict[str, Any]:
    """Moves every sharded tensor through the offload swap path to the meta device (on a GPU
    the target is the host; data cannot come back from meta, so this runs last) and reports
    whether the objects survived and their data really moved."""
    weight = trainer.lm.model.layers[0].self_attn.q_proj.weight
    assert trainer.optimizer is not None
    exp_avg = trainer.optimizer.state[weight]["exp_avg"]
    exp_avg_local = exp_avg._local_tensor
    inv_freq = trainer.lm.model.rotary_emb.inv_freq
    move_state(trainer.model, trainer.optimizer, torch.device("meta"))
    rotary = trainer.lm.model.rotary_emb
    return {
        "same_objects": trainer.lm.model.layers[0].self_attn.q_proj.weight is weight
        and trainer.optimizer.state[weight]["exp_avg"] is exp_avg
        and exp_avg._local_tensor is exp_avg_local
        and trainer.optimizer.param_groups[0]["params"][0] is next(trainer.model.parameters())
        and rotary.inv_freq is inv_freq,
        "moved": {t.device.type for t in (weight._local_tensor, exp_avg_local, inv_freq)}
        == {"meta"},
        # every shard and FSDP2's flat (padded) view of it: no copy stays on the old device
        "all_moved": all(p._local_tensor.is_meta for p in trainer.model.parameters())
        and all(fp._sharded_param_data.is_meta for fp in _fsdp_params(trainer.model)),
    }


def _rank(rank: int, world_size: int, model_dir: str, out: str) -> None:
    trainer = PolicyTrainer(policy(Path(model_dir), micro_batch_size=2), rank, world_size)
    shard = make_batch(size=7).select(SHARDS[rank])
    result: dict[str, Any] = {"logprobs": trainer.logprobs(shard)}
    # inference resharded the root: no full embedding / LM head stays resident
    result["sharded_after_logprobs"] = isinstance(trainer.lm.model.embed_tokens.weight, DTensor)
    result["first"] = trainer.train(shard, token_nll)
    result["second"] = trainer.train(shard, token_nll)
    result["weights"] = dict(trainer.iter_weights())
    result["live"] = trainer.streams_live_weights  # gathers: a refit must pack them
    trainer.save_checkpoint(Path(out) / "ckpt", extra={"data_position": 14})
    try:  # rank 1 gets no rows: every rank must raise rather than hang in a collective
        trainer.train(shard.select(slice(0, 1 - rank)), token_nll)
    except ValueError as error:
        result["empty_shard_error"] = str(error)
    result["swap"] = _identity_after_move(trainer)
    torch.save(result, Path(out) / f"rank{rank}.pt")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_qwen2(tmp_path_factory.mktemp("tiny"), tied=True)


@pytest.fixture(scope="module")
def two_ranks(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("fsdp")
    spawn(_rank, 2, str(model_dir), str(out))
    return out


@pytest.fixture(scope="module")
def one_rank(model_dir: Path) -> dict[str, Any]:
    trainer = PolicyTrainer(policy(model_dir, micro_batch_size=2))
    batch = make_batch(size=7)
    result: dict[str, Any] = {"logprobs": trainer.logprobs(batch)}
    result["first"] = trainer.train(batch, token_nll)
    result["second"] = trainer.train(batch, token_nll)
    # unsharded, iter_weights yields the live parameters: copy before training on
    result["weights"] = {name: t.clone() for name, t in trainer.iter_weights()}
    result["third"] = trainer.train(make_batch(seed=1, size=7), token_nll)["loss"]
    return result


def test_two_ranks_train_like_one(two_ranks: Path, one_rank: dict[str, Any]) -> None:
    rank0, rank1 = (torch.load(two_ranks / f"rank{r}.pt") for r in range(2))
    for step in ("first", "second"):
        for key in ("loss", "grad_norm", "num_tokens", "num_sequences", "lr", "tokens_seen"):
            assert rank0[step][key] == pytest.approx(one_rank[step][key], rel=1e-5), key
            assert rank1[step][key] == rank0[step][key], key  # every rank reports global sums
    assert rank1["weights"] == {}  # only rank 0 yields
    assert not rank0["live"] and not rank1["live"]
    assert rank0["weights"].keys() == one_rank["weights"].keys()
    assert "lm_head.weight" not in rank0["weights"]  # tied: loaders re-tie it
    for name, tensor in one_rank["weights"].items():
        assert torch.allclose(rank0["weights"][name], tensor, atol=1e-5, rtol=0), name


def test_an_empty_shard_fails_on_every_rank(two_ranks: Path) -> None:
    for rank in range(2):
        error = torch.load(two_ranks / f"rank{rank}.pt")["empty_shard_error"]
        assert "at least one sequence" in error


def test_logprobs_of_uneven_shards(two_ranks: Path, one_rank: dict[str, Any]) -> None:
    shards = [torch.load(two_ranks / f"rank{r}.pt")["logprobs"] for r in range(2)]
    assert [len(s) for s in shards] == [5, 2]
    assert torch.load(two_ranks / "rank0.pt")["sharded_after_logprobs"]
    assert torch.allclose(torch.cat(shards), one_rank["logprobs"], atol=1e-6, rtol=0)


def test_offload_swap_keeps_fsdp_tensor_identity(two_ranks: Path) -> None:
    for rank in range(2):
        swap = torch.load(two_ranks / f"rank{rank}.pt")["swap"]
        assert swap == {"same_objects": True, "moved": True, "all_moved": True}


def test_two_rank_checkpoint_resumes_on_one_rank(
    two_ranks: Path, one_rank: dict[str, Any], model_dir: Path
) -> None:
    assert not (two_ranks / "ckpt.tmp").exists()
    resumed = PolicyTrainer(policy(model_dir, micro_batch_size=2))
    assert resumed.load_checkpoint(two_ranks / "ckpt") == {"data_position": 14}
    assert resumed.step == 2
    saved = torch.load(two_ranks / "rank0.pt")["weights"]
    for name, tensor in resumed.iter_weights():
        assert torch.equal(tensor, saved[name]), name
    third = resumed.train(make_batch(seed=1, size=7), token_nll)["loss"]
    assert third == pytest.approx(one_rank["third"], rel=1e-5)


def _padded_rank(rank: int, world_size: int, out: str) -> None:
    """A 3-row weight over 2 ranks: rank 1's shard (1 row) is padded to 2 rows by FSDP2."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    module = torch.nn.Linear(5, 3)
    fully_shard(module, mesh=init_device_mesh("cpu", (world_size,)))
    (fsdp_param,) = [fp for fp in _fsdp_params(module) if fp.sharded_param is module.weight]
    local = module.weight._local_tensor
    before = local.clone()
    move_state(module, None, torch.device("meta"))
    moved_to_meta = module.weight._local_tensor is local and local.is_meta
    moved_to_meta &= fsdp_param._sharded_param_data.is_meta
    result = {
        "padded": fsdp_param._sharded_param_data.numel() > local.numel(),
        "moved": moved_to_meta,
        "shape": tuple(local.shape) == tuple(before.shape),
    }
    torch.save(result, Path(out) / f"padded{rank}.pt")


def test_offload_moves_padded_shards_whole(tmp_path: Path) -> None:
    spawn(_padded_rank, 2, str(tmp_path))
    results = [torch.load(tmp_path / f"padded{rank}.pt") for rank in range(2)]
    assert [r["padded"] for r in results] == [False, True]
    assert all(r["moved"] and r["shape"] for r in results)


def _one_rank_weights(rank: int, world_size: int, model_dir: str, out: str) -> None:
    """FSDP2 on a one-rank mesh (what mixed precision on one GPU builds): the weight stream."""
    trainer = PolicyTrainer(policy(Path(model_dir), mixed_precision=True), rank, world_size)
    trainer.train(make_batch(size=3), token_nll)
    locals_ = {name: p._local_tensor for name, p in trainer.lm.named_parameters()}
    streamed = dict(trainer.iter_weights())
    result = {
        "sharded": all(isinstance(p, DTensor) for p in trainer.lm.parameters()),
        # the stream yields the live shards themselves: no gather, no copy
        "no_copy": all(t.data_ptr() == locals_[name].data_ptr() for name, t in streamed.items()),
        "equal_to_gather": all(
            torch.equal(t, dict(trainer.lm.named_parameters())[name].full_tensor())
            for name, t in streamed.items()
        ),
        "names": sorted(streamed),
        "live": trainer.streams_live_weights,
    }
    move_state(trainer.model, trainer.optimizer, torch.device("meta"))  # as if offloaded
    result["live_when_offloaded"] = trainer.streams_live_weights
    torch.save(result, Path(out) / "one_rank_weights.pt")


def test_one_rank_fsdp_streams_its_shards_without_a_gather(model_dir: Path, tmp_path: Path) -> None:
    spawn(_one_rank_weights, 1, str(model_dir), str(tmp_path))
    result = torch.load(tmp_path / "one_rank_weights.pt")
    assert result["sharded"]
    assert result["no_copy"]
    assert result["equal_to_gather"]
    assert result["live"] and not result["live_when_offloaded"]
    assert "model.embed_tokens.weight" in result["names"]


def _gathered_or_not(rank: int, world_size: int, model_dir: str, out: str) -> None:
    """One rank, mixed precision and checkpointing, 4 micro-batches a step: the parameters kept
    gathered through a step (the default on one rank), then resharded after every forward and
    backward as on several ranks."""
    config = policy(
        Path(model_dir), mixed_precision=True, activation_checkpointing=True, micro_batch_size=2
    )
    results = {}
    for gathered in (True, False):
        if not gathered:
            parallelize.stays_gathered = policy_trainer.stays_gathered = lambda *_: False
        trainer = PolicyTrainer(config, rank, world_size)
        steps = [trainer.train(make_batch(seed=seed, size=7), token_nll) for seed in range(2)]
        with AtenCalls(data_only=False) as ops:
            trainer.train(make_batch(seed=2, size=7), token_nll)
        results[gathered] = {
            "steps": steps,
            "ops": ops.count,
            "resharded": all(isinstance(p, DTensor) for p in trainer.lm.parameters()),
            "logprobs": trainer.logprobs(make_batch(seed=3, size=7)),
            "weights": {name: t.clone() for name, t in trainer.iter_weights()},
        }
    torch.save(results, Path(out) / "gathered.pt")


def test_one_rank_keeps_its_parameters_gathered_through_a_step(
    model_dir: Path, tmp_path: Path
) -> None:
    spawn(_gathered_or_not, 1, str(model_dir), str(tmp_path))
    gathered, resharded = torch.load(tmp_path / "gathered.pt").values()
    assert gathered["steps"] == resharded["steps"]  # losses, grad norms: the same numbers
    assert torch.equal(gathered["logprobs"], resharded["logprobs"])
    for name, tensor in resharded["weights"].items():
        assert torch.equal(gathered["weights"][name], tensor), name
    assert gathered["resharded"] and resharded["resharded"]  # nothing stays gathered after it
    # no gather, cast, reduction a layer and micro-batch: fewer ops for the same step
    assert gathered["ops"] < resharded["ops"]


def _lone_rank_twice(rank: int, world_size: int, model_dir: str, out: str) -> None:
    """A lone FSDP2 rank with no MASTER_PORT in its environment, built again after its
    process group was destroyed (a notebook, a benchmark running several settings)."""
    import os

    os.environ.pop("MASTER_PORT")
    config = policy(Path(model_dir), mixed_precision=True)
    losses = []
    for _ in range(2):
        trainer = PolicyTrainer(config)
        losses.append(trainer.train(make_batch(size=3), token_nll)["loss"])
        torch.distributed.destroy_process_group()
    torch.save({"losses": losses, "port_set": "MASTER_PORT" in os.environ}, Path(out) / "l.pt")


def test_a_lone_rank_serves_a_new_store_each_time_it_starts(
    model_dir: Path, tmp_path: Path
) -> None:
    spawn(_lone_rank_twice, 1, str(model_dir), str(tmp_path))
    result = torch.load(tmp_path / "l.pt")
    assert result["losses"][0] == result["losses"][1]  # the same model, the same batch
    assert not result["port_set"]  # a free port of its own, not left for the next group


def test_only_a_model_small_beside_the_gpu_stays_gathered(monkeypatch: pytest.MonkeyPatch) -> None:
    """One rank keeps a compute-dtype copy gathered through the step only while it takes at
    most ``GATHERED_SHARE`` of the GPU (any size on a CPU; never with several ranks or CPU
    offload)."""
    from types import SimpleNamespace

    from tandem.config.models import PolicyConfig
    from tandem.trainer.parallelize import GATHERED_SHARE, stays_gathered

    model = torch.nn.Linear(1000, 1000)  # 1,001,000 parameters: 2.0 MB in bf16
    config = PolicyConfig(mixed_precision=True)
    cuda = torch.device("cuda", 0)

    def gpu(total: float) -> None:
        properties = SimpleNamespace(total_memory=int(total))
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda *_: properties)

    gpu(2_002_000 / GATHERED_SHARE)
    assert stays_gathered(config, 1, model, cuda)
    gpu(2_001_999 / GATHERED_SHARE)
    assert not stays_gathered(config, 1, model, cuda)
    assert stays_gathered(config, 1, model, torch.device("cpu"))
    assert not stays_gathered(config, 2, model, torch.device("cpu"))
    offload = PolicyConfig(mixed_precision=True, cpu_offload=True)
    assert not stays_gathered(offload, 1, model, torch.device("cpu"))


def _checkpointed_rank(rank: int, world_size: int, model_dir: str, out: str) -> None:
    config = policy(Path(model_dir), micro_batch_size=2, activation_checkpointing=True)
    trainer = PolicyTrainer(config, rank, world_size)
    shard = make_batch(size=7).select(SHARDS[rank])
    result = {"first": trainer.train(shard, token_nll), "second": trainer.train(shard, token_nll)}
    result["weights"] = dict(trainer.iter_weights())
    torch.save(result, Path(out) / f"checkpointed{rank}.pt")


def test_two_ranks_with_reentrant_checkpointing_train_like_one_plain_rank(
    model_dir: Path, one_rank: dict[str, Any], tmp_path: Path
) -> None:
    """Decoder layers under torch's reentrant checkpoint, resharded after every forward as on
    several ranks (FSDP2 gathers each layer again for the recomputation): the plain rank's
    steps and weights."""
    spawn(_checkpointed_rank, 2, str(model_dir), str(tmp_path))
    rank0 = torch.load(tmp_path / "checkpointed0.pt")
    for step in ("first", "second"):
        for key in ("loss", "grad_norm"):
            assert rank0[step][key] == pytest.approx(one_rank[step][key], rel=1e-5), key
    for name, tensor in one_rank["weights"].items():
        assert torch.allclose(rank0["weights"][name], tensor, atol=1e-5, rtol=0), name
