"""Data loading errors, rollout batching, checkpoint atomicity and metric sinks of the driver."""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from tandem.algorithms.rollouts import rollouts_to_batch, score_rollouts
from tandem.config.models import CheckpointConfig, DataConfig, LoggingConfig
from tandem.data.prompts import PromptSource, load_prompt_file
from tandem.generation.base import Rollout
from tandem.logging.metrics import CONSOLE_KEYS, MetricsLogger, format_console_line, read_metrics
from tandem.logging.plots import plot_run
from tandem.rewards import RewardError
from tandem.runs import Checkpoints


def jsonl(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n")
    return path


def test_malformed_jsonl_row_names_file_and_line(tmp_path: Path) -> None:
    data = jsonl(tmp_path / "d.jsonl", ['{"question": "a", "answer": "1"}', '{"question": "b",'])
    config = DataConfig(task="jsonl", train_path=data)
    with pytest.raises(ValueError, match=r"d\.jsonl:2: not valid JSON"):
        load_prompt_file(data, config)


def test_missing_column_names_file_line_and_key(tmp_path: Path) -> None:
    data = jsonl(tmp_path / "d.jsonl", ['{"question": "a", "answer": "1"}', '{"question": "b"}'])
    config = DataConfig(task="jsonl", train_path=data)
    with pytest.raises(ValueError, match=r"d\.jsonl:2: missing key\(s\) \['answer'\]"):
        load_prompt_file(data, config)


def test_prompt_template_is_applied(tmp_path: Path) -> None:
    data = jsonl(tmp_path / "d.jsonl", ['{"question": "2+2?", "answer": "#### 4"}'])
    config = DataConfig(task="jsonl", train_path=data, prompt_template="Q: {question}\nA:")
    assert load_prompt_file(data, config) == [{"prompt": "Q: 2+2?\nA:", "answer": "#### 4"}]


def test_train_prompts_depend_only_on_seed_and_step() -> None:
    items = [{"prompt": str(i), "answer": str(i)} for i in range(10)]
    a = PromptSource(items, items, None, lambda *_: 0.0, seed=3)
    b = PromptSource(items, items, None, lambda *_: 0.0, seed=3)
    assert a.train_prompts(4, 3) == b.train_prompts(4, 3)
    epoch = [p["prompt"] for step in range(5) for p in a.train_prompts(step, 2)]
    assert sorted(epoch) == sorted(str(i) for i in range(10))  # one epoch covers every item
    # what a source served before does not change a step's prompts (epoch orders are cached)
    fresh = PromptSource(items, items, None, lambda *_: 0.0, seed=3)
    assert a.train_prompts(3, 3) == fresh.train_prompts(3, 3)  # spans epochs 0 and 1
    assert a.train_prompts(0, 2) == PromptSource(
        items, items, None, lambda *_: 0.0, 3
    ).train_prompts(0, 2)
    a.train = items[:4]  # fewer items: another permutation, not the kept one
    fewer = PromptSource(items[:4], [], None, lambda *_: 0.0, seed=3)
    assert a.train_prompts(0, 4) == fewer.train_prompts(0, 4)


def rollout(index: int, prompt: list[int], response: list[int]) -> Rollout:
    logprobs = [-0.5] * len(response)
    return Rollout(index, prompt, response, "", logprobs, "stop")


def test_rollouts_to_batch_masks_the_response_only() -> None:
    batch = rollouts_to_batch([rollout(0, [5, 6], [7]), rollout(0, [5], [8, 9])], pad_token_id=0)
    assert batch.input_ids.tolist() == [[5, 6, 7], [5, 8, 9]]
    assert batch.loss_mask.tolist() == [[0, 0, 1], [0, 1, 1]]
    assert batch.generator_logprobs is not None
    assert batch.generator_logprobs.tolist() == [[0, 0, -0.5], [0, -0.5, -0.5]]


def test_failing_reward_is_reported_with_its_sample() -> None:
    def reward(prompt: str, response: str, answer: str) -> float:
        raise KeyError("boom")

    def decode(ids: list[int]) -> str:
        return "".join(map(str, ids))

    with pytest.raises(RewardError, match="prompt='1\\+1=', response='2'") as info:
        score_rollouts(reward, [{"prompt": "1+1=", "answer": "2"}], [rollout(0, [1], [2])], decode)
    assert "KeyError: 'boom'" in str(info.value)


class FakeTrainerSaver:
    """Stands in for the trainer group's save only: writes a file, or fails midway."""

    def __init__(self, fail: bool = False):
        self.fail = fail

    def save_checkpoint(self, path: str) -> None:
        Path(path).mkdir(parents=True)
        (Path(path) / "shard").write_text("x")
        if self.fail:
            raise OSError("disk full")


def test_checkpoint_is_atomic_and_pruned(tmp_path: Path) -> None:
    ckpts = Checkpoints(tmp_path, CheckpointConfig(every=1, keep=2))
    for step in (1, 2, 3):
        ckpts.save(step, FakeTrainerSaver(), {"note": step})
    assert sorted(p.name for p in (tmp_path / "checkpoints").glob("step_*")) == ["step_2", "step_3"]
    with pytest.raises(OSError):
        ckpts.save(4, FakeTrainerSaver(fail=True), {})
    latest = ckpts.latest()
    assert latest is not None and latest.name == "step_3"
    assert json.loads((latest / "driver_state.json").read_text())["note"] == 3


def test_a_prune_cut_short_by_ctrl_c_leaves_no_hidden_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ckpts = Checkpoints(tmp_path, CheckpointConfig(every=1, keep=1))
    ckpts.save(1, FakeTrainerSaver(), {})
    real_rmtree = shutil.rmtree
    cut = []

    def rmtree_cut_once(path: Path, ignore_errors: bool = False) -> None:
        if Path(path).name.endswith(".del") and Path(path).exists() and not cut:
            cut.append(path)  # half the files gone, then the signal
            next(Path(path).rglob("shard")).unlink()
            raise KeyboardInterrupt
        real_rmtree(path, ignore_errors=ignore_errors)

    monkeypatch.setattr(shutil, "rmtree", rmtree_cut_once)
    with pytest.raises(KeyboardInterrupt):
        ckpts.save(2, FakeTrainerSaver(), {})
    assert cut
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["latest", "step_2"]


def test_metrics_logger_writes_jsonl_tensorboard_and_plot(tmp_path: Path) -> None:
    config = LoggingConfig(progress=False)
    with MetricsLogger(config, tmp_path, total_steps=2) as logger:
        logger.log(1, {"train/reward_mean": torch.tensor(0.25), "eval/accuracy": 0.5})
        logger.log(2, {"train/reward_mean": 0.75})
    records = read_metrics(tmp_path)
    assert records == [
        {"step": 1, "train/reward_mean": 0.25, "eval/accuracy": 0.5},
        {"step": 2, "train/reward_mean": 0.75},
    ]
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    png = plot_run(records, tmp_path / "reward.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    ("records", "lines"),
    [
        ([{"step": 1, "train/loss": 0.5}, {"step": 2, "train/loss": 0.25}], ["train loss"]),
        ([{"step": 1, "train/loss": 0.5, "eval/accuracy": 0.5}], ["held-out accuracy"]),
        ([{"step": 1}], []),
        ([], []),
    ],
    ids=["loss-only", "accuracy", "no-series", "empty"],
)
def test_a_run_without_rewards_or_evaluation_plots_without_warnings(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, records: list[dict], lines: list[str]
) -> None:
    """A supervised run without evaluation plots its training loss (a run with rewards or
    accuracies plots those); a run that logged nothing to plot still writes a PNG, and none
    warns on the console (matplotlib's empty legend)."""
    import matplotlib.pyplot as plt

    plotted: list[str] = []
    real = plt.Axes.plot

    def plot(ax: Any, *args: Any, **kwargs: Any) -> Any:
        plotted.append(kwargs["label"])
        return real(ax, *args, **kwargs)

    monkeypatch.setattr(plt.Axes, "plot", plot)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        png = plot_run(records, tmp_path / "reward.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert plotted == lines


def test_the_progress_bar_names_the_call_under_way(tmp_path: Path) -> None:
    with MetricsLogger(LoggingConfig(), tmp_path, total_steps=3, start_step=1) as logger:
        logger.phase("generate")
        logger.log(2, {"train/reward_mean": 0.5})
        logger.phase("train")
        (task,) = logger._progress.tasks
        assert (task.description, task.completed, task.total) == ("steps · train", 2, 3)


def test_metrics_line_is_one_line_off_a_terminal(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    metrics = {key: 0.123456 for key in CONSOLE_KEYS}
    with MetricsLogger(LoggingConfig(progress=False), tmp_path, total_steps=1) as logger:
        logger.log(1, metrics)
    line = format_console_line({"step": 1, **metrics})
    assert len(line) > 80  # wider than rich's default width when stderr is not a terminal
    assert line in capsys.readouterr().err.splitlines()


@pytest.mark.parametrize("start", [0, 4], ids=["fresh", "resumed"])
def test_graphs_compiled_after_the_first_step_warn_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, start: int
) -> None:
    """The first step of a process builds the compiled layers' graphs; a graph built in a
    later step is a form of call compiled at that step's expense: one warning with the step,
    the graphs, the seconds and where torch logged why. A resumed run's first step compiles
    anew without one."""
    from tandem.config import GrpoConfig, load_config
    from tandem.driver import open_run

    overrides = [f"logging.run_dir={tmp_path}", "logging.tensorboard=false"]
    overrides += ["logging.progress=false", "checkpoint.enabled=false"]
    overrides += ["checkpoint.export_hf=false", "algorithm.num_steps=9"]
    config = load_config(GrpoConfig, None, overrides)

    class Workers:  # what open_run asks of a runtime that is not resumed or exported
        where = "nowhere"

    built = {"compile/graphs": 3.0, "compile/seconds": 41.5}
    none = {"compile/graphs": 0.0, "compile/seconds": 0.0}
    with open_run(config, tmp_path / "run", False, Workers()) as run:  # type: ignore[arg-type]
        run.start_step = start  # (a resumed run's, without a checkpoint to load)
        with caplog.at_level("WARNING", logger="tandem.driver"):
            run.log(start + 1, built)
            run.log(start + 2, none)
            assert not caplog.records
            run.log(start + 3, {**built, "compile/graphs": 2.0})
            run.log(start + 4, built)
    [record] = caplog.records
    message = record.getMessage()
    assert f"step {start + 3}:" in message and "2 more graph(s)" in message
    assert "41.5 s" in message and str(tmp_path / "run" / "logs" / "console.log") in message
    metrics = read_metrics(tmp_path / "run")
    assert [m["compile/graphs"] for m in metrics] == [3.0, 0.0, 2.0, 3.0]
