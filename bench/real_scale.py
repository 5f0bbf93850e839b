"""One cell of the real-scale matrix within one time budget: a random Qwen2.5 shape with the
151,936-token vocabulary, 32 prompts x 8 samples of up to 2048 tokens with spread lengths, fp32
masters + bf16 compute; tandem (``e2e_gpu.py``: per-phase times, trainer memory phases, the
device's memory in use, train MFU against the bf16 matmul rate and generated tokens/s against
the decode roofline of the same run) and TRL's ``GRPOTrainer`` (``trl_peer.py``) on the same
model, prompts, reward and lengths, alternating.

Every part runs in its own process under the time left: a part that fails or runs out of time
leaves one ``{"figure": "real_scale_error", ...}`` or ``real_scale_unfinished`` line (with what it
did finish: tandem's steps from the run's metrics, TRL's steps as they ended) and the cell goes
on. JSON lines go to stdout and to ``$OUT/real_scale.jsonl`` (each part's log beside it); a
``real_scale_cell`` line ends the cell with the ratio where both sides have a step.

    python bench/real_scale.py --shape 0.5b [--max-tokens 2048] [--prompts 32] [--steps 2]
        [--sides tandem trl] [--budget-s 520] [--layers 1 (CPU dry runs)]

``bench/real_scale_gpu.sh`` runs it with the matrix's settings; docs/performance.md has the
formulas and the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
GRACE_S = 30.0
"""How long a part stopped at its limit (SIGTERM: tandem shuts Ray and its trainers down as
after Ctrl-C) has before it is killed."""


class Sink:
    """Where the cell's JSON lines go: stdout and ``out/real_scale.jsonl``."""

    def __init__(self, out: Path, cell: dict[str, Any]) -> None:
        self.path = out / "real_scale.jsonl"
        self.cell = cell

    def emit(self, record: dict[str, Any]) -> None:
        line = json.dumps({**record, "cell": self.cell["name"]})
        print(line, flush=True)
        with self.path.open("a") as file:
            file.write(line + "\n")


def run_part(
    name: str, command: list[str], limit_s: float, sink: Sink, log: Path
) -> tuple[int | None, list[dict[str, Any]]]:
    """``command`` in its own process group, its JSON lines passed on as they come; SIGTERM at
    ``limit_s``, SIGKILL ``GRACE_S`` later. Returns (exit status, None past the limit; lines)."""
    env = {k: v for k, v in os.environ.items() if k != "BENCH_JSONL"}  # this sink writes them
    lines: list[dict[str, Any]] = []
    with log.open("w") as stderr, log.with_suffix(".stdout").open("w") as stdout:
        child = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=stderr, text=True, env=env,
            start_new_session=True,
        )  # fmt: skip

        def read() -> None:
            assert child.stdout is not None
            for text in child.stdout:
                stdout.write(text)
                if text.startswith('{"figure"'):
                    lines.append(json.loads(text))
                    sink.emit({**lines[-1], "part": name})

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        try:
            rc: int | None = child.wait(timeout=max(limit_s, 1.0))
        except subprocess.TimeoutExpired:
            rc = None
            stop(child)
        reader.join(timeout=10)
    return rc, lines


def stop(child: subprocess.Popen) -> None:
    """SIGTERM to the part's process group, then SIGKILL if it is still there after the grace.
    Not SIGINT: a shell starts background jobs with SIGINT ignored, and their children inherit
    that, so a matrix run from ``nohup ... &`` never stopped a part before the SIGKILL."""
    for sig, wait in ((signal.SIGTERM, GRACE_S), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(child.pid, sig)
            child.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue
        except ProcessLookupError:
            return


def stop_ray(python: str) -> None:
    """``ray stop --force`` (on the GPU machine every Ray process is this cell's)."""
    command = [python, "-m", "ray.scripts.scripts", "stop", "--force"]
    subprocess.run(command, capture_output=True, timeout=120, check=False)


def tail(log: Path, chars: int = 1500) -> str:
    text = log.read_text(errors="replace") if log.exists() else ""
    return text[-chars:]


def failure(part: str, rc: int | None, limit_s: float, log: Path) -> dict[str, Any]:
    """The line a part that did not finish leaves."""
    text = tail(log, 20000)
    if rc is None:
        return {"figure": "real_scale_unfinished", "part": part, "limit_s": round(limit_s)}
    why = "out of memory" if "OutOfMemoryError" in text or "out of memory" in text else "failed"
    return {"figure": "real_scale_error", "part": part, "rc": rc, "why": why, "log": tail(log)}


def tandem_steps(run_dir: Path) -> list[dict[str, Any]]:
    """The steps a tandem run wrote to its metrics (also when it was stopped)."""
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in records if "timing/step_s" in r]


def median_after_first(values: list[float]) -> float | None:
    return statistics.median(values[1:] or values) if values else None


class ProcessMemory:
    """Each GPU process's memory (``nvidia-smi``), sampled every second while a part runs:
    the peak per process, named by its command line (Ray names its actors' processes
    ``ray::<Actor>``), so the trainer's and the generator's show apart. Nothing without
    ``nvidia-smi``."""

    QUERY = ("nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits")

    def __init__(self) -> None:
        self.peaks: dict[str, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.is_set():
            try:
                out = subprocess.run(self.QUERY, capture_output=True, text=True, timeout=10)
            except (OSError, subprocess.TimeoutExpired):
                return
            for row in out.stdout.splitlines():
                pid, _, mib = row.partition(",")
                if mib.strip().isdigit():
                    name = f"{self._name(pid.strip())} ({pid.strip()})"
                    self.peaks[name] = max(self.peaks.get(name, 0), int(mib))
            self._stop.wait(1.0)

    @staticmethod
    def _name(pid: str) -> str:
        try:
            words = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            return "?"
        text = " ".join(w.decode(errors="replace") for w in words[:3] if w)
        return text[:80]

    def __enter__(self) -> ProcessMemory:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=15)


def prepare(args: argparse.Namespace) -> None:
    """(In its own process) the model folder and the prompts both sides train on."""
    import torch
    import transformers
    from e2e_gpu import model_dir

    from tandem.config import DataConfig
    from tandem.data.prompts import make_prompt_source

    start = time.perf_counter()
    cuda = torch.cuda.is_available()
    args.real_vocab = True
    path = model_dir(args.shape, args, args.root, cuda)
    source = make_prompt_source(DataConfig(), path, lambda *_: 0.0, seed=0)
    rows = source.train_prompts(0, args.prompts * args.steps)
    prompts = args.root / f"prompts-{args.prompts}x{args.steps}.jsonl"
    prompts.write_text("".join(json.dumps(row) + "\n" for row in rows))
    record = {
        "figure": "real_scale_prepare",
        "model": str(path),
        "prompts": str(prompts),
        "seconds": round(time.perf_counter() - start, 1),
        "cuda": cuda,
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }
    print(json.dumps(record), flush=True)


def tandem_command(args: argparse.Namespace) -> list[str]:
    command = [args.python, str(BENCH / "e2e_gpu.py"), "--shapes", args.shape, "--real-vocab"]
    command += ["--mean-length", str(args.mean_length), "--max-tokens", str(args.max_tokens)]
    command += ["--steps", str(args.steps), "--prompts", str(args.prompts)]
    command += ["--generations", str(args.generations), "--mixed-precision"]
    command += ["--activation-checkpointing", "--micro-batch-size", str(args.micro_batch_size)]
    command += ["--max-tokens-per-micro-batch", str(args.max_tokens_per_micro_batch)]
    command += [] if args.layers is None else ["--layers", str(args.layers)]
    return command + [arg for item in args.overrides for arg in ("--set", item)]


def decode_command(args: argparse.Namespace, ready: dict[str, Any]) -> list[str]:
    """The generator alone on the cell's model: by default its decode now and with the attention
    it had before its windows (``hf_generate_gpu.py``'s ``tandem_whole_reads``), against the
    roofline; ``--decode-paths`` picks others (``tandem_compiled``)."""
    command = [args.python, str(BENCH / "hf_generate_gpu.py"), "--model", ready["model"]]
    command += ["--max-tokens", str(args.max_tokens), "--prompts", str(args.prompts)]
    command += ["--generations", str(args.generations), "--rounds", "1", "--roofline"]
    return [*command, "--paths", *args.decode_paths]


def trl_command(args: argparse.Namespace, ready: dict[str, Any], label: str) -> list[str]:
    command = [args.trl_python, str(BENCH / "trl_peer.py"), f"--model={ready['model']}"]
    command += [f"--prompts={ready['prompts']}", "--reward=digit_fraction", "--lr=1e-5"]
    command += [f"--steps={args.trl_steps}", f"--prompts-per-step={args.prompts}"]
    command += [f"--generations={args.generations}", f"--max-tokens={args.max_tokens}"]
    command += [f"--micro-batch={args.trl_micro_batch}", f"--label={label}"]
    return command + (["--bf16"] if ready["cuda"] else [])  # fp32 masters + bf16 autocast


class Cell:
    """The parts of one cell in order, each under the time left, and what they leave."""

    def __init__(self, args: argparse.Namespace, sink: Sink) -> None:
        self.args, self.sink = args, sink
        self.deadline = time.monotonic() + args.budget_s
        self.ready: dict[str, Any] = {}
        self.results: dict[str, list[dict[str, Any]]] = {"tandem": [], "trl": [], "decode": []}
        self.took: dict[str, float] = {}

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def part(
        self, name: str, command: list[str], reserve: float = 0.0
    ) -> tuple[bool, list[dict[str, Any]]] | None:
        """Run one part with the time left less ``reserve`` (and the grace a stop takes):
        whether it finished (else its line says why) and the lines it printed; None where no
        time was left for it."""
        kind = name.split("-")[0]
        limit = self.left() - reserve - GRACE_S - 5
        if limit < self.took.get(kind, 0.0) or limit < 10:  # as long as its last run took
            self.sink.emit({"figure": "real_scale_skipped", "part": name, "left_s": int(limit)})
            return None
        log = self.args.out / f"{self.sink.cell['name']}-{name}.log"
        start = time.monotonic()
        with ProcessMemory() as memory:
            rc, lines = run_part(name, command, limit, self.sink, log)
        self.took[kind] = time.monotonic() - start
        if memory.peaks:
            record = {"figure": "real_scale_process_memory", "part": name, "peak_mib": memory.peaks}
            self.sink.emit(record)
        if rc != 0:
            self.sink.emit({**failure(name, rc, limit, log), "lines": len(lines)})
        return rc == 0, lines

    def prepare(self) -> bool:
        args = self.args
        command = [args.python, __file__, "--prepare", *sys.argv[1:]]
        _, lines = self.part("prepare", command) or (False, [])
        found = [line for line in lines if line["figure"] == "real_scale_prepare"]
        self.ready = found[0] if found else {}
        return bool(found)

    def tandem(self, round_index: int, reserve: float) -> None:
        run = self.args.root / "runs" / Path(self.ready["model"]).name
        shutil.rmtree(run, ignore_errors=True)  # (e2e_gpu does too, once it has started)
        done = self.part(f"tandem-{round_index}", tandem_command(self.args), reserve)
        if done is None:
            return
        medians = [line for line in done[1] if line["figure"] == "e2e_gpu_median"]
        if medians:
            self.results["tandem"].append(medians[0])
            return
        if self.ready["cuda"]:  # a stopped run's Ray processes would hold the GPU for TRL
            stop_ray(self.args.python)
        steps = tandem_steps(run)  # what it did finish
        if steps:
            step_s = median_after_first([r["timing/step_s"] for r in steps])
            partial = {"figure": "real_scale_tandem_partial", "steps": len(steps)}
            self.sink.emit({**partial, "step_s": step_s, "last": steps[-1]})
            self.results["tandem"].append({**steps[-1], "timing/step_s": step_s, "partial": True})

    def decode(self, round_index: int) -> None:
        done = self.part(f"decode-{round_index}", decode_command(self.args, self.ready))
        lines = [] if done is None else done[1]
        self.results["decode"] += [line for line in lines if line["figure"] == "hf_generate_s"]

    def trl(self, round_index: int) -> None:
        label = f"{self.args.shape}-{round_index}"
        done = self.part(f"trl-{round_index}", trl_command(self.args, self.ready, label))
        if done is None:
            return
        finished, lines = done
        steps = [line["value"] for line in lines if line["figure"] == "trl_step_s"]
        if steps:  # a run stopped at its limit: the steps it finished count
            self.results["trl"].append({"steps": steps, "finished": finished})

    def summary(self) -> dict[str, Any]:
        """The cell's line: tandem's medians and figures, TRL's steps, the ratio."""
        args = self.args
        record: dict[str, Any] = {
            "figure": "real_scale_cell",
            "shape": args.shape,
            "work": f"{args.prompts}x{args.generations}x<={args.max_tokens} tokens",
            "mean_length": args.mean_length,
            "device": self.ready.get("device"),
            "micro_batch": [args.micro_batch_size, args.max_tokens_per_micro_batch],
            "trl_micro_batch": args.trl_micro_batch,
        }
        tandem = [r["timing/step_s"] for r in self.results["tandem"]]
        keep = [f"timing/{phase}_s" for phase in ("generate", "train", "logprobs", "refit")]
        keep += ["train_mfu", "decode_roofline_fraction", "gen_tokens_per_s", "mismatch_max"]
        keep += ["train/response_len_mean", "device_used_peak_bytes", "partial"]
        if self.results["tandem"]:
            last = self.results["tandem"][-1]
            record.update({k: last.get(k) for k in keep})
        trl_runs = self.results["trl"]
        # TRL's median step after its first; a run with one step gives that (warm-up included)
        trl = [statistics.median(run["steps"][1:] or run["steps"]) for run in trl_runs]
        record.update(
            tandem_step_s=statistics.median(tandem) if tandem else None,
            tandem_runs=tandem,
            trl_step_s=statistics.median(trl) if trl else None,
            trl_runs=[run["steps"] for run in trl_runs],
            trl_finished=[run["finished"] for run in trl_runs],
        )
        if tandem and trl:
            record["ratio"] = round(statistics.median(tandem) / statistics.median(trl), 3)
        for line in self.results["decode"]:  # the generator alone
            shown = ("tokens_per_s", "decode_roofline_fraction", "value", "forward_ms_per_step")
            record[f"decode_{line['path']}"] = {k: line.get(k) for k in shown}
        return record


def run_cell(args: argparse.Namespace, sink: Sink) -> None:
    cell = Cell(args, sink)
    sink.emit({"figure": "real_scale_start", **{k: str(v) for k, v in vars(args).items()}})
    if not cell.prepare():
        return
    for round_index in range(args.rounds):
        for index, side in enumerate(args.sides):
            if side == "tandem":  # leave TRL its time when it follows in this round
                follows = "trl" in args.sides[index + 1 :]
                cell.tandem(round_index, args.trl_reserve_s if follows else 0.0)
            elif side == "decode":
                cell.decode(round_index)
            else:
                cell.trl(round_index)
    sink.emit(cell.summary())


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--shape", required=True, choices=["0.5b", "1.5b", "3b", "7b"])
    parser.add_argument("--max-tokens", type=int, default=2048)
    parser.add_argument("--mean-length", type=float, default=None, help="default: max / 4")
    parser.add_argument("--prompts", type=int, default=32, help="fewer to fit a time limit")
    parser.add_argument("--generations", type=int, default=8)
    parser.add_argument("--steps", type=int, default=2, help="tandem's (medians after the 1st)")
    parser.add_argument("--trl-steps", type=int, default=2)
    parser.add_argument("--micro-batch-size", type=int, default=64)
    parser.add_argument("--max-tokens-per-micro-batch", type=int, default=65536)
    parser.add_argument("--trl-micro-batch", type=int, default=8)
    parser.add_argument(
        "--decode-paths",
        nargs="+",
        default=["tandem_cuda_graphs", "tandem_whole_reads"],
        help="--sides decode: hf_generate_gpu.py's paths",
    )
    parser.add_argument(
        "--sides", nargs="+", default=["tandem", "trl"], choices=["tandem", "trl", "decode"]
    )
    parser.add_argument("--rounds", type=int, default=1, help="more while time is left")
    parser.add_argument("--budget-s", type=float, default=520.0, help="the whole cell")
    parser.add_argument("--trl-reserve-s", type=float, default=150.0, help="kept for TRL")
    parser.add_argument("--layers", type=int, default=None, help="fewer layers (CPU checks)")
    parser.add_argument("--python", default=sys.executable)
    parser.add_argument("--trl-python", default=sys.executable, help="a Python that has TRL")
    parser.add_argument("--root", type=Path, default=Path(tempfile.gettempdir()) / "tandem-e2e")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "/tmp/real-scale")))
    parser.add_argument("--set", dest="overrides", action="append", default=[], help="tandem")
    parser.add_argument("--prepare", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.mean_length = args.mean_length or args.max_tokens / 4  # tens of tokens to the cap
    return args


def main() -> None:
    args = parse()
    if args.prepare:
        prepare(args)
        return
    args.out.mkdir(parents=True, exist_ok=True)
    args.root.mkdir(parents=True, exist_ok=True)
    name = f"{args.shape}-{args.max_tokens}-{args.prompts}x{args.generations}"
    sink = Sink(args.out, {"name": name})
    try:
        run_cell(args, sink)
    except Exception as err:  # the cell's line, not a traceback that hides the parts' lines
        sink.emit({"figure": "real_scale_error", "part": "cell", "why": repr(err)[:1500]})
        sys.exit(1)


if __name__ == "__main__":
    main()
