"""Where bf16's logprob error comes from, at the real Qwen2.5 shapes (random weights, vocabulary
151,936), on the CPU: the logprobs of tokens sampled from the fp32 model, computed

    fp32                 the reference (the bf16 weights, upcast)
    bf16                 a full-sequence forward, as the trainer computes them
    bf16, fp32 head      the same hidden states through the LM head and softmax in fp32
    bf16, fp32 residual  every layer computes in bf16, the residual stream is kept in fp32
    bf16 decode          the last ``--tail`` tokens one at a time with a KV cache, as a
                         generator computes them

and the relative error of the hidden states after every 4th layer. A random model's next-token
distribution is close to uniform (mean sampled logprob about -12, where a trained model's is
nearer -1); ``--sharpen S`` multiplies the final norm's weight by S, the logits with it, for a
peaked distribution of the same model. One JSON line per shape and sharpening:
mean |logprob - fp32| of each, and bf16 full against bf16 decode (two bf16 computations that
differ only in their shapes: what the trainer/generator mismatch measures).

    PYTHONPATH=bench ./run.sh python bench/bf16_floor.py --shapes 0.5b 1.5b [--sharpen 1 8]
"""

from __future__ import annotations

import argparse
from typing import Any

import torch
import transformers
from ceilings import emit

from tandem.assets.real_shapes import real_config


def _bf16(x: Any) -> Any:
    if torch.is_tensor(x) and x.is_floating_point():
        return x.to(torch.bfloat16)
    return tuple(_bf16(y) for y in x) if isinstance(x, tuple) else x


def _fp32_residual(model: Any) -> list[Any]:
    """Hooks: the embeddings' output in fp32 (so every residual add is fp32), each attention,
    MLP and the LM head fed bf16."""

    def feed_bf16(_module: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        return tuple(_bf16(a) for a in args), {k: _bf16(v) for k, v in kwargs.items()}

    handles = [model.model.embed_tokens.register_forward_hook(lambda _m, _a, out: out.float())]
    for layer in model.model.layers:
        for part in (layer.self_attn, layer.mlp):
            handles.append(part.register_forward_pre_hook(feed_bf16, with_kwargs=True))
    handles.append(model.lm_head.register_forward_pre_hook(feed_bf16, with_kwargs=True))
    return handles


class _EagerUpdateCache(transformers.DynamicCache):
    """transformers' cache with its update outside compiled layers (as the generator's own
    cache): traced, its per-layer state would recompile the shared layer graph."""

    @torch.compiler.disable
    def update(self, *args: Any, **kwargs: Any) -> Any:
        return super().update(*args, **kwargs)


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Each token's logprob under ``logits`` (fp32 softmax; ``tokens`` as logits without their
    last dimension)."""
    return logits.float().log_softmax(-1).gather(-1, tokens[..., None])[..., 0]


def _errors(hidden: tuple, reference: tuple) -> list[float]:
    pairs = list(zip(hidden, reference, strict=True))
    picked = [*pairs[4::4], pairs[-1]] if (len(pairs) - 1) % 4 else pairs[4::4]
    return [round(float((h.float() - r).norm() / r.norm()), 4) for h, r in picked]


def _sample(model: Any, first: torch.Tensor, tokens: int) -> torch.Tensor:
    """``tokens`` ids: ``first``, then each sampled from the fp32 model given those before it."""
    cache = transformers.DynamicCache()
    ids = first
    logits = model(ids, past_key_values=cache, use_cache=True).logits[:, -1]
    while ids.shape[1] < tokens:
        token = torch.distributions.Categorical(logits=logits).sample()[:, None]
        ids = torch.cat([ids, token], dim=1)
        logits = model(token, past_key_values=cache, use_cache=True).logits[:, -1]
    return ids


@torch.no_grad()
def measure(
    shape: str, tokens: int, tail: int, seed: int, sharpen: float, compiled: bool = False
) -> dict[str, Any]:
    torch.manual_seed(seed)
    config = real_config(shape)
    model = transformers.Qwen2ForCausalLM(config).to(torch.bfloat16).eval()
    model.model.norm.weight.mul_(sharpen)
    model.float()
    ids = _sample(model, torch.randint(0, config.vocab_size - 2000, (1, 1)), tokens)
    targets = ids[:, 1:]
    ref = model(ids, output_hidden_states=True)
    fp32 = token_logprobs(ref.logits[:, :-1], targets)
    head = model.lm_head.weight.detach().clone()
    model.to(torch.bfloat16)
    full = model(ids, output_hidden_states=True)
    bf16 = token_logprobs(full.logits[:, :-1], targets)
    head32 = token_logprobs((full.hidden_states[-1].float() @ head.T)[:, :-1], targets)
    handles = _fp32_residual(model)
    try:
        mixed = model(ids, output_hidden_states=True)
    finally:
        for handle in handles:
            handle.remove()
    residual32 = token_logprobs(mixed.logits[:, :-1], targets)
    start = tokens - tail  # prefill, then one token at a time

    def decode_tail() -> torch.Tensor:
        cache = _EagerUpdateCache()
        steps = [model(ids[:, :start], past_key_values=cache, use_cache=True).logits[:, -1:]]
        for i in range(start, tokens - 1):
            steps.append(model(ids[:, i : i + 1], past_key_values=cache, use_cache=True).logits)
        return token_logprobs(torch.cat(steps, dim=1), ids[:, start:])

    decode = decode_tail()
    last = slice(start - 1, tokens - 1)

    def gap(a: torch.Tensor, b: torch.Tensor) -> float:
        return round(float((a - b).abs().mean()), 5)

    both: dict[str, float] = {}
    if compiled:  # every decoder layer through Inductor, as policy.compile / generation.compile
        for layer in model.model.layers:
            layer.compile(dynamic=True)
        # a layer's index an input, not a constant: all layers share one graph (as the generator)
        with torch._dynamo.config.patch(allow_unspec_int_on_nn_module=True):
            cfull = token_logprobs(model(ids, use_cache=False).logits[:, :-1], targets)[:, last]
            cdecode = decode_tail()
        both = {
            "compiled_full_vs_fp32": gap(cfull, fp32[:, last]),
            "compiled_full_vs_compiled_decode": gap(cfull, cdecode),
            "compiled_full_vs_eager_decode": gap(cfull, decode),
            "eager_full_vs_compiled_decode": gap(bf16[:, last], cdecode),
        }

    return both | {
        "bench": "bf16_floor",
        "shape": shape,
        "layers": config.num_hidden_layers,
        "hidden": config.hidden_size,
        "tokens": tokens,
        "sharpen": sharpen,
        "mean_logprob_fp32": round(float(fp32.mean()), 3),
        "bf16": gap(bf16, fp32),
        "bf16_fp32_head": gap(head32, fp32),
        "bf16_fp32_residual": gap(residual32, fp32),
        "bf16_decode_tail": gap(decode, fp32[:, last]),
        "bf16_full_tail": gap(bf16[:, last], fp32[:, last]),
        "bf16_full_vs_bf16_decode_tail": gap(bf16[:, last], decode),
        "hidden_rel_err_every_4_layers": _errors(full.hidden_states, ref.hidden_states),
        "hidden_rel_err_every_4_layers_fp32_residual": _errors(
            mixed.hidden_states, ref.hidden_states
        ),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="+", default=["0.5b", "1.5b"])
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--tail", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--sharpen", type=float, nargs="+", default=[1.0])
    parser.add_argument(
        "--compiled", action="store_true", help="also with every decoder layer compiled"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    for shape in args.shapes:
        for sharpen in args.sharpen:
            emit(measure(shape, args.tokens, args.tail, args.seed, sharpen, args.compiled))


if __name__ == "__main__":
    main()
