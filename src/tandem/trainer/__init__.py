"""The policy trainer: a plain class over a Hugging Face causal LM, sharded with FSDP2."""

from tandem.trainer.policy_trainer import PolicyTrainer

__all__ = ["PolicyTrainer"]
