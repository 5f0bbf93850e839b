"""The peer side of the end-to-end benchmarks: TRL's ``GRPOTrainer`` on the same work as a
tandem run (same model folder, prompts, reward, group size, completion length, learning rate;
transformers generation), one JSON line per optimizer step with its wall time.

Run by ``e2e_cpu.py`` (in a scratch venv it builds: TRL is not a tandem dependency) and
``e2e_gpu.py`` (TRL carried as wheels), each in its own process:

    python bench/trl_peer.py --model DIR --prompts prompts.jsonl --reward exact_match
        --steps 8 --prompts-per-step 8 --generations 8 --max-tokens 8 [--bf16]
        [--lora-rank 16 --lora-alpha 32 --lora-targets q_proj k_proj ...]

``--lora-rank`` trains peft LoRA adapters (``GRPOTrainer(peft_config=...)``) on the modules
``--lora-targets`` names (the callers pass tandem's ``policy.lora`` default: every linear
projection of the decoder layers).

``--image-key KEY`` (``vlm_trl_cpu.py``) reads image prompts: each row's ``KEY`` is an image
path relative to the prompts file. The rows become what TRL's GRPOTrainer takes for a
vision-language model: conversational prompts (one user message) beside an ``image`` column of
``datasets``' Image feature, with the model's own processor (``AutoProcessor``) as the
processing class. A processor without a chat template (tandem's embedded model) gets
``PLAIN_TEMPLATE``: the image's tokens, then the text, no role markers, the token ids of
tandem's image prompts (which apply no chat template).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
sys.path[:0] = [str(BENCH), str(BENCH.parent / "src")]


PLAIN_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['content'] is string -%}{{ message['content'] }}"
    "{%- else -%}{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'image' -%}<|vision_start|><|image_pad|><|vision_end|>"
    "{%- elif part['type'] == 'text' -%}{{ part['text'] }}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}{%- endfor -%}"
)
"""A chat template that lays out a message as tandem lays out an image prompt: each image's
``<|vision_start|> <|image_pad|> <|vision_end|>`` (the processor repeats the pad once per merged
patch), then the text."""


def text_of(value: Any) -> str:
    """A prompt or completion as text: a string as is; a conversation's (list of messages)
    text parts joined (TRL passes conversational prompts and completions as messages)."""
    if isinstance(value, str):
        return value
    parts = [message["content"] for message in value]
    return "".join(
        p if isinstance(p, str) else "".join(b["text"] for b in p if b.get("type") == "text")
        for p in parts
    )


def reward_function(name: str) -> Any:
    """A TRL reward function (completions + dataset columns -> scores) around a tandem one."""
    if name == "exact_match":
        from tandem.rewards.exact_match import exact_match as score
    else:
        from e2e_rewards import digit_fraction as score

    def reward(prompts: list, completions: list, answer: list[str], **_: Any) -> list:
        pairs = zip(prompts, completions, answer, strict=True)
        return [score(text_of(p), text_of(c), a) for p, c, a in pairs]

    reward.__name__ = name
    return reward


def lora_config(rank: int, alpha: int, targets: list[str]) -> Any:
    """peft's LoraConfig of ``rank`` adapters on ``targets``, or None (``rank`` 0)."""
    if rank <= 0:
        return None
    if not targets:
        raise SystemExit("--lora-rank needs --lora-targets")
    from peft import LoraConfig

    return LoraConfig(
        r=rank,
        lora_alpha=alpha,
        lora_dropout=0.0,
        target_modules=targets,
        bias="none",
        task_type="CAUSAL_LM",
    )


def image_dataset(rows: list[dict[str, Any]], prompts: Path, key: str, text_key: str) -> Any:
    """TRL's form of image prompts: ``prompt`` (the row's ``text_key``) as one user message,
    ``image`` (the row's ``key``, a path relative to ``prompts``) cast to ``datasets``' Image
    feature."""
    from datasets import Dataset, Image

    out = [
        {
            **{k: v for k, v in row.items() if k not in (key, text_key)},
            "prompt": [{"role": "user", "content": row[text_key]}],
            "image": str((prompts.parent / row[key]).resolve()),
        }
        for row in rows
    ]
    return Dataset.from_list(out).cast_column("image", Image())


def processing_class(model: str, images: bool) -> Any:
    """The model's tokenizer, or for image prompts its processor (``AutoProcessor``), given
    ``PLAIN_TEMPLATE`` when it has no chat template."""
    from transformers import AutoProcessor, AutoTokenizer

    if not images:
        return AutoTokenizer.from_pretrained(model)
    processor = AutoProcessor.from_pretrained(model)
    if getattr(processor, "chat_template", None) is None:
        processor.chat_template = PLAIN_TEMPLATE
    return processor


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", required=True)
    parser.add_argument("--prompts", required=True, help="JSONL of {prompt, answer} rows")
    parser.add_argument("--reward", choices=["exact_match", "digit_fraction"], required=True)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--prompts-per-step", type=int, default=8)
    parser.add_argument("--generations", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--bf16", action="store_true", help="mixed precision (GPU)")
    parser.add_argument(
        "--micro-batch", type=int, default=0, help="completions per forward (0: all of a step)"
    )
    parser.add_argument(
        "--no-gradient-checkpointing", action="store_true", help="(TRL's default: on)"
    )
    parser.add_argument("--lora-rank", type=int, default=0, help="LoRA rank (0: full weights)")
    parser.add_argument("--lora-alpha", type=int, default=32)
    parser.add_argument("--lora-targets", nargs="+", default=[], help="module names (LoRA)")
    parser.add_argument(
        "--model-dtype", choices=["float32", "bfloat16"], default="float32", help="load dtype"
    )
    parser.add_argument(
        "--image-key", default=None, help="image prompts: the column of image paths"
    )
    parser.add_argument("--prompt-key", default="prompt", help="image prompts: the text column")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--label", default="trl")
    args = parser.parse_args()

    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    rows = [json.loads(line) for line in Path(args.prompts).read_text().splitlines() if line]
    completions = args.prompts_per_step * args.generations
    micro = args.micro_batch or completions
    if completions % micro:
        raise SystemExit(f"--micro-batch {micro} must divide the {completions} completions")
    config = GRPOConfig(
        output_dir=str(Path(args.prompts).parent / f"trl-{args.label}"),
        # one generation of every completion of a step, then micro-batches of them
        per_device_train_batch_size=micro,
        gradient_accumulation_steps=completions // micro,
        gradient_checkpointing=not args.no_gradient_checkpointing,
        num_generations=args.generations,
        max_completion_length=args.max_tokens,
        learning_rate=args.lr,
        max_steps=args.steps,
        temperature=args.temperature,
        beta=0.0,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        bf16=args.bf16,
        use_cpu=not torch.cuda.is_available(),
        seed=0,
        disable_dropout=True,
        model_init_kwargs={"dtype": getattr(torch, args.model_dtype)},
    )
    stamps: list[float] = []

    class StepClock(TrainerCallback):  # type: ignore[misc]
        """Prints each step's line as it ends, so a run stopped at a time limit keeps them."""

        def on_step_end(self, *_: Any, **__: Any) -> None:
            stamps.append(time.perf_counter())
            record = {"figure": "trl_step_s", "label": args.label, "step": len(stamps) - 1}
            print(json.dumps({**record, "value": round(stamps[-1] - stamps[-2], 4)}), flush=True)

    prompts = Path(args.prompts)
    dataset = Dataset.from_list(rows)
    if args.image_key:
        dataset = image_dataset(rows, prompts, args.image_key, args.prompt_key)
    trainer = GRPOTrainer(
        model=args.model,
        reward_funcs=[reward_function(args.reward)],
        args=config,
        train_dataset=dataset,
        processing_class=processing_class(args.model, images=args.image_key is not None),
        callbacks=[StepClock()],
        peft_config=lora_config(args.lora_rank, args.lora_alpha, args.lora_targets),
    )
    trained = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
    print(json.dumps({"figure": "trl_trainable_params", "label": args.label, "value": trained}))
    stamps.append(time.perf_counter())  # the start
    trainer.train()


if __name__ == "__main__":
    main()
