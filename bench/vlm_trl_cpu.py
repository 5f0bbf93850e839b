"""tandem's ``grpo_visual`` recipe against TRL's GRPOTrainer on the same vision-language work,
on this CPU machine, runs alternating.

The work: the embedded tiny Qwen2.5-VL (``embedded:tiny-qwen2.5-vl``) on the embedded visual task
(name the colour of the shapes in a 48x48 image), the recipe's group size, completion length,
learning rate and temperature, ``--prompts`` prompts a step, ``--steps`` steps. The task's
images and ``train.jsonl`` (``question``, ``answer``, ``image`` path) are written once, by the
task's own writer, and both sides read that file: tandem as a data file with an image column
(``tandem grpo --config grpo_visual data.task=jsonl data.train_path=... data.image_key=image
cluster.runtime=in_process``), TRL through ``trl_peer.py --image-key image`` (conversational
prompts, an ``image`` column, the model's ``AutoProcessor``; the prompt token ids are tandem's).

TRL's side needs the Qwen2.5-VL processor, which transformers builds only where torchvision
imports. PyPI has no torchvision for the CPU build of torch that tandem's lock installs (and the
scratch venv of ``e2e_cpu.py`` copies), so the bench first runs TRL there for one step and
prints what failed (``vlm_trl_cpu_probe``), then runs it in a second scratch venv with PyPI's
torch of the same version (its CUDA build, which runs on a CPU) and the torchvision that
matches it. ``--venv-control`` also runs e2e_cpu's ``short`` text workload with TRL in both venvs
each round: the step-time ratio of the two torch builds on the same text work.

Per run one JSON line (median step after the first, fastest step, whole process, load), per
round the ratio tandem/TRL, then the medians over rounds, their spread, the median ratio and the
machine. A failure of TRL's run prints one line with the exception's last line instead.

    ./run.sh python bench/vlm_trl_cpu.py [--prompts 8] [--steps 10] [--rounds 3]
        [--venv-control] [--trl-no-gradient-checkpointing]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
from importlib.metadata import version
from pathlib import Path

import e2e_cpu
from ceilings import emit
from e2e_cpu import GENERATIONS, TRL_VERSION, Run, run_line, run_tandem, run_trl, spread

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"
NAME = "visual"


def recipe_workload(prompts: int, steps: int) -> dict:
    """``grpo_visual``'s group size, completion length, learning rate and temperature, with
    ``prompts`` prompts a step and ``steps`` steps, as an ``e2e_cpu`` workload."""
    from tandem.config import GrpoConfig
    from tandem.config.load import load_config

    config = load_config(GrpoConfig, "grpo_visual", [])
    if config.algorithm.num_generations != GENERATIONS:
        raise SystemExit(f"grpo_visual's group is {config.algorithm.num_generations}")
    return {
        "prompts": prompts,
        "steps": steps,
        "max_tokens": config.generation.sampling.max_tokens,
        "reward": config.data.reward,
        "lr": config.policy.optimizer.lr,
        "temperature": config.generation.sampling.temperature,
        "model": None,
    }


def write_task(root: Path, count: int) -> Path:
    """``count`` training images of the visual task and their ``train.jsonl`` (written once)."""
    from tandem.data.visual import scenes, write_split

    folder = root / f"visual-{count}"
    path = folder / "train.jsonl"
    if not path.is_file():
        write_split(folder, "train", scenes(count, 0, held_out=False))
    return path


def vision_python(root: Path) -> Path:
    """A scratch venv with TRL, PyPI's torch of tandem's version and its torchvision."""
    venv = root / f"trl-{TRL_VERSION}-vision"
    python = venv / "bin" / "python"
    if python.exists():
        return python
    subprocess.run(["uv", "venv", "-q", "--python", sys.executable, str(venv)], check=True)
    same = [f"{name}=={version(name)}" for name in ("transformers", "peft", "pillow")]
    torch = f"torch=={version('torch').split('+')[0]}"
    packages = [torch, "torchvision", *same, f"trl=={TRL_VERSION}", "datasets", "accelerate"]
    subprocess.run(
        ["uv", "pip", "install", "-q", "--compile-bytecode", "--python", str(python), *packages],
        check=True,
    )
    return python


def with_pillow(python: Path) -> Path:
    """``python``'s venv with tandem's Pillow (image files; e2e_cpu's venv has none)."""
    pillow = f"pillow=={version('pillow')}"
    subprocess.run(["uv", "pip", "install", "-q", "--python", str(python), pillow], check=True)
    return python


def last_error(text: str) -> str:
    """The last exception of a traceback: its type and first sentence (transformers' import
    errors wrap it over lines)."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    starts = [i for i, line in enumerate(lines) if re.match(r"^[\w.]+(Error|Exception)\b", line)]
    if not starts:
        return lines[-1] if lines else ""
    message = " ".join(lines[starts[-1] : starts[-1] + 3])
    return message.split(". ")[0].rstrip(".") + "."


def trl_versions(python: Path) -> dict[str, str]:
    code = (
        "import json, importlib.metadata as m\n"
        "names = ['trl', 'torch', 'torchvision', 'transformers']\n"
        "def v(n):\n    try: return m.version(n)\n    except m.PackageNotFoundError: return None\n"
        "print(json.dumps({n: v(n) for n in names}))"
    )
    out = subprocess.run([str(python), "-c", code], capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def run_trl_images(python: Path, train: Path, index: int, no_checkpointing: bool) -> Run:
    """``trl_peer.py`` on the visual workload, its images, under ``python``."""
    from tandem.assets import VISUAL_MODEL_DIR

    work = e2e_cpu.WORKLOADS[NAME]
    extra = ("--image-key=image", "--prompt-key=question", f"--temperature={work['temperature']}")
    extra += ("--no-gradient-checkpointing",) if no_checkpointing else ()
    lr = float(work["lr"])
    return run_trl(NAME, VISUAL_MODEL_DIR, train, python, index, 0, lr, extra)


def probe(python: Path, train: Path, venv: str) -> bool:
    """One line: whether TRL runs the visual work (2 steps) under ``python``, else what failed."""
    saved = dict(e2e_cpu.WORKLOADS[NAME])
    e2e_cpu.WORKLOADS[NAME]["steps"] = 2
    try:
        run_trl_images(python, train, -1, no_checkpointing=False)
        error = None
    except RuntimeError as failed:
        error = last_error(str(failed))
    finally:
        e2e_cpu.WORKLOADS[NAME] = saved
    line = {"figure": "vlm_trl_cpu_probe", "venv": venv, **trl_versions(python)}
    emit({**line, "runs": error is None, **({"error": error} if error else {})})
    return error is None


def machine() -> dict:
    """The CPU's name, the cores this process may use and OMP_NUM_THREADS (unset: None)."""
    cpuinfo = Path("/proc/cpuinfo")
    names = [line for line in cpuinfo.read_text().splitlines() if line.startswith("model name")]
    return {
        "cpu": names[0].split(":", 1)[1].strip() if names else platform.processor(),
        "cores": len(os.sched_getaffinity(0)),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
    }


def control(pythons: dict[str, Path], root: Path, index: int, runs: dict[str, list[Run]]) -> None:
    """e2e_cpu's ``short`` text workload with TRL under each venv (the torch builds' ratio),
    in the opposite order every other round."""
    from tandem.assets import DEFAULT_MODEL_DIR

    work = e2e_cpu.WORKLOADS["short"]
    folder = root / "vlm-control"
    folder.mkdir(exist_ok=True)
    prompts = e2e_cpu.prompts_file(
        DEFAULT_MODEL_DIR, int(work["prompts"]), int(work["steps"]), folder
    )
    order = list(pythons) if index % 2 == 0 else list(pythons)[::-1]
    for venv in order:
        python = pythons[venv]
        run = run_trl("short", DEFAULT_MODEL_DIR, prompts, python, index, 0, float(work["lr"]))
        runs[venv].append(run)
        emit({**run_line("short", f"trl_{venv}", index, run), "figure": "vlm_trl_cpu_control"})


def summary(runs: dict[str, list[Run]], loads: list[float], versions: dict) -> dict:
    tandem, trl = runs["tandem"], runs["trl"]
    ratios = [t[0] / r[0] for t, r in zip(tandem, trl, strict=True)]
    return {
        "figure": "vlm_trl_cpu_vs_trl",
        "workload": {k: v for k, v in e2e_cpu.WORKLOADS[NAME].items() if k != "model"},
        "generations": GENERATIONS,
        "rounds": len(ratios),
        "tandem_step_s": round(statistics.median(t[0] for t in tandem), 4),
        "trl_step_s": round(statistics.median(r[0] for r in trl), 4),
        "round_ratios": [round(r, 3) for r in ratios],
        "median_ratio": round(statistics.median(ratios), 3),
        "tandem_step_spread": spread([t[0] for t in tandem]),
        "trl_step_spread": spread([r[0] for r in trl]),
        "fastest_step_ratio": round(min(t[4] for t in tandem) / min(r[4] for r in trl), 3),
        "tandem_process_s": round(statistics.median(t[1] for t in tandem), 2),
        "trl_process_s": round(statistics.median(r[1] for r in trl), 2),
        "load_avg_1m_spread": spread(loads),
        "tandem_torch": version("torch"),
        "trl_side": versions,
        **machine(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--prompts", type=int, default=8, help="prompts a step")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--venv-control", action="store_true", help="TRL text runs, both venvs")
    parser.add_argument("--trl-no-gradient-checkpointing", action="store_true")
    args = parser.parse_args()
    root = Path(tempfile.gettempdir()) / "tandem-e2e-cpu"
    root.mkdir(exist_ok=True)
    e2e_cpu.WORKLOADS[NAME] = recipe_workload(args.prompts, args.steps)
    train = write_task(root, args.prompts * args.steps)
    cpu_python = with_pillow(e2e_cpu.trl_python(root))
    probe(cpu_python, train, "torch+cpu (tandem's build), no torchvision")
    python = vision_python(root)
    if not probe(python, train, "PyPI torch and torchvision"):
        return
    versions = trl_versions(python)
    from tandem.assets import VISUAL_MODEL_DIR

    extra = ["--config", "grpo_visual", "cluster.runtime=in_process", "data.task=jsonl"]
    extra += [f"data.train_path={train}", "data.image_key=image"]
    lr = float(e2e_cpu.WORKLOADS[NAME]["lr"])
    runs: dict[str, list[Run]] = {"tandem": [], "trl": []}
    checks: dict[str, list[Run]] = {"cpu": [], "vision": []}
    loads: list[float] = []
    for index in range(args.rounds):
        order = ["tandem", "trl"] if index % 2 == 0 else ["trl", "tandem"]
        for side in order:
            if side == "trl":
                run = run_trl_images(python, train, index, args.trl_no_gradient_checkpointing)
            else:
                run = run_tandem(NAME, VISUAL_MODEL_DIR, root, index, "hf", extra, lr)
            runs[side].append(run)
            emit({**run_line(NAME, side, index, run), "figure": "vlm_trl_cpu_run"})
        tandem, trl = runs["tandem"][-1][0], runs["trl"][-1][0]
        steps = {"tandem_step_s": round(tandem, 4), "trl_step_s": round(trl, 4)}
        ratio = round(tandem / trl, 3)
        emit({"figure": "vlm_trl_cpu_round", "round": index, **steps, "ratio": ratio})
        if args.venv_control:
            control({"cpu": cpu_python, "vision": python}, root, index, checks)
        loads.append(os.getloadavg()[0])
    emit(summary(runs, loads, versions))
    if args.venv_control:
        cpu, vision = (statistics.median(r[0] for r in checks[k]) for k in ("cpu", "vision"))
        ratios = [v[0] / c[0] for c, v in zip(checks["cpu"], checks["vision"], strict=True)]
        emit(
            {
                "figure": "vlm_trl_cpu_control_ratio",
                "workload": "short (text)",
                "trl_cpu_torch_step_s": round(cpu, 4),
                "trl_pypi_torch_step_s": round(vision, 4),
                "pypi_over_cpu": round(vision / cpu, 3),
                "round_ratios": [round(r, 3) for r in ratios],
                "median_round_ratio": round(statistics.median(ratios), 3),
            }
        )


if __name__ == "__main__":
    main()
