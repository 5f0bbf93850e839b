"""Hugging Face <-> Megatron-core weight layouts of Qwen2/Llama-family decoders: names, the
fused QKV and gate/up projections, and the split over tensor-parallel ranks. Pure tensor code
(no megatron import), so it is tested where megatron-core cannot run.

Megatron-core's GPT model (local layer spec) names and fuses the weights so:

=====================================================  =============================================
Megatron                                                Hugging Face
=====================================================  =============================================
``embedding.word_embeddings.weight``                    ``model.embed_tokens.weight`` (vocab padded)
``decoder.final_layernorm.weight``                      ``model.norm.weight``
``output_layer.weight`` (untied only)                   ``lm_head.weight``
``decoder.layers.L.input_layernorm.weight``             ``model.layers.L.input_layernorm.weight``
``decoder.layers.L.self_attention.linear_qkv.weight``   ``q_proj``, ``k_proj``, ``v_proj``, grouped
``decoder.layers.L.self_attention.linear_qkv.bias``     their biases, interleaved alike (Qwen2)
``decoder.layers.L.self_attention.linear_proj.weight``  ``self_attn.o_proj.weight``
``decoder.layers.L.pre_mlp_layernorm.weight``           ``post_attention_layernorm.weight``
``decoder.layers.L.mlp.linear_fc1.weight``              ``gate_proj`` rows, then ``up_proj`` rows
``decoder.layers.L.mlp.linear_fc2.weight``              ``mlp.down_proj.weight``
=====================================================  =============================================

The QKV rows are grouped by key/value head: for each of the ``g`` query groups, the rows of its
``h / g`` query heads, then its key head, then its value head (``SelfAttention.
get_query_key_value_tensors`` views the output as ``[.., g, (h/g + 2) * d]`` and splits it
so). Over ``t`` tensor-parallel ranks the column-parallel weights (QKV, fc1, the embedding and
the output layer) are cut along their rows and the row-parallel ones (``linear_proj``, ``fc2``)
along their columns; fc1 is cut per half, so each rank holds its gate rows, then its up rows
(swiglu chunks its own output in two).
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class DecoderShape:
    """The sizes the layouts depend on, read from a Hugging Face config."""

    num_layers: int
    hidden_size: int
    num_heads: int
    num_query_groups: int
    head_dim: int
    ffn_hidden_size: int
    vocab_size: int
    padded_vocab_size: int
    tied: bool

    @classmethod
    def from_hf(cls, config: Any, tensor_parallel: int = 1, divisible_by: int = 1) -> DecoderShape:
        """``config``: a transformers ``PretrainedConfig`` or its config.json as a dict. The
        vocabulary is padded to a multiple of ``divisible_by * tensor_parallel`` rows."""

        def get(key: str) -> Any:
            return config.get(key) if isinstance(config, dict) else getattr(config, key, None)

        heads = int(get("num_attention_heads"))
        vocab = int(get("vocab_size"))
        return cls(
            num_layers=int(get("num_hidden_layers")),
            hidden_size=int(get("hidden_size")),
            num_heads=heads,
            num_query_groups=int(get("num_key_value_heads") or heads),
            head_dim=int(get("head_dim") or get("hidden_size") // heads),
            ffn_hidden_size=int(get("intermediate_size")),
            vocab_size=vocab,
            padded_vocab_size=padded_vocab_size(vocab, tensor_parallel, divisible_by),
            tied=bool(get("tie_word_embeddings")),
        )


def padded_vocab_size(vocab_size: int, tensor_parallel: int = 1, divisible_by: int = 1) -> int:
    """``vocab_size`` rounded up to a multiple of ``divisible_by * tensor_parallel`` (every
    rank's slice of the embedding and the output layer the same size)."""
    multiple = divisible_by * tensor_parallel
    return -(-vocab_size // multiple) * multiple


# -- the fused projections --------------------------------------------------------------------
def fuse_qkv(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_groups: int, head_dim: int
) -> torch.Tensor:
    """Megatron's ``linear_qkv`` rows (or bias) from HF's q/k/v projections: per query group,
    its query heads' rows, then its key head's, then its value head's."""
    trailing = q.shape[1:]
    per_group = q.shape[0] // (num_groups * head_dim)
    groups = [
        q.reshape(num_groups, per_group * head_dim, *trailing),
        k.reshape(num_groups, head_dim, *trailing),
        v.reshape(num_groups, head_dim, *trailing),
    ]
    return torch.cat(groups, dim=1).reshape(-1, *trailing)


def split_qkv(
    qkv: torch.Tensor, num_heads: int, num_groups: int, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The inverse of ``fuse_qkv``: HF's (q, k, v) rows from ``linear_qkv``."""
    trailing = qkv.shape[1:]
    per_group = num_heads // num_groups
    grouped = qkv.reshape(num_groups, (per_group + 2) * head_dim, *trailing)
    q, k, v = grouped.split([per_group * head_dim, head_dim, head_dim], dim=1)
    return (
        q.reshape(-1, *trailing).contiguous(),
        k.reshape(-1, *trailing).contiguous(),
        v.reshape(-1, *trailing).contiguous(),
    )


# -- names ------------------------------------------------------------------------------------
_HF_LAYER = "model.layers.{}."
_MC_LAYER = "decoder.layers.{}."
_LAYER_PAIRS = {  # megatron suffix -> HF suffix, one tensor each
    "input_layernorm.weight": "input_layernorm.weight",
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    "mlp.linear_fc2.weight": "mlp.down_proj.weight",
}
_LAYER_NAME = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")


def _pad_rows(tensor: torch.Tensor, rows: int) -> torch.Tensor:
    if tensor.shape[0] == rows:
        return tensor
    padding = tensor.new_zeros((rows - tensor.shape[0], *tensor.shape[1:]))
    return torch.cat([tensor, padding])


def hf_to_megatron(hf: Mapping[str, torch.Tensor], shape: DecoderShape) -> dict[str, torch.Tensor]:
    """Megatron-core tensors (full, not split over ranks; layers by their global index) from a
    Hugging Face state dict. The vocabulary is padded with zero rows; a tied model has no
    ``output_layer`` (its ``lm_head``, if present, is the embedding and is ignored)."""
    vocab = shape.padded_vocab_size
    out = {
        "embedding.word_embeddings.weight": _pad_rows(hf["model.embed_tokens.weight"], vocab),
        "decoder.final_layernorm.weight": hf["model.norm.weight"],
    }
    if not shape.tied:
        out["output_layer.weight"] = _pad_rows(hf["lm_head.weight"], vocab)
    groups, head_dim = shape.num_query_groups, shape.head_dim
    for layer in range(shape.num_layers):
        src, dst = _HF_LAYER.format(layer), _MC_LAYER.format(layer)
        for mc_suffix, hf_suffix in _LAYER_PAIRS.items():
            out[dst + mc_suffix] = hf[src + hf_suffix]
        for kind in ("weight", "bias"):
            names = [f"{src}self_attn.{p}_proj.{kind}" for p in "qkv"]
            if names[0] in hf:
                q, k, v = (hf[n] for n in names)
                out[f"{dst}self_attention.linear_qkv.{kind}"] = fuse_qkv(q, k, v, groups, head_dim)
        gate, up = hf[src + "mlp.gate_proj.weight"], hf[src + "mlp.up_proj.weight"]
        out[dst + "mlp.linear_fc1.weight"] = torch.cat([gate, up])
    return out


def megatron_to_hf(
    mc: Mapping[str, torch.Tensor], shape: DecoderShape
) -> Iterator[tuple[str, torch.Tensor]]:
    """Hugging Face (name, tensor) pairs from full Megatron-core tensors (``hf_to_megatron``'s
    inverse), in the order ``mc`` holds them; vocabulary padding dropped, no ``lm_head`` when
    tied (loaders tie it to the embedding). Layer names keep ``mc``'s indices."""
    for name, tensor in mc.items():
        yield from megatron_tensor_to_hf(name, tensor, shape)


def megatron_tensor_to_hf(
    name: str, tensor: torch.Tensor, shape: DecoderShape
) -> Iterator[tuple[str, torch.Tensor]]:
    """The Hugging Face tensors of one full Megatron-core tensor (three for QKV, two for fc1),
    as views where they can be; nothing for names that carry no weight (``_extra_state``)."""
    if name == "embedding.word_embeddings.weight":
        yield "model.embed_tokens.weight", tensor[: shape.vocab_size]
    elif name == "output_layer.weight":
        if not shape.tied:
            yield "lm_head.weight", tensor[: shape.vocab_size]
    elif name == "decoder.final_layernorm.weight":
        yield "model.norm.weight", tensor
    elif (match := _LAYER_NAME.match(name)) is not None:
        prefix, suffix = _HF_LAYER.format(match.group(1)), match.group(2)
        if suffix in _LAYER_PAIRS:
            yield prefix + _LAYER_PAIRS[suffix], tensor
        elif suffix.startswith("self_attention.linear_qkv."):
            kind = suffix.rsplit(".", 1)[1]
            if kind in ("weight", "bias"):
                parts = split_qkv(tensor, shape.num_heads, shape.num_query_groups, shape.head_dim)
                for proj, part in zip("qkv", parts, strict=True):
                    yield f"{prefix}self_attn.{proj}_proj.{kind}", part
        elif suffix == "mlp.linear_fc1.weight":
            gate, up = tensor.chunk(2)
            yield prefix + "mlp.gate_proj.weight", gate
            yield prefix + "mlp.up_proj.weight", up


def megatron_shapes(shape: DecoderShape, qkv_bias: bool) -> dict[str, tuple[int, ...]]:
    """The full shape of every Megatron-core tensor of a model of ``shape`` (vocabulary
    padded), in the order streams follow: embedding, final norm, output layer (untied), then
    layer by layer its norms, output projections, QKV (weight, bias) and fc1."""
    hidden, ffn, vocab = shape.hidden_size, shape.ffn_hidden_size, shape.padded_vocab_size
    qkv = (shape.num_heads + 2 * shape.num_query_groups) * shape.head_dim
    out: dict[str, tuple[int, ...]] = {
        "embedding.word_embeddings.weight": (vocab, hidden),
        "decoder.final_layernorm.weight": (hidden,),
    }
    if not shape.tied:
        out["output_layer.weight"] = (vocab, hidden)
    for layer in range(shape.num_layers):
        prefix = _MC_LAYER.format(layer)
        out[prefix + "input_layernorm.weight"] = (hidden,)
        out[prefix + "self_attention.linear_proj.weight"] = (
            hidden,
            shape.num_heads * shape.head_dim,
        )
        out[prefix + "pre_mlp_layernorm.weight"] = (hidden,)
        out[prefix + "mlp.linear_fc2.weight"] = (hidden, ffn)
        out[prefix + "self_attention.linear_qkv.weight"] = (qkv, hidden)
        if qkv_bias:
            out[prefix + "self_attention.linear_qkv.bias"] = (qkv,)
        out[prefix + "mlp.linear_fc1.weight"] = (2 * ffn, hidden)
    return out


def hf_metadata(shape: DecoderShape, qkv_bias: bool) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of every Hugging Face tensor ``megatron_tensor_to_hf`` makes of the
    tensors of ``megatron_shapes``, in that order (the conversion run on meta tensors)."""
    out = []
    for name, full in megatron_shapes(shape, qkv_bias).items():
        meta = torch.empty(full, device="meta")
        out += [(hf, tuple(t.shape)) for hf, t in megatron_tensor_to_hf(name, meta, shape)]
    return out


def hf_names(shape: DecoderShape, qkv_bias: bool) -> list[str]:
    """Every Hugging Face name ``megatron_to_hf`` yields for a model of ``shape``."""
    return [name for name, _ in hf_metadata(shape, qkv_bias)]


# -- pipeline stages --------------------------------------------------------------------------
def stage_name(name: str, layer_offset: int) -> str:
    """A global layer name (``decoder.layers.{L}...``) as the pipeline stage whose first layer
    is ``layer_offset`` names it (``decoder.layers.{L - offset}...``); other names unchanged."""
    match = _LAYER_NAME.match(name)
    if match is None:
        return name
    return _MC_LAYER.format(int(match.group(1)) - layer_offset) + match.group(2)


def global_name(name: str, layer_offset: int) -> str:
    """The inverse of ``stage_name``."""
    return stage_name(name, -layer_offset)


# -- tensor parallelism -----------------------------------------------------------------------
def parallel_dim(name: str) -> int | None:
    """The dimension ``name`` is split along over tensor-parallel ranks (0 for column-parallel
    and vocabulary-parallel weights, 1 for row-parallel ones), None where it is replicated."""
    if name.endswith(("linear_qkv.weight", "linear_qkv.bias", "linear_fc1.weight")):
        return 0
    if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        return 0
    if name.endswith(("linear_proj.weight", "linear_fc2.weight")):
        return 1
    return None


def tp_split(name: str, tensor: torch.Tensor, tp_size: int) -> list[torch.Tensor]:
    """``tensor`` (full) cut into the ``tp_size`` slices the tensor-parallel ranks hold, in rank
    order; fc1 per half (each rank: its gate rows, then its up rows)."""
    dim = parallel_dim(name)
    if dim is None or tp_size == 1:
        return [tensor] * tp_size
    if name.endswith("linear_fc1.weight"):
        gate, up = tensor.chunk(2)
        pairs = zip(gate.chunk(tp_size), up.chunk(tp_size), strict=True)
        return [torch.cat([g, u]) for g, u in pairs]
    if tensor.shape[dim] % tp_size:
        raise ValueError(f"{name}: size {tensor.shape[dim]} does not split over {tp_size} ranks")
    return [part.contiguous() for part in tensor.chunk(tp_size, dim=dim)]


def tp_gather(name: str, shards: list[torch.Tensor]) -> torch.Tensor:
    """The full tensor from the ranks' slices (``tp_split``'s inverse)."""
    dim = parallel_dim(name)
    if dim is None or len(shards) == 1:
        return shards[0]
    if name.endswith("linear_fc1.weight"):
        halves = [shard.chunk(2) for shard in shards]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves])
    return torch.cat(shards, dim=dim)


def pad_row_without_input_grad(module: torch.nn.Module, pad_id: int | None) -> None:
    """Give ``module`` (an embedding lookup: ids in, vectors out) the Hugging Face model's
    ``padding_idx``: Qwen2 and Llama build ``nn.Embedding(vocab, hidden, pad_token_id)``, whose
    row ``pad_id`` gets no gradient from the lookup (it still does as a tied output layer).
    Megatron's embedding has no such row, so positions holding ``pad_id`` (the embedded model's
    EOS is its pad token) pass their vectors on detached: the same values, the same gradients
    as the Hugging Face model."""
    if pad_id is None:
        return

    def detach_pad_rows(_: torch.nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
        ids = args[0]
        if output.shape[: ids.dim()] != ids.shape:  # not one vector per id (e.g. scattered)
            return output
        return torch.where((ids == pad_id).unsqueeze(-1), output.detach(), output)

    module.register_forward_hook(detach_pad_rows)
