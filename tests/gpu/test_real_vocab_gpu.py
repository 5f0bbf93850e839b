"""GRPO at the real vocabulary on one GPU through Ray: a random model of Qwen2.5-0.5B's shape
with a 151,936-token vocabulary (``tandem.assets.real_shapes``), responses of up to 1024 tokens
whose lengths spread (EOS after ~256 tokens on average), fp32 masters and bf16 compute with
activation checkpointing, colocated with the HF generator.

Per step the run's own metrics must show the memory phases (0 B on the device after the
trainer's offload; the refit's peak within the resident state + two buckets + the largest cast
tensor, here the 151,936 x 896 embedding) and parity (generator/trainer logprob mismatch
<= 1e-2 at every step, bf16 compute); the batch's lengths must actually spread.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tandem.assets.real_shapes import QWEN25_VOCAB_SIZE, write_real_shape

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.ray,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

BUCKET_BYTES = 64 * 2**20
MAX_TOKENS = 1024


def digit_fraction(prompt: str, response: str, answer: str) -> float:
    """The dense reward (``data.reward: test_real_vocab_gpu:digit_fraction``)."""
    return sum(c.isdigit() for c in response) / len(response) if response else 0.0


@pytest.mark.usefixtures("ray_cluster")
def test_real_vocabulary_long_spread_responses(tmp_path: Path) -> None:
    from tandem.config import GrpoConfig, load_config
    from tandem.driver import run_grpo

    model = write_real_shape(tmp_path / "model", "0.5b", mean_length=256, device="cuda")
    config = load_config(
        GrpoConfig,
        "grpo_arithmetic",
        [
            "cluster.env_mode=shared",
            "cluster.runtime=ray",
            "generation.backend=hf",
            f"policy.model_path={model}",
            "policy.mixed_precision=true",
            "policy.activation_checkpointing=true",
            "policy.micro_batch_size=8",
            "policy.max_tokens_per_micro_batch=16384",
            "policy.optimizer.lr=1e-6",
            f"refit.bucket_bytes={BUCKET_BYTES}",
            "algorithm.num_steps=3",
            "algorithm.prompts_per_step=8",
            "algorithm.num_generations=8",
            "algorithm.eval_every=0",
            f"generation.sampling.max_tokens={MAX_TOKENS}",
            "data.reward=test_real_vocab_gpu:digit_fraction",
            "checkpoint.enabled=false",
            "logging.progress=false",
            "logging.tensorboard=false",
            f"logging.run_dir={tmp_path}",
            "logging.name=real-vocab",
        ],
    )
    records = run_grpo(config)
    steps = [r for r in records if r["step"] >= 1]
    assert len(steps) == 3
    largest_cast = QWEN25_VOCAB_SIZE * 896 * 4  # the fp32 embedding, cast to bf16 on the way
    for record in steps:
        step = record["step"]
        assert record["memory/trainer_bytes_offloaded"] == 0, step
        headroom = (
            record["memory/trainer_peak_refit_bytes"] - record["memory/trainer_resident_bytes"]
        )
        assert headroom <= 2 * BUCKET_BYTES + largest_cast, (step, headroom)
        assert record["gen/logprob_mismatch"] <= 1e-2, (step, record["gen/logprob_mismatch"])
        # lengths spread: neither all at the cap nor all stopped at once
        assert 8 <= record["train/response_len_mean"] <= 0.9 * MAX_TOKENS, record
    print({k: [r.get(k) for r in steps] for k in sorted(steps[0]) if "/" in k})
