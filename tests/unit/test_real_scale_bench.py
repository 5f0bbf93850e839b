"""``bench/real_scale.py``'s parts (the GPU matrix, one cell per call): a part past its time
limit is stopped with what it printed kept, a failing part is named with why, and a stopped
tandem run's finished steps are read back from its metrics."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import real_scale


@pytest.fixture
def sink(tmp_path: Path) -> real_scale.Sink:
    return real_scale.Sink(tmp_path, {"name": "test"})


def test_a_part_past_its_limit_is_stopped_and_keeps_its_lines(
    tmp_path: Path, sink: real_scale.Sink
) -> None:
    # SIGINT ignored, as in every process a shell starts in the background
    script = "import json, signal, time; signal.signal(signal.SIGINT, signal.SIG_IGN);"
    script += " print(json.dumps({'figure': 'trl_step_s', 'value': 1.5}), flush=True);"
    script += " time.sleep(60)"
    log = tmp_path / "part.log"
    start = time.monotonic()
    rc, lines = real_scale.run_part("trl-0", [sys.executable, "-c", script], 3, sink, log)
    assert time.monotonic() - start < 20  # the stop ended it, not the sleep or the SIGKILL
    assert rc is None and lines == [{"figure": "trl_step_s", "value": 1.5}]
    written = [json.loads(line) for line in sink.path.read_text().splitlines()]
    assert written == [{"figure": "trl_step_s", "value": 1.5, "part": "trl-0", "cell": "test"}]
    assert real_scale.failure("trl-0", rc, 3, log)["figure"] == "real_scale_unfinished"


def test_a_failing_part_says_why(tmp_path: Path, sink: real_scale.Sink) -> None:
    script = "import sys; sys.exit('torch.OutOfMemoryError: CUDA out of memory')"
    log = tmp_path / "part.log"
    rc, lines = real_scale.run_part("tandem-0", [sys.executable, "-c", script], 30, sink, log)
    assert rc == 1 and lines == []
    line = real_scale.failure("tandem-0", rc, 30, log)
    assert line["figure"] == "real_scale_error" and line["why"] == "out of memory"
    assert "OutOfMemoryError" in line["log"]


def test_a_stopped_runs_steps_come_from_its_metrics(tmp_path: Path) -> None:
    records = [{"step": 0, "eval/accuracy": 0.1}]
    records += [{"step": s, "timing/step_s": t} for s, t in ((1, 30.0), (2, 10.0), (3, 12.0))]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    steps = real_scale.tandem_steps(tmp_path)
    assert [s["step"] for s in steps] == [1, 2, 3]
    assert real_scale.median_after_first([s["timing/step_s"] for s in steps]) == 11.0
    assert real_scale.tandem_steps(tmp_path / "none") == []
