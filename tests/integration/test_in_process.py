"""``cluster.runtime=in_process`` as a user runs it: ``tandem grpo`` with the trainer and the
generator in its own process, no Ray started (``cluster/launch.py``)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow]

RUN = """
import json, sys
from tandem.cli import main
code = main(sys.argv[1:])
print(json.dumps({"code": code, "ray_imported": "ray" in sys.modules}))
sys.exit(code)
"""


def _grpo(tmp_path: Path, *overrides: str) -> subprocess.CompletedProcess[str]:
    args = [
        "grpo",
        "cluster.runtime=in_process",
        "generation.backend=hf",
        "algorithm.num_steps=3",
        "algorithm.prompts_per_step=4",
        "algorithm.num_generations=4",
        "algorithm.eval_every=3",
        "data.num_eval_prompts=8",
        "policy.optimizer.lr=1e-3",
        "logging.progress=false",
        "logging.tensorboard=false",
        f"logging.run_dir={tmp_path}",
        "logging.name=inproc",
        *overrides,
    ]
    return subprocess.run(
        [sys.executable, "-c", RUN, *args], capture_output=True, text=True, timeout=600
    )


def test_a_grpo_run_in_process_starts_no_ray_and_refits_every_step(tmp_path: Path) -> None:
    out = _grpo(tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result == {"code": 0, "ray_imported": False}
    # the terminal shows the run's own lines; the libraries' go to the run's log
    assert "workers: in this process" in out.stderr and "step    1  loss" in out.stderr
    assert "Loading weights" not in out.stderr + out.stdout
    run = tmp_path / "inproc"
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [row for row in rows if "train/loss" in row]
    assert [row["step"] for row in steps] == [1, 2, 3]
    # the generator sampled with the weights the trainer had: every refit landed (a generator
    # left on the step-1 weights differs from a policy trained at lr 1e-3 by far more)
    assert all(row["gen/logprob_mismatch"] < 1e-5 for row in steps), steps
    assert all(row["refit/gb_per_s"] > 0 for row in steps[:-1])
    assert any("eval/accuracy" in row for row in rows)
    assert (run / "hf" / "model.safetensors").is_file()
    assert (run / "checkpoints" / "latest").is_file()


HEAP = """
import ctypes, json, sys, torch
from tandem.cluster.launch import keep_freed_host_memory

class MallInfo2(ctypes.Structure):  # glibc's struct mallinfo2, every field a size_t
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]

libc = ctypes.CDLL(None)
libc.mallinfo2.restype = MallInfo2
if sys.argv[1] == "keep":
    assert keep_freed_host_memory()
tensor = torch.empty(25_000_000)  # 100 MB, above glibc's largest mmap threshold
alive = libc.mallinfo2()
del tensor
freed = libc.mallinfo2()
print(json.dumps({"mapped_alive": alive.hblkhd, "free_in_heap_after": freed.fordblks}))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_the_driver_keeps_the_host_memory_it_frees() -> None:
    """With ``keep_freed_host_memory`` (the in-process runtime's), a 100 MB tensor comes from
    glibc's heap and its memory stays there once freed, for the next step's to reuse; in a
    process without, glibc maps it apart and unmaps it on free, and the next step faults it in
    again, page by page (``mallinfo2``, glibc >= 2.33)."""

    def heap(mode: str) -> dict[str, int]:
        out = subprocess.run(
            [sys.executable, "-c", HEAP, mode], capture_output=True, text=True, timeout=300
        )
        assert out.returncode == 0, out.stderr[-3000:]
        return json.loads(out.stdout.strip().splitlines()[-1])

    plain, kept = heap("plain"), heap("keep")
    size = 100_000_000
    assert plain["mapped_alive"] >= size  # the control: mapped apart
    assert plain["free_in_heap_after"] < size
    assert kept["mapped_alive"] < size
    assert kept["free_in_heap_after"] >= 0.9 * size
