"""On-policy distillation: the student samples, a teacher scores the sampled tokens, and each
token's advantage is the negative of the per-token reverse KL estimate,
``log pi_teacher(x_t) - log pi_student(x_t)`` (no discount: each token is credited with its own
term), as in the published on-policy distillation recipe (Agarwal et al. 2024, GKD; Thinking
Machines, 2025). The student's logprobs are the generator's, those of the policy that sampled."""

from __future__ import annotations

import torch


def distill_advantages(
    teacher_logprobs: torch.Tensor,
    student_logprobs: torch.Tensor,
    loss_mask: torch.Tensor,
    coef: float,
) -> tuple[torch.Tensor, dict[str, float]]:
    """``[B, T]`` advantages ``coef * (teacher - student)`` on the trained tokens (0 elsewhere),
    and the metrics: ``distill/reverse_kl`` (mean over the trained tokens of ``student -
    teacher``, the sampled estimate of KL(student || teacher)) and ``distill/teacher_logprob``."""
    mask = loss_mask.float()
    gap = (teacher_logprobs.float() - student_logprobs.float()) * mask
    tokens = mask.sum().clamp(min=1.0)
    return coef * gap, {
        "distill/reverse_kl": float(-gap.sum() / tokens),
        "distill/teacher_logprob": float((teacher_logprobs.float() * mask).sum() / tokens),
    }
