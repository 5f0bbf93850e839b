from pathlib import Path

import pytest
import yaml

from tandem.cluster.spec import RuntimeSpec
from tandem.config import (
    ConfigError,
    DpoConfig,
    GrpoConfig,
    RmConfig,
    SftConfig,
    load_config,
    save_resolved,
)
from tandem.config.load import RECIPES_DIR


@pytest.mark.parametrize("recipe", sorted(RECIPES_DIR.glob("*.yaml")), ids=lambda p: p.stem)
def test_every_shipped_recipe_validates(recipe: Path) -> None:
    kinds = {"sft": SftConfig, "dpo": DpoConfig, "ipo": DpoConfig, "rm": RmConfig}
    model = kinds.get(recipe.stem.split("_")[0], GrpoConfig)
    config = load_config(model, recipe)
    section = config.model if isinstance(config, RmConfig) else config.policy
    assert section.model_path.exists()


def test_overrides_are_typed_and_nested() -> None:
    config = load_config(
        GrpoConfig, None, ["policy.optimizer.lr=3e-6", "generation.sampling.stop=[a, b]"]
    )
    assert config.policy.optimizer.lr == pytest.approx(3e-6)
    assert config.generation.sampling.stop == ["a", "b"]


def test_typo_names_key_and_suggests_closest() -> None:
    with pytest.raises(ConfigError) as err:
        load_config(GrpoConfig, None, ["policy.optimizer.lrr=1e-3"])
    message = str(err.value)
    assert "policy.optimizer.lrr: unknown key" in message
    assert "did you mean 'policy.optimizer.lr'" in message


def test_wrong_type_names_key_value_and_allowed() -> None:
    with pytest.raises(ConfigError) as err:
        load_config(GrpoConfig, None, ["cluster.placement=sideways"])
    message = str(err.value)
    assert "cluster.placement" in message and '"sideways"' in message
    assert "'colocated' or 'split'" in message


def test_defaults_parent_is_merged_under_child(tmp_path: Path) -> None:
    parent = tmp_path / "parent.yaml"
    parent.write_text(yaml.safe_dump({"algorithm": {"num_steps": 7, "num_generations": 4}}))
    child = tmp_path / "child.yaml"
    child.write_text(yaml.safe_dump({"defaults": "parent.yaml", "algorithm": {"num_steps": 3}}))
    config = load_config(GrpoConfig, child)
    assert (config.algorithm.num_steps, config.algorithm.num_generations) == (3, 4)


def test_missing_recipe_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match=r"recipe file not found: nope\.yaml"):
        load_config(GrpoConfig, "nope.yaml")


def test_resolved_config_round_trips(tmp_path: Path) -> None:
    config = load_config(GrpoConfig, "grpo_arithmetic", ["algorithm.num_steps=2"])
    save_resolved(config, tmp_path)
    again = GrpoConfig.model_validate(yaml.safe_load((tmp_path / "config.yaml").read_text()))
    assert again == config


@pytest.mark.parametrize(
    "args, expected",
    [
        (["grpo", "policy.optimzer.lr=1"], "did you mean 'policy.optimizer'"),
        (["grpo", "policy.micro_batch_size=many"], "policy.micro_batch_size"),
        (["grpo", "--config", "missing.yaml"], "recipe file not found: missing.yaml"),
    ],
)
def test_cli_config_errors_exit_nonzero_without_traceback(
    args: list[str], expected: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from tandem.cli import main

    assert main(args) == 2
    stderr = capsys.readouterr().err
    assert expected in stderr
    assert "Traceback" not in stderr
    assert len(stderr.strip().splitlines()) <= 3


def _spec(*overrides: str, in_flight_refit: bool = False) -> RuntimeSpec:
    config = load_config(GrpoConfig, None, list(overrides))
    parts = (config.cluster, config.policy, config.generation, config.refit)
    return RuntimeSpec(*parts, in_flight_refit=in_flight_refit)


@pytest.fixture
def cpu_machine_with_vllm(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """A machine with no GPU device files (append to the list to add one), vllm importable and
    no $RAY_ADDRESS."""
    from tandem import machine
    from tandem.cluster import spec as spec_module

    devices: list[str] = []
    monkeypatch.setattr(machine.glob, "glob", lambda pattern: list(devices))
    monkeypatch.setattr(spec_module, "find_spec", lambda name: object())
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    return devices


def test_in_process_names_every_misfit_and_async_needs_ray(
    cpu_machine_with_vllm: list[str],
) -> None:
    spec = _spec(
        "cluster.runtime=in_process", "cluster.num_generators=2", "cluster.placement=split"
    )
    with pytest.raises(ValueError) as err:
        spec.resolve()
    message = str(err.value)
    assert "cluster.runtime=in_process needs" in message
    assert "cluster.num_generators=1" in message and "cluster.placement=colocated" in message
    assert "num_trainers" not in message  # only what is wrong is named
    with pytest.raises(ConfigError, match=r"cluster\.runtime=ray"):
        load_config(
            GrpoConfig,
            None,
            [
                "cluster.runtime=in_process",
                "algorithm.max_staleness=1",
                "algorithm.rollout_correction=token_tis",
            ],
        )
    assert _spec("cluster.runtime=in_process").resolve().cluster.runtime == "in_process"


def test_auto_runs_in_process_where_the_run_fits(
    cpu_machine_with_vllm: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from tandem.cluster import spec as spec_module

    def chosen(*overrides: str, in_flight_refit: bool = False) -> str:
        return _spec(*overrides, in_flight_refit=in_flight_refit).resolve().cluster.runtime

    assert chosen() == "in_process"
    assert chosen("cluster.runtime=ray") == "ray"
    for override in [
        "cluster.num_generators=2",
        "cluster.num_trainers=2",
        "cluster.placement=split",
        "cluster.address=10.0.0.1:6379",
        "generation.tensor_parallel_size=2",
    ]:
        assert chosen(override) == "ray", override
    assert chosen(in_flight_refit=True) == "ray"
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")  # a cluster to join
    assert chosen() == "ray"
    monkeypatch.delenv("RAY_ADDRESS")
    cpu_machine_with_vllm.append("/dev/nvidia0")
    assert chosen() == "ray"
    with pytest.raises(ValueError, match="without NVIDIA GPUs"):
        _spec("cluster.runtime=in_process").resolve()
    cpu_machine_with_vllm.clear()
    monkeypatch.setattr(spec_module, "find_spec", lambda name: None)  # no vllm here
    assert chosen("generation.backend=vllm") == "ray"
    assert chosen() == "in_process"  # auto generates with transformers on a CPU machine


def test_auto_generates_with_vllm_where_the_run_has_gpus_or_fp8(
    cpu_machine_with_vllm: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from tandem import machine

    def backend(*overrides: str) -> str:
        return _spec(*overrides).resolve().generation.backend

    assert backend() == "hf"
    assert backend("generation.backend=vllm") == "vllm"
    assert backend("generation.precision=fp8") == "vllm"
    assert backend("generation.kv_cache_dtype=fp8") == "vllm"
    assert backend("cluster.address=10.0.0.1:6379") == "vllm"
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")
    assert backend() == "vllm"
    monkeypatch.delenv("RAY_ADDRESS")
    cpu_machine_with_vllm.append("/dev/nvidia0")
    assert backend() == "vllm" and backend("generation.backend=hf") == "hf"
    monkeypatch.setattr(machine, "find_spec", lambda name: None)  # an interpreter without vllm
    assert backend("cluster.env_mode=shared") == "hf"  # the generators run in it
    assert backend() == "vllm"  # their own environment installs it
    with pytest.raises(ConfigError, match=r"precision=fp8 needs generation\.backend=vllm"):
        load_config(GrpoConfig, None, ["generation.backend=hf", "generation.precision=fp8"])


def test_generation_compile_follows_the_trainers_layers_unless_set(
    cpu_machine_with_vllm: list[str],
) -> None:
    """Unset, the transformers generator compiles its layers where the trainer compiles its
    (one side compiled computes other bf16 arithmetic than the other); vLLM and LoRA adapter
    refits never follow; an explicit setting wins, and an explicit true where auto decides for
    vLLM is one message before anything starts."""

    def compiled(*overrides: str) -> bool | None:
        return _spec(*overrides).resolve().generation.compile

    assert compiled() is False
    assert compiled("policy.compile=true") is True
    assert compiled("policy.compile=true", "generation.compile=false") is False
    assert compiled("generation.compile=true") is True
    assert compiled("policy.compile=true", "generation.backend=vllm") is False
    lora = load_config(GrpoConfig, "grpo_arithmetic_lora", ["policy.compile=true"])
    assert lora.generation.compile is False  # adapters refit: the layers would recompile
    cpu_machine_with_vllm.append("/dev/nvidia0")  # auto decides for vLLM
    assert compiled("policy.compile=true") is False
    assert compiled("policy.compile=true", "generation.backend=hf") is True
    with pytest.raises(ValueError, match="vLLM compiles its own model"):
        _spec("generation.compile=true").resolve()


def test_every_key_the_runtime_decides_may_differ_on_resume(
    cpu_machine_with_vllm: list[str],
) -> None:
    """The saved config records what ``RuntimeSpec.resolve`` decided (the backend, the
    runtime, the generator's compile); a resumed run loads the unresolved one, or one saved by
    an earlier version: each key resolve may change is one ``--resume`` accepts."""
    from tandem.runs import RESUMABLE, _flatten

    def decided(*overrides: str) -> list[str]:
        spec = _spec(*overrides)
        resolved = spec.resolve()
        before = _flatten({"cluster": spec.cluster.model_dump(mode="json")})
        before |= _flatten({"generation": spec.generation.model_dump(mode="json")})
        after = _flatten({"cluster": resolved.cluster.model_dump(mode="json")})
        after |= _flatten({"generation": resolved.generation.model_dump(mode="json")})
        return [key for key in before if before[key] != after[key]]

    changed = decided() + decided("policy.compile=true")
    cpu_machine_with_vllm.append("/dev/nvidia0")
    changed += decided("policy.compile=true") + decided("cluster.runtime=ray")
    assert {"generation.backend", "generation.compile", "cluster.runtime"} <= set(changed)
    assert [key for key in changed if not key.startswith(RESUMABLE)] == []


def test_generation_compile_on_a_machine_that_decides_for_vllm_is_one_message(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``generation.compile`` with backend auto: where the generator's machine decides for vLLM
    (a GPU with vLLM installed) its worker refuses it before loading anything."""
    from tandem import machine
    from tandem.config.models import GenerationConfig
    from tandem.generation import make_generator

    monkeypatch.setattr(machine, "generator_backend", lambda config: "vllm")
    with pytest.raises(ConfigError, match="vLLM compiles its own model"):
        make_generator(GenerationConfig(compile=True), "no/such/model")


def test_in_process_with_a_bad_setting_is_an_error_before_anything_starts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from tandem.cli import main

    args = ["grpo", "cluster.runtime=in_process", "generation.tensor_parallel_size=2"]
    assert main([*args, f"logging.run_dir={tmp_path}"]) == 2
    stderr = capsys.readouterr().err
    assert "cluster.runtime=in_process needs generation.tensor_parallel_size=1" in stderr
    assert "Traceback" not in stderr
    assert not any(tmp_path.iterdir())  # nothing written
