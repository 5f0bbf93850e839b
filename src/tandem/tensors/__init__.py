"""Tensor layout and batched copies, below both the trainer and the refit (no torch.distributed,
no refit): ``copies.device_copies`` lays tensors out back to back, ``copies.copy_tensors`` and
``copies.TargetRuns`` copy many of them in few launches."""

from tandem.tensors.copies import (
    ALIGN_BYTES,
    TargetRuns,
    coalesce,
    copy_tensors,
    device_copies,
    pack_parameters,
    span,
)

__all__ = [
    "ALIGN_BYTES",
    "TargetRuns",
    "coalesce",
    "copy_tensors",
    "device_copies",
    "pack_parameters",
    "span",
]
