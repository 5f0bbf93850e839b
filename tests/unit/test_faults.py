"""Fault injection, the fast part: mistakes a new user makes that were not on the first list, and
faults of the run's own machinery (a reward that hangs or kills its process, a checkpoint cut
off or damaged, a resume with a changed config). Each case asserts what ``docs/errors.md``
promises: a user's mistake ends with exit status 2 and one message without a traceback; a
fault is bounded in time and leaves only complete checkpoints. The cases that need a whole run
are in ``tests/integration/test_faults_cli.py``."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tandem.assets import DEFAULT_MODEL_DIR
from tandem.cli import build_parser, main
from tandem.cluster import ray_cluster
from tandem.config import GrpoConfig, load_config
from tandem.config.models import CheckpointConfig, DataConfig
from tandem.data import prompts
from tandem.rewards.scorer import RewardScorer
from tandem.runs import Checkpoints, check_run_dir

Setup = Callable[[Path], list[str]]

BOM = b"\xef\xbb\xbf"
ROWS = '{"question": "1+1=", "answer": "2"}\n{"question": "2+2=", "answer": "4"}\n'


def _write(path: Path, text: str | bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text)
    return path


def _reward_module(tmp: Path, source: str, name: str = "user_reward") -> str:
    """A reward module the user wrote, importable from ``tmp`` (the run's working folder)."""
    _write(tmp / f"{name}.py", textwrap.dedent(source))
    sys.path.insert(0, str(tmp))
    sys.modules.pop(name, None)
    return f"data.reward={name}:score"


def _recipe(tmp: Path, text: str | bytes, name: str = "r.yaml") -> list[str]:
    return ["grpo", "--config", str(_write(tmp / name, text))]


def _jsonl(tmp: Path, data: bytes, name: str = "train.jsonl") -> list[str]:
    return ["grpo", "data.task=jsonl", f"data.train_path={_write(tmp / name, data)}"]


USER_MISTAKES: dict[str, tuple[Setup, str]] = {
    # 1. the user's own reward module
    "reward syntax error": (
        lambda t: ["grpo", _reward_module(t, "def score(prompt, response, answer)\n  return 1\n")],
        "user_reward.py, line 1",
    ),
    "reward missing dependency": (
        lambda t: ["grpo", _reward_module(t, "import no_such_dependency_xyz\n")],
        "No module named 'no_such_dependency_xyz'",
    ),
    "reward raises at import": (
        lambda t: ["grpo", _reward_module(t, "raise RuntimeError('needs an API key')\n")],
        "RuntimeError: needs an API key",
    ),
    "reward module not found": (
        lambda t: ["grpo", "data.reward=no_such_user_module:score"],
        "cannot import module 'no_such_user_module'",
    ),
    "reward attribute missing": (
        lambda t: ["grpo", _reward_module(t, "def other(p, r, a):\n    return 1.0\n")],
        "has no attribute 'score'",
    ),
    "reward not callable": (
        lambda t: ["grpo", _reward_module(t, "score = 1.0\n")],
        "not a function",
    ),
    "reward takes two arguments": (
        lambda t: ["grpo", _reward_module(t, "def score(prompt, response):\n    return 1.0\n")],
        "(prompt, response, answer)",
    ),
    "reward takes four arguments": (
        lambda t: ["grpo", _reward_module(t, "def score(p, r, a, extra):\n    return 1.0\n")],
        "(prompt, response, answer)",
    ),
    "reward needs a keyword": (
        lambda t: ["grpo", _reward_module(t, "def score(p, r, a, *, k):\n    return 1.0\n")],
        "(prompt, response, answer)",
    ),
    # 2. names and paths the run writes to
    "name with ..": (lambda t: ["grpo", "logging.name=../elsewhere"], "logging.name"),
    "absolute name": (lambda t: ["grpo", f"logging.name={t}/abs"], "logging.name"),
    "name with a separator": (lambda t: ["grpo", "logging.name=a/b"], "logging.name"),
    "name '.'": (lambda t: ["grpo", "logging.name=."], "logging.name"),
    "empty name": (lambda t: ["grpo", "logging.name="], "logging.name"),
    "run_dir is a file": (
        lambda t: ["grpo", f"logging.run_dir={_write(t / 'f', 'x')}"],
        "logging.run_dir",
    ),
    "sft output_dir is the model": (
        lambda t: ["sft", f"output_dir={DEFAULT_MODEL_DIR}"],
        "output_dir",
    ),
    "sft output_dir is a file": (
        lambda t: ["sft", f"output_dir={_write(t / 'o', 'x')}"],
        "output_dir",
    ),
    "export over a folder that is not a model": (
        lambda t: ["export", str(t), str(_write(t / "home" / "notes.txt", "mine").parent)],
        "not a Hugging Face model folder",
    ),
    # 3. config files
    "duplicate top-level key": (
        lambda t: _recipe(t, "algorithm:\n  num_steps: 3\nalgorithm:\n  seed: 1\n"),
        "'algorithm' given twice (line 3",
    ),
    "duplicate nested key": (
        lambda t: _recipe(t, "algorithm:\n  num_steps: 3\n  seed: 1\n  num_steps: 5\n"),
        "'num_steps' given twice (line 4",
    ),
    "duplicate key in a defaults parent": (
        lambda t: (
            _write(t / "base.yaml", "data:\n  reward: exact_match\n  reward: math_verify\n"),
            _recipe(t, "defaults: base.yaml\nalgorithm:\n  num_steps: 3\n"),
        )[1],
        "base.yaml: 'reward' given twice (line 3",
    ),
    "UTF-16 recipe": (
        lambda t: _recipe(t, "algorithm:\n  num_steps: 3\n".encode("utf-16")),
        "not UTF-8",
    ),
    "tab-indented recipe": (lambda t: _recipe(t, "algorithm:\n\tnum_steps: 3\n"), "not valid YAML"),
    "empty section": (lambda t: _recipe(t, "algorithm:\n"), "algorithm"),
    "recipe given without --config": (lambda t: ["grpo", "my_recipe.yaml"], "--config"),
    "UTF-16 data file": (lambda t: _jsonl(t, ROWS.encode("utf-16")), "not UTF-8"),
    "data file of unknown format": (
        lambda t: _jsonl(t, ROWS.encode(), name="train.txt"),
        ".jsonl, .json, .csv or .parquet",
    ),
    "corrupt parquet": (
        lambda t: _jsonl(t, b"PAR1 not really parquet", name="train.parquet"),
        "train.parquet",
    ),
    "positional field in the prompt template": (
        lambda t: [*_jsonl(t, ROWS.encode()), "data.prompt_template=Q: {0}"],
        "data.prompt_template",
    ),
    "unbalanced brace in the prompt template": (
        lambda t: [*_jsonl(t, ROWS.encode()), "data.prompt_template=Q: {question"],
        "data.prompt_template",
    ),
}


@pytest.mark.parametrize("case", list(USER_MISTAKES))
def test_user_mistake_exits_2_with_one_message(
    case: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setenv("RAY_ADDRESS", "")
    setup, expected = USER_MISTAKES[case]
    args = setup(tmp_path)

    def no_ray(*_: object) -> None:
        raise AssertionError("Ray started for a bad input")

    def no_run(*_: object) -> None:
        raise AssertionError("the run started for a bad input")

    monkeypatch.setattr(ray_cluster, "init_ray", no_ray)
    monkeypatch.setattr(prompts, "load_tokenizer", no_run)  # the workers start next
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    assert err.count(": error: ") == 1, err
    assert expected in err, err
    assert not (tmp_path / "runs").exists()
    assert not (tmp_path.parent / "elsewhere").exists()


# ---- 3. text the user's tools wrote: read, not refused ----------------------------------------


def test_recipe_with_a_byte_order_mark_is_read(tmp_path: Path) -> None:
    recipe = _write(tmp_path / "r.yaml", BOM + b"algorithm:\n  num_steps: 3\n")
    assert load_config(GrpoConfig, recipe).algorithm.num_steps == 3


@pytest.mark.parametrize("suffix", [".jsonl", ".json", ".csv"])
def test_data_file_with_a_byte_order_mark_and_crlf_is_read(tmp_path: Path, suffix: str) -> None:
    from tandem.data.prompts import load_prompt_file

    text = {
        ".jsonl": ROWS,
        ".json": json.dumps([json.loads(line) for line in ROWS.splitlines()]),
        ".csv": "question,answer\n1+1=,2\n2+2=,4\n",
    }[suffix].replace("\n", "\r\n")
    path = _write(tmp_path / f"train{suffix}", BOM + text.encode())
    items = load_prompt_file(path, DataConfig(task="jsonl", train_path=path))
    assert items == [{"prompt": "1+1=", "answer": "2"}, {"prompt": "2+2=", "answer": "4"}]


def test_preference_file_with_a_byte_order_mark_is_read(tmp_path: Path) -> None:
    from tandem.config.dpo import PreferenceDataConfig
    from tandem.data.preferences import load_preference_file

    row = {"prompt": "1+1=", "chosen": "2", "rejected": "3"}
    path = _write(tmp_path / "pairs.jsonl", BOM + (json.dumps(row) + "\n").encode())
    config = PreferenceDataConfig(task="file", train_path=path)
    assert load_preference_file(path, config) == [row]


# ---- 4. the command line: flags and overrides in any order ------------------------------------


@pytest.mark.parametrize("command", ["grpo", "sft", "dpo"])
def test_flags_and_overrides_in_any_order(command: str) -> None:
    args = build_parser().parse_args(
        [command, "algorithm.num_steps=5", "--resume", "algorithm.seed=1", "-c", "x.yaml", "a.b=2"]
    )
    assert args.resume and args.config == "x.yaml"
    assert args.overrides == ["algorithm.num_steps=5", "algorithm.seed=1", "a.b=2"]


def test_envs_flag_after_its_kinds() -> None:
    args = build_parser().parse_args(["envs", "build", "trainer", "--rebuild", "generator"])
    assert args.rebuild and args.kinds == ["trainer", "generator"]


# ---- 1. rewards that hang or kill their process -----------------------------------------------

HANG = "import time\ndef score(p, r, a):\n    time.sleep(3600)\n"
HANG_IGNORING_TERM = (
    "import signal, time\ndef score(p, r, a):\n"
    "    signal.signal(signal.SIGTERM, signal.SIG_IGN)\n    time.sleep(3600)\n"
)
SUICIDE = "import os, signal\ndef score(p, r, a):\n    os.kill(os.getpid(), signal.SIGKILL)\n"
EXITS = "import os\ndef score(p, r, a):\n    os._exit(3)\n"
SAMPLES = [("p", "r", "a")] * 3


def _scorer_script(tmp: Path, source: str, invalid: str = "error") -> subprocess.CompletedProcess:
    """Scores in a fresh process (as the driver does), so its exit shows leaked semaphores."""
    _write(tmp / "user_reward.py", source)
    code = textwrap.dedent(f"""
        import time, multiprocessing
        from tandem.rewards.scorer import RewardScorer
        from tandem.rewards.base import RewardError
        start = time.perf_counter()
        try:
            with RewardScorer("user_reward:score", 2, 1.0, "{invalid}") as scorer:
                print("scores", scorer.score({SAMPLES!r}).rewards)
        except RewardError as err:
            print("RewardError", str(err).splitlines()[0])
        print("children", len(multiprocessing.active_children()))
        print("seconds", time.perf_counter() - start)
    """)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(tmp), os.environ.get("PYTHONPATH", "")]),
    }
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env, cwd=tmp
    )


@pytest.mark.parametrize(
    ("source", "invalid", "expected"),
    [
        (HANG, "error", "took longer than data.reward_timeout_s=1 s"),
        (HANG, "zero", "scores [0.0, 0.0, 0.0]"),
        (HANG_IGNORING_TERM, "error", "took longer than data.reward_timeout_s=1 s"),
        (SUICIDE, "error", "died (signal SIGKILL)"),
        (EXITS, "zero", "died (exit code 3)"),
    ],
    ids=["hangs", "hangs, scored zero", "hangs ignoring SIGTERM", "kills itself", "exits"],
)
def test_a_reward_that_hangs_or_dies_ends_within_its_bound(
    source: str, invalid: str, expected: str, tmp_path: Path
) -> None:
    result = _scorer_script(tmp_path, source, invalid)
    assert expected in result.stdout, result.stdout + result.stderr
    assert "children 0" in result.stdout
    seconds = float(result.stdout.split("seconds")[1])
    assert seconds < 20, result.stdout  # warm-up (spawn + import) plus a few 1 s timeouts
    assert "leaked semaphore" not in result.stderr, result.stderr
    assert "Traceback" not in result.stderr, result.stderr


def test_ctrl_c_while_rewards_score_leaves_no_worker_and_no_traceback(tmp_path: Path) -> None:
    """A terminal's Ctrl-C reaches the whole process group: the workers too."""
    _write(tmp_path / "user_reward.py", HANG)
    # a shell starts a command with Ctrl-C's default (the suite's process may have inherited
    # an ignored SIGINT, which a child keeps across exec)
    code = textwrap.dedent("""
        import multiprocessing, signal
        signal.signal(signal.SIGINT, signal.default_int_handler)
        from tandem.rewards.scorer import RewardScorer
        try:
            with RewardScorer("user_reward:score", 2, 60.0) as scorer:
                print("scoring", flush=True)
                scorer.score([("p", "r", "a")] * 4)
        except KeyboardInterrupt:
                        print("interrupted", len(multiprocessing.active_children()), flush=True)
    """)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]),
    }
    proc = subprocess.Popen(
        [sys.executable, "-c", code],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=tmp_path,
        start_new_session=True,
    )
    assert proc.stdout is not None and proc.stdout.readline().startswith("scoring")
    time.sleep(1.0)
    os.killpg(proc.pid, signal.SIGINT)
    out, err = proc.communicate(timeout=10)
    assert "interrupted 0" in out, out + err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err


def test_reward_scorer_in_this_process_checks_the_signature() -> None:
    with pytest.raises(ValueError, match=r"\(prompt, response, answer\)"):
        RewardScorer("x", fn=lambda prompt: 1.0)  # type: ignore[arg-type,misc]
    RewardScorer("x", fn=lambda *args: 1.0)  # any callable that takes three arguments


# ---- 5/6. checkpoints: cut off, damaged, resumed with a changed config ------------------------


class TrainerRuntime:
    """What ``Checkpoints`` needs of a runtime, on a real trainer of the embedded model."""

    def __init__(self, fail_after_write: BaseException | None = None):
        from tandem.config.models import PolicyConfig
        from tandem.trainer import PolicyTrainer

        self.trainer = PolicyTrainer(PolicyConfig(), device="cpu")
        self.fail_after_write = fail_after_write

    def save_checkpoint(self, path: str) -> None:
        self.trainer.save_checkpoint(path)
        if self.fail_after_write is not None:
            raise self.fail_after_write

    def load_checkpoint(self, path: str) -> None:
        self.trainer.load_checkpoint(path)


@pytest.fixture(scope="module")
def runtime() -> TrainerRuntime:
    return TrainerRuntime()


def _two_checkpoints(tmp: Path, runtime: TrainerRuntime) -> Checkpoints:
    checkpoints = Checkpoints(tmp, CheckpointConfig(keep=3))
    for step in (1, 2):
        checkpoints.save(step, runtime, {})
    return checkpoints


def _shard(step_dir: Path) -> Path:
    return max((step_dir / "trainer" / "shards").glob("*.distcp"), key=lambda p: p.stat().st_size)


DAMAGE: dict[str, Callable[[Path], object]] = {
    "truncated shard": lambda d: _shard(d).write_bytes(_shard(d).read_bytes()[:100]),
    "missing shard": lambda d: _shard(d).unlink(),
    "bad driver_state.json": lambda d: (d / "driver_state.json").write_text("{oops"),
    "missing trainer_state.json": lambda d: (d / "trainer" / "trainer_state.json").unlink(),
    "missing latest pointer": lambda d: (d.parent / "latest").unlink(),
    "latest points nowhere": lambda d: (d.parent / "latest").write_text("step_9"),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_damaged_latest_checkpoint_falls_back_to_the_previous(
    damage: str, tmp_path: Path, runtime: TrainerRuntime, caplog: pytest.LogCaptureFixture
) -> None:
    checkpoints = _two_checkpoints(tmp_path, runtime)
    DAMAGE[damage](tmp_path / "checkpoints" / "step_2")
    state = checkpoints.load(runtime)
    pointer_only = "latest" in damage
    assert state["step"] == (2 if pointer_only else 1)
    if not pointer_only:
        assert "step_2 is damaged" in caplog.text  # said on the console


def test_all_checkpoints_damaged_is_refused(
    tmp_path: Path, runtime: TrainerRuntime, monkeypatch: pytest.MonkeyPatch
) -> None:
    checkpoints = _two_checkpoints(tmp_path, runtime)
    for step in (1, 2):
        DAMAGE["truncated shard"](tmp_path / "checkpoints" / f"step_{step}")
    with pytest.raises(ValueError, match=r"no usable checkpoint.*step_2.*step_1"):
        checkpoints.load(runtime)


def test_all_checkpoints_damaged_ends_the_command_with_2(
    tmp_path: Path,
    runtime: TrainerRuntime,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    run = tmp_path / "run"
    _two_checkpoints(run, runtime)
    saved = load_config(GrpoConfig, "grpo_arithmetic", [f"logging.run_dir={tmp_path}"])
    (run / "config.json").write_text(json.dumps(saved.model_dump(mode="json")))
    for step in (1, 2):
        (run / "checkpoints" / f"step_{step}" / "driver_state.json").unlink()
    monkeypatch.setattr(ray_cluster, "init_ray", lambda *_: pytest.fail("Ray started"))
    assert main(["grpo", "--resume", f"logging.run_dir={tmp_path}", "logging.name=run"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "no usable checkpoint" in err, err


@pytest.mark.parametrize("error", [KeyboardInterrupt(), OSError(28, "No space left on device")])
def test_a_checkpoint_cut_off_leaves_the_previous_one_whole(
    error: BaseException, tmp_path: Path, runtime: TrainerRuntime
) -> None:
    checkpoints = _two_checkpoints(tmp_path, runtime)
    with pytest.raises(type(error)):
        checkpoints.save(3, TrainerRuntime(error), {})
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [
        "latest",
        "step_1",
        "step_2",
    ]
    assert checkpoints.load(runtime)["step"] == 2


def test_a_checkpoint_killed_mid_write_leaves_the_previous_one_whole(tmp_path: Path) -> None:
    """kill -9 while the shards are written: the next load and the next save ignore the rest."""
    code = textwrap.dedent(f"""
        import os, signal, sys
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from test_faults import TrainerRuntime
        from tandem.runs import Checkpoints
        from tandem.config.models import CheckpointConfig
        runtime = TrainerRuntime()
        checkpoints = Checkpoints(__import__("pathlib").Path({str(tmp_path)!r}), CheckpointConfig())
        checkpoints.save(1, runtime, {{}})
        runtime.fail_after_write = None
        save = runtime.trainer.save_checkpoint
        def dies(path):
            save(path)
            os.kill(os.getpid(), signal.SIGKILL)
        runtime.save_checkpoint = dies
        checkpoints.save(2, runtime, {{}})
    """)
    result = subprocess.run([sys.executable, "-c", code], timeout=120, capture_output=True)
    assert result.returncode == -signal.SIGKILL, result.stderr.decode()[-2000:]
    checkpoints = Checkpoints(tmp_path, CheckpointConfig())
    latest = checkpoints.latest()
    assert latest is not None and latest.name == "step_1"
    assert [p.name for p in (tmp_path / "checkpoints").glob("step_*")] == ["step_1"]


def _saved_run(tmp: Path, *overrides: str) -> GrpoConfig:
    config = load_config(GrpoConfig, None, [f"logging.run_dir={tmp}", "logging.name=run"])
    run = tmp / "run"
    (run / "checkpoints" / "step_1").mkdir(parents=True)
    for name in ("COMPLETE", "driver_state.json", "trainer/trainer_state.json"):
        _write(run / "checkpoints" / "step_1" / name, '{"step": 1}')
    (run / "checkpoints" / "latest").write_text("step_1")
    (run / "config.json").write_text(json.dumps(config.model_dump(mode="json")))
    return load_config(GrpoConfig, None, [f"logging.run_dir={tmp}", "logging.name=run", *overrides])


def test_resume_refuses_changed_keys_naming_old_and_new(tmp_path: Path) -> None:
    config = _saved_run(
        tmp_path, f"policy.model_path={tmp_path}", "policy.optimizer.lr=0.5", "algorithm.seed=7"
    )
    with pytest.raises(ValueError) as info:
        check_run_dir(config, "grpo", resume=True)
    message = str(info.value)
    for key in ("policy.model_path", "policy.optimizer.lr: 1e-05 -> 0.5", "algorithm.seed: 0 -> 7"):
        assert key in message, message


def test_resume_accepts_keys_that_may_change(tmp_path: Path) -> None:
    config = _saved_run(
        tmp_path,
        "algorithm.num_steps=500",
        "algorithm.eval_every=1",
        "logging.progress=false",
        "checkpoint.every=3",
        "checkpoint.keep=5",
        "data.reward_timeout_s=5",
        "refit.timeout_s=10",
        "cluster.call_timeout_s=100",
        "policy.offload_weights=false",  # where the state waits, not what it trains
    )
    check_run_dir(config, "grpo", resume=True)


def test_resume_with_another_model_ends_the_command_with_2(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _saved_run(tmp_path)
    other = tmp_path / "model"
    import shutil

    shutil.copytree(DEFAULT_MODEL_DIR, other)
    monkeypatch.setattr(ray_cluster, "init_ray", lambda *_: pytest.fail("Ray started"))
    args = ["grpo", f"policy.model_path={other}", f"logging.run_dir={tmp_path}", "logging.name=run"]
    assert main([*args, "--resume"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count(": error: ") == 1, err
    assert f"policy.model_path: {DEFAULT_MODEL_DIR} -> {other}" in err, err


# ---- 5. signals inside a command ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("sig", "status", "word"),
    [(signal.SIGINT, 130, "interrupted"), (signal.SIGTERM, 143, "terminated")],
)
def test_a_signal_becomes_an_interrupt_and_silences_finalisers(
    sig: signal.Signals, status: int, word: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from tandem.interrupts import exit_status, signals_as_interrupts

    class FailsWhenFreed:
        def __del__(self) -> None:
            raise RuntimeError("engine already shut down")

    hook = sys.unraisablehook
    try:
        with pytest.raises(KeyboardInterrupt) as info, signals_as_interrupts("tandem grpo"):
            held = FailsWhenFreed()
            os.kill(os.getpid(), sig)
            time.sleep(1)  # the handler raises here
        del held
        assert exit_status(info.value) == (status, word)
        assert "engine already shut down" not in capsys.readouterr().err
    finally:
        sys.unraisablehook = hook
    assert signal.getsignal(signal.SIGINT) is not None  # the previous handlers are back


def test_a_second_ctrl_c_does_not_cut_the_cleanup_short() -> None:
    from tandem.interrupts import signals_as_interrupts

    hook, cleaned = sys.unraisablehook, False
    try:
        with pytest.raises(KeyboardInterrupt), signals_as_interrupts():
            try:
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(1)
            finally:
                os.kill(os.getpid(), signal.SIGINT)  # the impatient second Ctrl-C
                time.sleep(0.2)
                cleaned = True
    finally:
        sys.unraisablehook = hook
    assert cleaned


class Reworded(BaseException):
    """What torch's checkpoint writer makes of a KeyboardInterrupt inside it."""


class RewordingRuntime:
    def save_checkpoint(self, path: str) -> None:
        try:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(1)
        except KeyboardInterrupt:
            raise Reworded("CheckpointException ranks:dict_keys([0])") from None


def test_an_interrupt_a_library_rewords_is_still_an_interrupt(
    tmp_path: Path, runtime: TrainerRuntime
) -> None:
    from tandem.interrupts import signals_as_interrupts

    checkpoints = _two_checkpoints(tmp_path, runtime)
    hook = sys.unraisablehook
    try:
        with signals_as_interrupts(), pytest.raises(KeyboardInterrupt):
            checkpoints.save(3, RewordingRuntime(), {})
    finally:
        sys.unraisablehook = hook
    assert [p.name for p in checkpoints.complete()] == ["step_2", "step_1"]
    assert not [p for p in (tmp_path / "checkpoints").iterdir() if p.name.startswith(".")]
