"""Reward models: a Hugging Face ``AutoModelForSequenceClassification`` with one label that
scores ``prompt + response`` at its last token, and its Bradley-Terry training.

``RewardModel`` loads and scores (the reward-model worker of GRPO uses it); ``RewardModelTrainer``
adds the optimizer, the Bradley-Terry step, checkpoints and the export (``tandem rm``). The text a
model scores is the prompt followed by the response, tokenized without special tokens and
right-padded; transformers' classification models read the score at the last token that is not
padding, so an export scores the same way when loaded by a user.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from tandem.algorithms.bradley_terry import bradley_terry
from tandem.config.models import OptimizerConfig
from tandem.files import atomic_dir
from tandem.trainer.fits import check_reward_model_fits

STATE_FILE = "reward_model.pt"
LM_CHUNK_TOKENS = 1024
"""Tokens whose logits ``chosen_lm_coef``'s loss forms at once (capped by the chunked head's
``MAX_CHUNK_LOGITS``: 441 tokens at a 151,936-token vocabulary)."""


class RewardModel:
    """A reward model on ``device``, in eval mode unless ``trainable``."""

    def __init__(
        self,
        path: Path,
        device: str | torch.device = "cpu",
        dtype: str = "float32",
        max_length: int = 1024,
        trainable: bool = False,
        seed: int = 0,
    ):
        from transformers import AutoModelForSequenceClassification, AutoTokenizer
        from transformers.utils import logging as transformers_logging

        self.device = torch.device(device)
        self.max_length = max_length
        self.tokenizer = AutoTokenizer.from_pretrained(str(path))
        pad = self.tokenizer.pad_token_id
        if pad is None:
            pad = self.tokenizer.eos_token_id
        self.pad_token_id = int(pad)
        torch.manual_seed(seed)  # a fresh score head is drawn from this
        verbosity = transformers_logging.get_verbosity()
        transformers_logging.set_verbosity_error()  # "score.weight newly initialized": meant
        try:
            self.model, loading = AutoModelForSequenceClassification.from_pretrained(
                str(path), num_labels=1, dtype=getattr(torch, dtype), output_loading_info=True
            )
        finally:
            transformers_logging.set_verbosity(verbosity)
        self.model.config.pad_token_id = self.pad_token_id
        # the head was drawn here: the folder holds a causal LM, not a reward model
        prefix = self.model.base_model_prefix + "."
        self.fresh_head = any(not key.startswith(prefix) for key in loading["missing_keys"])
        self.model.to(self.device)
        self.model.train(trainable)
        self.model.requires_grad_(trainable)

    def encode(self, prompts: Sequence[str], responses: Sequence[str]) -> dict[str, torch.Tensor]:
        """Right-padded ``input_ids`` and ``attention_mask`` of each ``prompt + response``,
        keeping its last ``max_length`` tokens. A response that is empty (or whose tokens are all
        the padding id) leaves at least the prompt's last token to score."""
        rows = []
        for prompt, response in zip(prompts, responses, strict=True):
            ids = self.tokenizer.encode(prompt + response, add_special_tokens=False)
            rows.append(ids[-self.max_length :] or [self.pad_token_id])
        width = max(len(row) for row in rows)
        ids = torch.full((len(rows), width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, row in enumerate(rows):
            ids[i, : len(row)] = torch.tensor(row)
            mask[i, : len(row)] = 1
        return {"input_ids": ids.to(self.device), "attention_mask": mask.to(self.device)}

    def forward(self, prompts: Sequence[str], responses: Sequence[str]) -> torch.Tensor:
        """``[B]`` scores (with gradients when trainable)."""
        logits = self.model(**self.encode(prompts, responses)).logits
        return logits[:, 0].float()

    @torch.no_grad()
    def score(
        self, prompts: Sequence[str], responses: Sequence[str], batch_size: int = 64
    ) -> list[float]:
        """Every sample's score, ``batch_size`` at a time."""
        scores: list[float] = []
        for start in range(0, len(prompts), batch_size):
            end = start + batch_size
            scores += self.forward(prompts[start:end], responses[start:end]).tolist()
        return scores

    def export_hf(self, path: Path) -> None:
        """A folder that ``AutoModelForSequenceClassification.from_pretrained`` loads (config,
        safetensors, tokenizer), written atomically."""
        with atomic_dir(path) as tmp:
            self.model.save_pretrained(tmp)
            self.tokenizer.save_pretrained(tmp)


class RewardModelTrainer(RewardModel):
    """A reward model trained with the Bradley-Terry loss on preference pairs. With
    ``trainable_layers`` only the top of the model trains; with ``unfreeze_after`` too, every
    parameter trains from that step on (a linear-probe-then-fine-tune schedule)."""

    def __init__(
        self,
        path: Path,
        optimizer: OptimizerConfig,
        total_steps: int,
        device: str | torch.device = "cpu",
        dtype: str = "float32",
        max_length: int = 1024,
        seed: int = 0,
        trainable_layers: int | None = None,
        unfreeze_after: int | None = None,
        unfreeze_lr: float | None = None,
        chosen_lm_coef: float = 0.0,
        score_init: str = "random",
    ):
        super().__init__(path, device, dtype, max_length, trainable=True, seed=seed)
        if score_init == "zero" and self.fresh_head:
            self._zero_score_head()
        self.optimizer_config, self.total_steps = optimizer, total_steps
        self.chosen_lm_coef = chosen_lm_coef
        self.lm_chunk_tokens = LM_CHUNK_TOKENS
        if chosen_lm_coef and not getattr(self.model.config, "tie_word_embeddings", False):
            raise ValueError(
                f"algorithm.chosen_lm_coef needs a model whose output layer is its input "
                f"embeddings (tie_word_embeddings); {path} has its own output layer, which a "
                "sequence-classification model drops (set algorithm.chosen_lm_coef=0)"
            )
        self.unfreeze_after = unfreeze_after if trainable_layers is not None else None
        self.unfreeze_lr = unfreeze_lr
        self.steps_done, self.unfrozen = 0, False
        if trainable_layers is not None:
            self.freeze_below(trainable_layers)
        unfreezes = self.unfreeze_after is not None
        check_reward_model_fits(self.model, dtype, unfreezes, self.device)  # before AdamW
        self.max_grad_norm = optimizer.max_grad_norm
        self._build_optimizer(optimizer, total_steps)

    def _zero_score_head(self) -> None:
        """Zero the last linear layer of the fresh head (``score`` of a decoder's classification
        model): every score starts at 0 and the backbone gets no gradient until the head has
        learned a direction, instead of a random head's."""
        head = [
            module
            for name, child in self.model.named_children()
            if name != self.model.base_model_prefix
            for module in child.modules()
            if isinstance(module, torch.nn.Linear)
        ]
        torch.nn.init.zeros_(head[-1].weight)
        if head[-1].bias is not None:
            torch.nn.init.zeros_(head[-1].bias)

    def _build_optimizer(self, config: OptimizerConfig, steps: int) -> None:
        from tandem.trainer.schedule import build_optimizer

        params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer, self.scheduler = build_optimizer(params, config, steps)

    def unfreeze(self) -> None:
        """Every parameter trains from now on, with a fresh optimizer at ``unfreeze_lr`` whose
        warm-up and schedule run over the steps left after ``unfreeze_after``."""
        self.model.requires_grad_(True)
        lr = self.unfreeze_lr or self.optimizer_config.lr
        config = self.optimizer_config.model_copy(update={"lr": lr})
        self._build_optimizer(config, max(1, self.total_steps - (self.unfreeze_after or 0)))
        self.unfrozen = True

    def freeze_below(self, trainable_layers: int) -> None:
        """Train only the last ``trainable_layers`` decoder layers, the final norm and the score
        head: the layers below keep the causal LM's features (a fresh head's first, random
        gradients would otherwise scramble them) and need no backward pass."""
        body: Any = self.model.base_model  # the decoder (Qwen2Model, LlamaModel...)
        layers = getattr(body, "layers", None)
        if layers is None:
            raise ValueError(
                f"model.trainable_layers: {type(body).__name__} has no .layers to freeze "
                "(set model.trainable_layers: null to train every parameter)"
            )
        self.model.requires_grad_(False)
        for module in [
            *layers[max(0, len(layers) - trainable_layers) :],
            getattr(body, "norm", None),
        ]:
            if module is not None:
                module.requires_grad_(True)
        prefix = self.model.base_model_prefix + "."
        for name, param in self.model.named_parameters():
            if not name.startswith(prefix):  # the score head
                param.requires_grad_(True)

    def train_step(self, pairs: Sequence[dict[str, str]]) -> dict[str, float]:
        """One optimizer step on ``pairs`` (``prompt``, ``chosen``, ``rejected``)."""
        due = self.unfreeze_after is not None and self.steps_done >= self.unfreeze_after
        if due and not self.unfrozen:
            self.unfreeze()
        self.steps_done += 1
        self.model.train()
        prompts = [p["prompt"] for p in pairs]
        responses = [p["chosen"] for p in pairs] + [p["rejected"] for p in pairs]
        batch = self.encode(prompts + prompts, responses)
        hidden: list[torch.Tensor] = []  # the decoder's last hidden states, for the LM loss
        hook = self.model.base_model.register_forward_hook(
            lambda _module, _args, output: hidden.append(output[0])
        )
        try:
            scores = self.model(**batch).logits[:, 0].float()
        finally:
            hook.remove()
        loss, metrics = bradley_terry(scores[: len(pairs)], scores[len(pairs) :])
        if self.chosen_lm_coef:
            chosen = {key: value[: len(pairs)] for key, value in batch.items()}
            lm_loss = self._chosen_lm_loss(hidden[0][: len(pairs)], chosen, pairs)
            loss = loss + self.chosen_lm_coef * lm_loss
            metrics["chosen_lm_loss"] = float(lm_loss.detach())
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(
            self.model.parameters(), self.max_grad_norm or float("inf")
        )
        self.optimizer.step()
        lr = self.scheduler.get_last_lr()[0]
        self.scheduler.step()
        return {**metrics, "grad_norm": float(norm), "lr": float(lr)}

    def _chosen_lm_loss(
        self, hidden: torch.Tensor, batch: dict[str, torch.Tensor], pairs: Sequence[dict[str, str]]
    ) -> torch.Tensor:
        """Mean next-token cross-entropy of the chosen responses' tokens (those after the
        prompt's), predicted from the decoder's last hidden states through the input embeddings
        (the causal LM's tied output layer): the backbone keeps computing the right answer.
        Only the response tokens' logits are formed, ``lm_chunk_tokens`` at a time with the
        policy trainer's chunked head (no ``[rows, tokens, vocabulary]`` logits)."""
        from tandem.trainer.logprobs import token_logprobs

        weight = self.model.get_input_embeddings().weight
        labels = batch["input_ids"][:, 1:].clone()
        kept = batch["attention_mask"].sum(dim=1).tolist()
        positions = torch.arange(labels.shape[1], device=labels.device)
        for row, pair in enumerate(pairs):
            text = pair["prompt"] + pair["chosen"]
            dropped = len(self.tokenizer.encode(text, add_special_tokens=False)) - kept[row]
            start = len(self.tokenizer.encode(pair["prompt"], add_special_tokens=False)) - dropped
            labels[row, (positions < start - 1) | (positions >= kept[row] - 1)] = -100
        trained = labels != -100
        if not bool(trained.any()):  # every response cut off by max_length
            return hidden.sum() * 0.0
        picked, _ = token_logprobs(
            hidden[:, :-1][trained], weight, labels[trained], self.lm_chunk_tokens
        )
        return -picked.mean()

    @torch.no_grad()
    def evaluate(self, pairs: Sequence[dict[str, str]], batch_size: int = 256) -> dict[str, float]:
        """Bradley-Terry loss and pair accuracy (chosen scored above rejected) of ``pairs``."""
        self.model.eval()
        prompts = [p["prompt"] for p in pairs]
        chosen = torch.tensor(self.score(prompts, [p["chosen"] for p in pairs], batch_size))
        rejected = torch.tensor(self.score(prompts, [p["rejected"] for p in pairs], batch_size))
        return bradley_terry(chosen, rejected)[1]

    def save_checkpoint(self, path: str) -> None:
        """Model, optimizer, schedule and RNG state in one file under ``path``."""
        state: dict[str, Any] = {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "rng": torch.get_rng_state(),
            "steps_done": self.steps_done,
            "unfrozen": self.unfrozen,
        }
        Path(path).mkdir(parents=True, exist_ok=True)
        torch.save(state, Path(path) / STATE_FILE)

    def load_checkpoint(self, path: str) -> None:
        state = torch.load(Path(path) / STATE_FILE, map_location=self.device, weights_only=False)
        self.model.load_state_dict(state["model"])
        self.steps_done = int(state.get("steps_done", 0))
        if state.get("unfrozen") and not self.unfrozen:
            self.unfreeze()  # the optimizer of every parameter, whose state follows
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        torch.set_rng_state(state["rng"].cpu())
