"""The Hugging Face <-> Megatron-core weight layouts (no megatron-core needed)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from transformers import Qwen2Config, Qwen2ForCausalLM

from tandem.assets import DEFAULT_MODEL_DIR
from tandem.trainer.megatron_weights import (
    DecoderShape,
    fuse_qkv,
    global_name,
    hf_metadata,
    hf_names,
    hf_to_megatron,
    megatron_shapes,
    megatron_to_hf,
    split_qkv,
    stage_name,
    tp_gather,
    tp_split,
)


def _random_qwen2(tied: bool) -> tuple[Qwen2Config, dict[str, torch.Tensor]]:
    config = Qwen2Config(
        vocab_size=37,
        hidden_size=24,
        intermediate_size=40,
        num_hidden_layers=2,
        num_attention_heads=6,
        num_key_value_heads=2,
        head_dim=4,
        tie_word_embeddings=tied,
    )
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    if tied:  # what save_pretrained writes: no lm_head for a tied model
        state.pop("lm_head.weight", None)
    return config, state


def _embedded() -> tuple[Qwen2Config, dict[str, torch.Tensor]]:
    config = Qwen2Config.from_pretrained(DEFAULT_MODEL_DIR)
    return config, load_file(DEFAULT_MODEL_DIR / "model.safetensors")


def _assert_round_trip(config: Qwen2Config, hf: dict[str, torch.Tensor], tp: int) -> None:
    shape = DecoderShape.from_hf(config, tensor_parallel=tp, divisible_by=4)
    mc = hf_to_megatron(hf, shape)
    assert mc["embedding.word_embeddings.weight"].shape[0] == shape.padded_vocab_size
    assert shape.padded_vocab_size % (4 * tp) == 0
    assert ("output_layer.weight" in mc) is not shape.tied
    # split over the ranks and gathered back: the same tensors
    gathered = {name: tp_gather(name, tp_split(name, t, tp)) for name, t in mc.items()}
    back = dict(megatron_to_hf(gathered, shape))
    assert sorted(back) == sorted(hf)
    assert sorted(back) == sorted(hf_names(shape, qkv_bias=True))
    # the streams' layout: every Megatron tensor's full shape, and the HF tensors made of
    # them in that order with their shapes
    layout = megatron_shapes(shape, qkv_bias=True)
    assert {name: tuple(t.shape) for name, t in mc.items()} == layout
    ordered = {name: mc[name] for name in layout}
    assert [(n, tuple(t.shape)) for n, t in megatron_to_hf(ordered, shape)] == hf_metadata(
        shape, qkv_bias=True
    )
    for name, tensor in hf.items():
        assert back[name].shape == tensor.shape, name
        assert torch.equal(back[name], tensor), name


@pytest.mark.parametrize("tp", [1, 2])
def test_round_trip_embedded_model(tp: int) -> None:
    config, hf = _embedded()
    assert config.num_key_value_heads < config.num_attention_heads
    _assert_round_trip(config, hf, tp)


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("tp", [1, 2])
def test_round_trip_random_gqa_qwen2(tied: bool, tp: int) -> None:
    config, hf = _random_qwen2(tied)
    _assert_round_trip(config, hf, tp)


def test_qkv_interleave_by_hand() -> None:
    # 4 query heads in 2 groups, head_dim 1: rows q0 q1 k0 v0 | q2 q3 k1 v1
    q = torch.tensor([[0.0], [1.0], [2.0], [3.0]])
    k = torch.tensor([[10.0], [11.0]])
    v = torch.tensor([[20.0], [21.0]])
    fused = fuse_qkv(q, k, v, num_groups=2, head_dim=1)
    assert fused.flatten().tolist() == [0.0, 1.0, 10.0, 20.0, 2.0, 3.0, 11.0, 21.0]
    # head_dim 2, one group (multi-query): q heads' rows, then k's, then v's
    q2, k2, v2 = torch.arange(4.0), torch.arange(10.0, 12.0), torch.arange(20.0, 22.0)
    assert fuse_qkv(q2, k2, v2, 1, 2).tolist() == [0, 1, 2, 3, 10, 11, 20, 21]
    back = split_qkv(fused, num_heads=4, num_groups=2, head_dim=1)
    assert all(torch.equal(a, b) for a, b in zip(back, (q, k, v), strict=True))


def test_qkv_layout_gives_hf_heads() -> None:
    """Megatron's view of linear_qkv's output ([.., g, (h/g + 2) * d], split into the group's
    queries, key, value) gives HF's q/k/v projections head for head."""
    heads, groups, head_dim, hidden = 6, 2, 4, 24
    _, hf = _random_qwen2(tied=False)
    prefix = "model.layers.0.self_attn."
    q, k, v = (hf[f"{prefix}{p}_proj.weight"] for p in "qkv")
    x = torch.randn(3, hidden)
    fused = fuse_qkv(q, k, v, groups, head_dim)
    mixed = (x @ fused.T).view(3, groups, (heads // groups + 2) * head_dim)
    mq, mk, mv = mixed.split([heads // groups * head_dim, head_dim, head_dim], dim=-1)
    torch.testing.assert_close(mq.reshape(3, heads, head_dim), (x @ q.T).view(3, heads, head_dim))
    torch.testing.assert_close(mk.reshape(3, groups, head_dim), (x @ k.T).view(3, groups, head_dim))
    torch.testing.assert_close(mv.reshape(3, groups, head_dim), (x @ v.T).view(3, groups, head_dim))


def test_tensor_parallel_mlp_equals_full() -> None:
    """Each rank's swiglu over its fc1 slice (chunked in two) through its fc2 columns, summed
    over ranks (the row-parallel all-reduce), is the full MLP: the fc1 split keeps gate and up
    rows paired."""
    _, hf = _random_qwen2(tied=False)
    shape = DecoderShape.from_hf(_random_qwen2(tied=False)[0])
    mc = hf_to_megatron(hf, shape)
    fc1, fc2 = (mc[f"decoder.layers.1.mlp.linear_fc{i}.weight"] for i in (1, 2))
    x = torch.randn(5, shape.hidden_size)
    gate, up = hf["model.layers.1.mlp.gate_proj.weight"], hf["model.layers.1.mlp.up_proj.weight"]
    full = (F.silu(x @ gate.T) * (x @ up.T)) @ hf["model.layers.1.mlp.down_proj.weight"].T
    shards1 = tp_split("decoder.layers.1.mlp.linear_fc1.weight", fc1, 4)
    shards2 = tp_split("decoder.layers.1.mlp.linear_fc2.weight", fc2, 4)
    total = torch.zeros_like(full)
    for w1, w2 in zip(shards1, shards2, strict=True):
        g, u = (x @ w1.T).chunk(2, dim=-1)
        total += (F.silu(g) * u) @ w2.T
    torch.testing.assert_close(total, full)


def test_split_refuses_uneven_and_stage_names() -> None:
    with pytest.raises(ValueError, match="does not split over 4 ranks"):
        tp_split("decoder.layers.0.self_attention.linear_proj.weight", torch.zeros(2, 6), 4)
    assert stage_name("decoder.layers.7.mlp.linear_fc2.weight", 4) == (
        "decoder.layers.3.mlp.linear_fc2.weight"
    )
    assert global_name("decoder.layers.3.input_layernorm.weight", 4) == (
        "decoder.layers.7.input_layernorm.weight"
    )
    assert stage_name("output_layer.weight", 4) == "output_layer.weight"


def test_pad_row_gets_no_gradient_from_the_lookup_as_in_hugging_face() -> None:
    """An embedding without ``padding_idx`` plus the hook: the values and gradients of
    ``nn.Embedding(..., padding_idx=pad)``, the pad row still learning as a tied output layer."""
    from tandem.trainer.megatron_weights import pad_row_without_input_grad

    torch.manual_seed(0)
    pad = 5
    hf = torch.nn.Embedding(8, 4, padding_idx=pad)
    with torch.no_grad():
        hf.weight[pad] = torch.randn(4)  # a trained pad row (HF only zeroes it at init)
    plain = torch.nn.Embedding(8, 4)
    plain.weight.data.copy_(hf.weight.data)
    pad_row_without_input_grad(plain, pad)
    ids = torch.tensor([[1, pad, 2, pad], [pad, 3, 3, 0]])
    target = torch.randn(2, 4, 4)
    grads = []
    for emb in (hf, plain):
        out = emb(ids)
        tied = out @ emb.weight.T  # the output layer's use of the same rows
        ((out - target).pow(2).sum() + tied.logsumexp(-1).sum()).backward()
        grads.append(emb.weight.grad)
    torch.testing.assert_close(hf(ids), plain(ids))
    torch.testing.assert_close(grads[0], grads[1])
    assert grads[1][pad].abs().sum() > 0  # the output side still reaches the pad row

    unhooked = torch.nn.Embedding(8, 4)
    unhooked.weight.data.copy_(hf.weight.data)
    (unhooked(ids) - target).pow(2).sum().backward()
    assert unhooked.weight.grad[pad].abs().sum() > 0  # what the hook takes away
