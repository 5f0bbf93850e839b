"""The Megatron-core trainer against the FSDP2 trainer on one GPU (JSON lines).

1. Parity on a random Qwen2.5-0.5B-shaped model (real widths and vocabulary, ``--layers``
   deep): logprobs and entropies before training, the loss, grad norm and logprobs after one
   AdamW step, in fp32 (goal <= 1e-5) and bf16 (goal <= 1e-2). In fp32 also: the weight stream
   (HF names) equals the model folder's tensors, and a checkpoint saved, trained past and
   loaded gives the same logprobs.
2. Throughput at the 1.5B shape, 2048-token sequences, bf16: train-step MFU of both trainers
   (model FLOPs per token 6N + 12*L*d*S as ``bench/train_throughput.py``, over the bf16 matmul
   peak measured in the same run).
3. Megatron's offload: device bytes allocated after it (goal 0), offload/onload GB/s (medians
   of 5 rounds) against the pinned-copy ceiling measured after each round, the same tensor
   objects after onload, and equal logprobs.

    PYTHONPATH=src python bench/megatron_parity.py [--layers 24] [--skip-throughput]
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
import traceback
from pathlib import Path
from typing import Any

import torch
from ceilings import _copy_seconds, _matmul_seconds, emit
from train_throughput import train_steps

from tandem.algorithms.losses import nll_loss
from tandem.assets.real_shapes import real_config
from tandem.config.models import MegatronConfig, OptimizerConfig, PolicyConfig
from tandem.data.batch import TrainBatch


def model_dir(shape: str, layers: int | None, root: Path) -> Path:
    """A Hugging Face folder (config + bf16 safetensors) of a random Qwen2.5-``shape``."""
    import transformers

    path = root / f"qwen25-{shape}-{layers or 'all'}"
    if (path / "config.json").exists():
        return path
    torch.manual_seed(0)
    with torch.device("cuda"):
        model: Any = transformers.Qwen2ForCausalLM(real_config(shape, layers))
        model = model.to(torch.bfloat16)
    model.save_pretrained(path)
    del model
    torch.cuda.empty_cache()
    return path


def parity_batch(vocab: int, rows: int = 4, width: int = 192) -> TrainBatch:
    """Right-padded rows of different lengths, the loss on the second half of each."""
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (rows, width), generator=gen)
    attention = torch.zeros(rows, width, dtype=torch.long)
    loss_mask = torch.zeros(rows, width)
    for row in range(rows):
        length = width - 37 * row
        attention[row, :length] = 1
        loss_mask[row, length // 2 : length] = 1
    return TrainBatch(ids * attention, attention, loss_mask)


def build(backend: str, path: Path, dtype: str, **extra: Any) -> Any:
    config = PolicyConfig(
        model_path=path,
        dtype=dtype,  # type: ignore[arg-type]
        backend=backend,  # type: ignore[arg-type]
        optimizer=OptimizerConfig(lr=1e-4, max_grad_norm=1.0),
        megatron=MegatronConfig(),
        **extra,
    )
    if backend == "megatron":
        from tandem.trainer.megatron_trainer import MegatronTrainer

        return MegatronTrainer(config, device="cuda:0")
    from tandem.trainer import PolicyTrainer

    return PolicyTrainer(config, device="cuda:0")


def release(*objects: Any) -> None:
    del objects
    gc.collect()
    torch.cuda.empty_cache()


def masked_max(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> float:
    return float(((a - b).abs() * mask).max())


def masked_mean(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> float:
    """The logprob-parity alarm's measure (``gen/logprob_mismatch``): mean over loss tokens."""
    return float(((a - b).abs() * mask).sum() / mask.sum())


def run_one(backend: str, path: Path, dtype: str, batch: TrainBatch, **extra: Any) -> dict:
    trainer = build(backend, path, dtype, **extra)
    out: dict[str, Any] = {}
    out["logprobs"], out["entropy"] = trainer.logprobs(batch, with_entropy=True)
    out["train"] = trainer.train(batch, nll_loss)
    out["after"] = trainer.logprobs(batch)
    if backend == "megatron" and dtype == "float32":
        out["checks"] = megatron_checks(trainer, path, batch)
    release(trainer)
    return out


def megatron_checks(trainer: Any, path: Path, batch: TrainBatch) -> dict[str, Any]:
    """The weight stream's names and shapes against the metadata, a checkpoint's round trip,
    export_hf's folder loads back."""
    import tempfile

    import transformers

    meta = trainer.weight_metadata()
    stream = [(n, tuple(t.shape)) for n, t in trainer.iter_weights()]
    checks: dict[str, Any] = {"stream_matches_metadata": stream == [(n, s) for n, s, _ in meta]}
    with tempfile.TemporaryDirectory() as tmp:
        before = trainer.logprobs(batch)
        trainer.save_checkpoint(Path(tmp) / "ckpt", {"k": 1})
        trainer.train(batch, nll_loss)
        extra = trainer.load_checkpoint(Path(tmp) / "ckpt")
        checks["checkpoint_logprob_diff"] = float((trainer.logprobs(batch) - before).abs().max())
        checks["checkpoint_extra"] = extra
        trainer.export_hf(Path(tmp) / "export")
        lm = transformers.AutoModelForCausalLM.from_pretrained(
            str(Path(tmp) / "export"), dtype=torch.float32
        )
        hf = {n: p.float() for n, p in lm.state_dict().items()}
        ours = {n: t.float().cpu() for n, t in trainer.iter_weights()}
        checks["export_max_diff"] = max(float((hf[n] - t).abs().max()) for n, t in ours.items())
    return checks


def parity(args: argparse.Namespace, root: Path) -> None:
    """fp32 against fp32; in bf16 each backend also against the fp32 logprobs of the same (bf16
    stored) weights, the truth both round away from: the floor bf16 compute itself sets."""
    path = model_dir("0.5b", args.layers, root)
    batch = parity_batch(151_936)
    mask = batch.attention_mask.float()
    mask[:, 0] = 0
    runs = {
        "float32": (("fsdp2", {}), ("megatron", {})),
        # FSDP2 with fp32 masters and bf16 compute: like Megatron's fp32 main parameters
        "bfloat16": (("fsdp2", {"mixed_precision": True}), ("megatron", {})),
    }
    truth = None
    for dtype, goal in (("float32", 1e-5), ("bfloat16", 1e-2)):
        (ref_backend, ref_extra), (_, meg_extra) = runs[dtype]
        dtype_for_ref = "float32" if ref_extra.get("mixed_precision") else dtype
        ref = run_one(ref_backend, path, dtype_for_ref, batch, **ref_extra)
        meg = run_one("megatron", path, dtype, batch, **meg_extra)
        if truth is None:
            truth = ref["logprobs"]
        record = {
            "figure": "megatron_parity",
            "dtype": dtype,
            "fsdp2": "fp32 masters, bf16 compute" if ref_extra else dtype,
            "layers": args.layers,
            "goal": goal,
            "logprob_max_diff": masked_max(ref["logprobs"], meg["logprobs"], mask),
            "logprob_mean_diff": masked_mean(ref["logprobs"], meg["logprobs"], mask),
            "fsdp2_vs_fp32_max": masked_max(ref["logprobs"], truth, mask),
            "fsdp2_vs_fp32_mean": masked_mean(ref["logprobs"], truth, mask),
            "megatron_vs_fp32_max": masked_max(meg["logprobs"], truth, mask),
            "megatron_vs_fp32_mean": masked_mean(meg["logprobs"], truth, mask),
            "entropy_max_diff": masked_max(ref["entropy"], meg["entropy"], mask),
            "loss_fsdp2": ref["train"]["loss"],
            "loss_megatron": meg["train"]["loss"],
            "grad_norm_fsdp2": ref["train"]["grad_norm"],
            "grad_norm_megatron": meg["train"]["grad_norm"],
            "after_step_logprob_max_diff": masked_max(ref["after"], meg["after"], mask),
            "after_step_logprob_mean_diff": masked_mean(ref["after"], meg["after"], mask),
        }
        emit(record | meg.get("checks", {}))


def flops_per_token(path: Path, seq: int) -> float:
    import transformers

    config = transformers.AutoConfig.from_pretrained(str(path))
    hidden, layers = config.hidden_size, config.num_hidden_layers
    heads, kv = config.num_attention_heads, config.num_key_value_heads
    head_dim = hidden // heads
    per_layer = hidden * (heads + 2 * kv) * head_dim + heads * head_dim * hidden
    per_layer += 3 * hidden * config.intermediate_size
    n = layers * per_layer + config.vocab_size * hidden  # the LM head (tied: counted once)
    return 6 * n + 12 * layers * hidden * seq


def throughput(root: Path, peak: float) -> Any:
    path = model_dir("1.5b", None, root)
    seq, rows = 2048, 8
    ids = torch.randint(0, 151_643, (rows, seq), generator=torch.Generator().manual_seed(0))
    loss_mask = torch.ones(rows, seq)
    loss_mask[:, 0] = 0
    batch = TrainBatch(ids, torch.ones_like(ids), loss_mask)
    fpt = flops_per_token(path, seq)
    kept = None
    # FSDP2 in bf16 (bf16 parameters and Adam state), FSDP2 with fp32 masters and bf16 compute
    # (Megatron's own recipe: fp32 main parameters and Adam state), Megatron
    runs = (
        ("fsdp2", "bfloat16", {}),
        ("fsdp2", "float32", {"mixed_precision": True}),
        ("megatron", "bfloat16", {}),
    )
    for backend, dtype, extra in runs:
        gc.collect()
        before_build = torch.cuda.memory_allocated()
        trainer = build(backend, path, dtype, micro_batch_size=2, **extra)
        seconds = train_steps(trainer, batch, steps=3)
        tokens_s = rows * seq / seconds
        emit(
            {
                "figure": "megatron_train_mfu",
                "backend": backend,
                "precision": "fp32 masters, bf16 compute"
                if backend == "megatron" or extra
                else "bf16",
                "shape": "1.5b",
                "seq": seq,
                "rows": rows,
                "micro_batch_size": 2,
                "step_s": round(seconds, 4),
                "tokens_s": round(tokens_s),
                "mfu": round(fpt * tokens_s / (peak * 1e12), 4),
                "peak_tflop_s": round(peak, 1),
                "peak_mem_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2),
            }
        )
        torch.cuda.reset_peak_memory_stats()
        if backend == "megatron":
            kept = (trainer, batch, before_build)
        else:
            trainer = None  # the loop's name held it past release() into the next build
            release()
    return kept


def leftovers(limit: int = 5) -> list[str]:
    """The largest CUDA tensors still alive (shape, dtype, storage bytes)."""
    found = {}
    for obj in gc.get_objects():
        try:
            if torch.is_tensor(obj) and obj.is_cuda and obj.untyped_storage().nbytes():
                storage = obj.untyped_storage()
                found[storage.data_ptr()] = (storage.nbytes(), tuple(obj.shape), str(obj.dtype))
        except Exception:  # objects gc holds that refuse inspection
            continue
    biggest = sorted(found.values(), reverse=True)[:limit]
    return [f"{shape} {dtype} {nbytes} B" for nbytes, shape, dtype in biggest]


ROUNDS = 5
"""Timed offload/onload rounds (medians), a ceiling measured after each."""


def same_bytes_seconds(offload: Any) -> tuple[float, float]:
    """Seconds to copy the offload's own page-locked host memory into one device buffer and
    back, one copy per host allocation: the ceiling of the same bytes from the same memory
    (the 4 GiB copy of ``_copy_seconds`` is a shorter transfer from other host memory). Run
    while the state is on the device: the host copies are then free to be overwritten (the
    way back writes what the way in read)."""
    storages = {h.untyped_storage().data_ptr(): h.untyped_storage() for h in offload.host}
    hosts = [torch.empty(0, dtype=torch.uint8).set_(s) for s in storages.values()]
    device = torch.empty(sum(h.numel() for h in hosts), dtype=torch.uint8, device="cuda")
    pairs, at = [], 0
    for host in hosts:
        pairs.append((host, device[at : at + host.numel()]))
        at += host.numel()
    seconds = []
    for to_device in (True, False):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for host, target in pairs:
            if to_device:
                target.copy_(host, non_blocking=True)
            else:
                host.copy_(target, non_blocking=True)
        end.record()
        end.synchronize()
        seconds.append(start.elapsed_time(end) / 1e3)
    del device, pairs
    torch.cuda.empty_cache()
    return seconds[0], seconds[1]


def fresh_h2d_seconds(offload: Any) -> tuple[float, float]:
    """Right after an offload, the onload's bytes from the offload's own host memory into one
    device allocation the driver has to give (the state's memory was just given back): seconds
    from the allocation to the last copy's end, and of the copies alone. The onload's ceiling
    in the device's own state; only reads the host copies, which still hold the state."""
    storages = {h.untyped_storage().data_ptr(): h.untyped_storage() for h in offload.host}
    hosts = [torch.empty(0, dtype=torch.uint8).set_(s) for s in storages.values()]
    torch.cuda.synchronize()
    begin = time.perf_counter()
    device = torch.empty(sum(h.numel() for h in hosts), dtype=torch.uint8, device="cuda")
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    at = 0
    for host in hosts:
        device[at : at + host.numel()].copy_(host, non_blocking=True)
        at += host.numel()
    end.record()
    end.synchronize()
    seconds = time.perf_counter() - begin, start.elapsed_time(end) / 1e3
    del device
    torch.cuda.empty_cache()
    return seconds


def offload(trainer: Any, batch: TrainBatch, before_build: int = 0) -> None:
    """``before_build``: bytes allocated before the trainer was built (other objects')."""
    small = batch.select(slice(0, 1)).columns(slice(0, 256))
    before = trainer.logprobs(small)
    ids = [id(p) for p in trainer.model.parameters()]
    baseline = torch.cuda.memory_allocated()
    rounds = []
    ceilings = []
    same: list[tuple[float, float]] = []  # the same bytes, from the same host memory
    fresh: list[tuple[float, float]] = []  # the same bytes into memory just given back
    for index in range(ROUNDS + 1):  # the first pins its host memory (not counted)
        torch.cuda.synchronize()
        start = time.perf_counter()
        trainer.offload()
        off_s = time.perf_counter() - start
        left = torch.cuda.memory_allocated()
        start = time.perf_counter()
        trainer.onload()
        on_s = time.perf_counter() - start
        if index:
            rounds.append((off_s, on_s, left))
            # the ceiling between rounds (a 4 GiB pinned copy at most): the link's rate drifts
            ceilings.append(_copy_seconds(min(trainer._offload.nbytes, 4 * 2**30))[:2])
            same.append(same_bytes_seconds(trainer._offload))
        # each round as it ends: a run cut short by its time limit still shows the copies
        emit({"figure": "megatron_offload_round", "round": index, "offload_s": round(off_s, 4),
              "onload_s": round(on_s, 4), "bytes_after_offload": left,
              "copies": trainer._offload.copies})  # fmt: skip
    parts = {f"{k}_s": round(v, 4) for k, v in trainer._offload.seconds.items()}
    for _ in range(3):  # after the timed rounds, so that no onload follows this allocation
        trainer.offload()
        fresh.append(fresh_h2d_seconds(trainer._offload))
        trainer.onload()
    moved = trainer._offload.nbytes
    ceiling_bytes = min(moved, 4 * 2**30)
    off_s = statistics.median(r[0] for r in rounds)
    on_s = statistics.median(r[1] for r in rounds)
    left = max(r[2] for r in rounds)
    h2d = statistics.median(c[0] for c in ceilings)
    d2h = statistics.median(c[1] for c in ceilings)
    emit(
        {
            "figure": "megatron_offload",
            "resident_bytes": baseline,
            "copied_bytes": moved,
            "dropped_bytes": sum(trainer._offload.discarded_sizes),
            "bytes_after_offload": left,
            "bytes_after_offload_above_before_build": left - before_build,
            "largest_left": leftovers() if left > before_build else [],
            "first_offload_s": round(rounds[0][0], 3),
            "offload_gb_s": round(moved / off_s / 1e9, 2),
            "onload_gb_s": round(moved / on_s / 1e9, 2),
            "offload_s": round(off_s, 4),
            "onload_s": round(on_s, 4),
            **parts,  # the copies alone, freeing, allocating: what the rest of the time is
            "storages": len(trainer._offload.sizes),
            "copies": trainer._offload.copies,  # storages back to back move in one copy
            "pinned_d2h_gb_s": round(ceiling_bytes / d2h / 1e9, 2),
            "pinned_h2d_gb_s": round(ceiling_bytes / h2d / 1e9, 2),
            "offload_of_ceiling": round(d2h / ceiling_bytes * moved / off_s, 3),
            "onload_of_ceiling": round(h2d / ceiling_bytes * moved / on_s, 3),
            "rounds_onload_of_ceiling": [
                round(c[0] / ceiling_bytes * moved / r[1], 3)
                for r, c in zip(rounds, ceilings, strict=True)
            ],
            # per round, against one copy of the same host bytes (its own allocation) each way
            "same_bytes_h2d_gb_s": round(moved / statistics.median(c[0] for c in same) / 1e9, 2),
            "same_bytes_d2h_gb_s": round(moved / statistics.median(c[1] for c in same) / 1e9, 2),
            "rounds_offload_of_same_bytes": [
                round(c[1] / r[0], 3) for r, c in zip(rounds, same, strict=True)
            ],
            "rounds_onload_of_same_bytes": [
                round(c[0] / r[1], 3) for r, c in zip(rounds, same, strict=True)
            ],
            # the same bytes copied right after an offload into one allocation the driver
            # gives (with it / the copies alone; 3 rounds after the timed ones): onload's case
            "fresh_h2d_gb_s": round(moved / statistics.median(f[0] for f in fresh) / 1e9, 2),
            "fresh_h2d_copies_gb_s": round(moved / statistics.median(f[1] for f in fresh) / 1e9, 2),
            "onload_of_fresh_h2d": round(statistics.median(f[0] for f in fresh) / on_s, 3),
            "same_objects": ids == [id(p) for p in trainer.model.parameters()],
            "logprob_diff_after_onload": float((trainer.logprobs(small) - before).abs().max()),
        }
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--root", default="/tmp/tandem-bench")
    parser.add_argument("--skip-throughput", action="store_true")
    parser.add_argument(
        "--only",
        choices=("parity", "throughput", "offload"),
        help="one part (each in a fresh process); offload: the 1.5B Megatron trainer's alone",
    )
    args = parser.parse_args()
    root = Path(args.root)
    kept: list[Any] = []

    def measure() -> None:
        peak = 2 * 8192**3 / _matmul_seconds(8192) / 1e12
        kept.append(throughput(root, peak))

    def offload_kept() -> None:
        if kept and kept[0] is not None:
            offload(*kept[0])

    def offload_small() -> None:  # without the 1.5B run: offload the parity model's trainer
        path = model_dir("0.5b", args.layers, root)
        gc.collect()
        before_build = torch.cuda.memory_allocated()
        trainer = build("megatron", path, "bfloat16")
        batch = parity_batch(151_936)
        trainer.train(batch, nll_loss)  # the optimizer state exists after a step
        offload(trainer, batch, before_build)

    def offload_large() -> None:  # the throughput part's Megatron trainer, without the runs
        start = time.perf_counter()

        def stage(name: str) -> None:  # how far a run cut short by its time limit got
            emit({"figure": "megatron_offload_stage", "stage": name,
                  "s": round(time.perf_counter() - start, 1)})  # fmt: skip

        path = model_dir("1.5b", None, root)
        stage("model written")
        ids = torch.randint(0, 151_643, (8, 2048), generator=torch.Generator().manual_seed(0))
        mask = torch.ones(8, 2048)
        mask[:, 0] = 0
        batch = TrainBatch(ids, torch.ones_like(ids), mask)
        gc.collect()
        before_build = torch.cuda.memory_allocated()
        trainer = build("megatron", path, "bfloat16", micro_batch_size=2)
        stage("trainer built")
        trainer.train(batch, nll_loss)  # the optimizer state exists after a step
        stage("trained a step")
        offload(trainer, batch, before_build)

    if args.only == "offload":
        offload_large()
        return
    steps: list[tuple[str, Any]] = [("parity", lambda: parity(args, root))]
    if args.skip_throughput or args.only == "parity":
        steps.append(("offload", offload_small))
    else:
        steps += [("throughput", measure), ("offload", offload_kept)]
    if args.only == "throughput":
        steps = steps[1:]
    for name, step in steps:
        try:
            step()
        except Exception as error:  # report and go on: one device run covers every part
            traceback.print_exc()
            emit({"figure": f"megatron_{name}", "error": f"{type(error).__name__}: {error}"})


if __name__ == "__main__":
    main()
