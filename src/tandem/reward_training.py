"""``tandem rm``: a reward model trained on preference pairs (Bradley-Terry), read top to bottom:
check the inputs, load the pairs, build the model, open the run folder (resume, config, logger),
loop over the steps, export. It trains in this process (one model, no generation: nothing for
actors to overlap); the export is what ``reward.model`` of a GRPO run takes."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from tandem.config.load import save_resolved
from tandem.config.reward_model import RmConfig
from tandem.imports import resume_gc
from tandem.logging.metrics import MetricsLogger, read_metrics
from tandem.logging.plots import plot_run
from tandem.runs import Checkpoints, check_run_dir, make_run_dir, truncate_metrics


def _device(choice: str) -> str:
    import torch

    if choice == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if choice == "cuda" and not torch.cuda.is_available():
        raise ValueError("model.device=cuda but no CUDA device is visible; use cpu or auto")
    return choice


def run_rm(config: RmConfig, resume: bool = False) -> list[dict[str, Any]]:
    """Train, evaluate held-out pair accuracy every ``eval_every`` steps, checkpoint, export to
    ``<run>/hf`` (and ``output_dir``)."""
    from tandem.data.preferences import load_pairs
    from tandem.data.prompts import PromptSource
    from tandem.rewards import load_reward
    from tandem.trainer.reward_model import RewardModelTrainer

    model_path = config.model.model_path
    if not (model_path / "config.json").is_file():
        raise ValueError(f"model.model_path={model_path}: no config.json (not a model folder)")
    check_run_dir(config, "rm", resume)  # type: ignore[arg-type]  # reads .logging, .checkpoint
    algo = config.algorithm
    if config.model.threads is not None:
        import torch

        torch.set_num_threads(config.model.threads)
    train, held_out, _ = load_pairs(config.data, algo.seed)
    trainer = RewardModelTrainer(
        model_path,
        config.model.optimizer,
        total_steps=algo.num_steps,
        device=_device(config.model.device),
        dtype=config.model.dtype,
        max_length=config.model.max_length,
        seed=algo.seed,
        trainable_layers=config.model.trainable_layers,
        unfreeze_after=config.model.unfreeze_after,
        unfreeze_lr=config.model.unfreeze_lr,
        chosen_lm_coef=algo.chosen_lm_coef,
        score_init=config.model.score_init,
    )
    pairs = PromptSource(train, held_out, trainer.tokenizer, load_reward("exact_match"), algo.seed)
    resume_gc()
    run_dir = make_run_dir(config.logging, "rm", resume)
    save_resolved(config, run_dir)
    checkpoints = Checkpoints(run_dir, config.checkpoint)
    start = int(checkpoints.load(trainer)["step"]) if resume else 0
    if resume:
        truncate_metrics(run_dir, start)
    with MetricsLogger(config.logging, run_dir, algo.num_steps, start_step=start) as logger:
        logger.info(f"run directory: {run_dir}")
        if held_out and algo.eval_every > 0 and start == 0:
            logger.log(0, _evaluation(trainer, held_out))
        for step in range(start + 1, algo.num_steps + 1):
            began = time.perf_counter()
            metrics = trainer.train_step(pairs.train_prompts(step - 1, algo.batch_size))
            record = {f"train/{key}": value for key, value in metrics.items()}
            record["timing/step_s"] = time.perf_counter() - began
            due = algo.eval_every > 0 and (step % algo.eval_every == 0 or step == algo.num_steps)
            if held_out and due:
                record.update(_evaluation(trainer, held_out))
            logger.log(step, record)
            if checkpoints.due(step, algo.num_steps):
                checkpoints.save(step, trainer, {})
        exports = [run_dir / "hf"] if config.checkpoint.export_hf else []
        exports += [config.output_dir] if config.output_dir is not None else []
        for path in exports:
            trainer.export_hf(Path(path).resolve())
            logger.info(f"reward model (AutoModelForSequenceClassification): {path}")
    plot_run(read_metrics(run_dir), run_dir / "reward.png", title=f"rm: {run_dir.name}")
    return read_metrics(run_dir)


def _evaluation(trainer: Any, held_out: list[dict[str, str]]) -> dict[str, float]:
    """Held-out Bradley-Terry loss and pair accuracy (``eval/preference_accuracy``)."""
    metrics = trainer.evaluate(held_out)
    return {
        "eval/loss": metrics["loss"],
        "eval/preference_accuracy": metrics["accuracy"],
        "eval/margin": metrics["margin"],
    }
