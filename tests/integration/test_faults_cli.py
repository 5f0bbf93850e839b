"""Fault injection into whole ``tandem grpo`` runs on the embedded model (the default runtime: the
workers in the command's process): Ctrl-C and SIGTERM at each phase of a run, a checkpoint that
fills the disk, a damaged checkpoint on resume, a reward that hangs. Each asserts the exit
status, one message and no traceback, an end within its bound, no child process left behind,
and only complete checkpoints (docs/errors.md)."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
import pytest

pytestmark = [pytest.mark.slow]

TINY = [
    "algorithm.prompts_per_step=4",
    "algorithm.num_generations=2",
    "data.num_eval_prompts=8",
    "logging.progress=false",
    "logging.tensorboard=false",
    "logging.name=run",
]

SIGNAL_IN = """
import os, signal, {module} as target
original = target.{function}
def signalling(*args, **kwargs):
    if {inside}:
        result = original(*args, **kwargs)
        os.kill(os.getpid(), signal.{signal})
        return result
    os.kill(os.getpid(), signal.{signal})
    return original(*args, **kwargs)
target.{function} = signalling
"""
"""Patches ``module.function`` to send the run a signal as it is called (``inside``: once its
work is done, still inside the caller's block), then starts the real command."""


_STARTED: list[subprocess.Popen[str]] = []


@pytest.fixture(autouse=True)
def _no_run_outlives_its_test() -> Iterator[None]:
    """A case that fails (a run that hangs past its bound) leaves nothing running."""
    yield
    while _STARTED:
        proc = _STARTED.pop()
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _start(tmp: Path, args: list[str], prelude: str = "") -> subprocess.Popen[str]:
    code = f"{prelude}\nimport sys\nsys.argv = ['tandem', *{args!r}]\n"
    code += "from tandem.cli import entry\nentry()\n"
    env = {**os.environ, "RAY_ADDRESS": ""}
    env["PYTHONPATH"] = os.pathsep.join([str(tmp), env.get("PYTHONPATH", "")])
    proc = subprocess.Popen(
        [sys.executable, "-c", code],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=tmp,
        env=env,
        start_new_session=True,  # its own process group, as a terminal gives a command
    )
    _STARTED.append(proc)
    return proc


def _run_args(tmp: Path, *extra: str) -> list[str]:
    return ["grpo", f"logging.run_dir={tmp / 'runs'}", *TINY, *extra]


def _descendants(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def _finish(proc: subprocess.Popen[str], timeout: float) -> tuple[int, str, float]:
    start = time.monotonic()
    _, err = proc.communicate(timeout=timeout)
    return proc.returncode, err, time.monotonic() - start


def _left_behind(children: list[psutil.Process]) -> list[str]:
    """The children still running 3 s after the command ended (a resource tracker notices its
    parent's end a moment later)."""
    deadline = time.monotonic() + 3.0
    while True:
        alive = []
        for child in children:
            try:
                if child.status() != psutil.STATUS_ZOMBIE:
                    alive.append(" ".join(child.cmdline())[:200])
            except psutil.NoSuchProcess:
                pass
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.2)


def _wait_for(proc: subprocess.Popen[str], ready: Callable[[], bool], limit: float = 300) -> None:
    deadline = time.monotonic() + limit
    while not ready():
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.monotonic() < deadline, "the run never reached the point to interrupt"
        time.sleep(0.1)


def _assert_only_complete_checkpoints(run: Path) -> None:
    from tandem.runs import COMPLETE_MARKER, damage

    root = run / "checkpoints"
    if not root.exists():
        return
    leftovers = [p.name for p in root.iterdir() if p.name.startswith(".")]
    assert not leftovers, leftovers
    for step in root.glob("step_*"):
        assert (step / COMPLETE_MARKER).is_file() and damage(step) is None, step


def _assert_interrupted(code: int, err: str, seconds: float, status: int, word: str) -> None:
    assert code == status, err[-3000:]
    assert f"tandem grpo: {word}" in err, err[-3000:]
    assert "Traceback" not in err and "Exception ignored" not in err, err[-3000:]
    assert seconds < 5.0, f"{seconds:.1f} s from the signal to the exit"


def _steps_logged(tmp: Path, count: int) -> Callable[[], bool]:
    metrics = tmp / "runs" / "run" / "metrics.jsonl"
    return lambda: metrics.exists() and len(metrics.read_text().splitlines()) >= count


@pytest.mark.parametrize(
    ("when", "sig", "status", "word"),
    [
        ("setup", signal.SIGINT, 130, "interrupted"),
        ("step", signal.SIGINT, 130, "interrupted"),
        ("step", signal.SIGTERM, 143, "terminated"),
    ],
)
def test_a_signal_at_a_phase_ends_the_run_quietly(
    when: str, sig: signal.Signals, status: int, word: str, tmp_path: Path
) -> None:
    proc = _start(tmp_path, _run_args(tmp_path, "algorithm.num_steps=200", "checkpoint.every=1"))
    if when == "setup":
        time.sleep(3.0)  # importing, loading the model: no run folder yet
    else:
        _wait_for(proc, _steps_logged(tmp_path, 2))
    children = _descendants(proc.pid)
    os.killpg(proc.pid, sig)  # a terminal's Ctrl-C reaches the whole process group
    code, err, seconds = _finish(proc, timeout=30)
    _assert_interrupted(code, err, seconds, status, word)
    assert not _left_behind(children)
    _assert_only_complete_checkpoints(tmp_path / "runs" / "run")


@pytest.mark.parametrize(
    ("module", "function", "inside"),
    [
        ("tandem.checkpoint.sharded", "save", "True"),  # the trainer's shards written
        ("tandem.algorithms.grpo", "evaluate", "False"),
    ],
    ids=["checkpoint write", "evaluation"],
)
def test_ctrl_c_inside_a_checkpoint_or_an_evaluation(
    module: str, function: str, inside: str, tmp_path: Path
) -> None:
    prelude = SIGNAL_IN.format(module=module, function=function, inside=inside, signal="SIGINT")
    args = _run_args(tmp_path, "algorithm.num_steps=3", "algorithm.eval_every=2")
    proc = _start(tmp_path, [*args, "checkpoint.every=1"], prelude)
    code, err, _ = _finish(proc, timeout=300)
    assert code == 130, err[-3000:]
    assert "tandem grpo: interrupted" in err and "Traceback" not in err, err[-3000:]
    _assert_only_complete_checkpoints(tmp_path / "runs" / "run")


def test_ctrl_c_while_a_user_reward_scores_leaves_no_worker(tmp_path: Path) -> None:
    (tmp_path / "slow_reward.py").write_text(
        "import time\ndef score(prompt, response, answer):\n    time.sleep(600)\n"
    )
    args = _run_args(tmp_path, "algorithm.num_steps=5", "data.reward=slow_reward:score")
    proc = _start(tmp_path, args)
    _wait_for(
        proc, lambda: any("spawn_main" in " ".join(c.cmdline()) for c in _descendants(proc.pid))
    )
    time.sleep(3.0)  # the workers started; the first samples are being scored
    children = _descendants(proc.pid)
    os.killpg(proc.pid, signal.SIGINT)
    code, err, seconds = _finish(proc, timeout=30)
    _assert_interrupted(code, err, seconds, 130, "interrupted")
    assert "KeyboardInterrupt" not in err
    assert not _left_behind(children)


def test_a_hung_reward_ends_the_run_at_its_bound(tmp_path: Path) -> None:
    (tmp_path / "hung_reward.py").write_text(
        "import signal, time\ndef score(prompt, response, answer):\n"
        "    signal.signal(signal.SIGTERM, signal.SIG_IGN)\n    time.sleep(600)\n"
    )
    args = _run_args(
        tmp_path,
        "algorithm.num_steps=2",
        "data.reward=hung_reward:score",
        "data.reward_timeout_s=2",
    )
    proc = _start(tmp_path, args)
    code, err, _ = _finish(proc, timeout=240)
    assert code == 2, err[-3000:]
    assert err.count("tandem grpo: error: ") == 1 and "Traceback" not in err, err[-3000:]
    assert "took longer than data.reward_timeout_s=2 s" in err
    assert not _descendants(proc.pid)


def test_resume_falls_back_from_a_damaged_checkpoint(tmp_path: Path) -> None:
    first = _start(tmp_path, _run_args(tmp_path, "algorithm.num_steps=2", "checkpoint.every=1"))
    code, err, _ = _finish(first, timeout=300)
    assert code == 0, err[-3000:]
    step_2 = tmp_path / "runs" / "run" / "checkpoints" / "step_2"
    shard = max((step_2 / "trainer" / "shards").glob("*.distcp"), key=lambda p: p.stat().st_size)
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    resumed = _start(tmp_path, [*_run_args(tmp_path, "algorithm.num_steps=3"), "--resume"])
    code, err, _ = _finish(resumed, timeout=300)
    assert code == 0, err[-3000:]
    assert "step_2 is damaged" in err and "Traceback" not in err, err[-3000:]
    import json

    steps = [json.loads(line)["step"] for line in (step_2.parents[1] / "metrics.jsonl").open()]
    assert steps[-2:] == [2, 3]  # step 2 trained again from step 1's checkpoint, then step 3
    assert (step_2.parent / "damaged_step_2").is_dir()  # kept for a look, out of the way
    _assert_only_complete_checkpoints(tmp_path / "runs" / "run")


def test_resume_with_another_seed_is_refused_before_anything_starts(tmp_path: Path) -> None:
    first = _start(tmp_path, _run_args(tmp_path, "algorithm.num_steps=1"))
    assert _finish(first, timeout=300)[0] == 0
    resumed = _start(tmp_path, [*_run_args(tmp_path, "algorithm.seed=3"), "--resume"])
    code, err, _ = _finish(resumed, timeout=60)
    assert code == 2 and "algorithm.seed: 0 -> 3" in err and "Traceback" not in err, err


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a small tmpfs needs root")
def test_a_disk_that_fills_during_a_checkpoint(tmp_path: Path) -> None:
    """The run folder on a 6 MiB tmpfs: the metrics fit, the first checkpoint (model and
    optimizer state, ~10 MiB) does not."""
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=6m", "tmpfs", str(disk)])
    if mounted.returncode != 0:
        pytest.skip("this machine does not let tests mount a tmpfs")
    try:
        args = ["grpo", f"logging.run_dir={disk}", *TINY, "algorithm.num_steps=2"]
        code, err, _ = _finish(_start(tmp_path, [*args, "checkpoint.export_hf=false"]), 300)
        assert code == 1, err[-3000:]
        assert err.count("tandem grpo: error: ") == 1, err[-3000:]
        assert "No space left on device" in err and "Traceback" not in err, err[-3000:]
        assert not list((disk / "run" / "checkpoints").glob("*step_*"))
    finally:
        subprocess.run(["umount", str(disk)], check=False)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_ctrl_c_at_a_random_moment_of_a_run(seed: int, tmp_path: Path) -> None:
    """Steps, evaluations and checkpoints follow each other; the signal lands in any of them."""
    args = _run_args(tmp_path, "algorithm.num_steps=200", "algorithm.eval_every=2")
    proc = _start(tmp_path, [*args, "checkpoint.every=1"])
    _wait_for(proc, _steps_logged(tmp_path, 1))
    time.sleep(random.Random(seed).uniform(0.0, 4.0))
    children = _descendants(proc.pid)
    os.killpg(proc.pid, signal.SIGINT)
    code, err, seconds = _finish(proc, timeout=30)
    _assert_interrupted(code, err, seconds, 130, "interrupted")
    assert not _left_behind(children)
    _assert_only_complete_checkpoints(tmp_path / "runs" / "run")


def test_kill_9_at_a_random_moment_then_resume(tmp_path: Path) -> None:
    """No cleanup at all: what is on disk is whatever the kill found; --resume goes on from
    the newest complete checkpoint and the next save clears the half-written one."""
    proc = _start(tmp_path, [*_run_args(tmp_path, "algorithm.num_steps=200"), "checkpoint.every=1"])
    _wait_for(proc, _steps_logged(tmp_path, 2))
    time.sleep(random.Random(7).uniform(0.0, 2.0))
    os.killpg(proc.pid, signal.SIGKILL)
    proc.communicate(timeout=30)
    from tandem.config.models import CheckpointConfig
    from tandem.runs import Checkpoints

    run = tmp_path / "runs" / "run"
    latest = Checkpoints(run, CheckpointConfig()).latest()
    assert latest is not None
    last = int(latest.name.removeprefix("step_"))
    args = [*_run_args(tmp_path, f"algorithm.num_steps={last + 1}"), "--resume"]
    code, err, _ = _finish(_start(tmp_path, args), timeout=300)
    assert code == 0, err[-3000:]
    import json

    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").open()]
    assert steps[-1] == last + 1 and steps == sorted(set(steps)), steps
    _assert_only_complete_checkpoints(run)
