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

    python bench/trained_floor.py --shape 1.5b --train-s 240          # a GPU
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
    score them with one full-sequence bf16 forward and one fp32 forward."""
    bf16 = copy.deepcopy(model).to(torch.bfloat16).eval()
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
    was_training = model.training
    model.eval()
    fp32 = token_logprobs(model(ids).logits[:, start - 1 : -1], sampled)
    model.train(was_training)
    return {
        "mean_logprob": round(float(decode.mean()), 4),
        "mismatch_full_vs_decode": round(float((full - decode).abs().mean()), 5),
        "max_full_vs_decode": round(float((full - decode).abs().max()), 4),
        "full_bf16_vs_fp32": round(float((full - fp32).abs().mean()), 5),
        "decode_bf16_vs_fp32": round(float((decode - fp32).abs().mean()), 5),
    }


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
    model = transformers.Qwen2ForCausalLM(config).to(device).train()
    fused = device.type == "cuda"
    params = model.parameters()
    optimizer = torch.optim.AdamW(params, args.lr, (0.9, 0.95), weight_decay=0.1, fused=fused)
    warmup = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / args.warmup))
    pending = sorted(args.measure_at)
    step, trained_s, loss_value = 0, 0.0, float("nan")
    base = {"bench": "trained_floor", "shape": args.shape, "layers": config.num_hidden_layers}
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
        with torch.autocast(device.type, dtype=torch.bfloat16):
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
