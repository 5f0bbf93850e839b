"""The trainer's side of the refit (``trainer.refit.WeightSource``): what it sends, live or
streamed, FP8 or not, to a receiver in this process (a thread plays the trainer)."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch
from test_trainer_support import make_batch, policy, token_nll, write_tiny_qwen2

from tandem.config.models import RefitConfig
from tandem.quant import quantize_weight_stream
from tandem.trainer import PolicyTrainer
from tandem.trainer.refit import WeightSource
from tandem.weight_sync import make_receiver
from tandem.weight_sync.buckets import flat_bytes

REFIT = RefitConfig(transport="colocated", bucket_bytes=2**16)


@pytest.fixture(scope="module")
def trainer(tmp_path_factory: pytest.TempPathFactory) -> PolicyTrainer:
    model_dir = write_tiny_qwen2(tmp_path_factory.mktemp("tiny"), tied=False)
    trainer = PolicyTrainer(policy(model_dir))
    trainer.train(make_batch(), token_nll)
    return trainer


def _refit(source: WeightSource) -> tuple[Any, dict[str, torch.Tensor], dict[str, float]]:
    """One refit of ``source`` into fresh tensors: (spec, received, the sender's stats)."""
    spec = source.prepare()
    assert spec is not None  # rank 0
    stats: dict[str, Any] = {}
    thread = threading.Thread(target=lambda: stats.update(source.send()))
    thread.start()
    received = {name: tensor.clone() for name, tensor in make_receiver(spec, "cpu").iter_weights()}
    thread.join(timeout=60)
    return spec, received, stats


def test_a_one_rank_trainer_sends_its_parameters_live(trainer: PolicyTrainer) -> None:
    source = WeightSource(trainer, REFIT, num_receivers=1, host="127.0.0.2")
    assert source.live()  # one rank, on its device: the parameters themselves
    for _ in range(2):  # the second refit reuses the sender and its plan
        spec, received, stats = _refit(source)
        assert spec.store_host == "127.0.0.2"  # where the generators reach this node
        assert len(spec.plan.buckets) > 3 and stats["bytes"] == spec.plan.total_bytes
        expected = dict(trainer.iter_weights())
        assert list(received) == list(expected)
        for name, tensor in expected.items():
            assert torch.equal(flat_bytes(received[name]), flat_bytes(tensor)), name
        trainer.train(make_batch(1), token_nll)  # new weights, same tensors
    source.close()


def test_fp8_streams_quantised_copies(trainer: PolicyTrainer) -> None:
    source = WeightSource(trainer, REFIT, precision="fp8")
    assert not source.live()  # quantisation makes new tensors
    spec, received, _ = _refit(source)
    expected = dict(quantize_weight_stream(trainer.iter_weights()))
    assert list(received) == list(expected) == [meta.name for meta in spec.plan.tensors]
    assert any(t.dtype == torch.float8_e4m3fn for t in received.values())
    for name, tensor in expected.items():
        assert torch.equal(flat_bytes(received[name]), flat_bytes(tensor)), name
    source.close()
    with pytest.raises(RuntimeError, match="prepare"):
        WeightSource(trainer, REFIT).send()


def test_a_cast_to_the_generators_dtype_is_streamed(trainer: PolicyTrainer) -> None:
    source = WeightSource(trainer, REFIT, dtype=torch.bfloat16)
    assert not source.live()  # the cast makes new tensors
    _, received, stats = _refit(source)
    expected = dict(trainer.iter_weights(torch.bfloat16))
    assert stats["in_place_bytes"] == 0 and list(received) == list(expected)
    for name, tensor in expected.items():
        assert received[name].dtype == torch.bfloat16 and torch.equal(received[name], tensor)
    source.close()
