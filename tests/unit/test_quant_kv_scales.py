"""KV-cache scale calibration (percentile, margin, RoPE bound, DP max) and vLLM naming."""

import json
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from transformers.models.qwen2.modeling_qwen2 import apply_rotary_pos_emb

from tandem.quant import (
    FP8_E4M3_MAX,
    KvScaleCalibrator,
    append_kv_scales,
    calibrate_kv_scales,
    kv_scale_names,
)

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def model() -> transformers.Qwen2ForCausalLM:
    torch.manual_seed(0)
    config = transformers.Qwen2Config(
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=300,
    )
    return transformers.Qwen2ForCausalLM(config).eval()


def batch(seed: int, size: tuple[int, int] = (2, 32)) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, 300, size, generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids}


def test_scales_are_positive_finite_per_layer(model: transformers.Qwen2ForCausalLM) -> None:
    scales = calibrate_kv_scales(model, [batch(0)])
    assert sorted(scales) == [0, 1]
    for per_kind in scales.values():
        assert sorted(per_kind) == ["k", "q", "v"]
        assert all(math.isfinite(s) and s > 0 for s in per_kind.values())


def test_margin_multiplies_and_percentile_orders(model: transformers.Qwen2ForCausalLM) -> None:
    plain = calibrate_kv_scales(model, [batch(0)], percentile=99.9, margin=1.0)
    padded = calibrate_kv_scales(model, [batch(0)], percentile=99.9, margin=1.25)
    median = calibrate_kv_scales(model, [batch(0)], percentile=50.0, margin=1.0)
    full = calibrate_kv_scales(model, [batch(0)], percentile=100.0, margin=1.0)
    for layer in plain:
        for kind in "qkv":
            assert padded[layer][kind] == pytest.approx(1.25 * plain[layer][kind], rel=1e-6)
            assert median[layer][kind] < plain[layer][kind] <= full[layer][kind]


def layer_inputs(
    model: transformers.Qwen2ForCausalLM, ids: torch.Tensor
) -> list[tuple[Any, torch.Tensor]]:
    """(layer, the normalised hidden states its q/k/v projections read), built independently."""
    with torch.no_grad():
        hidden = model(ids, output_hidden_states=True).hidden_states
        return [
            (layer, layer.input_layernorm(hidden[i])) for i, layer in enumerate(model.model.layers)
        ]


def test_percentile_100_is_the_observed_max(model: transformers.Qwen2ForCausalLM) -> None:
    ids = batch(3)["input_ids"]
    scales = calibrate_kv_scales(model, [{"input_ids": ids}], percentile=100.0, margin=1.0)
    with torch.no_grad():
        for i, (layer, x) in enumerate(layer_inputs(model, ids)):
            v_amax = layer.self_attn.v_proj(x).abs().max().item()
            assert scales[i]["v"] == pytest.approx(v_amax / FP8_E4M3_MAX, rel=1e-6)


def test_k_and_q_scales_bound_the_post_rope_values(model: transformers.Qwen2ForCausalLM) -> None:
    ids = batch(4, (2, 64))["input_ids"]
    scales = calibrate_kv_scales(model, [{"input_ids": ids}], percentile=100.0, margin=1.0)
    positions = torch.arange(ids.shape[1])[None].expand_as(ids)
    head_dim = 256 // 4
    with torch.no_grad():
        for i, (layer, x) in enumerate(layer_inputs(model, ids)):
            attn = layer.self_attn
            q = attn.q_proj(x).view(*ids.shape, -1, head_dim).transpose(1, 2)
            k = attn.k_proj(x).view(*ids.shape, -1, head_dim).transpose(1, 2)
            cos, sin = model.model.rotary_emb(x, positions)
            q_rot, k_rot = apply_rotary_pos_emb(q, k, cos, sin)
            for kind, rotated, raw in (("q", q_rot, q), ("k", k_rot, k)):
                bound = scales[i][kind] * FP8_E4M3_MAX
                assert rotated.abs().max() <= bound * (1 + 1e-6)
                assert raw.abs().max() <= bound * (1 + 1e-6)
                # A rotation leaves at least 1/sqrt(2) of a pair's norm on one element.
                assert rotated.abs().max() >= bound / math.sqrt(2) * (1 - 1e-6)


def test_several_calibration_batches_take_the_max(model: transformers.Qwen2ForCausalLM) -> None:
    first = calibrate_kv_scales(model, [batch(5)])
    second = calibrate_kv_scales(model, [batch(6)])
    both = calibrate_kv_scales(model, [batch(5), batch(6)])
    for layer in both:
        for kind in "qkv":
            expected = max(first[layer][kind], second[layer][kind])
            assert both[layer][kind] == pytest.approx(expected, rel=1e-6)


def test_subsampling_keeps_the_percentile_close(model: transformers.Qwen2ForCausalLM) -> None:
    exact = calibrate_kv_scales(model, [batch(7, (4, 64))], percentile=99.0)
    sampled = calibrate_kv_scales(model, [batch(7, (4, 64))], percentile=99.0, max_samples=4096)
    for layer in exact:
        for kind in "qkv":
            assert sampled[layer][kind] == pytest.approx(exact[layer][kind], rel=0.15)


def test_hooks_are_removed_and_misuse_raises(model: transformers.Qwen2ForCausalLM) -> None:
    def hook_counts() -> list[int]:
        return [len(m._forward_hooks) for m in model.modules()]

    before = hook_counts()  # transformers registers hooks of its own
    calibrator = KvScaleCalibrator(model)
    with pytest.raises(RuntimeError, match="after"):
        _ = calibrator.scales
    with pytest.raises(ValueError, match="no forward pass"), calibrator:
        assert sum(hook_counts()) == sum(before) + 3 * 2  # q/k/v of two layers
    assert hook_counts() == before
    with pytest.raises(ValueError, match="percentile"):
        KvScaleCalibrator(model, percentile=0.0)
    with pytest.raises(ValueError, match="margin"):
        KvScaleCalibrator(model, margin=-1.0)
    with pytest.raises(ValueError, match="Qwen2/Llama"):
        KvScaleCalibrator(torch.nn.Linear(4, 4), head_dim=4)
    with pytest.raises(ValueError, match="head_dim"):
        KvScaleCalibrator(torch.nn.Linear(4, 4))


def test_data_parallel_ranks_agree_on_the_max(tmp_path: Path) -> None:
    """Two real gloo ranks with different data: both end with the max of their local scales."""
    script = textwrap.dedent(
        """
        import json, sys
        import torch, torch.distributed as dist
        from torch import nn
        from tandem.quant import calibrate_kv_scales

        rank, store, out = int(sys.argv[1]), sys.argv[2], sys.argv[3]

        class Attn(nn.Module):
            def __init__(self):
                super().__init__()
                self.q_proj, self.k_proj, self.v_proj = (nn.Linear(16, 16) for _ in range(3))

        class Layer(nn.Module):
            def __init__(self):
                super().__init__()
                self.self_attn = Attn()

        class Tiny(nn.Module):
            def __init__(self):
                super().__init__()
                self.layers = nn.ModuleList([Layer(), Layer()])
            def forward(self, x):
                for layer in self.layers:
                    a = layer.self_attn
                    x = x + a.q_proj(x) + a.k_proj(x) + a.v_proj(x)
                return x

        torch.manual_seed(0)
        model = Tiny()
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(rank)) * (rank + 1)
        data = [{"x": x}]
        local = calibrate_kv_scales(model, data, head_dim=8)
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
        reduced = calibrate_kv_scales(model, data, head_dim=8)
        dist.destroy_process_group()
        json.dump({"local": local, "reduced": reduced}, open(out, "w"))
        """
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    store = tmp_path / "store"
    outs = [tmp_path / f"rank{r}.json" for r in range(2)]
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", script, str(r), str(store), str(outs[r])], cwd=ROOT, env=env
        )
        for r in range(2)
    ]
    assert [p.wait(timeout=120) for p in procs] == [0, 0]
    results = [json.loads(out.read_text()) for out in outs]
    assert results[0]["reduced"] == results[1]["reduced"]
    for layer, per_kind in results[0]["reduced"].items():
        for kind, value in per_kind.items():
            expected = max(r["local"][layer][kind] for r in results)
            assert value == pytest.approx(expected, rel=1e-6)
            assert results[0]["local"][layer][kind] != results[1]["local"][layer][kind]


def test_kv_scale_names_are_vllms() -> None:
    flat = kv_scale_names({0: {"k": 0.5, "v": 0.25}, "model.layers.3": {"q": 1.0, "k": 2.0}})
    assert sorted(flat) == [
        "model.layers.0.self_attn.attn.k_scale",
        "model.layers.0.self_attn.attn.v_scale",
        "model.layers.3.self_attn.attn.k_scale",
        "model.layers.3.self_attn.attn.q_scale",
    ]
    scale = flat["model.layers.3.self_attn.attn.k_scale"]
    assert scale.dtype == torch.float32 and scale.shape == () and scale.item() == 2.0


@pytest.mark.parametrize(
    "key", ["layers.3", "model.layers.x", "model.layers.3.self_attn", "3", -1, True, 2.0]
)
def test_malformed_layer_keys_raise(key: object) -> None:
    with pytest.raises(ValueError, match="malformed layer key"):
        kv_scale_names({key: {"k": 1.0}})  # type: ignore[dict-item]


def test_bad_scale_values_raise() -> None:
    with pytest.raises(ValueError, match="twice"):
        kv_scale_names({3: {"k": 1.0}, "model.layers.3": {"v": 1.0}})
    with pytest.raises(ValueError, match="positive finite"):
        kv_scale_names({0: {"k": 0.0}})
    with pytest.raises(ValueError, match="positive finite"):
        kv_scale_names({0: {"v": float("nan")}})
    with pytest.raises(ValueError, match="subset"):
        kv_scale_names({0: {"kv": 1.0}})


def test_append_kv_scales_follows_the_stream() -> None:
    weights = [("model.norm.weight", torch.empty(8, device="meta"))]
    stream = append_kv_scales(iter(weights), {1: {"k": 0.1, "v": 0.2}}, device="meta")
    out = list(stream)
    assert [n for n, _ in out] == [
        "model.norm.weight",
        "model.layers.1.self_attn.attn.k_scale",
        "model.layers.1.self_attn.attn.v_scale",
    ]
    assert all(t.device.type == "meta" for _, t in out)
    with pytest.raises(ValueError, match="malformed"):
        append_kv_scales(iter(weights), {"bad": {"k": 1.0}})  # raises before iteration
