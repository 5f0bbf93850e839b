"""policy.optimizer.bf16_stochastic_round in the environment its trainers run in (the trainer's
packages plus the lowbit extra: torchao, which the other environments never install): with bf16
weights at an RL learning rate, AdamW's updates survive in expectation, where rounding to nearest
drops nearly all of them. Measured as each bf16 trainer's weight change projected on an fp32
trainer's change after the same three steps (1 keeps the update, 0 loses it). The rounding's
random bits come from a seeded generator: a second trainer repeats the first bit for bit."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from tandem.cluster import envs

pytestmark = [pytest.mark.slow]

TESTS = Path(__file__).resolve().parents[1]

SCRIPT = """
import json, sys, torch
from pathlib import Path
from test_trainer_support import make_batch, policy, token_nll, write_tiny_qwen2
from tandem.config.models import OptimizerConfig
from tandem.trainer import PolicyTrainer

folder = Path(sys.argv[1])
write_tiny_qwen2(folder, True)

def change(dtype, stochastic_round, draws=0):
    torch.rand(draws)  # the default generator elsewhere, as in another process
    optimizer = OptimizerConfig(lr=1e-6, bf16_stochastic_round=stochastic_round)
    trainer = PolicyTrainer(policy(folder, dtype=dtype, optimizer=optimizer))
    before = [p.detach().float().clone() for p in trainer.lm.parameters()]
    for step in range(3):
        trainer.train(make_batch(seed=step), token_nll)
    after = [p.detach().float() for p in trainer.lm.parameters()]
    return [a - b for a, b in zip(after, before)], type(trainer.optimizer).__module__

reference, _ = change("float32", False)
norm = sum(float((r * r).sum()) for r in reference)
out = {}
for stochastic_round in (False, True):
    delta, module = change("bfloat16", stochastic_round)
    kept = sum(float((d * r).sum()) for d, r in zip(delta, reference)) / norm
    out[str(stochastic_round)] = {"kept": kept, "optimizer": module}
    if stochastic_round:
        again, _ = change("bfloat16", True, draws=7)
        out["repeats"] = all(torch.equal(a, b) for a, b in zip(delta, again))
print("RESULT " + json.dumps(out))
"""


def test_stochastic_rounding_keeps_the_updates_bf16_weights_lose(tmp_path: Path) -> None:
    (info,) = envs.build_envs(["trainer_lowbit"])
    assert info.complete
    environ = {**os.environ, "PYTHONPATH": f"{envs.source_root()}{os.pathsep}{TESTS / 'unit'}"}
    done = subprocess.run(
        [str(info.python), "-c", SCRIPT, str(tmp_path / "model")],
        env=environ,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    (line,) = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    result = json.loads(line.removeprefix("RESULT "))
    nearest, stochastic = result["False"], result["True"]
    assert nearest["optimizer"].startswith("torch.optim")
    assert stochastic["optimizer"].startswith("torchao.optim")
    assert nearest["kept"] < 0.1  # rounding to nearest: most updates are below half a bf16 step
    assert stochastic["kept"] > 0.9  # stochastic rounding: the fp32 update in expectation
    assert result["repeats"] is True
    assert "Traceback" not in done.stderr
