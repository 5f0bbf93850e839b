"""Bad inputs to the ``tandem`` command, as a new user makes them: each one ends with exit
status 2, exactly one error message naming what to fix, and no traceback. All of them fail
before Ray or any actor starts (the cases that need a running generator are in
``tests/integration/test_bad_rewards.py``)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from tandem.assets import DEFAULT_MODEL_DIR
from tandem.cli import main
from tandem.cluster import ray_cluster

Setup = Callable[[Path], list[str]]
"""Builds whatever the case needs under a temp folder; returns the command's arguments."""


def _write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def _model_copy(tmp: Path, drop: tuple[str, ...] = ()) -> Path:
    folder = tmp / "model"
    shutil.copytree(DEFAULT_MODEL_DIR, folder)
    for name in drop:
        (folder / name).unlink()
    return folder


def _truncated_model(tmp: Path) -> list[str]:
    folder = _model_copy(tmp)
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    return ["grpo", f"policy.model_path={folder}"]


def _jsonl(tmp: Path, text: str, extra: tuple[str, ...] = ()) -> list[str]:
    path = _write(tmp / "train.jsonl", text)
    return ["grpo", "data.task=jsonl", f"data.train_path={path}", *extra]


GOOD_ROW = '{"question": "1+1=", "answer": "2"}\n'

CASES: dict[str, tuple[Setup, str]] = {
    # config: keys, types, bounds, recipes
    "unknown key": (lambda t: ["grpo", "policy.optimizer.lrr=1e-3"], "policy.optimizer.lrr"),
    "wrong type": (lambda t: ["grpo", "algorithm.num_steps=many"], "algorithm.num_steps"),
    "not an allowed value": (lambda t: ["grpo", "cluster.placement=sideways"], "'split'"),
    "top_k=0": (lambda t: ["grpo", "generation.sampling.top_k=0"], "top_k=0"),
    "clip_low>=1": (lambda t: ["grpo", "algorithm.clip_low=1.0"], "algorithm.clip_low"),
    "negative lr": (lambda t: ["grpo", "policy.optimizer.lr=-1"], "policy.optimizer.lr"),
    "a group of one": (  # was found at the first step, after the model loaded and evaluated
        lambda t: ["grpo", "algorithm.num_generations=1"],
        "algorithm.num_generations: Input should be greater than or equal to 2 (got 1)",
    ),
    "deep sleep with adapter refits": (
        lambda t: ["grpo", "--config", "grpo_arithmetic_lora", "generation.sleep_level=2"],
        "the base weights would never come back",
    ),
    "compile on megatron": (
        lambda t: ["grpo", "policy.backend=megatron", "policy.compile=true"],
        "policy.backend=megatron does not take policy.compile=true",
    ),
    "stochastic rounding of fp32 weights": (
        lambda t: ["grpo", "policy.optimizer.bf16_stochastic_round=true"],
        "needs policy.dtype=bfloat16 and policy.mixed_precision=false",
    ),
    "stochastic rounding in a process without torchao": (
        lambda t: [
            "grpo",
            "policy.dtype=bfloat16",
            "policy.optimizer.bf16_stochastic_round=true",
            "cluster.runtime=in_process",
        ],
        "torchao in this interpreter for policy.optimizer.bf16_stochastic_round",
    ),
    "top_p=0": (lambda t: ["grpo", "generation.sampling.top_p=0"], "sampling.top_p"),
    "no generations": (lambda t: ["grpo", "algorithm.num_generations=0"], "num_generations"),
    "negative temperature": (lambda t: ["grpo", "generation.sampling.temperature=-1"], "temp"),
    "dual clip <= 1": (lambda t: ["grpo", "algorithm.dual_clip=1.0"], "algorithm.dual_clip"),
    "correction_low=0": (lambda t: ["grpo", "algorithm.correction_low=0"], "correction_low"),
    "correction_high<1": (lambda t: ["grpo", "algorithm.correction_high=0.5"], "correction_high"),
    "dpo beta=0": (lambda t: ["dpo", "algorithm.beta=0"], "algorithm.beta"),
    "dpo empty pairs file": (
        lambda t: ["dpo", "data.task=file", f"data.train_path={_write(t / 'p.jsonl', '')}"],
        "p.jsonl is empty",
    ),
    "dpo resume without a run": (
        lambda t: ["dpo", "--resume", f"logging.run_dir={t}"],
        "--resume: no dpo run with a checkpoint",
    ),
    "invalid_reward": (lambda t: ["grpo", "data.invalid_reward=maybe"], "data.invalid_reward"),
    "fp8 on hf": (
        lambda t: ["grpo", "generation.backend=hf", "generation.precision=fp8"],
        "precision=fp8 needs",
    ),
    "compile on vllm": (
        lambda t: ["grpo", "generation.backend=vllm", "generation.compile=true"],
        "generation.compile compiles the transformers generator",
    ),
    "compile with lora adapters": (
        lambda t: ["grpo", "-c", "grpo_arithmetic_lora", "generation.compile=true"],
        "policy.lora with generation.compile",
    ),
    "jsonl without a file": (lambda t: ["grpo", "data.task=jsonl"], "data.train_path"),
    # multi-turn environments
    "unknown environment": (
        lambda t: ["grpo", "--config", "grpo_guess_number", "environment.name=nope"],
        "environment 'nope' is neither a built-in",
    ),
    "environment module missing": (
        lambda t: ["grpo", "--config", "grpo_guess_number", "environment.name=no_such_mod:Env"],
        "environment 'no_such_mod:Env': cannot import module 'no_such_mod'",
    ),
    "environment not a class": (
        lambda t: [
            "grpo",
            "--config",
            "grpo_guess_number",
            "environment.name=tandem.rewards:exact_match",
        ],
        "'exact_match' is a function, not a class",
    ),
    "environment task, no environment": (
        lambda t: ["grpo", "data.task=environment"],
        "no environment section",
    ),
    "episode beyond the context": (
        lambda t: ["grpo", "--config", "grpo_guess_number", "environment.max_tokens=4096"],
        "environment.max_tokens=4096 exceeds the model's context of 256",
    ),
    "multi-turn async": (
        lambda t: ["grpo", "--config", "grpo_guess_number", "algorithm.max_staleness=1"],
        "no environment section (episodes are not pipelined)",
    ),
    "sft unknown key": (lambda t: ["sft", "algorithm.batchsize=4"], "algorithm.batchsize"),
    "override without =": (lambda t: ["grpo", "algorithm.num_steps"], "section.key=value"),
    "missing recipe": (lambda t: ["grpo", "--config", "nope.yaml"], "recipe file not found"),
    "recipe not YAML": (
        lambda t: ["grpo", "--config", str(_write(t / "r.yaml", "a: [1,\n"))],
        "not valid YAML",
    ),
    "recipe not a mapping": (
        lambda t: ["grpo", "--config", str(_write(t / "r.yaml", "- 1\n"))],
        "must be a mapping",
    ),
    # models
    "model path missing": (lambda t: ["grpo", f"policy.model_path={t}/none"], "does not exist"),
    "model path is a file": (
        lambda t: ["grpo", f"policy.model_path={_write(t / 'f', 'x')}"],
        "is a file",
    ),
    "empty model folder": (
        lambda t: ["grpo", f"policy.model_path={t}"],
        "it has no config.json, a tokenizer",
    ),
    "no tokenizer": (
        lambda t: [
            "grpo",
            f"policy.model_path={_model_copy(t, ('tokenizer.json', 'tokenizer_config.json'))}",
        ],
        "it has no a tokenizer",
    ),
    "no weights": (
        lambda t: ["grpo", f"policy.model_path={_model_copy(t, ('model.safetensors',))}"],
        "weights (*.safetensors)",
    ),
    "truncated weights": (_truncated_model, "truncated or corrupt"),
    "max_tokens beyond the context": (
        lambda t: ["grpo", "generation.sampling.max_tokens=100000"],
        "max_position_embeddings",
    ),
    "sft max_tokens beyond the context": (
        lambda t: ["sft", "generation.sampling.max_tokens=256"],
        "leaves no room for a prompt",
    ),
    # data
    "data file missing": (
        lambda t: [*_jsonl(t, GOOD_ROW)[:-1], f"data.train_path={t}/no.jsonl"],
        "not found",
    ),
    "empty data file": (lambda t: _jsonl(t, ""), "train.jsonl is empty"),
    "blank data file": (lambda t: _jsonl(t, "\n\n"), "train.jsonl is empty"),
    "empty eval file": (
        lambda t: _jsonl(t, GOOD_ROW, (f"data.eval_path={_write(t / 'eval.jsonl', '')}",)),
        "data.eval_path",
    ),
    "bad JSON line": (lambda t: _jsonl(t, GOOD_ROW + "{oops\n"), "train.jsonl:2: not valid JSON"),
    "missing column": (lambda t: _jsonl(t, '{"q": "1+1=", "answer": "2"}\n'), "missing key"),
    # rewards
    "unknown reward": (lambda t: ["grpo", "data.reward=nonsense"], "neither a built-in"),
    "reward module missing": (lambda t: ["grpo", "data.reward=no_such_mod:f"], "cannot import"),
    "reward attribute missing": (
        lambda t: ["grpo", "data.reward=tandem.rewards.exact_match:nope"],
        "has no attribute 'nope'",
    ),
    # resume and export
    "resume without a run": (
        lambda t: ["grpo", "--resume", f"logging.run_dir={t}"],
        "--resume: no grpo run with a checkpoint",
    ),
    "sft resume without a run": (
        lambda t: ["sft", "--resume", f"logging.run_dir={t}", "logging.name=x"],
        "--resume: no complete checkpoint",
    ),
    "export of no checkpoint": (lambda t: ["export", str(t), str(t / "out")], "not a complete"),
    "a named run over an earlier one": (
        lambda t: [
            "grpo",
            f"logging.run_dir={_write(t / 'old' / 'x' / 'metrics.jsonl', '{}').parents[1]}",
            "logging.name=x",
        ],
        "holds an earlier run (metrics.jsonl); continue it with --resume",
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_exits_2_with_one_message(
    case: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """In this process through ``cli.main`` (what the console script calls): fast."""
    setup, expected = CASES[case]
    args = setup(tmp_path)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("RAY_ADDRESS", "")

    def no_ray(*_: object) -> None:
        raise AssertionError("Ray started for a bad input")

    monkeypatch.setattr(ray_cluster, "init_ray", no_ray)
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert err.count(": error: ") == 1, err
    assert expected in err, err
    assert not (tmp_path / "runs").exists()  # nothing was started, nothing written


@pytest.mark.parametrize("case", ["top_k=0", "truncated weights"])
def test_the_console_command_exits_2_without_a_traceback(case: str, tmp_path: Path) -> None:
    setup, expected = CASES[case]
    result = subprocess.run(
        [sys.executable, "-m", "tandem.cli", *setup(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        env={**os.environ, "RAY_ADDRESS": ""},
    )
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    assert result.stderr.count(": error: ") == 1 and expected in result.stderr


def test_help_config_lists_every_key_with_type_default_and_doc() -> None:
    from tandem.config import GrpoConfig
    from tandem.config.help import describe_config

    text = describe_config(GrpoConfig)
    for key in ("policy.optimizer.lr: float = 1e-05", "data.invalid_reward:", "refit.timeout_s"):
        assert key in text
    assert "Peak learning rate of AdamW." in text
    assert "kv_scale_recalibrate_every" not in text
    result = subprocess.run(
        [sys.executable, "-m", "tandem.cli", "sft", "--help-config"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0 and "algorithm.batch_size: int = 32" in result.stdout


def test_preflight_checks_the_model_folder_without_importing_torch() -> None:
    """A bad input is reported before torch's import (seconds): the weights' check reads the
    safetensors header without a torch framework."""
    code = (
        "import sys; from tandem.preflight import check_model_folder; "
        "from tandem.assets import DEFAULT_MODEL_DIR; check_model_folder(DEFAULT_MODEL_DIR); "
        "print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_the_driver_reaches_ray_without_importing_torch() -> None:
    """Everything the driver does before Ray starts (``driver.runtime_and_prompts``) is
    torch-free, so torch's import (1.1-1.3 s) runs in a thread while Ray starts."""
    code = (
        "import sys; import tandem.cli, tandem.driver, tandem.cluster.ray_cluster; "
        "from tandem.cluster.spec import RuntimeSpec; from tandem.config import GrpoConfig; "
        "from tandem.data.prompts import load_prompt_items; from tandem.rewards import "
        "RewardScorer; c = GrpoConfig(); "
        "RuntimeSpec(c.cluster, c.policy, c.generation, c.refit); "
        "load_prompt_items(c.data, 0); print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip().splitlines()[-1] == "False"


@pytest.mark.parametrize(
    ("overrides", "warned"),
    [
        (["policy.dtype=bfloat16"], True),
        (["policy.dtype=bfloat16", "policy.mixed_precision=true"], True),  # bf16 masters too
        (["policy.dtype=float32", "policy.mixed_precision=true"], False),
        (["policy.dtype=bfloat16", "policy.lora.rank=4"], False),  # peft's adapters are fp32
        # rounded stochastically, the updates are kept in expectation
        (["policy.dtype=bfloat16", "policy.optimizer.bf16_stochastic_round=true"], False),
        ([], False),
    ],
)
def test_weights_trained_in_bf16_are_warned_about_before_the_run(
    overrides: list[str], warned: bool, caplog: pytest.LogCaptureFixture
) -> None:
    from tandem.config import GrpoConfig, load_config
    from tandem.preflight import check_run_inputs

    config = load_config(GrpoConfig, "grpo_arithmetic", [*overrides, "policy.optimizer.lr=3e-6"])
    with caplog.at_level("WARNING", logger="tandem.preflight"):
        check_run_inputs(config.policy, config.generation, config.data)
    messages = [r.getMessage() for r in caplog.records if r.name == "tandem.preflight"]
    if warned:
        (message,) = messages
        assert "1/256" in message and "lr is 3e-06" in message
        assert "policy.dtype=float32 policy.mixed_precision=true" in message
        assert "policy.optimizer.bf16_stochastic_round=true" in message
    else:
        assert messages == []


def test_compile_without_a_cpp_compiler_exits_2_before_the_model_loads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """On a machine without NVIDIA GPUs Inductor needs a C++ compiler ($CXX, else g++)."""
    from tandem import machine

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("RAY_ADDRESS", "")
    monkeypatch.setenv("CXX", "no-such-c++")
    monkeypatch.setattr(machine, "nvidia_devices", lambda: [])
    assert main(["grpo", "policy.compile=true"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count(": error: ") == 1, err
    assert "(no-such-c++, from $CXX or the default g++) is not installed" in err
    assert "policy.compile=false" in err
    assert not (tmp_path / "runs").exists()
