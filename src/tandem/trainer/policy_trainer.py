"""PolicyTrainer: one trainer rank of a Hugging Face causal LM, FSDP2-sharded across ranks.

A plain class (no Ray): ``cluster/`` runs it as an actor, tests and benchmarks drive it directly.
Every rank of a data-parallel group constructs one and calls the same methods in the same order
(``train``, ``logprobs``, ``iter_weights``, checkpoints are collectives under FSDP2).
"""

from __future__ import annotations

import copy
import dataclasses
import math
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule

from tandem.attention import full_attention_only
from tandem.checkpoint import Ranks, TrainState, hf_export, sharded
from tandem.config.models import PolicyConfig
from tandem.contracts import LossFn
from tandem.data.batch import TrainBatch
from tandem.data.images import is_vision_model
from tandem.data.packing import (
    MICRO_BATCH_OVERHEAD,
    MicroBatch,
    plan_micro_batches,
    trimmed,
    unpack,
)
from tandem.tensors.copies import pack_parameters
from tandem.tensors.devices import DTYPES, default_device
from tandem.trainer import lora
from tandem.trainer.fits import check_offload_fits, check_state_fits
from tandem.trainer.logprobs import LogprobModel, right_padded
from tandem.trainer.offload import HostPool, move_state, offload_bytes
from tandem.trainer.parallelize import (
    apply_activation_checkpointing,
    apply_fsdp,
    compile_layers,
    init_distributed,
    reshard,
    stays_gathered,
    uses_fsdp,
    vision_tower,
)
from tandem.trainer.schedule import build_optimizer
from tandem.trainer.weights import full_tensor, hf_state
from tandem.vision_attention import batch_vision_windows
from tandem.vision_mlp import align_vision_mlps

STOCHASTIC_ROUND_SEED = 20_261_207
"""Seed of each trainer rank's default generator (plus its rank) with
``policy.optimizer.bf16_stochastic_round``."""


def vision_patch_cost(lm: Any) -> float:
    """``data.packing.plan_micro_batches``' patch cost for ``lm``: one image patch through the
    vision tower per token through the language model, by their weights (0: no tower)."""
    tower = vision_tower(lm)
    if tower is None:
        return 0.0
    embedded = sum(p.numel() for p in lm.get_input_embeddings().parameters())
    text = sum(p.numel() for p in lm.get_decoder().parameters()) - embedded
    return sum(p.numel() for p in tower.parameters()) / max(text, 1)


def shared_prompt_cost(lm: Any) -> float | None:
    """``data.packing.layout_cost``'s attention cost for ``lm``: the forward FLOPs of one
    attended (query, key) pair (QK and AV over every layer's heads) per FLOP of one token through
    the layers' weights. None where shared prompts cannot be laid out: the attention must take
    an explicit 4D mask (sdpa, eager) and see every earlier token on every layer (a custom mask
    replaces sliding windows)."""
    config = lm.config
    if getattr(config, "_attn_implementation", None) not in ("sdpa", "eager"):
        return None
    if not full_attention_only(config):
        return None
    embedded = sum(p.numel() for p in lm.get_input_embeddings().parameters())
    weights = sum(p.numel() for p in lm.get_decoder().parameters()) - embedded
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return 2 * config.num_hidden_layers * heads * head_dim / max(weights, 1)


def _load_lm(config: PolicyConfig) -> Any:
    """The Hugging Face causal LM of ``config.model_path`` (a ``PreTrainedModel``)."""
    from transformers import AutoModelForCausalLM

    path = Path(config.model_path)
    if not (path / "config.json").exists():
        raise ValueError(
            f"policy.model_path={str(path)!r} is not a Hugging Face model folder (no "
            "config.json); point it at a folder written by save_pretrained or a downloaded "
            "snapshot"
        )
    # loaded on the host: fully_shard then moves one layer's shard at a time to the device
    if is_vision_model(path):
        from transformers import AutoModelForImageTextToText

        lm = AutoModelForImageTextToText.from_pretrained(str(path), dtype=DTYPES[config.dtype])
        batch_vision_windows(lm)  # the tower's windows in one attention call per length
        align_vision_mlps(lm)  # its MLP's width padded for the GPU's fast matmuls
        return lm
    return AutoModelForCausalLM.from_pretrained(str(path), dtype=DTYPES[config.dtype])


@dataclasses.dataclass(frozen=True)
class _Placed:
    """A micro-batch on the device (``PolicyTrainer._on_device``)."""

    mb: MicroBatch
    causal: bool
    """Right-padded: the model runs causal without its mask (``logprobs.right_padded``)."""
    sources: torch.Tensor | None
    """Packed: the flat positions whose hidden states predict the valid tokens."""
    targets: torch.Tensor | None
    """Packed: those tokens."""


def _on(value: Any, device: torch.device) -> torch.Tensor:
    """A metric (a scalar tensor, or a number) as a tensor on ``device``."""
    return value if torch.is_tensor(value) else torch.tensor(float(value), device=device)


class PolicyTrainer:
    """One rank of the policy: loads ``config.model_path``, shards it with FSDP2 (see
    ``parallelize.uses_fsdp`` for when) and trains it with AdamW.

    ``trainable=False`` builds a frozen copy (the reference policy): no optimizer, logprobs and
    weights only. ``total_steps`` is the schedule length when ``optimizer.total_steps`` is None.
    """

    def __init__(
        self,
        config: PolicyConfig,
        rank: int = 0,
        world_size: int = 1,
        device: torch.device | str | None = None,
        trainable: bool = True,
        total_steps: int | None = None,
    ):
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"need 0 <= rank < world_size, got rank={rank} of {world_size}")
        self.config = config
        self.rank, self.world_size = rank, world_size
        self.device = torch.device(device) if device is not None else default_device(rank)
        self.uses_fsdp = uses_fsdp(config, world_size)
        if self.uses_fsdp:
            init_distributed(rank, world_size, self.device)
        self.lm = _load_lm(config)
        self.peft = lora.wrap_lora(self.lm, config.lora) if config.lora is not None else None
        """With ``policy.lora``: the ``PeftModel`` around ``lm`` (peft's layers are injected into
        ``lm`` itself, which is what trains); None trains every weight."""
        # the exported config keeps the model's own setting; training never uses a KV cache
        self.hf_use_cache = bool(getattr(self.lm.config, "use_cache", True))
        self.lm.config.use_cache = False
        self.vision = is_vision_model(Path(config.model_path))
        """A vision-language policy: no packing, no shared prompts (its positions are derived
        from whole rows and their images), images passed with their rows."""
        shares = config.share_prompts and not self.vision and not config.compile
        self.attention_cost = shared_prompt_cost(self.lm) if shares else None
        """``plan_micro_batches``' attention_cost: None computes every sequence's prompt.
        Compiled layers (``policy.compile``) take none: a shared prompt's micro-batch calls the
        layers with a mask where the padded one passes None, and each such form of call is a
        graph of its own, compiled when it first comes (on an H100 a 1.5B train phase of 47-82 s
        instead of 6 s in each of the first three steps)."""
        self.stays_gathered = stays_gathered(config, world_size, self.lm, self.device)
        """FSDP2 keeps the parameters gathered through a train step (``parallelize``)."""
        self.patch_cost = vision_patch_cost(self.lm)
        """``plan_micro_batches``' patch cost: micro-batches that keep an image's rows together
        run the vision tower fewer times."""
        self.micro_batch_overhead = (
            MICRO_BATCH_OVERHEAD.get(self.device.type, MICRO_BATCH_OVERHEAD["cuda"])
            if config.micro_batch_overhead is None
            else config.micro_batch_overhead
        )
        if not trainable:
            self.lm.requires_grad_(False)
        check_state_fits(self.lm, config, world_size if self.uses_fsdp else 1, self.device)
        if config.compile:
            compile_layers(self.lm)
        if config.activation_checkpointing:
            apply_activation_checkpointing(self.lm)
        self.model = LogprobModel(self.lm, config.logprob_chunk_size)
        if self.uses_fsdp:
            apply_fsdp(self.model, self.lm, config, self.device)
        else:
            self.model.to(self.device)
        self.adapters = lora.Adapters(self.lm) if self.peft is not None else None
        """The LoRA adapters in a refit's order (``lora.Adapters``); None without LoRA."""
        if self.adapters is not None and not self.uses_fsdp:
            # back to back in stream order: an adapter refit copies them at once (onload keeps
            # them so: ``offload.move_module`` lays them out first, in this order)
            pack_parameters(self.adapters.params, self.device)
        self.optimizer: torch.optim.Optimizer | None = None
        self.scheduler: torch.optim.lr_scheduler.LambdaLR | None = None
        if trainable:
            # with LoRA only the adapters require gradients: the optimizer holds nothing else
            trained = [p for p in self.model.parameters() if p.requires_grad]
            self.optimizer, self.scheduler = build_optimizer(trained, config.optimizer, total_steps)
            if config.optimizer.bf16_stochastic_round:
                # its rounding draws from the default generator, which each process seeds at
                # random: seeded here, a run repeats and a resume (which restores it) continues
                torch.manual_seed(STOCHASTIC_ROUND_SEED + rank)
        self.step = 0
        self.resident = True
        """Whether the state is on the device (``offload``/``onload`` toggle it)."""
        self._host_pool: HostPool | None = None

    def _require_resident(self, what: str) -> None:
        # On a GPU an offloaded trainer would compute on host parameters with device inputs (or
        # silently on the host); on the CPU nothing moves, so the flag is what catches it.
        if not self.resident:
            raise RuntimeError(
                f"PolicyTrainer.{what}() called while offloaded: call onload() first (the "
                "runtime's memory phases do this before every trainer call)"
            )

    # -- collectives over the trainer ranks ---------------------------------------------------
    def _all_reduce(self, values: torch.Tensor, op: Any = None) -> torch.Tensor:
        if self.world_size > 1:
            values = values.to(self.device)
            dist.all_reduce(values, op=op or dist.ReduceOp.SUM)
        return values.cpu()

    def _max(self, values: torch.Tensor) -> list[int]:
        return [int(v) for v in self._all_reduce(values, dist.ReduceOp.MAX).tolist()]

    def _micro_batches(self, batch: TrainBatch) -> list[tuple[MicroBatch, bool]]:
        """This rank's micro-batches (``data.packing``: trimmed, by token budget, packed as
        configured), padded with no-loss fillers to the largest count of any rank: under FSDP2
        every forward/backward is a collective, so all ranks run as many."""
        config = self.config
        local = [
            (mb, True)
            for mb in plan_micro_batches(
                batch,
                config.micro_batch_size,
                config.max_tokens_per_micro_batch,
                config.packing and not self.vision,
                self.attention_cost,
                self.micro_batch_overhead,
                self.patch_cost,
            )
        ]
        # one collective for both: the most micro-batches and (negated) the fewest sequences
        most, negated_fewest = self._max(torch.tensor([len(local), -batch.num_sequences]))
        if negated_fewest == 0:  # every rank raises, so none waits for the others in a collective
            raise ValueError(
                "a trainer rank got an empty batch: give every rank at least one sequence "
                "(batch size >= number of trainers)"
            )
        filler = trimmed(batch.select(slice(0, 1)))
        filler.loss_mask = torch.zeros_like(filler.loss_mask)
        filler_mb = MicroBatch(torch.tensor([0]), filler)
        return local + [(filler_mb, False)] * (most - len(local))

    def _on_device(self, mb: MicroBatch) -> _Placed:
        """``mb`` with its tensors on the device (``rows`` stay on the host), and what its
        forward derives from them found on the host first: whether it is right-padded, a packed
        layout's scored positions and their tokens (a check or a boolean index of device
        tensors waits for the device, which kept the host from queueing micro-batches ahead)."""
        packed = mb.packed
        if packed is None:
            causal = right_padded(mb.batch.attention_mask)
            return _Placed(MicroBatch(mb.rows, mb.batch.to(self.device)), causal, None, None)
        sources = packed.sources[packed.valid].to(self.device)
        targets = mb.batch.input_ids[packed.valid].to(self.device)
        moved: dict[str, Any] = {}
        for field in dataclasses.fields(packed):
            value = getattr(packed, field.name)
            moved[field.name] = None if value is None else value.to(self.device)
        packed = dataclasses.replace(packed, **moved)
        placed = MicroBatch(mb.rows, mb.batch.to(self.device), packed)
        return _Placed(placed, False, sources, targets)

    def _forward(self, placed: _Placed, with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """Token logprobs and entropies ``[b, T]`` of the micro-batch's (trimmed) layout."""
        mb = placed.mb
        if mb.packed is None:
            return self.model(
                mb.batch.input_ids,
                mb.batch.attention_mask,
                with_entropy=with_entropy,
                images=mb.batch.images,
                causal=placed.causal,
            )
        packed = mb.packed
        logprobs, entropy = self.model(
            packed.input_ids,
            packed.attention_mask,
            with_entropy=with_entropy,
            position_ids=packed.position_ids,
            sources=placed.sources,
            targets=placed.targets,
        )
        return unpack(logprobs, packed), unpack(entropy, packed)

    # -- logprobs -------------------------------------------------------------------------------
    @torch.no_grad()
    def logprobs(self, batch: TrainBatch, with_entropy: bool = False) -> Any:
        """Token logprobs ``[B, T]`` float32 on the host (entry t = log p(token t | < t),
        entry 0 and padding 0); with ``with_entropy`` the pair (logprobs, entropy)."""
        self._require_resident("logprobs")
        self.model.eval()
        shape = tuple(batch.input_ids.shape)
        out, ent = torch.zeros(shape), torch.zeros(shape)
        for mb, real in self._micro_batches(batch):
            logprobs, entropy = self._forward(self._on_device(mb), with_entropy)
            if real:
                width = logprobs.shape[1]
                out[mb.rows, :width] = logprobs.float().cpu()
                ent[mb.rows, :width] = entropy.float().cpu()
        if self.uses_fsdp:
            reshard(self.model)
        return (out, ent) if with_entropy else out

    def base_logprobs(self, batch: TrainBatch) -> torch.Tensor:
        """``logprobs`` of the model with its LoRA adapters disabled: the frozen base model, so
        a LoRA policy is its own reference policy (no second copy of the weights)."""
        if self.peft is None:
            raise ValueError("base_logprobs needs policy.lora (without it, build a reference)")
        with self.peft.disable_adapter():
            return self.logprobs(batch)

    # -- training -------------------------------------------------------------------------------
    def train(
        self, batch: TrainBatch, loss_fn: LossFn, with_entropy: bool = False
    ) -> dict[str, float]:
        """One optimizer step on this rank's shard ``batch``.

        ``loss_fn(logprobs, micro_batch, num_global_tokens, num_global_sequences)`` normalises by
        counts over all micro-batches and ranks (sequences = rows with a trained token), so
        accumulating micro-batches and summing gradients over ranks gives the full-batch step.
        With ``with_entropy`` it also gets ``entropy=`` (with grad). Returns the loss and
        ``loss_fn``'s metrics summed over micro-batches and ranks, grad_norm (before clipping),
        the lr of this step, num_tokens and num_sequences; a non-finite gradient norm skips the
        update (``skipped_step`` = 1).

        Under FSDP2 every micro-batch's backward reduce-scatters its gradients (summed, see
        ``apply_fsdp``). Deferring the sync to the last micro-batch would save communication but
        keep unsharded gradients of the whole model on every rank: the memory FSDP saves. One
        rank (``parallelize.stays_gathered``) has no other rank: it keeps its parameters
        gathered and reduces once, after the last micro-batch (the same fp32 sums).
        """
        if self.optimizer is None or self.scheduler is None:
            raise ValueError("this PolicyTrainer was built with trainable=False")
        self._require_resident("train")
        self.model.train()
        mask = batch.loss_mask
        counts = torch.tensor([mask.sum().item(), (mask.sum(-1) > 0).sum().item()])
        num_tokens, num_sequences = self._all_reduce(counts.double()).tolist()
        # Every micro-batch on the device before the first forward, and the metrics summed
        # there: a copy from pageable host memory (either way) waits for the device's queue to
        # drain, which once per micro-batch kept the host from queueing ahead.
        micro_batches = [self._on_device(mb) for mb, _ in self._micro_batches(batch)]
        sums = self._accumulate(micro_batches, loss_fn, num_tokens, num_sequences, with_entropy)
        lr = float(self.scheduler.get_last_lr()[0])
        grad_norm = self._clip_gradients()
        if math.isfinite(grad_norm):
            self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        keys = sorted(sums)
        reduced = self._all_reduce(torch.stack([sums[k] for k in keys]).cpu())
        out = {k: float(v) for k, v in zip(keys, reduced.tolist(), strict=True)}
        out.update(
            grad_norm=grad_norm,
            lr=lr,
            num_tokens=num_tokens,
            num_sequences=num_sequences,
            skipped_step=float(not math.isfinite(grad_norm)),
        )
        return out

    def _accumulate(
        self,
        micro_batches: list[_Placed],
        loss_fn: LossFn,
        num_tokens: float,
        num_sequences: float,
        with_entropy: bool,
    ) -> dict[str, torch.Tensor]:
        """Forward and backward of every micro-batch; the loss and ``loss_fn``'s metrics summed
        over them (float64, on the device: one stack, cast and add a micro-batch)."""
        gathered = self.stays_gathered
        # each FSDP module itself: recursing walks every module of the model (LoRA: thousands)
        fsdp = [m for m in self.model.modules() if isinstance(m, FSDPModule)] if gathered else []
        totals: dict[tuple[str, ...], torch.Tensor] = {}
        try:
            for index, placed in enumerate(micro_batches):
                last = index == len(micro_batches) - 1
                for module in fsdp:  # one reduction, after the last micro-batch
                    module.set_requires_gradient_sync(last, recurse=False)
                logprobs, entropy = self._forward(placed, with_entropy)
                extra = {"entropy": entropy} if with_entropy else {}
                loss, metrics = loss_fn(
                    logprobs, placed.mb.batch, num_tokens, num_sequences, **extra
                )
                loss.backward()
                named = {**metrics, "loss": loss}
                keys = tuple(sorted(named))
                with torch.no_grad():
                    values = torch.stack([_on(named[k], loss.device) for k in keys]).double()
                totals[keys] = values + totals[keys] if keys in totals else values
        finally:
            if gathered:  # the step changes the sharded parameters: gather them anew
                reshard(self.model)
        sums: dict[str, torch.Tensor] = {}
        for keys, values in totals.items():
            for key, value in zip(keys, values.unbind(), strict=True):
                sums[key] = value + sums[key] if key in sums else value
        return sums

    def _clip_gradients(self) -> float:
        """Global gradient norm (over all shards), clipped to ``max_grad_norm`` when set."""
        params = [p for p in self.model.parameters() if p.grad is not None]
        max_norm = self.config.optimizer.max_grad_norm
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm or float("inf"))
        return float(full_tensor(norm, self.device))

    # -- weights --------------------------------------------------------------------------------
    def _gather(self, tensor: torch.Tensor) -> torch.Tensor:
        return full_tensor(tensor, self.device)

    def weight_metadata(
        self, dtype: torch.dtype | None = None
    ) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
        """(name, full shape, dtype) of every tensor ``iter_weights(dtype)`` yields; no
        communication, the same on every rank."""
        if self.peft is not None:
            return lora.merged_metadata(hf_state(self.lm), dtype)
        return [(name, tuple(t.shape), dtype or t.dtype) for name, t in hf_state(self.lm)]

    def adapter_metadata(
        self, dtype: torch.dtype | None = None
    ) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
        """(name, full shape, dtype) of every tensor ``iter_adapter(dtype)`` yields."""
        return self._adapters().metadata(dtype)

    def _adapters(self) -> lora.Adapters:
        if self.adapters is None:
            raise ValueError("this policy has no LoRA adapters (policy.lora is unset)")
        return self.adapters

    def iter_adapter(
        self, dtype: torch.dtype | None = None, scaled: bool = True
    ) -> Iterable[tuple[str, torch.Tensor]]:
        """The LoRA adapters in peft's saved names (``lora.Adapters.tensors``; ``scaled``: B
        times alpha / rank), gathered one at a time; as ``iter_weights``, only rank 0 yields.
        Scaled on a plain module: copied at once (``lora.Adapters.scaled_copy``)."""
        self._require_resident("iter_adapter")
        adapters = self._adapters()
        if scaled and not self.uses_fsdp:  # one rank: a PackedStream, copied at once
            copied = adapters.scaled_copy(self.device, dtype)
            if copied is not None:
                return copied if self.rank == 0 else iter(())
        return self._rank_zero(adapters.tensors(self._gather, scaled, dtype))

    def _rank_zero(
        self, stream: Iterator[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """``stream`` run on every rank (its gathers are collectives), yielded on rank 0."""
        for name, tensor in stream:
            if self.rank == 0:
                yield name, tensor

    @property
    def streams_live_weights(self) -> bool:
        """Whether ``iter_weights()`` yields the live parameters themselves: one rank, no CPU
        offload policy, and not offloaded now (else it yields copies on the device). They stay
        valid until the next step or offload, so a refit may read them in place."""
        if self.world_size != 1 or self.config.cpu_offload or self.peft is not None:
            return False  # (with LoRA the weights are merged on the way: new tensors)
        param = next(self.lm.parameters(), None)
        return param is not None and getattr(param, "_local_tensor", param).device == self.device

    def iter_weights(self, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """Full weights in Hugging Face names, one tensor at a time, on this rank's device.
        Under FSDP2 each gather is a collective: every rank iterates to the end, only rank 0
        yields. Tied LM heads are left out (loaders re-tie them to the embedding). On one rank
        (with or without FSDP) the tensors on the device are the live parameters (no copy):
        copy them to keep them past a step. With LoRA: the weights with the adapters merged in."""
        self._require_resident("iter_weights")
        stream = hf_state(self.lm)
        if self.peft is not None:  # gathered there already (full_tensor then passes them)
            stream = lora.merged_tensors(self.lm, stream, self._gather)
        for name, tensor in stream:
            full = full_tensor(tensor, self.device)
            if self.rank == 0:
                yield name, full if dtype is None else full.to(dtype)
            del full

    # -- checkpoints ----------------------------------------------------------------------------
    def _ranks(self) -> Ranks:
        return Ranks(self.rank, self.world_size, self.uses_fsdp and dist.is_initialized())

    def _train_state(self) -> TrainState:
        # with LoRA the base weights are the model folder's: a checkpoint holds the adapters
        keep = (lambda name: ".lora_" in name) if self.peft is not None else None
        return TrainState(
            self.model, self.optimizer, self.scheduler, self.step, self._ranks(), keep
        )

    def save_checkpoint(self, path: Path | str, extra: dict[str, Any] | None = None) -> None:
        """Sharded model + optimizer + scheduler state (and ``extra``, a JSON-able dict of the
        caller's state) into ``path``, atomically. A collective under FSDP2."""
        self._require_resident("save_checkpoint")
        sharded.save(self._train_state(), Path(path), extra or {})

    def load_checkpoint(self, path: Path | str) -> dict[str, Any]:
        """Restores what ``save_checkpoint`` wrote; returns its ``extra``."""
        state = self._train_state()
        extra = sharded.load(state, Path(path))
        self.step = state.step
        return extra

    def export_hf(
        self, path: Path | str, dtype: torch.dtype | None = None, merged: bool = False
    ) -> None:
        """A Hugging Face folder (config, safetensors, tokenizer) of the current weights. With
        LoRA a peft adapter folder (adapter_config.json, adapter_model.safetensors: what
        ``PeftModel.from_pretrained(base, path)`` loads), or with ``merged`` a model folder of
        the weights with the adapters merged in. A collective under FSDP2."""
        source = Path(self.config.model_path)
        if self.peft is not None and not merged:
            adapter_config = lora.adapter_config(self.peft)
            tensors = self.iter_adapter(dtype, scaled=False)
            hf_export.export_adapter(Path(path), tensors, adapter_config, source, self._ranks())
            return
        config = copy.deepcopy(self.lm.config)
        config.use_cache = self.hf_use_cache  # as loaded: training turned it off
        if dtype is not None:
            config.dtype = dtype
        weights = self.iter_weights(dtype)
        hf_export.export_hf(Path(path), weights, config, source, self._ranks())

    # -- memory phases --------------------------------------------------------------------------
    def offload_host_bytes(self) -> int:
        """The host memory ``pin_offload_memory`` would page-lock (0 where it pins nothing:
        without CUDA, with ``cpu_offload``, or pinned already)."""
        if self._host_pool is not None or self.device.type != "cuda" or self.config.cpu_offload:
            return 0
        adapters, weights = self._offloads_adapters_only, self.config.offload_weights
        return offload_bytes(self.model, self.optimizer, adapters, weights)

    def pin_offload_memory(self) -> None:
        """Start pinning the host memory offloads will use, in the background (``HostPool``),
        so the first offload runs at pinned bandwidth, after checking the host has it
        (``check_offload_fits``). A no-op without CUDA or when called again."""
        num_bytes = self.offload_host_bytes()
        if num_bytes:
            check_offload_fits(num_bytes)
            self._host_pool = HostPool()
            self._host_pool.start(num_bytes)

    @property
    def _offloads_adapters_only(self) -> bool:
        """``policy.lora.offload_base=false``: offloads leave the frozen base on the device."""
        return self.config.lora is not None and not self.config.lora.offload_base

    def offload(self) -> None:
        """Parameters, gradients, buffers and optimizer state to (pinned) host memory; the same
        tensor objects stay referenced everywhere. With ``cpu_offload`` only buffers move (the
        sharded parameters and the optimizer state live on the host already); with
        ``policy.lora.offload_base=false`` the adapters, their gradients and the optimizer
        state alone (the frozen base stays); with ``policy.offload_weights=false`` the
        optimizer state alone."""
        host = torch.device("cpu")
        include = not self.config.cpu_offload
        adapters = self._offloads_adapters_only
        move_state(
            self.model,
            self.optimizer,
            host,
            include,
            self._host_pool,
            adapters,
            weights=self.config.offload_weights,
        )
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        self.resident = False

    def onload(self) -> None:
        """Back to the device, the inverse of ``offload``."""
        move_state(
            self.model,
            self.optimizer,
            self.device,
            include_parameters=not self.config.cpu_offload,
            trainable_only=self._offloads_adapters_only,
            first=self.adapters.params if self.adapters is not None else (),
            weights=self.config.offload_weights,
        )
        self.resident = True
