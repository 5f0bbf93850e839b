"""The Bradley-Terry loss of a reward model on preference pairs: ``P(chosen > rejected) =
sigmoid(r_chosen - r_rejected)``, minimised as ``-log sigmoid(r_chosen - r_rejected)`` averaged
over the pairs (Ouyang et al. 2022)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def bradley_terry(
    chosen: torch.Tensor, rejected: torch.Tensor
) -> tuple[torch.Tensor, dict[str, float]]:
    """The mean loss of ``[P]`` chosen and rejected scores, and its metrics: ``loss``,
    ``accuracy`` (share of pairs with the chosen scored higher; a tie counts as wrong),
    ``margin`` (mean ``r_chosen - r_rejected``), ``chosen_score`` and ``rejected_score``."""
    margin = chosen - rejected
    loss = -F.logsigmoid(margin).mean()
    return loss, {
        "loss": float(loss.detach()),
        "accuracy": float((margin > 0).float().mean()),
        "margin": float(margin.detach().mean()),
        "chosen_score": float(chosen.detach().mean()),
        "rejected_score": float(rejected.detach().mean()),
    }
