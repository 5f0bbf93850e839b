"""Offload/onload on CPU: the swap path keeps every tensor object (parameters, tied weights,
gradients, buffers and their aliases, optimizer state and its parameter references). The device
move itself is tested on a GPU in tests/gpu/test_offload_gpu.py; here the meta device stands in
as a target that is not the host, and offload/onload between CPU steps must change nothing."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_trainer_support import make_batch, policy, token_nll, write_tiny_qwen2
from torch import nn

from tandem.trainer import PolicyTrainer
from tandem.trainer.offload import move_state


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_qwen2(tmp_path_factory.mktemp("tiny"), tied=True)


def test_move_keeps_every_tensor_object(model_dir: Path) -> None:
    trainer = PolicyTrainer(policy(model_dir))
    trainer.train(make_batch(), token_nll)
    batch = make_batch(1)
    logprobs, _ = trainer.model(batch.input_ids, batch.attention_mask)
    (-logprobs.sum()).backward()  # gradients exist, as between backward and step
    lm, optimizer = trainer.lm, trainer.optimizer
    assert optimizer is not None
    weight = lm.model.layers[0].self_attn.q_proj.weight
    grad = weight.grad
    embedding = lm.model.embed_tokens.weight
    rotary = lm.model.rotary_emb
    buffers = (rotary.inv_freq, rotary.original_inv_freq)
    state = optimizer.state[weight]
    moments = (state["exp_avg"], state["exp_avg_sq"])
    step = state["step"]
    params = list(optimizer.param_groups[0]["params"])

    move_state(trainer.model, optimizer, torch.device("meta"))

    assert lm.model.layers[0].self_attn.q_proj.weight is weight and weight.is_meta
    assert weight.grad is grad and grad is not None and grad.is_meta
    assert lm.lm_head.weight is embedding is lm.model.embed_tokens.weight and embedding.is_meta
    assert (rotary.inv_freq, rotary.original_inv_freq) == buffers  # same objects
    assert all(b.is_meta for b in buffers)
    assert optimizer.state[weight]["exp_avg"] is moments[0] and moments[0].is_meta
    assert optimizer.state[weight]["exp_avg_sq"] is moments[1] and moments[1].is_meta
    assert optimizer.param_groups[0]["fused"]  # its step counter lives beside the parameter
    assert state["step"] is step and step.is_meta  # so it moves with it
    assert all(a is b for a, b in zip(params, trainer.model.parameters(), strict=True))
    assert all(p.is_meta for p in trainer.model.parameters())


def test_offload_and_onload_between_steps_change_nothing(model_dir: Path) -> None:
    straight, cycled = PolicyTrainer(policy(model_dir)), PolicyTrainer(policy(model_dir))
    weight = cycled.lm.model.layers[0].self_attn.q_proj.weight
    for seed in range(3):
        cycled.offload()
        cycled.onload()
        a, b = (
            straight.train(make_batch(seed), token_nll),
            cycled.train(make_batch(seed), token_nll),
        )
        assert a == b
    assert cycled.lm.model.layers[0].self_attn.q_proj.weight is weight
    for (name, x), (_, y) in zip(straight.iter_weights(), cycled.iter_weights(), strict=True):
        assert torch.equal(x, y), name


def test_an_offload_of_the_optimizer_state_alone_leaves_the_weights(model_dir: Path) -> None:
    """``policy.offload_weights=false``: the AdamW moments (and a fused step counter) move, the
    weights, gradients and buffers stay; the pool is sized for the moments alone, and offload /
    onload between steps change nothing."""
    from tandem.trainer.offload import HostPool, offload_bytes

    trainer = PolicyTrainer(policy(model_dir, offload_weights=False))
    before = offload_bytes(trainer.model, trainer.optimizer, weights=False)
    trained = sum(p.numel() * p.element_size() for p in trainer.model.parameters())
    assert (
        trained * 2
        <= before
        <= trained * 2 + 3 * HostPool.ALIGN * len(list(trainer.model.parameters()))
    )  # the two moments, before the first step created them
    trainer.train(make_batch(), token_nll)
    assert offload_bytes(trainer.model, trainer.optimizer, weights=False) < offload_bytes(
        trainer.model, trainer.optimizer
    )
    optimizer = trainer.optimizer
    assert optimizer is not None
    weight = trainer.lm.model.layers[0].self_attn.q_proj.weight
    moments = optimizer.state[weight]["exp_avg"], optimizer.state[weight]["exp_avg_sq"]

    # the weights on the meta device (the stand-in for a GPU) and their moments on the host,
    # as after such an offload: the onload brings the moments beside them, nothing else moves
    buffers = list(trainer.model.buffers())
    for param in trainer.model.parameters():
        torch.utils.swap_tensors(param, nn.Parameter(torch.empty_like(param, device="meta")))
    move_state(trainer.model, optimizer, torch.device("meta"), weights=False)
    assert all(m.is_meta for m in moments) and optimizer.state[weight]["exp_avg"] is moments[0]
    assert not any(b.is_meta for b in buffers)  # left where they were

    straight = PolicyTrainer(policy(model_dir))
    cycled = PolicyTrainer(policy(model_dir, offload_weights=False))
    for seed in range(2):
        cycled.offload()
        cycled.onload()
        assert straight.train(make_batch(seed), token_nll) == cycled.train(
            make_batch(seed), token_nll
        )


def test_offload_weights_false_needs_a_full_fsdp2_policy(model_dir: Path) -> None:
    from tandem.config.lora import LoraConfig

    with pytest.raises(ValueError, match=r"policy\.lora\.offload_base=false"):
        policy(model_dir, offload_weights=False, lora=LoraConfig(rank=4, alpha=8))
    with pytest.raises(ValueError, match=r"policy\.cpu_offload"):
        policy(model_dir, offload_weights=False, cpu_offload=True)
    with pytest.raises(ValueError, match=r"policy\.offload_weights=false \(an FSDP2 policy\)"):
        policy(model_dir, offload_weights=False, backend="megatron")
