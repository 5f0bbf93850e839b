"""Trainer checkpoints (sharded, atomic, resumable) and Hugging Face export, of plain state
objects (``TrainState``, ``Ranks``)."""

from tandem.checkpoint.hf_export import export_hf
from tandem.checkpoint.sharded import complete, load, save
from tandem.checkpoint.state import Ranks, TrainState

__all__ = ["Ranks", "TrainState", "complete", "export_hf", "load", "save"]
