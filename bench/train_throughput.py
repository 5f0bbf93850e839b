"""PolicyTrainer train-step throughput and MFU on a Qwen2.5-1.5B-shaped random model, and the
peak memory of chunked ``logprobs`` vs naive full-vocabulary logits.

bf16 parameters, one rank (plain module), full 2048-token sequences. MFU = model FLOPs / s over
the bf16 matmul peak measured in the same run, with model FLOPs per token (PaLM, appendix B)
6·N + 12·L·d·S: N = parameters in matmuls (the tied embedding counted once, as the LM head),
L layers, d hidden size, S sequence length. Recomputation (the checkpointed LM-head chunks) is
not counted, as MFU demands.

    PYTHONPATH=src python bench/train_throughput.py [--micro-batches 4 8] [--profile FILE]
"""

from __future__ import annotations

import argparse
import gc
import time
from typing import Any

import torch
from ceilings import QWEN_1P5B, emit, measure_ceilings, random_model_dir

from tandem.algorithms.losses import nll_loss
from tandem.config.models import OptimizerConfig, PolicyConfig
from tandem.data.batch import TrainBatch
from tandem.trainer import PolicyTrainer

SEQ = 2048


def make_batch(size: int, vocab: int, seed: int = 0) -> TrainBatch:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (size, SEQ), generator=gen)
    loss_mask = torch.ones(size, SEQ)
    loss_mask[:, 0] = 0
    return TrainBatch(ids, torch.ones_like(ids), loss_mask)


def flops_per_token(trainer: PolicyTrainer) -> float:
    config = trainer.lm.config
    n = sum(p.numel() for name, p in trainer.lm.named_parameters() if "embed_tokens" not in name)
    if config.tie_word_embeddings:
        n += config.vocab_size * config.hidden_size  # the LM head matmul uses the embedding
    return 6 * n + 12 * config.num_hidden_layers * config.hidden_size * SEQ


def train_steps(
    trainer: PolicyTrainer, batch: TrainBatch, steps: int, profile: str | None = None
) -> float:
    """Median seconds of a train step (after two warm-up steps)."""
    for _ in range(2):
        trainer.train(batch, nll_loss)
    times = []
    for _ in range(steps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        trainer.train(batch, nll_loss)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    if profile:
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as torch_profile

        with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            trainer.train(batch, nll_loss)
            torch.cuda.synchronize()
        table = prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=25)
        with open(profile, "w") as handle:
            handle.write(table)
    return sorted(times)[len(times) // 2]


def logprob_memory(trainer: PolicyTrainer, batch: TrainBatch) -> dict[str, Any]:
    """Peak bytes above the resident state: chunked ``logprobs`` vs full logits + log_softmax."""
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    trainer.logprobs(batch)
    chunked = torch.cuda.max_memory_allocated() - base
    torch.cuda.reset_peak_memory_stats()
    with torch.no_grad():
        ids = batch.input_ids.cuda()
        logits = trainer.lm(input_ids=ids, attention_mask=batch.attention_mask.cuda()).logits
        logp = torch.log_softmax(logits.float(), -1)[:, :-1].gather(-1, ids[:, 1:, None])
        del logits, logp
    naive = torch.cuda.max_memory_allocated() - base
    return {"chunked_gb": round(chunked / 1e9, 2), "naive_gb": round(naive / 1e9, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--micro-batches", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--batch", type=int, default=16, help="sequences per optimizer step")
    parser.add_argument("--chunk", type=int, default=4096, help="logprob_chunk_size")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--profile", default=None, help="write a profiler table of one step")
    args = parser.parse_args()
    peak = measure_ceilings(2**30)["bf16_matmul_tflop_s"]
    path = random_model_dir(QWEN_1P5B)
    for index, micro in enumerate(args.micro_batches):
        config = PolicyConfig(
            model_path=path,
            dtype="bfloat16",
            micro_batch_size=micro,
            logprob_chunk_size=args.chunk,
            optimizer=OptimizerConfig(lr=1e-6),
        )
        trainer = PolicyTrainer(config, device="cuda:0")
        batch = make_batch(args.batch, trainer.lm.config.vocab_size)
        torch.cuda.reset_peak_memory_stats()
        profile = args.profile if index == 0 else None
        seconds = train_steps(trainer, batch, args.steps, profile)
        tokens_s = args.batch * SEQ / seconds
        tflops = flops_per_token(trainer) * tokens_s / 1e12
        emit(
            {
                "figure": "train_tokens_s",
                "micro_batch": micro,
                "batch": args.batch,
                "seq": SEQ,
                "value": round(tokens_s),
                "model_tflop_s": round(tflops, 1),
                "peak_bf16_tflop_s": round(peak, 1),
                "mfu": round(tflops / peak, 3),
                "step_s": round(seconds, 3),
                "peak_memory_gb": round(torch.cuda.max_memory_allocated() / 1e9, 1),
            }
        )
        if index == 0:
            for chunk in sorted({1024, args.chunk}):
                trainer.model.chunk_size = chunk
                memory = logprob_memory(trainer, make_batch(micro, trainer.lm.config.vocab_size))
                record = {"figure": "logprobs_peak_gb", "tokens": micro * SEQ, "chunk": chunk}
                emit({**record, **memory})
        del trainer
        gc.collect()
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
