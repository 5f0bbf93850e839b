"""The chunked LM-head logprobs (``ChunkedTokenLogprobs``): values and gradients equal to the
unchunked log-softmax's, and one chunk of logits at a time."""

import pytest
import torch
import torch.nn.functional as F

from tandem.trainer import logprobs as logprobs_module
from tandem.trainer.logprobs import chunk_rows, token_logprobs


def _reference(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    logp = torch.log_softmax(F.linear(hidden, weight), dim=-1)
    entropy = -(logp.exp() * logp).sum(-1)
    return logp.gather(-1, targets[:, None])[:, 0], entropy


def _inputs(seed: int, tokens: int = 53, width: int = 16, vocab: int = 97) -> tuple:
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(tokens, width, generator=generator).requires_grad_()
    weight = (torch.randn(vocab, width, generator=generator) * 0.5).requires_grad_()
    targets = torch.randint(0, vocab, (tokens,), generator=generator)
    # a loss of the kind the policy loss is: per-token weights on logprobs and entropies
    weights = torch.randn(2, tokens, generator=generator)
    return hidden, weight, targets, weights


@pytest.mark.parametrize("with_entropy", [False, True])
@pytest.mark.parametrize("chunk_size", [7, 53, 1000])
def test_gradients_equal_the_unchunked_loss(chunk_size: int, with_entropy: bool) -> None:
    hidden, weight, targets, weights = _inputs(seed=chunk_size)
    picked, entropy = token_logprobs(hidden, weight, targets, chunk_size, with_entropy)
    loss = (weights[0] * picked).sum() + (weights[1] * entropy).sum() * with_entropy
    grads = torch.autograd.grad(loss, (hidden, weight))
    ref_picked, ref_entropy = _reference(hidden, weight, targets)
    ref_loss = (weights[0] * ref_picked).sum() + (weights[1] * ref_entropy).sum() * with_entropy
    ref_grads = torch.autograd.grad(ref_loss, (hidden, weight))
    assert torch.allclose(picked, ref_picked, atol=1e-6, rtol=0)
    if with_entropy:
        assert torch.allclose(entropy, ref_entropy, atol=1e-6, rtol=1e-6)
    else:
        assert not entropy.any()
    for grad, ref in zip(grads, ref_grads, strict=True):
        assert (grad - ref).abs().max() <= 1e-6 * max(1.0, float(ref.abs().max()))
        assert ref.abs().max() > 1e-2  # a gradient that could be wrong


def test_a_chunk_holds_at_most_max_chunk_logits(monkeypatch: pytest.MonkeyPatch) -> None:
    """The cap on one chunk's logits holds whatever chunk_size says, in forward and in the
    backward's recomputation: every LM-head matmul sees at most that many rows."""
    monkeypatch.setattr(logprobs_module, "MAX_CHUNK_LOGITS", 97 * 5)
    assert chunk_rows(1024, 97) == 5 and chunk_rows(3, 97) == 3
    hidden, weight, targets, weights = _inputs(seed=1)
    rows: list[int] = []
    real_linear = F.linear

    def counting_linear(x: torch.Tensor, w: torch.Tensor, *args: object) -> torch.Tensor:
        rows.append(x.shape[0])
        return real_linear(x, w, *args)

    monkeypatch.setattr(logprobs_module.F, "linear", counting_linear)
    picked, _ = token_logprobs(hidden, weight, targets, 1024)
    (weights[0] * picked).sum().backward()
    monkeypatch.setattr(logprobs_module.F, "linear", real_linear)
    assert max(rows) == 5 and sum(rows) == 2 * 53  # forward and backward, every token once each
    ref_picked, _ = _reference(hidden.detach(), weight.detach(), targets)
    assert torch.allclose(picked, ref_picked, atol=1e-6)
    assert hidden.grad is not None and weight.grad is not None


def test_without_gradients_nothing_is_kept() -> None:
    hidden, weight, targets, _ = _inputs(seed=3)
    with torch.no_grad():
        picked, entropy = token_logprobs(hidden, weight, targets, 8, with_entropy=True)
    ref_picked, ref_entropy = _reference(hidden.detach(), weight.detach(), targets)
    assert picked.grad_fn is None
    assert torch.allclose(picked, ref_picked, atol=1e-6)
    assert torch.allclose(entropy, ref_entropy, atol=1e-6)


@pytest.mark.parametrize("with_entropy", [False, True])
def test_bf16_logits_gradient_is_the_fp32_one_rounded_once(with_entropy: bool) -> None:
    """In bf16 compute the head's logits stay bf16; the (log-)softmax and the gradient on the
    logits run in fp32 and are rounded once into bf16, so they equal the fp32 gradient of the
    same bf16 logits rounded to bf16 (a bf16 pass in between would round twice)."""
    hidden, weight, targets, weights = _inputs(seed=3, tokens=40, width=32, vocab=5003)
    logits = F.linear(hidden.detach().bfloat16(), weight.detach().bfloat16())
    wide = logits.float().requires_grad_()
    logp = torch.log_softmax(wide, -1)
    loss = (weights[0] * logp.gather(-1, targets[:, None])[:, 0]).sum()
    if with_entropy:
        loss = loss + (weights[1] * -(logp.exp() * logp).sum(-1)).sum()
    (reference,) = torch.autograd.grad(loss, wide)
    grad = logprobs_module._logits_grad(
        logits, targets, weights[0], weights[1] if with_entropy else None
    )
    assert grad.dtype == torch.bfloat16
    ulp = reference.abs().clamp_min(1e-30).log2().floor().sub(7).exp2()  # bf16's spacing there
    apart = (grad.float() - reference).abs() / ulp
    assert apart.max() <= 1.01  # the rounding of the fp32 value (and fp32 arithmetic's last bits)
    assert (grad == reference.bfloat16()).float().mean() > 0.99


def test_an_unused_entropy_costs_no_entropy_gradient(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without ``with_entropy`` the backward gets no entropy gradient (None, not zeros), so it
    takes the softmax-only path."""
    seen: list[object] = []
    real = logprobs_module._logits_grad

    def spy(logits, targets, grad_picked, grad_entropy):  # type: ignore[no-untyped-def]
        seen.append(grad_entropy)
        return real(logits, targets, grad_picked, grad_entropy)

    monkeypatch.setattr(logprobs_module, "_logits_grad", spy)
    hidden, weight, targets, weights = _inputs(seed=5)
    picked, _ = token_logprobs(hidden, weight, targets, 16)
    (weights[0] * picked).sum().backward()
    assert len(seen) == 4 and all(grad is None for grad in seen)
