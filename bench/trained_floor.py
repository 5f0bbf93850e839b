"""The generator/trainer bf16 logprob gap of a *trained* model of a real Qwen2.5 shape.

A random model's next-token distribution is close to uniform over 151,936 ids, so each sampled
token's logprob carries its logit's whole bf16 error (bench/bf16_floor.py: 0.016 at 1.5B).
Scaling its logits does not make it a trained model (it scales the error with them). This
benchmark trains one instead, as far as a few minutes allow: a random model of the shape
(vocabulary 151,936, the assets' byte-level tokenizer), fp32 master weights and bf16 autocast,
AdamW, on Python's own standard library sources (text every machine has), then at every
``--measure-at`` fraction of the training time

    samples rows from the bf16 model one token at a time with a KV cache (as a generator
    does), keeping each sampled token's logprob, then scores the same sequences with one
    bf16 full-sequence forward (as the trainer does)

and prints one JSON line: the mean sampled logprob, the training loss, and the mean
|full - decode| logprob over the sampled tokens (what the loop's mismatch metric measures),
beside the bf16 full-sequence logprobs' gap to fp32. The measurement at 0 is the random model.

``--bf16-state`` trains as the loop's 80 GB recipe for 7B does (``policy.dtype=bfloat16``,
``policy.optimizer.bf16_stochastic_round``): bf16 weights and AdamW state, torchao's AdamW
rounding its updates stochastically, activation checkpointing; 8 bytes a parameter instead of
16, so the 7B shape trains on an 80 GB GPU. The model is then its own bf16 copy and has no fp32
weights to compare with (those columns are left out).

    python bench/trained_floor.py --shape 1.5b --train-s 240          # a GPU
    python bench/trained_floor.py --shape 7b --bf16-state --batch 4 --train-s 200  # 80 GB
    PYTHONPATH=src:bench python bench/trained_floor.py --shape 0.5b --layers 2 --train-s 20 \
        --seq 128 --batch 4 --rows 2 --new-tokens 24                  # the path, on a CPU
"""

from __future__ import annotations

import argparse
import copy
import sysconfig
import time
from pathlib import Path
from typing import Any

import torch
import transformers
from bf16_floor import token_logprobs
from ceilings import emit

from tandem.assets.real_shapes import build_tokenizer, real_config
from tandem.trainer.schedule import _stochastic_round_adamw


def corpus_ids(megabytes: float) -> torch.Tensor:
    """The standard library's ``.py`` files in path order, tokenized, up to ``megabytes``."""
    tokenizer = build_tokenizer()
    texts, size = [], 0
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py")):
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        texts.append(text)
        size += len(text)
        if size > megabytes * 2**20:
            break
    ids = [i for encoding in tokenizer.encode_batch(texts) for i in encoding.ids]
    return torch.tensor(ids, dtype=torch.long)


@torch.no_grad()
def measure(model: Any, prompts: torch.Tensor, new_tokens: int, seed: int) -> dict[str, float]:
    """Sample ``new_tokens`` after each prompt row from a bf16 copy, one token at a time, then
    score them with one full-sequence bf16 forward and one fp32 forward (a bf16 model: none)."""
    was_training = model.training
    bf16_state = next(model.parameters()).dtype == torch.bfloat16
    bf16 = model.eval() if bf16_state else copy.deepcopy(model).to(torch.bfloat16).eval()
    generator = torch.Generator(prompts.device).manual_seed(seed)
    cache = transformers.DynamicCache()
    logits = bf16(prompts, past_key_values=cache, use_cache=True).logits[:, -1]
    ids, decoded = prompts, []
    for _ in range(new_tokens):
        probs = logits.float().softmax(-1)
        token = torch.multinomial(probs, 1, generator=generator)
        decoded.append(token_logprobs(logits, token[:, 0])[:, None])
        ids = torch.cat([ids, token], dim=1)
        logits = bf16(token, past_key_values=cache, use_cache=True).logits[:, -1]
    decode = torch.cat(decoded, dim=1)
    start = prompts.shape[1]
    sampled = ids[:, start:]
    full = token_logprobs(bf16(ids).logits[:, start - 1 : -1], sampled)
    del bf16, cache
    record = {
        "mean_logprob": round(float(decode.mean()), 4),
        "mismatch_full_vs_decode": round(float((full - decode).abs().mean()), 5),
        "max_full_vs_decode": round(float((full - decode).abs().max()), 4),
    }
    if not bf16_state:
        model.eval()
        fp32 = token_logprobs(model(ids).logits[:, start - 1 : -1], sampled)
        record["full_bf16_vs_fp32"] = round(float((full - fp32).abs().mean()), 5)
        record["decode_bf16_vs_fp32"] = round(float((decode - fp32).abs().mean()), 5)
    model.train(was_training)
    return record


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="1.5b")
    parser.add_argument("--layers", type=int, default=None, help="fewer layers (a CPU check)")
    parser.add_argument("--train-s", type=float, default=240.0)
    parser.add_argument("--measure-at", type=float, nargs="+", default=[0.0, 0.25, 0.5, 1.0])
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--lr", type=float, default=6e-4)
    parser.add_argument("--warmup", type=int, default=40)
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=384)
    parser.add_argument("--corpus-mb", type=float, default=24.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--bf16-state",
        action="store_true",
        help="bf16 weights and AdamW state with stochastic rounding, checkpointing (7B on 80 GB)",
    )
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(args.seed)
    started = time.perf_counter()
    ids = corpus_ids(args.corpus_mb)
    held_out = ids[-args.rows * args.prompt_tokens * 4 :]
    train_ids = ids[: -held_out.numel()]
    offsets = torch.arange(args.prompt_tokens)
    rows = [held_out[i * 4 * args.prompt_tokens + offsets] for i in range(args.rows)]
    prompts = torch.stack(rows).to(device)
    emit(
        {
            "bench": "trained_floor",
            "event": "corpus",
            "tokens": train_ids.numel(),
            "distinct_ids": int(train_ids.unique().numel()),
            "seconds": round(time.perf_counter() - started, 1),
        }
    )
    config = real_config(args.shape, args.layers)
    with torch.device(device):  # initialised where it trains (a 7B model in seconds on a GPU)
        model = transformers.Qwen2ForCausalLM(config)
    adam: dict[str, Any] = {"lr": args.lr, "betas": (0.9, 0.95), "weight_decay": 0.1}
    if args.bf16_state:
        model = model.to(torch.bfloat16)
        model.gradient_checkpointing_enable()
        model.config.use_cache = False  # training only; measure passes its own cache
        adamw = _stochastic_round_adamw()
        optimizer = adamw(model.parameters(), **adam, bf16_stochastic_round=True)
    else:
        fused = device.type == "cuda"
        optimizer = torch.optim.AdamW(model.parameters(), **adam, fused=fused)
    model.train()
    warmup = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / args.warmup))
    pending = sorted(args.measure_at)
    step, trained_s, loss_value = 0, 0.0, float("nan")
    base = {"bench": "trained_floor", "shape": args.shape, "layers": config.num_hidden_layers}
    base |= {"state": "bf16, stochastic rounding" if args.bf16_state else "fp32"}
    base |= {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu"}
    while pending:
        if trained_s >= pending[0] * args.train_s:
            pending.pop(0)
            record = measure(model, prompts, args.new_tokens, args.seed)
            at = {"step": step, "trained_s": round(trained_s, 1), "loss": loss_value}
            emit(base | at | record)
            continue
        tick = time.perf_counter()
        starts = torch.randint(0, train_ids.numel() - args.seq, (args.batch,))
        batch = torch.stack([train_ids[s : s + args.seq] for s in starts.tolist()]).to(device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=not args.bf16_state):
            loss = model(batch, labels=batch).loss  # transformers shifts the labels
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        warmup.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        loss_value = round(float(loss.detach()), 4)  # waits for the step: trained_s is its time
        if step % 50 == 0 or step == 1:
            emit(base | {"event": "train", "step": step, "loss": loss_value})
        trained_s += time.perf_counter() - tick


if __name__ == "__main__":
    main()
