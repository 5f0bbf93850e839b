"""Policy and SFT losses against values worked out by hand, gradients, and additivity."""

from __future__ import annotations

import math
import pickle

import pytest
import torch

from tandem.algorithms.losses import (
    KL_ESTIMATORS,
    ClippedPolicyLoss,
    PolicyLossConfig,
    nll_loss,
)
from tandem.data.batch import TrainBatch

LN2 = math.log(2.0)
LN4 = math.log(4.0)


def make_batch(loss_mask: list[list[float]], **per_token: list[list[float]] | None) -> TrainBatch:
    mask = torch.tensor(loss_mask, dtype=torch.float32)
    tensors = {
        k: None if v is None else torch.tensor(v, dtype=torch.float32) for k, v in per_token.items()
    }
    return TrainBatch(
        input_ids=torch.zeros(mask.shape, dtype=torch.long),
        attention_mask=torch.ones(mask.shape, dtype=torch.long),
        loss_mask=mask,
        **tensors,
    )


def log(values: list[float]) -> list[list[float]]:
    return [[math.log(v) for v in values]]


def test_clip_boundaries_are_asymmetric_and_block_gradients() -> None:
    # clip_low=0.2, clip_high=0.28 (clip-higher), old logprobs 0 so ratio = exp(logprobs):
    #   A=+1, r=1.27 (inside 1.28):  -1.27, grad -r = -1.27
    #   A=+1, r=1.29 (outside 1.28): -1.28, grad 0 (clipped)
    #   A=-1, r=0.81 (inside 0.8):    0.81, grad +r = 0.81
    #   A=-1, r=0.79 (outside 0.8):   0.80, grad 0 (clipped)
    # token mean: (-1.27 - 1.28 + 0.81 + 0.80) / 4 = -0.235; grads / 4.
    # clip_frac 2/4; ratio_mean (1.27 + 1.29 + 0.81 + 0.79) / 4 = 1.04.
    loss_fn = ClippedPolicyLoss(PolicyLossConfig(clip_low=0.2, clip_high=0.28))
    batch = make_batch([[1, 1, 1, 1]], advantages=[[1, 1, -1, -1]], old_logprobs=[[0, 0, 0, 0]])
    logprobs = torch.tensor(log([1.27, 1.29, 0.81, 0.79]), requires_grad=True)
    loss, metrics = loss_fn(logprobs, batch, 4, 1)
    loss.backward()
    assert loss.item() == pytest.approx(-0.235, abs=1e-6)
    assert metrics["pg_loss"].item() == pytest.approx(-0.235, abs=1e-6)
    assert metrics["clip_frac"].item() == pytest.approx(0.5)
    assert metrics["ratio_mean"].item() == pytest.approx(1.04, abs=1e-6)
    torch.testing.assert_close(logprobs.grad, torch.tensor([[-0.3175, 0.0, 0.2025, 0.0]]))


def test_clip_only_on_the_side_of_the_advantage_sign() -> None:
    # A=+1 with r=0.5 and A=-1 with r=1.5 are outside the clip range on the "wrong" side: the
    # pessimistic max keeps the unclipped term, so loss (-0.5 + 1.5) / 2 = 0.5, grads (-0.5, 1.5)/2.
    loss_fn = ClippedPolicyLoss()
    batch = make_batch([[1, 1]], advantages=[[1, -1]], old_logprobs=[[0, 0]])
    logprobs = torch.tensor(log([0.5, 1.5]), requires_grad=True)
    loss, metrics = loss_fn(logprobs, batch, 2, 1)
    loss.backward()
    assert loss.item() == pytest.approx(0.5, abs=1e-6)
    assert metrics["clip_frac"].item() == 0.0
    torch.testing.assert_close(logprobs.grad, torch.tensor([[-0.25, 0.75]]))


@pytest.mark.parametrize(("dual_clip", "expected_loss"), [(3.0, 4.3 / 3), (None, 5.3 / 3)])
def test_dual_clip_caps_negative_advantages(dual_clip: float | None, expected_loss: float) -> None:
    # c=3: A=-1, r=4  -> -A r = 4 capped at -c A = 3, grad 0 (dual clipped)
    #      A=-1, r=2.5 -> 2.5 (below the cap), grad 2.5
    #      A=+1, r=4  -> -1.2 (ordinary clip-high; dual clip is for A<0 only), grad 0
    # sum 4.3 / 3 tokens. Without dual clip the first token stays at 4: sum 5.3.
    loss_fn = ClippedPolicyLoss(PolicyLossConfig(dual_clip=dual_clip))
    batch = make_batch([[1, 1, 1]], advantages=[[-1, -1, 1]], old_logprobs=[[0, 0, 0]])
    logprobs = torch.tensor(log([4.0, 2.5, 4.0]), requires_grad=True)
    loss, metrics = loss_fn(logprobs, batch, 3, 1)
    loss.backward()
    assert loss.item() == pytest.approx(expected_loss, abs=1e-6)
    assert metrics["clip_frac"].item() == pytest.approx(1 / 3)
    first_grad = 0.0 if dual_clip else 4.0 / 3
    torch.testing.assert_close(logprobs.grad, torch.tensor([[first_grad, 2.5 / 3, 0.0]]))
    if dual_clip:
        assert metrics["dual_clip_frac"].item() == pytest.approx(1 / 3)
    else:
        assert "dual_clip_frac" not in metrics


def test_kl_estimators_by_hand() -> None:
    # log r = log pi_ref - log pi; r=2 (reference more likely) and r=0.5 (policy more likely).
    # k1 = -log r: (-0.693147, 0.693147); k2 = (log r)^2/2 = 0.240227 both;
    # k3 = (r - 1) - log r: 1 - 0.693147 = 0.306853 and -0.5 + 0.693147 = 0.193147.
    log_r = torch.tensor([LN2, -LN2])
    torch.testing.assert_close(KL_ESTIMATORS["k1"](log_r), torch.tensor([-0.693147, 0.693147]))
    torch.testing.assert_close(KL_ESTIMATORS["k2"](log_r), torch.tensor([0.240227, 0.240227]))
    torch.testing.assert_close(KL_ESTIMATORS["k3"](log_r), torch.tensor([0.306853, 0.193147]))


@pytest.mark.parametrize(
    ("estimator", "expected_kl", "expected_grad"),
    [
        # Advantages 0, so loss = 0.1 * mean(kl). Policy (0.5, 0.25) vs reference (0.25, 0.5).
        # k1 = log pi - log pi_ref = (ln2, -ln2): mean 0; d/dlogpi = 1 -> grads 0.1 / 2.
        ("k1", 0.0, [0.05, 0.05]),
        # k2 = (ln2)^2 / 2 each: mean 0.240227; d/dlogpi = -log r = (ln2, -ln2) -> * 0.05.
        ("k2", 0.240227, [0.05 * LN2, -0.05 * LN2]),
        # k3: r = (0.5, 2): (-0.5 + ln2) + (1 - ln2) = 0.5 total, mean 0.25; d/dlogpi = 1 - r
        #   = (0.5, -1) -> * 0.05: descent raises log pi where the reference is more likely.
        ("k3", 0.25, [0.025, -0.05]),
    ],
)
def test_kl_penalty_direction_and_gradient(
    estimator: str, expected_kl: float, expected_grad: list[float]
) -> None:
    config = PolicyLossConfig(kl_coef=0.1, kl_estimator=estimator)  # type: ignore[arg-type]
    batch = make_batch(
        [[1, 1]],
        advantages=[[0, 0]],
        old_logprobs=log([0.5, 0.25]),
        reference_logprobs=log([0.25, 0.5]),
    )
    logprobs = torch.tensor(log([0.5, 0.25]), requires_grad=True)
    loss, metrics = ClippedPolicyLoss(config)(logprobs, batch, 2, 1)
    loss.backward()
    assert metrics["kl"].item() == pytest.approx(expected_kl, abs=1e-6)
    assert loss.item() == pytest.approx(0.1 * expected_kl, abs=1e-6)
    torch.testing.assert_close(logprobs.grad, torch.tensor([expected_grad]))


def test_kl_sign_policy_above_reference_is_positive() -> None:
    # Policy puts 0.5 where the reference puts 0.25 on the sampled token: KL(pi || ref) estimate
    # k1 = ln 0.5 - ln 0.25 = +ln 2 (the opposite direction would give -ln 2).
    batch = make_batch([[1]], advantages=[[0]], reference_logprobs=log([0.25]))
    config = PolicyLossConfig(kl_coef=1.0, kl_estimator="k1")
    _, metrics = ClippedPolicyLoss(config)(torch.tensor(log([0.5])), batch, 1, 1)
    assert metrics["kl"].item() == pytest.approx(LN2)


def test_kl_coef_zero_needs_no_reference_and_positive_coef_requires_it() -> None:
    batch = make_batch([[1]], advantages=[[1]])
    _, metrics = ClippedPolicyLoss()(torch.zeros(1, 1), batch, 1, 1)
    assert "kl" not in metrics
    with pytest.raises(ValueError, match="reference_logprobs"):
        ClippedPolicyLoss(PolicyLossConfig(kl_coef=0.1))(torch.zeros(1, 1), batch, 1, 1)


@pytest.mark.parametrize(
    ("aggregation", "expected_loss", "expected_grad"),
    [
        # On-policy (ratio 1): token loss = -A. Sequence 0 has 3 tokens with A=1, sequence 1 one
        # token with A=-2 (then padding). token: (-3 + 2) / 4 = -0.25, grads -A / 4.
        ("token", -0.25, [[-0.25, -0.25, -0.25], [0.5, 0.0, 0.0]]),
        # sequence: means (-1, 2), (-1 + 2) / 2 = 0.5; grads -A / len / 2.
        ("sequence", 0.5, [[-1 / 6, -1 / 6, -1 / 6], [1.0, 0.0, 0.0]]),
    ],
)
def test_token_vs_sequence_aggregation(
    aggregation: str, expected_loss: float, expected_grad: list[list[float]]
) -> None:
    config = PolicyLossConfig(aggregation=aggregation, kl_estimator="k1")  # type: ignore[arg-type]
    # k1 = log pi - log pi_ref is 1 on sequence 0's tokens and 0 on sequence 1's; the kl metric
    # is a token mean in both modes (3 / 4), kl_coef=0 keeps it out of the loss.
    batch = make_batch(
        [[1, 1, 1], [1, 0, 0]],
        advantages=[[1, 1, 1], [-2, 0, 0]],
        reference_logprobs=[[-2, -2, -2], [-1, 0, 0]],
    )
    logprobs = torch.full((2, 3), -1.0, requires_grad=True)
    loss, metrics = ClippedPolicyLoss(config)(logprobs, batch, 4, 2)
    loss.backward()
    assert loss.item() == pytest.approx(expected_loss, abs=1e-6)
    assert metrics["kl"].item() == pytest.approx(0.75)
    torch.testing.assert_close(logprobs.grad, torch.tensor(expected_grad))


def test_truncated_importance_weight() -> None:
    # old = 0, generator = -ln w so exp(old - generator) = w = (0.5, 3); cap 2 -> (0.5, 2).
    # On-policy, A = 1: token losses (-0.5, -2), mean -1.25; grads -w / 2 = (-0.25, -1).
    batch = make_batch(
        [[1, 1]],
        advantages=[[1, 1]],
        old_logprobs=[[0, 0]],
        generator_logprobs=[[LN2, -math.log(3)]],
    )
    logprobs = torch.zeros(1, 2, requires_grad=True)
    tis = PolicyLossConfig(rollout_correction="token_tis", correction_high=2.0)
    loss, metrics = ClippedPolicyLoss(tis)(logprobs, batch, 2, 1)
    loss.backward()
    assert loss.item() == pytest.approx(-1.25, abs=1e-6)
    assert metrics["importance_weight_mean"].item() == pytest.approx(1.25, abs=1e-6)
    assert metrics["rollout_correction/truncated_frac"].item() == pytest.approx(0.5)
    torch.testing.assert_close(logprobs.grad, torch.tensor([[-0.25, -1.0]]))
    # Off when disabled, and when the batch has no generator logprobs.
    for mode, gen in [("none", batch.generator_logprobs), ("token_tis", None)]:
        batch.generator_logprobs = gen
        config = PolicyLossConfig(rollout_correction=mode, correction_high=2.0)  # type: ignore[arg-type]
        loss, metrics = ClippedPolicyLoss(config)(logprobs, batch, 2, 1)
        assert loss.item() == pytest.approx(-1.0)
        assert "importance_weight_mean" not in metrics


def test_entropy_metric_and_masked_garbage() -> None:
    # Masked positions (prompt, padding) may hold anything, here nan from the generator side:
    # nothing of it may leak into the loss, the metrics or the gradient.
    nan = float("nan")
    batch = make_batch(
        [[0, 1, 1]],
        advantages=[[0, 1, 1]],
        old_logprobs=[[nan, 0, 0]],
        generator_logprobs=[[nan, 0, 0]],
        reference_logprobs=[[nan, 0, 0]],
    )
    logprobs = torch.zeros(1, 3, requires_grad=True)
    entropy = torch.tensor([[9.0, 1.0, 2.0]])
    config = PolicyLossConfig(kl_coef=0.1, rollout_correction="token_mask")
    loss, metrics = ClippedPolicyLoss(config)(logprobs, batch, 2, 1, entropy=entropy)
    loss.backward()
    assert loss.item() == pytest.approx(-1.0)
    assert metrics["entropy"].item() == pytest.approx(1.5)
    assert all(torch.isfinite(value) for value in metrics.values()), metrics
    assert logprobs.grad is not None and torch.isfinite(logprobs.grad).all()


def random_batch(seed: int) -> tuple[torch.Tensor, TrainBatch]:
    """6 sequences of unequal lengths, ratios spread wide enough to hit every clip."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([5, 1, 3, 6, 2, 4])
    mask = (torch.arange(7)[None, :] >= 1) & (torch.arange(7)[None, :] <= lengths[:, None])
    old = -torch.rand(6, 7, generator=gen, dtype=torch.float64) * 3
    logprobs = old + torch.randn(6, 7, generator=gen, dtype=torch.float64) * 0.5
    adv = torch.randn(6, 1, generator=gen, dtype=torch.float64).expand(6, 7) * mask
    return logprobs, TrainBatch(
        input_ids=torch.zeros(6, 7, dtype=torch.long),
        attention_mask=torch.ones(6, 7, dtype=torch.long),
        loss_mask=mask.double(),
        advantages=adv,
        old_logprobs=old,
        generator_logprobs=old + torch.randn(6, 7, generator=gen, dtype=torch.float64) * 0.3,
        reference_logprobs=old + torch.randn(6, 7, generator=gen, dtype=torch.float64) * 0.3,
    )


FULL_CONFIG = dict(
    clip_high=0.28,
    dual_clip=3.0,
    kl_coef=0.05,
    rollout_correction="token_tis",
    correction_high=1.5,
)


@pytest.mark.parametrize("aggregation", ["token", "sequence"])
def test_micro_batches_add_up_to_the_full_batch(aggregation: str) -> None:
    loss_fn = ClippedPolicyLoss(PolicyLossConfig(aggregation=aggregation, **FULL_CONFIG))  # type: ignore[arg-type]
    logprobs, batch = random_batch(0)
    num_tokens, num_sequences = batch.num_tokens, batch.num_sequences
    full_lp = logprobs.clone().requires_grad_(True)
    full_loss, full_metrics = loss_fn(full_lp, batch, num_tokens, num_sequences)
    full_loss.backward()
    assert 0 < full_metrics["clip_frac"] < 1  # the batch exercises the clipped branch

    micro_lp = logprobs.clone().requires_grad_(True)
    total_loss = torch.zeros((), dtype=torch.float64)
    totals = dict.fromkeys(full_metrics, 0.0)
    for rows in (slice(0, 2), slice(2, 5), slice(5, 6)):
        loss, metrics = loss_fn(micro_lp[rows], batch.select(rows), num_tokens, num_sequences)
        loss.backward()
        total_loss = total_loss + loss.detach()
        totals = {k: totals[k] + metrics[k].item() for k in totals}
    torch.testing.assert_close(total_loss, full_loss.detach())
    torch.testing.assert_close(micro_lp.grad, full_lp.grad)
    for key, value in full_metrics.items():
        assert totals[key] == pytest.approx(value.item()), key


@pytest.mark.parametrize("aggregation", ["token", "sequence"])
def test_gradcheck_float64(aggregation: str) -> None:
    # Ratios within 1 +- 0.05 stay inside the clip range, where the loss is smooth.
    logprobs, batch = random_batch(1)
    assert batch.old_logprobs is not None
    logprobs = (
        batch.old_logprobs + 0.05 * torch.tanh(logprobs - batch.old_logprobs)
    ).requires_grad_(True)
    loss_fn = ClippedPolicyLoss(PolicyLossConfig(aggregation=aggregation, **FULL_CONFIG))  # type: ignore[arg-type]
    _, metrics = loss_fn(logprobs, batch, batch.num_tokens, batch.num_sequences)
    assert metrics["clip_frac"].item() == 0.0
    assert torch.autograd.gradcheck(
        lambda lp: loss_fn(lp, batch, batch.num_tokens, batch.num_sequences)[0], (logprobs,)
    )


def test_loss_is_picklable_for_workers() -> None:
    loss_fn = pickle.loads(pickle.dumps(ClippedPolicyLoss(PolicyLossConfig(clip_high=0.28))))
    assert loss_fn.config.clip_high == 0.28


def test_missing_advantages_is_a_user_error() -> None:
    with pytest.raises(ValueError, match="advantages"):
        ClippedPolicyLoss()(torch.zeros(1, 1), make_batch([[1]]), 1, 1)


def test_nll_loss_is_global_token_mean_and_adds_up() -> None:
    # Trained tokens: 0.5, 0.25 (row 0) and 0.5 (row 1): NLL (ln2 + 2 ln2 + ln2) / 3 = 4 ln2 / 3.
    # Row 0 alone contributes 3 ln2 / 3 = ln2, row 1 ln2 / 3; masked entries (p=0.1) never count.
    batch = make_batch([[0, 1, 1], [0, 1, 0]])
    logprobs = torch.log(torch.tensor([[0.1, 0.5, 0.25], [0.1, 0.5, 0.1]])).requires_grad_(True)
    loss, metrics = nll_loss(logprobs, batch, 3, 2)
    loss.backward()
    assert loss.item() == pytest.approx(4 * LN2 / 3)
    assert metrics["loss"].item() == pytest.approx(4 * LN2 / 3)
    torch.testing.assert_close(logprobs.grad, torch.tensor([[0, -1 / 3, -1 / 3], [0, -1 / 3, 0]]))
    first, _ = nll_loss(logprobs[:1], batch.select(slice(0, 1)), 3, 2)
    second, _ = nll_loss(logprobs[1:], batch.select(slice(1, 2)), 3, 2)
    assert first.item() == pytest.approx(LN2)
    assert second.item() == pytest.approx(LN2 / 3)


def test_logprob_mismatch_is_the_token_mean_gap_to_the_generator_over_the_whole_batch() -> None:
    # Two micro-batches of one global batch of 3 trained tokens: |0.5 - 0.2|, |-1 - -1.5| and
    # |-2 - -2| over 3 tokens = 0.8 / 3; the prompt position's huge gap does not count.
    loss = ClippedPolicyLoss()
    first = make_batch([[0, 1, 1]], advantages=[[0, 1, 1]], generator_logprobs=[[9, 0.2, -1.5]])
    second = make_batch([[0, 0, 1]], advantages=[[0, 0, 1]], generator_logprobs=[[0, 0, -2]])
    total = sum(
        loss(torch.tensor(lp), batch, 3, 2)[1]["logprob_mismatch"].item()
        for lp, batch in (([[-9.0, 0.5, -1.0]], first), ([[0.0, 0.0, -2.0]], second))
    )
    assert total == pytest.approx(0.8 / 3)
    no_generator = make_batch([[0, 1]], advantages=[[0, 1]])
    assert "logprob_mismatch" not in loss(torch.zeros(1, 2), no_generator, 1, 1)[1]


# w = exp(old - generator) per token of one 4-token sequence: (0.25, 0.8, 1.5, 4); A = 1,
# on-policy (ratio 1), so each token's loss is -weight and its gradient -weight / 4.
W = [0.25, 0.8, 1.5, 4.0]
GEO = math.exp(sum(math.log(w) for w in W) / 4)  # the sequence's geometric mean, 0.98...


@pytest.mark.parametrize(
    ("mode", "weights", "truncated", "masked"),
    [
        ("token_tis", [0.25, 0.8, 1.5, 2.0], 1, 0),
        ("seq_tis", [GEO] * 4, 0, 0),
        ("token_mask", [0.0, 0.8, 1.5, 0.0], 0, 2),
        ("seq_mask", [GEO] * 4, 0, 0),
        ("icepop", [0.0, 1.0, 1.0, 0.0], 0, 2),
    ],
)
def test_rollout_correction_modes(
    mode: str, weights: list[float], truncated: int, masked: int
) -> None:
    batch = make_batch(
        [[1, 1, 1, 1]],
        advantages=[[1, 1, 1, 1]],
        old_logprobs=[[0, 0, 0, 0]],
        generator_logprobs=[[-math.log(w) for w in W]],
    )
    logprobs = torch.zeros(1, 4, requires_grad=True)
    config = PolicyLossConfig(rollout_correction=mode, correction_low=0.5, correction_high=2.0)  # type: ignore[arg-type]
    loss, metrics = ClippedPolicyLoss(config)(logprobs, batch, 4, 1)
    loss.backward()
    assert loss.item() == pytest.approx(-sum(weights) / 4, abs=1e-6)
    torch.testing.assert_close(logprobs.grad, -torch.tensor([weights]) / 4)
    assert metrics["rollout_correction/truncated_frac"].item() == pytest.approx(truncated / 4)
    assert metrics["rollout_correction/masked_frac"].item() == pytest.approx(masked / 4)


def test_seq_mask_drops_a_sequence_outside_the_range() -> None:
    # geometric mean of (4, 4) = 4 > 2: the whole sequence leaves the loss
    batch = make_batch(
        [[1, 1]], advantages=[[1, 1]], old_logprobs=[[0, 0]], generator_logprobs=[[-LN4, -LN4]]
    )
    logprobs = torch.zeros(1, 2, requires_grad=True)
    config = PolicyLossConfig(rollout_correction="seq_mask", correction_high=2.0)
    loss, metrics = ClippedPolicyLoss(config)(logprobs, batch, 2, 1)
    loss.backward()
    assert loss.item() == 0.0 and metrics["rollout_correction/masked_frac"].item() == 1.0
    assert logprobs.grad is not None and not logprobs.grad.any()


def test_gspo_sequence_ratio_and_its_clip() -> None:
    """GSPO by hand: two sequences, ratios per token exp(0.2), exp(0.4) (seq 1, mean 0.3) and
    exp(-0.1) (seq 2). Seq 1, A = 1, clip_high 0.2: s = exp(0.3) = 1.35 > 1.2 -> clipped, no
    gradient, loss -1.2. Seq 2, A = -1: s = exp(-0.1) inside -> loss s, gradient of each token
    d(s)/d(lp_t) = s / |y| = s (one token). Sequence aggregation: mean over the 2 sequences."""
    batch = make_batch(
        [[1, 1], [1, 0]], advantages=[[1, 1], [-1, 0]], old_logprobs=[[0, 0], [0, 0]]
    )
    logprobs = torch.tensor([[0.2, 0.4], [-0.1, 0.0]], requires_grad=True)
    config = PolicyLossConfig(ratio_level="sequence", aggregation="sequence")
    loss, metrics = ClippedPolicyLoss(config)(logprobs, batch, 3, 2)
    loss.backward()
    s2 = math.exp(-0.1)
    assert loss.item() == pytest.approx((-1.2 + s2) / 2, abs=1e-6)
    torch.testing.assert_close(logprobs.grad, torch.tensor([[0.0, 0.0], [s2 / 2, 0.0]]))
    assert metrics["ratio_mean"].item() == pytest.approx((2 * math.exp(0.3) + s2) / 3)
    assert metrics["clip_frac"].item() == pytest.approx(2 / 3)
