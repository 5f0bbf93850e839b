"""The Megatron trainer's chunked output layer (no megatron-core needed: the hook's arithmetic
is plain torch): logprobs, entropies and gradients equal those of the full logits over the
unpadded vocabulary."""

import torch
import torch.nn.functional as F

from tandem.trainer import megatron_logprobs


def _inputs(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    s, b, h, vocab, padded = 7, 3, 16, 37, 48
    hidden = torch.randn(s, b, h, generator=gen, dtype=torch.float64, requires_grad=True)
    layer = torch.nn.Linear(h, padded, bias=False, dtype=torch.float64)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(padded, h, generator=gen))
        layer.weight[vocab:] = 50.0  # padded rows that would dominate a softmax over them
    ids = torch.randint(0, vocab, (b, s), generator=gen)
    mask = torch.ones(b, s)
    mask[1, 5:] = 0
    return hidden, layer, ids, mask, vocab


def _head(vocab, chunk_size, with_entropy, hidden, ids, layer=None, weight=None, **more):
    """GPTModel's call of the output processor (``more``: what else it passes, ignored)."""
    kwargs = megatron_logprobs.head_kwargs(1, vocab, chunk_size, with_entropy=with_entropy)
    return kwargs["output_processor"](
        hidden_states=hidden,
        output_layer=layer,
        output_weight=weight,
        input_ids=ids,
        context=kwargs["output_processor_context"],
        **more,
    )


def test_chunked_head_equals_full_logits_over_the_real_vocabulary():
    hidden, layer, ids, mask, vocab = _inputs()
    output = _head(vocab, 4, True, hidden, ids, layer=layer, labels=None)
    logprobs, entropy = megatron_logprobs.aligned(output, ids, mask, True, None, vocab)
    (logprobs.sum() + 0.5 * entropy.sum()).backward()
    chunked = (hidden.grad.clone(), layer.weight.grad.clone())
    hidden.grad, layer.weight.grad = None, None

    logits = (hidden.transpose(0, 1) @ layer.weight.T)[..., :vocab]
    logp = F.log_softmax(logits[:, :-1], dim=-1)
    picked = logp.gather(-1, ids[:, 1:, None])[..., 0]
    ent = -(logp.exp() * logp).sum(-1)
    zeros = torch.zeros(ids.shape[0], 1, dtype=logp.dtype)
    want_lp = torch.cat([zeros, picked], 1) * mask
    want_ent = torch.cat([zeros, ent], 1) * mask
    (want_lp.sum() + 0.5 * want_ent.sum()).backward()

    torch.testing.assert_close(logprobs, want_lp.float(), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(entropy, want_ent.float(), atol=1e-6, rtol=1e-6)
    assert (logprobs[1, 5:] == 0).all() and (logprobs[:, 0] == 0).all()
    torch.testing.assert_close(chunked[0], hidden.grad, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(chunked[1], layer.weight.grad, atol=1e-6, rtol=1e-6)
    assert (chunked[1][vocab:] == 0).all()  # the padded rows get no gradient


def test_tied_weight_and_no_entropy():
    hidden, layer, ids, mask, vocab = _inputs(1)
    tied = layer.weight.detach().clone()[:vocab]
    output = _head(vocab, 1024, False, hidden, ids, weight=tied)
    logprobs, entropy = megatron_logprobs.aligned(output, ids, mask, False, None, vocab)
    logits = hidden.detach().transpose(0, 1) @ tied.T
    want = F.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None])[..., 0]
    torch.testing.assert_close(logprobs[:, 1:], (want * mask[:, 1:]).float(), atol=1e-6, rtol=1e-6)
    assert not entropy.any()
    assert megatron_logprobs.head_kwargs(2, vocab, 1024, False) == {}  # split logits over ranks
