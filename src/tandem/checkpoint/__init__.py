"""Trainer checkpoints (sharded, atomic, resumable) and Hugging Face export."""

from tandem.checkpoint.hf_export import export_hf
from tandem.checkpoint.sharded import complete, load, save

__all__ = ["complete", "export_hf", "load", "save"]
