"""The transformers backend: a fallback generator and the reference the vLLM one is tested
against.

It runs its own decode loop over the Hugging Face model (prefill, then one token per step with
the KV cache, left-padded batches) instead of ``model.generate``, for two reasons: each sample
gets its own seeded random stream (results do not depend on batch composition, like vLLM's
per-request seeds), and the logprob of each sampled token is taken from the raw logits, which is
vLLM's ``raw_logprobs`` semantics (see ``tandem.generation.base``). The loop stays on the device
(per-row streams are counter-based uniforms, not one torch.Generator per row; sampling is an
inverse CDF over each row, no sort or noise over the vocabulary), with one host sync per step as
in ``generate``; rows that finished leave the batch (``COMPACT_AT``). Each step runs under the
generator's ``WeightGate``: when a refit landed since the previous step, the batch is prefilled
again (prompts and the tokens so far) with the new weights before it goes on.

On a GPU the decode steps run over a static KV cache with a prepared attention mask, read in
windows of the positions written so far (``static_decode``), and each step is one CUDA graph
replay: a small model's decode step is otherwise bound by the launch of its hundreds of
kernels, not by the GPU. When rows leave, the cache keeps only the others and the graph is
captured again for the smaller batch. The cache holds the positions the rows reached (it grows
with the window), so the rows decode together where their first window fits the device; rows
whose growth would not fit wait, and go on from a prefill of their tokens once the others end.
"""

from __future__ import annotations

import inspect
import itertools
import logging
import secrets
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tandem.adapters import is_adapter_name
from tandem.attention import full_attention_only
from tandem.config.load import ConfigError
from tandem.data.images import RowImages, own_prompt
from tandem.generation import kv_cache, static_decode
from tandem.generation.base import FinishReason, Generator, Rollout, SamplingParams
from tandem.generation.hf_adapters import PeftAdapter
from tandem.generation.hf_vision import ImagePrefill, load_generation_model, same_prefill
from tandem.generation.kv_cache import decode_budget, decode_rows, prefill_bytes, row_bytes
from tandem.generation.packed_linear import pack_linears
from tandem.generation.phase_clock import PhaseClock
from tandem.generation.static_decode import Decoder, StaticDecode, window_length
from tandem.tensors import TargetRuns, device_copies
from tandem.tensors.devices import DTYPES, release_device_caches
from tandem.tensors.packed import PackedStream
from tandem.tensors.storage_offload import StorageOffload

log = logging.getLogger(__name__)

COMPACT_AT = 0.75
"""The decode drops its stopped rows (their KV cache with them) once the rows still decoding
are this fraction of the batch or fewer: each step then computes only those. Under CUDA graphs
each compaction captures the step again for the smaller batch (milliseconds)."""
COMPILE_BACKEND = "inductor"
"""``torch.compile``'s backend for ``generation.compile`` (Inductor: fused kernels)."""
SAMPLE_BLOCK = 1 << 22
"""fp32 elements of the block of rows that sampling takes at a time on a CPU (16 MiB): the
batch's logits stay in the model's dtype, only one block of rows is ever copied to fp32."""
SAMPLE_BLOCK_CUDA = 1 << 26
"""``SAMPLE_BLOCK`` on a GPU (256 MiB: 441 rows of 151,936), where a loop over small blocks
costs more in kernel launches than the fp32 copy saves (3.15 ms for 256 rows in blocks of 27
on an H200, against 0.86 ms for softmax + multinomial over the whole batch)."""


def _pick(tensor: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
    """``tensor``'s rows ``rows`` (all of them for None)."""
    return tensor if rows is None else tensor[rows]


@dataclass
class _Sample:
    tokens: list[int]
    logprobs: list[float]
    text: str
    finish_reason: FinishReason
    versions: list[int]


def _target(state: dict[str, torch.Tensor], name: str, tensor: Any) -> torch.Tensor:
    """The model's tensor that ``(name, tensor)`` of a weight stream updates (``tensor``: a
    tensor or a ``TensorMeta``; only its shape is read)."""
    if name not in state:
        raise ValueError(
            f"load_weights: {name!r} is not a parameter of the model "
            f"(expected Hugging Face names such as {next(iter(state))!r})"
        )
    if state[name].shape != tensor.shape:
        raise ValueError(
            f"load_weights: {name!r} has shape {tuple(tensor.shape)}, "
            f"the model expects {tuple(state[name].shape)}"
        )
    return state[name]


def _int64(value: int) -> int:
    """``value`` modulo 2**64, as the signed 64-bit integer a torch.long holds."""
    return (value + 2**63) % 2**64 - 2**63


_GOLDEN = _int64(0x9E3779B97F4A7C15)
_MIX1, _MIX2 = _int64(0xBF58476D1CE4E5B9), _int64(0x94D049BB133111EB)


def _mix(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser on int64 tensors: multiplications wrap; the masks make the
    (arithmetic) right shifts logical."""
    x = x ^ ((x >> 30) & (2**34 - 1))
    x = x * _MIX1
    x = x ^ ((x >> 27) & (2**37 - 1))
    x = x * _MIX2
    return x ^ ((x >> 31) & (2**33 - 1))


def sample_keys(seeds: list[int | None], device: torch.device) -> torch.Tensor:
    """One 64-bit key per sample: its seed mixed, or a random one where the seed is None."""
    values = [_int64(s) if s is not None else secrets.randbits(63) for s in seeds]
    return _mix(torch.tensor(values, dtype=torch.long, device=device))


def uniform_draws(keys: torch.Tensor, step: int) -> torch.Tensor:
    """``[B]`` uniforms in (0, 1), a pure function of (key of row b, step): a sample's stream
    does not depend on the batch around it (vLLM's per-request seeds give the same property)."""
    bits = (_mix(keys + _int64(step * _GOLDEN)) >> 40) & (2**24 - 1)
    return (bits.to(torch.float32) + 0.5) * 2.0**-24


def filter_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature, top-k and top-p applied to ``[B, V]`` logits (-inf outside the support).
    Only top-p sorts the vocabulary, and only when it is set."""
    logits = logits / params.temperature
    if params.top_k > 0 and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # drop a token when the mass before it already reaches top_p (the first always stays)
        drop_sorted = probs.cumsum(-1) - probs >= params.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def _plain_draws(block: torch.Tensor, uniform: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens of ``softmax(block)`` by inverse CDF at ``uniform`` and their raw logprobs, with
    ``block`` in the model's dtype: one fused softmax reads it and writes the probabilities in
    fp32 (no fp32 copy of the logits, no separate max, subtraction and exponential passes), and
    a token's logprob is the log of its probability."""
    probs = torch.softmax(block, dim=-1, dtype=torch.float32)
    cdf = probs.cumsum(-1)
    target = uniform[:, None] * cdf[:, -1:]
    token = torch.searchsorted(cdf, target, right=True)[:, 0].clamp_(max=block.shape[-1] - 1)
    picked = probs.gather(-1, token[:, None])[:, 0]
    return token, picked.clamp_(min=torch.finfo(torch.float32).tiny).log_()


def sample_tokens(
    logits: torch.Tensor, keys: torch.Tensor, step: int, params: SamplingParams
) -> tuple[torch.Tensor, torch.Tensor]:
    """The next token of each row and its logprob under the raw logits (vLLM's
    ``raw_logprobs``), from ``[B, V]`` logits in the model's dtype.

    Greedy, or inverse-CDF sampling of the filtered distribution with one counter-based
    uniform per row (``uniform_draws``): exact sampling from a cumulative sum, no sort and no
    noise over the vocabulary. Rows go through fp32 a block at a time (``SAMPLE_BLOCK``), so on a
    CPU a 151,936-token vocabulary costs no fp32 copy of the batch's logits; the plain
    distribution (temperature 1, no top-k/top-p: RL's usual) takes ``_plain_draws``."""
    size, vocab = logits.shape
    limit = SAMPLE_BLOCK_CUDA if logits.is_cuda else SAMPLE_BLOCK
    rows = max(1, limit // vocab)
    uniform = None if params.temperature == 0 else uniform_draws(keys, step)
    plain = params.temperature == 1 and params.top_p >= 1 and not 0 < params.top_k < vocab
    tokens, logprobs = [], []
    for start in range(0, size, rows):
        if uniform is not None and plain:
            token, logprob = _plain_draws(logits[start : start + rows], uniform[start:][:rows])
            tokens.append(token)
            logprobs.append(logprob)
            continue
        block = logits[start : start + rows].float()
        top = block.max(dim=-1, keepdim=True).values
        lse = top[:, 0] + (block - top).exp_().sum(-1).log()
        if uniform is None:
            token = block.argmax(dim=-1)
        else:  # the filtered distribution's own numerators
            cdf = torch.softmax(filter_logits(block, params), dim=-1).cumsum_(-1)
            target = uniform[start : start + rows, None] * cdf[:, -1:]
            token = torch.searchsorted(cdf, target, right=True)[:, 0].clamp_(max=vocab - 1)
        tokens.append(token)
        logprobs.append(block.gather(-1, token[:, None])[:, 0] - lse)
    return torch.cat(tokens), torch.cat(logprobs)


def _contiguous_rows(_: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
    """The LM head's input made contiguous. A prefill's last positions reach the head as a
    strided ``[rows, 1, hidden]`` slice (``logits_to_keep=1``), and torch multiplies a strided
    3-D input by a weight that needs no gradient (the frozen base under LoRA adapters) as a
    batched product over a broadcast weight instead of one matrix product: on a CPU in bf16,
    8 rows x a 151,936 x 896 head took 4.4 s instead of 20 ms. The copy is of ``rows x
    hidden`` values; a decode step's input is contiguous already (no copy)."""
    return (args[0].contiguous(), *args[1:])


class HfGenerator(Generator):
    """Generates with a transformers ``AutoModelForCausalLM`` in this process."""

    def __init__(
        self,
        model_path: str | Path,
        device: str | torch.device = "cpu",
        dtype: str = "float32",
        max_batch_size: int = 256,
        cuda_graphs: bool = True,
        sleep_level: int = 1,
        compile_layers: bool = False,
    ) -> None:
        from transformers import AutoTokenizer

        super().__init__()
        self.sleep_level = sleep_level
        """``generation.sleep_level``: ``sleep`` keeps the weights in host memory (1) or drops
        them (2: no copy either way, no host memory for them; a refit must fill them before
        the next generation, as the runtime's does after a deep sleep)."""
        self._dropped = False  # the weights were dropped by a deep sleep and not refit since
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)} (got {dtype!r})")
        self.device = torch.device(device)
        self.model = load_generation_model(str(model_path), DTYPES[dtype])
        self.vision = hasattr(getattr(self.model, "model", None), "visual")
        """A vision-language model: its batches go through ``hf_vision.ImagePrefill``."""
        if self.model.config._attn_implementation == "sdpa":
            from tandem.attention import register_gqa_sdpa

            self.model.set_attn_implementation(register_gqa_sdpa())
        # The parameters back to back in one allocation, as a trainer's after onload(): a refit
        # then copies runs of them at once (tensors.copies).
        params = list(self.model.parameters())
        with torch.no_grad():
            copies = device_copies([p.detach() for p in params], self.device)
        for param, copy in zip(params, copies, strict=True):
            torch.utils.swap_tensors(param, nn.Parameter(copy, requires_grad=param.requires_grad))
        self.model.to(self.device).eval()  # type: ignore[arg-type]  # the buffers
        self.compile_layers = compile_layers
        """``generation.compile``: the static decode's decoder layers run compiled
        (``_compile_layers``, at the first such decode)."""
        self._compiled = False
        # on a CPU the larger linear layers compute through oneDNN over packed weights (ops
        # that Inductor does not lower: not with compiled layers)
        packs = self.device.type == "cpu" and not compile_layers
        self._packed = pack_linears(self.model) if packs else []
        self.model.get_output_embeddings().register_forward_pre_hook(_contiguous_rows)
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        eos = self.model.generation_config.eos_token_id
        if eos is None:
            eos = self.tokenizer.eos_token_id
        self.eos_token_ids = set(eos if isinstance(eos, list) else [eos]) - {None}
        pad = self.tokenizer.pad_token_id
        self.pad_token_id = int(pad if pad is not None else next(iter(self.eos_token_ids), 0))
        self.max_batch_size = max_batch_size
        # The static-cache decode (CUDA graphs on top) on a GPU; the dynamic cache elsewhere.
        self.static_cache = self.device.type == "cuda"
        self.cuda_graphs = cuda_graphs and self.device.type == "cuda"
        forward = type(self.model.model).forward if hasattr(self.model, "model") else None
        self._takes_cache_position = forward is not None and (
            "cache_position" in inspect.signature(forward).parameters
        )
        self._refit_targets: TargetRuns | None = None  # the parameters in a refit's order
        self._stats: defaultdict[str, float] = defaultdict(float)  # take_stats
        self.adapter = PeftAdapter(self.model)
        """LoRA adapters refits send (``refit.lora=adapter``), applied through peft."""
        self._asleep: StorageOffload | None = None  # the weights on the host while asleep
        self._asleep_before: StorageOffload | None = None  # its host memory, for the next sleep

    def generate(self, prompt_token_ids: list[list[int]], params: SamplingParams) -> list[Rollout]:
        if any(len(p) == 0 for p in prompt_token_ids):
            raise ValueError("every prompt needs at least one token")
        self.wake_up()  # asleep (a caller that skipped wake_up): the weights first
        if self._dropped:
            raise ValueError(
                "the generator's weights were dropped by a deep sleep (sleep_level=2): load "
                "or receive the weights (a refit) before generating"
            )
        rows = [(i, j) for i in range(len(prompt_token_ids)) for j in range(params.n)]
        if not rows:
            return []
        width = max(len(p) for p in prompt_token_ids)
        at_once = self.rows_at_once(len(rows), width, params.max_tokens)
        if at_once < min(len(rows), self.max_batch_size):
            log.info(
                "hf generator: %d rows decode %d at a time (what the device's free memory holds "
                "for rows of %d + %d positions)",
                len(rows), at_once, width, params.max_tokens,
            )  # fmt: skip
        rollouts: list[Rollout] = []
        # compiled layers: their int attributes (a layer's index, which the cache's update
        # takes) are inputs, not constants, so the layers share one compiled graph
        compiling = torch._dynamo.config.patch(allow_unspec_int_on_nn_module=True)
        for start in range(0, len(rows), at_once):
            chunk = rows[start : start + at_once]
            prompts = [prompt_token_ids[i] for i, _ in chunk]
            seeds = [params.sample_seed(i, j) for i, j in chunk]
            with compiling:
                samples = self._generate_batch(prompts, seeds, params)
            for (i, _), sample in zip(chunk, samples, strict=True):
                rollouts.append(
                    Rollout(
                        prompt_index=i,
                        prompt_token_ids=own_prompt(prompt_token_ids[i]),
                        response_token_ids=sample.tokens,
                        response_text=sample.text,
                        response_logprobs=sample.logprobs,
                        finish_reason=sample.finish_reason,
                        response_versions=sample.versions,
                        policy_version=sample.versions[0],
                    )
                )
        return rollouts

    def rows_at_once(self, total: int, width: int, steps: int) -> int:
        """How many of ``total`` rows of ``width`` prompt positions and ``steps`` new tokens
        decode together (``_rows_fitting``); on a GPU against the memory free now. The windowed
        static decode (a GPU's, for models of full attention) takes the rows whose first window
        fits (its cache grows with the rows' positions, and rows that would outgrow the memory
        wait: ``room``); other decodes allocate every row's cache to the cap at their start.
        Raises ``ConfigError`` where not one row fits to the cap (a row prefilled again near
        the cap: a resumed or refit row's)."""
        free = self._free_bytes()
        if self._rows_fitting(1, 1, width + steps, 0, free) == 0:
            each, shared = self._row_cost(width + steps, 0)
            raise ConfigError(
                f"generation: one row of a {width}-token prompt and generation.sampling."
                f"max_tokens={steps} new tokens needs {(each + shared) / 1e9:.2f} GB of the "
                f"generator's GPU (its KV cache, prefill and logits); {(free or 0) / 1e9:.2f} "
                "GB are free: lower generation.sampling.max_tokens or shorten the prompts"
            )
        first = steps
        if self._windowed():
            first = window_length(width + 1, width + steps, static_decode.CACHE_BUCKET) - width
        return self._rows_fitting(total, self.max_batch_size, width, first, free)

    def _row_cost(self, width: int, steps: int) -> tuple[int, int]:
        """What rows of ``width`` positions so far take on the device with a KV cache of
        ``steps`` more: each row's bytes (its cache, logits, and where its prefill runs in one
        call, that prefill's activations: ``row_bytes``) and the bytes the rows share
        (``_prefill_room``)."""
        config, dtype = self.model.config, self.model.dtype
        if not self._chunked_prefill():
            return row_bytes(config, dtype, width, steps), 0
        return row_bytes(config, dtype, 0, width + steps), self._prefill_room()

    def _prefill_room(self) -> int:
        """Bytes a decode keeps free beside its rows for a prefill call's activations: a
        windowed decode of text prefills in calls of at most ``PREFILL_TOKENS`` tokens (0
        elsewhere: each row counts its own prefill)."""
        if not self._chunked_prefill():
            return 0
        return prefill_bytes(self.model.config, self.model.dtype, kv_cache.PREFILL_TOKENS)

    def _rows_fitting(
        self, total: int, limit: int, width: int, steps: int, free: int | None
    ) -> int:
        """``decode_rows`` for ``total`` rows (at most ``limit``) as ``_row_cost`` counts them,
        against ``free`` bytes (None: no bound)."""
        each, shared = self._row_cost(width, steps)
        text = getattr(self.model.config, "text_config", None) or self.model.config
        free = None if free is None else free - shared
        return decode_rows(total, limit, each, text.num_hidden_layers, free)

    def _free_bytes(self) -> int | None:
        """Bytes the device has free for a decode now (its own free memory and what the
        caching allocator holds unused); None on a CPU (no bound)."""
        if self.device.type != "cuda":
            return None
        unused = torch.cuda.memory_reserved(self.device) - torch.cuda.memory_allocated(self.device)
        return torch.cuda.mem_get_info(self.device)[0] + unused

    def _windowed(self) -> bool:
        """The decode runs over ``StaticDecode``'s windowed cache (it grows with the rows)."""
        return self.static_cache and full_attention_only(self.model.config)

    def _chunked_prefill(self) -> bool:
        """The prefill runs in calls of at most ``PREFILL_TOKENS`` tokens: a windowed decode's
        and any GPU decode's of text (an image prompt's prefill runs whole, its vision features
        in place; a CPU's decode is not bounded in bytes, and one call runs sooner there)."""
        return (self._windowed() or self.device.type == "cuda") and not self.vision

    @torch.inference_mode()
    def _generate_batch(
        self, prompts: list[list[int]], seeds: list[int | None], params: SamplingParams
    ) -> list[_Sample]:
        """Decode a left-padded batch on the device: one host sync per step (the "all done"
        check), as ``transformers.generate``; once enough rows have finished
        (``COMPACT_AT``) they leave the batch with their KV cache, so a long straggler
        decodes alone, and rows whose KV cache would outgrow the device wait for the others
        (``StaticDecode.room``). Stop strings need the text, so with ``params.stop`` the new
        tokens come to the host every step."""
        size, width, steps = len(prompts), max(len(p) for p in prompts), params.max_tokens
        input_ids, valid = self._left_padded(prompts, width, steps)
        images = RowImages.of(prompts)
        keys = sample_keys(seeds, self.device)
        eos = torch.tensor(sorted(self.eos_token_ids), dtype=torch.long, device=self.device)
        tokens = torch.full((size, steps), self.pad_token_id, dtype=torch.long, device=self.device)
        logprobs = torch.zeros((size, steps), dtype=torch.float32, device=self.device)
        lengths = torch.zeros(size, dtype=torch.long, device=self.device)
        stopped = torch.zeros(size, dtype=torch.bool, device=self.device)
        stop_cut: dict[int, str] = {}
        row_versions = torch.zeros((size, steps), dtype=torch.long)  # (host) weights of each token
        rows: torch.Tensor | None = None  # the rows decoded now (None: all), in batch order
        on_host: slice | torch.Tensor = slice(None)  # the same, on the host
        member = torch.ones(size, dtype=torch.bool, device=self.device)  # in the decode now
        waiting: list[tuple[int, torch.Tensor]] = []  # parked rows: (the step they resume at, rows)
        free = self._free_bytes()
        budget = decode_budget(free)  # the cache's: room is kept for a prefill call
        budget = None if budget is None else budget - self._prefill_room()
        decoder: Decoder | None = None
        token = tokens[:, 0]
        clock = PhaseClock(self.device)
        clock.start()
        step, row_steps, decode_steps, parks, prefills, weights, fresh = 0, 0, 0, 0, 0, None, True
        while True:
            with self.gate.step() as version:  # a refit lands between two of these
                if fresh or version != weights:  # the start, resumed rows, or new weights
                    decoder = None  # the decode before: its cache goes before the prefill
                    decoder = self._prefill(
                        _pick(input_ids, rows),
                        _pick(valid, rows),
                        _pick(tokens, rows)[:, :step],
                        steps,
                        images if images is None or rows is None else images.select(rows.cpu()),
                        budget,
                    )
                    logits, first, fresh, weights = decoder.logits, step, False, version
                    prefills += 1
                    clock.mark("prefill")
                else:
                    assert decoder is not None
                    logits = decoder.advance(_pick(token, rows), step - 1 - first)
                    clock.mark("forward")
                token, logprob = self._sample(logits, _pick(keys, rows), step, params)
                clock.mark("sample")
            row_versions[on_host, step] = version
            decode_steps += 1
            row_steps += size if rows is None else len(rows)
            if rows is not None:  # back to the whole batch; the rows left out stopped or wait
                token = torch.full_like(lengths, self.pad_token_id).index_copy_(0, rows, token)
                logprob = logprobs.new_zeros(size).index_copy_(0, rows, logprob)
            active = member & ~stopped
            tokens[:, step] = torch.where(active, token, tokens[:, step])
            logprobs[:, step] = torch.where(active, logprob, logprobs[:, step])
            lengths += active
            stopped |= active & torch.isin(token, eos)
            if params.stop:
                self._cut_stop_strings(tokens, lengths, stopped, stop_cut, params.stop)
            decoding = int((member & ~stopped).sum())  # the step's one host sync
            clock.mark("bookkeeping")
            if step + 1 == steps or decoding == 0:
                if not waiting:
                    break
                step, rows = self._resume(waiting, width, steps, free)
                member.zero_()[rows] = True
                on_host, fresh = rows.cpu(), True
                continue
            batch = size if rows is None else len(rows)
            fit = batch if decoder.room is None else decoder.room(step - first)  # the next step's
            if decoder.keep is not None and (decoding <= batch * COMPACT_AT or fit < batch):
                index = (~_pick(stopped, rows)).nonzero().flatten()  # drop the stopped rows
                ids = _pick(torch.arange(size, device=self.device), rows)
                if decoding > fit:  # and those the memory cannot take on: they wait
                    waiting.append((step + 1, ids[index[fit:]]))
                    index = index[:fit]
                    parks += decoding - fit
                    log.info(
                        "hf generator: %d of %d rows wait after %d tokens (their KV cache "
                        "would outgrow the device's free memory); they go on after the others",
                        decoding - fit, decoding, step + 1,
                    )  # fmt: skip
                decoder.keep(index)
                rows = ids[index]
                member.zero_()[rows] = True
                on_host = rows.cpu()
                clock.mark("compact")
            step += 1
        counts = {"steps": decode_steps, "row_steps": row_steps, "parked": parks}
        self._count(clock.seconds(), prefills=prefills, **counts)
        return self._samples(tokens, logprobs, lengths, stopped, stop_cut, row_versions)

    def _left_padded(
        self, prompts: list[list[int]], width: int, steps: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The prompts left-padded to ``width`` (the next token is at the end) and which of
        their ``width + steps`` positions hold a token so far, on the device."""
        input_ids = torch.full((len(prompts), width), self.pad_token_id, dtype=torch.long)
        valid = torch.zeros((len(prompts), width + steps), dtype=torch.bool)
        for row, prompt in enumerate(prompts):
            input_ids[row, width - len(prompt) :] = torch.tensor(prompt)
            valid[row, width - len(prompt) : width] = True
        return input_ids.to(self.device), valid.to(self.device)

    def _resume(
        self, waiting: list[tuple[int, torch.Tensor]], width: int, steps: int, free: int | None
    ) -> tuple[int, torch.Tensor]:
        """The last parked rows of ``waiting`` to go on (the step they resume at, the rows), as
        many at once as ``_rows_fitting`` takes against the ``free`` bytes the decode started
        with, each row's cache to the cap (``width + steps``), so they park no more; at least
        one (``rows_at_once`` checked that one fits). The others wait on."""
        step, rows = waiting.pop()
        done = width + step  # positions each row has so far
        at_once = max(1, self._rows_fitting(len(rows), len(rows), done, steps - step, free))
        if at_once < len(rows):
            waiting.append((step, rows[at_once:]))
        return step, rows[:at_once]

    def _count(self, seconds: dict[str, float], **counts: int) -> None:
        for part, value in seconds.items():
            self._stats[f"timing/decode_{part}_s"] += value
        for name, n in counts.items():
            self._stats[f"throughput/decode_{name}"] += n

    def take_stats(self) -> dict[str, float]:
        """Where the decodes since the last call spent their time, by ``phase_clock.PhaseClock``
        (``timing/decode_<part>_s``: ``prefill``, ``forward`` (a decode step's model call),
        ``sample``, ``bookkeeping`` (the step's tokens written, stops found, its one host
        sync), ``compact`` (finished rows leaving)), and how much they decoded
        (``throughput/decode_steps``; ``throughput/decode_row_steps``: rows summed over
        steps; ``throughput/decode_parked``: rows that waited for memory;
        ``throughput/decode_prefills``: the prefills, one a decode and one more for each group
        of resumed rows and each weight version landing mid-decode)."""
        stats, self._stats = dict(self._stats), defaultdict(float)
        return stats

    def _prefill(
        self,
        input_ids: torch.Tensor,
        valid: torch.Tensor,
        generated: torch.Tensor,
        steps: int,
        images: RowImages | None = None,
        budget: int | None = None,
    ) -> Decoder:
        """Prefill the prompts and the ``generated`` tokens so far (after new weights landed,
        or for parked rows: the KV cache is recomputed): the decode from here (its steps
        counted from here), its KV cache within ``budget`` bytes where it can grow. A
        vision-language model prefills through ``ImagePrefill`` (the rows' ``images``,
        multimodal positions)."""
        width, done = input_ids.shape[1], generated.shape[1]
        if done:
            input_ids = torch.cat([input_ids, generated], dim=1)
            valid = valid.clone()
            valid[:, width : width + done] = True  # finished rows' padding, as decoded
        position_ids = (valid[:, : width + done].long().cumsum(-1) - 1).clamp(min=0)
        model: Any = self.model
        if self.vision:
            model = ImagePrefill(self.model, images)
            position_ids = model.prefill_positions(input_ids, valid[:, : width + done])
        if self.static_cache:
            self._compile_layers()
            decode = StaticDecode(
                model, self._cache_position, self.cuda_graphs, self._compiled, budget
            )
            decode.on_capture_failure = self._capture_failed
            tokens = kv_cache.PREFILL_TOKENS if self._chunked_prefill() else None
            decoder = decode.prefill(input_ids, valid, position_ids, steps - done, tokens)
            if decoder is not None:
                return decoder
        return self._dynamic_decoder(input_ids, valid, position_ids, steps - done, model)

    def _compile_layers(self) -> None:
        """``torch.compile`` the decoder layers in place (once; ``generation.compile``), as the
        trainer's ``policy.compile``: Inductor fuses each layer's elementwise work (norms,
        rotary embeddings, activations, residuals), so a decode step launches fewer kernels.
        The KV cache's update stays eager (``kv_cache.WindowedCache``). Not for a model whose
        attention is not all full attention (it decodes over transformers' own cache)."""
        from tandem.trainer.parallelize import decoder_layers

        if not self.compile_layers or self._compiled:
            return
        if not full_attention_only(self.model.config):
            log.warning("hf generator: generation.compile skipped (not all full attention)")
            self.compile_layers = False
            return
        for layer in decoder_layers(self.model):
            layer.compile(dynamic=True, backend=COMPILE_BACKEND)
        self._compiled = True

    def _capture_failed(self) -> bool:
        """A capture failed: with compiled layers, this generator drops them and goes on with
        CUDA graphs over the eager layers (True: capture again); else it decodes without
        CUDA graphs from now on."""
        from tandem.trainer.parallelize import decoder_layers

        if self._compiled:
            log.warning("hf generator: generation.compile dropped (its capture failed)")
            for layer in decoder_layers(self.model):
                layer._compiled_call_impl = None  # what nn.Module.compile set
            self._compiled = self.compile_layers = False
            return True
        log.warning("hf generator: decoding without CUDA graphs from now on")
        self.cuda_graphs = False
        return False

    def _dynamic_decoder(
        self,
        input_ids: torch.Tensor,
        valid: torch.Tensor,
        position_ids: torch.Tensor,
        steps: int,
        model: Any = None,
    ) -> Decoder:
        """Prefill, then one model call per token over a cache that grows in place
        (``kv_cache.growing_cache``; transformers' dynamic cache where that has none). Rows that
        repeat a prompt (``n`` samples of it) are prefilled once and the cache and logits copied
        to each: the same tokens at the same real positions, and for image prompts the same
        images too (rows may share tokens but not images; ``model``, an ``ImagePrefill``, ran
        each image through the tower once); ``keep`` selects rows of the cache, the mask and
        the positions. Where ``_chunked_prefill``, the prefill runs in chunks of positions of
        at most ``PREFILL_TOKENS`` tokens over all its rows, each chunk attending the keys the
        ones before it wrote."""
        from tandem.generation.kv_cache import growing_cache

        width = input_ids.shape[1]
        attention_mask = valid.long()
        model = self.model if model is None else model
        images = model.images if isinstance(model, ImagePrefill) else None
        first, inverse = same_prefill(input_ids, valid, images)
        if isinstance(model, ImagePrefill):
            model = model.rows(first)
        chunk = width
        if self._chunked_prefill():
            chunk = max(1, kv_cache.PREFILL_TOKENS // len(first))
        cache = growing_cache(model.config, width + steps)  # None: the model makes its own
        for start in range(0, width, chunk):
            end = min(start + chunk, width)
            out = model(
                input_ids=input_ids[first, start:end],
                attention_mask=attention_mask[first, :end],
                position_ids=position_ids[first, start:end],
                past_key_values=cache,
                use_cache=True,
                logits_to_keep=1,
            )
            cache = out.past_key_values
        out.past_key_values.batch_select_indices(inverse)
        state = {"cache": out.past_key_values, "position": position_ids[:, -1:]}
        state["mask"] = attention_mask

        def advance(token: torch.Tensor, step: int) -> torch.Tensor:
            state["mask"][:, width + step] = 1
            state["position"] = state["position"] + 1
            out = model(
                input_ids=token[:, None],
                attention_mask=state["mask"][:, : width + step + 1],
                position_ids=state["position"],
                past_key_values=state["cache"],
                use_cache=True,
            )
            state["cache"] = out.past_key_values
            return out.logits[:, -1, :]

        def keep(index: torch.Tensor) -> None:
            state["cache"].batch_select_indices(index)
            state["mask"], state["position"] = state["mask"][index], state["position"][index]

        return Decoder(out.logits[inverse, -1, :], advance, keep, None)

    def _cache_position(self, positions: torch.Tensor) -> dict[str, torch.Tensor]:
        """``cache_position`` for the transformers releases whose models still take it."""
        return {"cache_position": positions} if self._takes_cache_position else {}

    def _cut_stop_strings(
        self,
        tokens: torch.Tensor,
        lengths: torch.Tensor,
        stopped: torch.Tensor,
        stop_cut: dict[int, str],
        stop: tuple[str, ...],
    ) -> None:
        """Stop the rows whose text now contains a stop string; keep their text cut before it."""
        for row in (~stopped).nonzero().flatten().tolist():
            text = self._decode(tokens[row, : int(lengths[row])].tolist())
            cuts = [text.find(s) for s in stop if s in text]
            if cuts:
                stopped[row] = True
                stop_cut[row] = text[: min(cuts)]

    def _samples(
        self,
        tokens: torch.Tensor,
        logprobs: torch.Tensor,
        lengths: torch.Tensor,
        stopped: torch.Tensor,
        stop_cut: dict[int, str],
        versions: torch.Tensor,
    ) -> list[_Sample]:
        columns = (tokens.tolist(), logprobs.tolist(), lengths.tolist(), stopped.tolist())
        samples = []
        rows = zip(*columns, versions.tolist(), strict=True)
        for row, (row_tokens, row_logprobs, length, done, row_versions) in enumerate(rows):
            ids = row_tokens[:length]
            text = stop_cut[row] if row in stop_cut else self._decode(ids)
            reason: FinishReason = "stop" if done else "length"
            samples.append(_Sample(ids, row_logprobs[:length], text, reason, row_versions[:length]))
        return samples

    def _sample(
        self, logits: torch.Tensor, keys: torch.Tensor, step: int, params: SamplingParams
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One decode step's tokens and their logprobs (``sample_tokens``)."""
        return sample_tokens(logits, keys, step, params)

    def _decode(self, tokens: list[int]) -> str:
        return str(self.tokenizer.decode(tokens, skip_special_tokens=True))

    @torch.no_grad()
    def load_weights(self, stream: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Weights in Hugging Face names, or LoRA adapters (``tandem.adapters``' names)."""
        self.wake_up()  # never write into storages emptied by sleep
        if isinstance(stream, PackedStream) and stream.names and is_adapter_name(stream.names[0]):
            self.adapter.load(stream)  # one copy when it lies as the generator's adapters do
            return
        stream = iter(stream)
        first = next(stream, None)
        if first is None:
            return
        if is_adapter_name(first[0]):
            self.adapter.load(itertools.chain([first], stream))
            return
        state = self.model.state_dict()
        for name, tensor in itertools.chain([first], stream):
            _target(state, name, tensor).copy_(tensor)
        self._repack()
        self._dropped = False
        # no prefix cache to reset: every generate call prefills from scratch

    @torch.no_grad()
    def receive_weights(self, spec: Any, first_rank: int = 1) -> None:
        """As ``load_weights`` of the refit's stream, with batched copies per bucket
        (``RefitReceiver.copy_into``). The parameters never move, so where they lie is worked
        out once per plan and kept."""
        from tandem.weight_sync import make_receiver

        self.wake_up()  # never write into storages emptied by sleep
        targets = self._refit_targets
        metas = spec.plan.tensors
        adapter = bool(metas) and is_adapter_name(metas[0].name)
        if targets is None or targets.checked != spec.plan.key:  # the first refit of its plan
            if adapter:
                found = self.adapter.targets([(meta.name, meta) for meta in metas])
            else:
                state = self.model.state_dict()
                found = [_target(state, meta.name, meta) for meta in metas]
            targets = TargetRuns(found)
            self._refit_targets = targets
        make_receiver(spec, self.device, rank=first_rank).copy_into(targets)
        if not adapter:  # the packed layers' weights are the base weights, which it left alone
            self._repack()
            self._dropped = False

    def _repack(self) -> None:
        """The packed linear layers follow their weights (after a refit wrote them)."""
        for layer in self._packed:
            layer.repack()

    # -- colocated memory: sleep and wake_up ---------------------------------------------------
    @property
    def supports_sleep(self) -> bool:
        """On a GPU: ``sleep`` moves the weights to pinned host memory and frees the rest."""
        return self.device.type == "cuda"

    def sleep(self) -> None:
        """Colocated with a trainer on a GPU: the weights' storages to (pinned) host memory,
        resized to 0 bytes, and the caching allocator's blocks (the last decode's KV cache)
        handed back. Every parameter object stays as it is, so a refit's targets and peft's
        adapters keep pointing at them. ``sleep_level`` 2 copies only the buffers (rotary
        frequencies, which no refit sends) and drops the parameters' bytes. No-op on a CPU (the
        memory is the host's already)."""
        if self.supports_sleep and self._asleep is None:
            drop = list(self.model.parameters()) if self.sleep_level == 2 else []
            self._asleep = self._weights_to_host(self._asleep_before, drop)
            self._dropped = self._dropped or bool(drop)
            release_device_caches()

    def wake_up(self, tags: list[str] | None = None) -> None:
        """The weights back in place (any tag: there is no KV cache between calls)."""
        if self._asleep is not None:
            self._asleep.onload()
            self._asleep_before, self._asleep = self._asleep, None

    def _weights_to_host(
        self, previous: StorageOffload | None = None, drop: list[torch.Tensor] | None = None
    ) -> StorageOffload:
        """Offload every storage of the model's parameters and buffers (the host copies of
        ``previous`` reused where the storages are the same), those of ``drop`` without their
        bytes."""
        tensors = [*self.model.parameters(), *self.model.buffers()]
        moved = StorageOffload(tensors, self.device, discard=drop or (), previous=previous)
        moved.offload()
        return moved

    def shutdown(self) -> None:
        del self.model
