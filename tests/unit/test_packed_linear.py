"""The CPU generator's oneDNN-packed linear layers (``generation/packed_linear.py``): which
layers are packed, the plain layers' outputs, and refits that the packed copies follow."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from tandem.assets import write_random_qwen2
from tandem.config.models import RefitConfig
from tandem.generation import SamplingParams, packed_linear
from tandem.generation.hf_generator import HfGenerator
from tandem.generation.packed_linear import PackedLinear
from tandem.weight_sync import make_sender, metadata_of

# MLP weights of 768 x 256 (0.75 MiB) are packed; attention and the LM head (0.25 MiB) are not
SHAPE = dict(
    hidden_size=256,
    intermediate_size=768,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
)
PARAMS = SamplingParams(temperature=1.0, max_tokens=12, n=4, seed=9)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_random_qwen2(tmp_path_factory.mktemp("wide"), SHAPE)


def _pair(model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[HfGenerator, HfGenerator]:
    packed = HfGenerator(model_dir)
    with monkeypatch.context() as patch:
        patch.setattr(packed_linear, "PACK_MIN_BYTES", 2**40)
        plain = HfGenerator(model_dir)
    return packed, plain


def _prompts(gen: HfGenerator) -> list[list[int]]:
    return [gen.tokenizer.encode(p, add_special_tokens=False) for p in ("17+25=", "3-1=", "9*9")]


def _same_samples(a: HfGenerator, b: HfGenerator) -> None:
    ids = _prompts(a)
    first, second = a.generate(ids, PARAMS), b.generate(ids, PARAMS)
    assert [r.response_token_ids for r in first] == [r.response_token_ids for r in second]
    assert max(len(r.response_token_ids) for r in first) > 4
    for x, y in zip(first, second, strict=True):
        assert x.response_logprobs == pytest.approx(y.response_logprobs, abs=1e-5)


def test_larger_linear_layers_are_packed_and_give_the_plain_layers_samples(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    packed, plain = _pair(model_dir, monkeypatch)
    names = {name for name, m in packed.model.named_modules() if isinstance(m, PackedLinear)}
    assert names == {
        f"model.layers.{i}.mlp.{proj}"
        for i in range(2)
        for proj in ("gate_proj", "up_proj", "down_proj")
    }
    assert not any(isinstance(m, PackedLinear) for m in plain.model.modules())
    assert isinstance(packed.model.model.layers[0].self_attn.q_proj, nn.Linear)
    # the parameters keep their names and their one allocation (refits copy runs of them)
    assert list(packed.model.state_dict()) == list(plain.model.state_dict())
    assert len({p.untyped_storage().data_ptr() for p in packed.model.parameters()}) == 1
    _same_samples(packed, plain)
    x = torch.randn(3, 5, 256)
    layer = packed.model.model.layers[1].mlp.up_proj
    with torch.no_grad():
        expected = nn.functional.linear(x, layer.weight, layer.bias)
        assert torch.allclose(layer(x), expected, atol=1e-5)


def test_packed_layers_follow_the_weights_a_refit_writes(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    packed, plain = _pair(model_dir, monkeypatch)
    original = load_file(str(model_dir / "model.safetensors"))
    original.pop("lm_head.weight", None)  # tied to the embedding
    before = packed.generate(_prompts(packed), PARAMS)
    torch.manual_seed(3)
    new = {k: v + 0.05 * torch.randn_like(v) for k, v in original.items()}
    packed.load_weights(iter(new.items()))
    plain.load_weights(iter(new.items()))
    _same_samples(packed, plain)
    after = packed.generate(_prompts(packed), PARAMS)
    assert [r.response_logprobs for r in after] != [r.response_logprobs for r in before]
    # through a refit's receiver (bucket copies into the parameters), back to the original
    sender = make_sender(RefitConfig(transport="colocated", bucket_bytes=2**18), "cpu")
    try:
        spec = sender.prepare(metadata_of(original.items()))
        trainer = threading.Thread(target=sender.send, args=(iter(original.items()),))
        trainer.start()
        packed.receive_weights(spec)
        trainer.join(timeout=60)
    finally:
        sender.close()
    plain.load_weights(iter(original.items()))
    _same_samples(packed, plain)


def test_lora_adapters_wrap_the_packed_layers_and_give_the_plain_layers_samples(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from peft.tuners.lora import LoraLayer

    packed, plain = _pair(model_dir, monkeypatch)
    before = packed.generate(_prompts(packed), PARAMS)
    torch.manual_seed(5)
    modules = [f"model.layers.{i}.mlp.{p}" for i in range(2) for p in ("up_proj", "down_proj")]
    adapters = {}
    for module in modules:
        linear = plain.model.get_submodule(module)
        prefix = f"base_model.model.{module}"
        adapters[f"{prefix}.lora_A.weight"] = 0.1 * torch.randn(8, linear.in_features)
        adapters[f"{prefix}.lora_B.weight"] = 0.1 * torch.randn(linear.out_features, 8)
    packed.load_weights(iter(adapters.items()))
    plain.load_weights(iter(adapters.items()))
    for module in modules:
        layer = packed.model.get_submodule(module)
        assert isinstance(layer, LoraLayer)
        assert isinstance(layer.get_base_layer(), PackedLinear)  # still oneDNN's product
    _same_samples(packed, plain)
    after = packed.generate(_prompts(packed), PARAMS)
    assert [r.response_logprobs for r in after] != [r.response_logprobs for r in before]
