"""MegatronTrainer: one rank of the policy on Megatron-core's GPT model, with the
``PolicyTrainer`` surface (train with the same ``LossFn``, logprobs, offload/onload, the weight
stream in Hugging Face names, checkpoints, export).

The model is built from the Hugging Face config (``megatron_config``; the local layer spec,
no Transformer Engine or Apex) and loaded from the folder's safetensors through
``megatron_weights``; trainable copies run under Megatron's DDP and distributed optimizer (fp32
main parameters and Adam state sharded over data-parallel ranks, bf16 model weights where
``policy.dtype`` or ``mixed_precision`` says bf16). Micro-batches go through Megatron's
forward-backward schedule, which pipelines them over stages. At tensor-parallel size 1 the
last stage's output layer runs chunk by chunk of tokens with the log-softmax
(``logprobs.ChunkedTokenLogprobs``, as the FSDP2 trainer: no ``[tokens, vocab]`` logits); over
several tensor-parallel ranks the logits stay split over them (``vocab_parallel``).

Every rank of the job constructs one and calls the same methods in the same order. The ranks
of one model-parallel group (tensor x pipeline) must be given the same batch. CUDA only:
megatron-core's model asks for the current CUDA device while it is built.
"""

from __future__ import annotations

import copy
import math
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from tandem.checkpoint import Ranks, hf_export
from tandem.config.models import PolicyConfig
from tandem.contracts import LossFn
from tandem.data.batch import TrainBatch
from tandem.data.packing import MICRO_BATCH_OVERHEAD, MicroBatch, plan_micro_batches, trimmed
from tandem.tensors.devices import release_device_caches
from tandem.tensors.storage_offload import StorageOffload, attribute_tensors
from tandem.trainer import megatron_checkpoint, megatron_logprobs
from tandem.trainer.fits import check_megatron_state_fits, check_offload_fits
from tandem.trainer.megatron_batches import join_model_parallel
from tandem.trainer.megatron_config import gpt_model_kwargs, transformer_config_kwargs
from tandem.trainer.megatron_weights import (
    DecoderShape,
    global_name,
    hf_to_megatron,
    megatron_tensor_to_hf,
    pad_row_without_input_grad,
    stage_name,
    tp_split,
)
from tandem.trainer.parallelize import init_distributed
from tandem.trainer.schedule import lr_factor


def _load_hf_state(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    state: dict[str, torch.Tensor] = {}
    for file in sorted(path.glob("*.safetensors")):
        state.update(load_file(str(file)))
    return state


class MegatronTrainer:
    """One rank of the policy on Megatron-core (see the module docstring). Arguments as
    ``PolicyTrainer``'s; ``world_size`` = data-parallel size x tensor x pipeline sizes."""

    peft = None
    """No LoRA on this backend (``config.megatron.check_megatron_policy`` refuses it)."""

    def __init__(
        self,
        config: PolicyConfig,
        rank: int = 0,
        world_size: int = 1,
        device: torch.device | str | None = None,
        trainable: bool = True,
        total_steps: int | None = None,
    ):
        if not torch.cuda.is_available():
            raise RuntimeError(
                "policy.backend=megatron needs a CUDA GPU (megatron-core's model runs on CUDA "
                "only); run this trainer on a GPU node or set policy.backend=fsdp2"
            )
        from transformers import AutoConfig

        self.config, self.rank, self.world_size = config, rank, world_size
        local = int(os.environ.get("LOCAL_RANK", rank % max(torch.cuda.device_count(), 1)))
        self.device = torch.device(device) if device is not None else torch.device("cuda", local)
        torch.cuda.set_device(self.device)
        init_distributed(rank, world_size, self.device)
        self._init_parallel()
        self.hf_config = AutoConfig.from_pretrained(str(config.model_path))
        self.hf_use_cache = bool(getattr(self.hf_config, "use_cache", True))
        layout = config.megatron
        self.shape = DecoderShape.from_hf(
            self.hf_config, layout.tensor_parallel_size, layout.vocab_divisible_by
        )
        self.bf16 = config.dtype == "bfloat16" or config.mixed_precision
        self.model = self._build_model()
        check_megatron_state_fits(
            self.model, config, self.bf16, trainable, world_size, self.device
        )  # before the gradient buffers and the optimizer's state
        self.layer_offset = self._layer_offset()
        self._load_weights(_load_hf_state(Path(config.model_path)))
        self.micro_batch_overhead = config.micro_batch_overhead or MICRO_BATCH_OVERHEAD["cuda"]
        self.ddp: Any = None
        self.optimizer: Any = None
        self._lr = lr_factor(config.optimizer, total_steps) if trainable else None
        if trainable:
            self._build_optimizer()
        else:
            self.model.requires_grad_(False)
        self.step = 0
        self.resident = True
        self._offload: StorageOffload | None = None

    # -- construction ---------------------------------------------------------------------------
    def _init_parallel(self) -> None:
        from megatron.core import parallel_state, tensor_parallel

        layout = self.config.megatron
        model_parallel = layout.tensor_parallel_size * layout.pipeline_parallel_size
        if self.world_size % model_parallel:
            raise ValueError(
                f"{self.world_size} trainer ranks do not divide into tensor_parallel_size x "
                f"pipeline_parallel_size = {model_parallel}: set cluster.num_trainers to a "
                "multiple of it"
            )
        if not parallel_state.model_parallel_is_initialized():
            parallel_state.initialize_model_parallel(
                tensor_model_parallel_size=layout.tensor_parallel_size,
                pipeline_model_parallel_size=layout.pipeline_parallel_size,
            )
            tensor_parallel.model_parallel_cuda_manual_seed(1234)
        self.tp_group = parallel_state.get_tensor_model_parallel_group()
        self.pp_group = parallel_state.get_pipeline_model_parallel_group()
        self.mp_group = parallel_state.get_model_parallel_group()
        self.tp_rank = dist.get_rank(self.tp_group)
        self.tp_size = dist.get_world_size(self.tp_group)
        self.first_stage = parallel_state.is_pipeline_first_stage()
        self.last_stage = parallel_state.is_pipeline_last_stage()
        self.last_stage_rank = parallel_state.get_pipeline_model_parallel_last_rank()

    def _build_model(self) -> Any:
        from megatron.core.models.gpt import GPTModel
        from megatron.core.transformer import TransformerConfig

        from tandem.trainer.megatron_attention import local_spec_with_sdpa

        layout = self.config.megatron
        kwargs = transformer_config_kwargs(
            self.hf_config,
            layout.tensor_parallel_size,
            layout.pipeline_parallel_size,
            bf16=self.bf16,
            recompute=self.config.activation_checkpointing,
        )
        # the loss is normalised by the caller (LossFn): no division by micro-batches or ranks
        self.transformer_config = TransformerConfig(**kwargs, calculate_per_token_loss=True)
        model = GPTModel(
            config=self.transformer_config,
            transformer_layer_spec=local_spec_with_sdpa(),
            pre_process=self.first_stage,
            post_process=self.last_stage,
            **gpt_model_kwargs(self.hf_config, self.shape),
        )
        if self.first_stage:  # the pad row learns only as the output layer, as in HF
            pad_id = getattr(self.hf_config, "pad_token_id", None)
            pad_row_without_input_grad(model.embedding.word_embeddings, pad_id)
        return model.to(self.device)

    def _layer_offset(self) -> int:
        layers = getattr(getattr(self.model, "decoder", None), "layers", None)
        return int(layers[0].layer_number) - 1 if layers is not None and len(layers) else 0

    def _megatron_names(self) -> list[tuple[str, torch.nn.Parameter]]:
        return [(n, p) for n, p in self.model.named_parameters() if "_extra_state" not in n]

    @torch.no_grad()
    def _load_weights(self, hf: dict[str, torch.Tensor]) -> None:
        """Every parameter of this rank from the Hugging Face tensors: converted, cut to this
        stage's layers and this tensor-parallel rank's slice; a tied output layer on the last
        stage of a pipeline takes the embedding."""
        full = hf_to_megatron(hf, self.shape)
        missing = []
        for name, param in self._megatron_names():
            key = global_name(name, self.layer_offset)
            if key == "output_layer.weight" and self.shape.tied:
                key = "embedding.word_embeddings.weight"
            if key not in full:
                missing.append(key)
                continue
            param.copy_(tp_split(key, full[key], self.tp_size)[self.tp_rank])
        if missing:
            raise ValueError(f"no Hugging Face weights map to {missing[:5]} ({len(missing)})")

    def _build_optimizer(self) -> None:
        from megatron.core.distributed import DistributedDataParallel as DDP
        from megatron.core.distributed import DistributedDataParallelConfig
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=True
        )
        self.ddp = DDP(config=self.transformer_config, ddp_config=ddp_config, module=self.model)
        opt = self.config.optimizer
        self.optimizer = get_megatron_optimizer(
            OptimizerConfig(
                optimizer="adam",
                lr=opt.lr,
                weight_decay=opt.weight_decay,
                adam_beta1=opt.betas[0],
                adam_beta2=opt.betas[1],
                adam_eps=opt.eps,
                clip_grad=opt.max_grad_norm or 0.0,
                bf16=self.bf16,
                params_dtype=torch.bfloat16 if self.bf16 else torch.float32,
                use_distributed_optimizer=True,
            ),
            [self.ddp],
        )
        self._fuse_adam()

    def _fuse_adam(self) -> None:
        """Without Apex or Transformer Engine megatron-core steps torch's AdamW with multi-tensor
        kernels (64 ms of a 0.75 s step at 1.5B): on CUDA its groups take the fused kernel (the
        same update; the ``step`` counters live on the device, where loading puts them too)."""
        for opt in self.inner_optimizers():
            params = [p for group in opt.param_groups for p in group["params"]]
            torch_adam = isinstance(opt, torch.optim.Adam | torch.optim.AdamW)  # not Apex's/TE's
            if torch_adam and params and all(p.is_cuda and p.is_floating_point() for p in params):
                for group in opt.param_groups:
                    group["fused"], group["foreach"] = True, False

    def _require_resident(self, what: str) -> None:
        if not self.resident:
            raise RuntimeError(
                f"MegatronTrainer.{what}() called while offloaded: call onload() first"
            )

    # -- collectives ----------------------------------------------------------------------------
    def _all_reduce(self, values: torch.Tensor, op: Any = None) -> torch.Tensor:
        if self.world_size > 1:
            values = values.to(self.device)
            dist.all_reduce(values, op=op or dist.ReduceOp.SUM)
        return values.cpu()

    def _from_last_stage(self, values: torch.Tensor) -> torch.Tensor:
        """``values`` as the last pipeline stage has them, on every stage (the shape is the
        same on all of them)."""
        if dist.get_world_size(self.pp_group) == 1:
            return values
        values = values.to(self.device)
        dist.broadcast(values, src=self.last_stage_rank, group=self.pp_group)
        return values.cpu()

    def _micro_batches(self, batch: TrainBatch) -> list[tuple[MicroBatch, bool]]:
        """This rank's micro-batches padded with no-loss fillers to the most of any rank."""
        config = self.config
        local = [
            (mb, True)
            for mb in plan_micro_batches(
                batch,
                config.micro_batch_size,
                config.max_tokens_per_micro_batch,
                False,
                None,
                self.micro_batch_overhead,
            )
        ]
        most, negated_fewest = (
            int(v)
            for v in self._all_reduce(
                torch.tensor([len(local), -batch.num_sequences]), dist.ReduceOp.MAX
            ).tolist()
        )
        if negated_fewest == 0:
            raise ValueError("a trainer rank got an empty batch: give every rank a sequence")
        filler = trimmed(batch.select(slice(0, 1)))
        filler.loss_mask = torch.zeros_like(filler.loss_mask)
        return local + [(MicroBatch(torch.tensor([0]), filler), False)] * (most - len(local))

    # -- forward --------------------------------------------------------------------------------
    def _token_logprobs(
        self, output: torch.Tensor, input_ids: torch.Tensor, attention_mask: torch.Tensor, ent: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Token-aligned ``[b, T]`` logprobs and entropies from the last stage's ``output``."""
        return megatron_logprobs.aligned(
            output, input_ids, attention_mask, ent, self.tp_group, self.shape.vocab_size
        )

    def _run(
        self,
        micro_batches: list[MicroBatch],
        loss_func: Any,
        forward_only: bool,
        with_entropy: bool = False,
    ) -> None:
        """Megatron's schedule over ``micro_batches`` (pipelined where there are stages);
        ``loss_func(mb, output)`` runs on the last stage (``output`` as ``_token_logprobs``
        takes it) and returns a scalar to backpropagate."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        one = torch.ones((), dtype=torch.int, device=self.device)

        def forward_step(data: Iterator[MicroBatch], model: Any) -> tuple[torch.Tensor, Any]:
            mb = next(data)
            ids = mb.batch.input_ids.to(self.device)
            width = ids.shape[1]
            positions = torch.arange(width, device=self.device).expand_as(ids)
            # causal (right padding needs no more); explicit, as Megatron's default is made
            # on "cuda" whatever the model's device
            causal = torch.ones(width, width, dtype=torch.bool, device=self.device)
            head = megatron_logprobs.head_kwargs(
                self.tp_size, self.shape.vocab_size, self.config.logprob_chunk_size, with_entropy
            )
            output = model(ids, positions, causal.triu(diagonal=1)[None, None], **head)
            return output, lambda logits: (loss_func(mb, logits), one, {})

        longest = max(mb.batch.input_ids.shape[1] for mb in micro_batches)
        get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=iter(micro_batches),
            model=[self.ddp if self.ddp is not None and not forward_only else self.model],
            num_microbatches=len(micro_batches),
            seq_length=longest,
            micro_batch_size=max(mb.batch.num_sequences for mb in micro_batches),
            forward_only=forward_only,
        )

    @torch.no_grad()
    def logprobs(self, batch: TrainBatch, with_entropy: bool = False) -> Any:
        """Token logprobs ``[B, T]`` float32 on the host (as ``PolicyTrainer.logprobs``); with
        ``with_entropy`` the pair (logprobs, entropy)."""
        self._require_resident("logprobs")
        self.model.eval()
        batch, mine = join_model_parallel(batch, self.mp_group)
        shape = tuple(batch.input_ids.shape)
        out, ent = torch.zeros(shape), torch.zeros(shape)
        planned = self._micro_batches(batch)
        real = {id(mb) for mb, is_real in planned if is_real}

        def collect(mb: MicroBatch, logits: torch.Tensor) -> torch.Tensor:
            ids, mask = mb.batch.input_ids.to(self.device), mb.batch.attention_mask.to(self.device)
            logprobs, entropy = self._token_logprobs(logits, ids, mask, with_entropy)
            if id(mb) in real:
                width = logprobs.shape[1]
                out[mb.rows, :width] = logprobs.float().cpu()
                ent[mb.rows, :width] = entropy.float().cpu()
            return logprobs.new_zeros(())

        self._run([mb for mb, _ in planned], collect, True, with_entropy)
        out, ent = self._from_last_stage(out)[mine], self._from_last_stage(ent)[mine]
        return (out, ent) if with_entropy else out

    # -- training -------------------------------------------------------------------------------
    def train(
        self, batch: TrainBatch, loss_fn: LossFn, with_entropy: bool = False
    ) -> dict[str, float]:
        """One optimizer step on this rank's shard ``batch`` (``PolicyTrainer.train``'s
        contract: ``loss_fn`` normalises by the global counts, so gradients summed over
        micro-batches and data-parallel ranks give the full-batch step)."""
        if self.optimizer is None or self._lr is None:
            raise ValueError("this MegatronTrainer was built with trainable=False")
        self._require_resident("train")
        self.model.train()
        batch, _ = join_model_parallel(batch, self.mp_group)
        mask = batch.loss_mask
        counts = torch.tensor([mask.sum().item(), (mask.sum(-1) > 0).sum().item()])
        # every rank of a model-parallel group holds the same batch: count data-parallel ranks
        model_parallel = self.tp_size * dist.get_world_size(self.pp_group)
        num_tokens, num_sequences = (self._all_reduce(counts.double()) / model_parallel).tolist()
        sums: dict[str, torch.Tensor] = {}

        def loss_func(mb: MicroBatch, logits: torch.Tensor) -> torch.Tensor:
            on_device = mb.batch.to(self.device)
            logprobs, entropy = self._token_logprobs(
                logits, on_device.input_ids, on_device.attention_mask, with_entropy
            )
            extra = {"entropy": entropy} if with_entropy else {}
            loss, metrics = loss_fn(logprobs, on_device, num_tokens, num_sequences, **extra)
            for key, value in {**metrics, "loss": loss}.items():
                sums[key] = sums.get(key, 0.0) + torch.as_tensor(value).detach().double().cpu()
            return loss

        lr = self.config.optimizer.lr * self._lr(self.step)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.ddp.zero_grad_buffer()
        self.optimizer.zero_grad()
        self._run([mb for mb, _ in self._micro_batches(batch)], loss_func, False, with_entropy)
        from megatron.core.distributed import finalize_model_grads

        finalize_model_grads([self.ddp])
        updated, grad_norm, _ = self.optimizer.step()
        grad_norm = float("nan") if grad_norm is None else float(grad_norm)
        self.step += 1
        return self._train_metrics(sums, grad_norm, lr, num_tokens, num_sequences, updated)

    def _train_metrics(
        self,
        sums: dict[str, torch.Tensor],
        grad_norm: float,
        lr: float,
        num_tokens: float,
        num_sequences: float,
        updated: bool,
    ) -> dict[str, float]:
        """The loss and ``loss_fn``'s metrics summed over micro-batches and data-parallel ranks
        (they are computed on last stages only, once per tensor-parallel rank)."""
        keys = sorted(self._key_union(sums))
        local = torch.stack([sums.get(k, torch.zeros((), dtype=torch.float64)) for k in keys])
        reduced = self._all_reduce(local) / self.tp_size
        out = {k: float(v) for k, v in zip(keys, reduced.tolist(), strict=True)}
        skipped = not updated or not math.isfinite(grad_norm)
        out.update(
            grad_norm=grad_norm,
            lr=lr,
            num_tokens=num_tokens,
            num_sequences=num_sequences,
            skipped_step=float(skipped),
        )
        return out

    def _key_union(self, sums: dict[str, torch.Tensor]) -> list[str]:
        """The metric names of the last stages, on every rank (earlier stages have none)."""
        if self.world_size == 1:
            return list(sums)
        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, sorted(sums))
        return sorted({key for keys in gathered for key in keys})

    # -- weights --------------------------------------------------------------------------------
    def _stage_layers(self) -> list[tuple[int, int]]:
        """(first layer, number of layers) of every pipeline stage, in stage order."""
        layers = getattr(getattr(self.model, "decoder", None), "layers", None)
        mine = (self.layer_offset, len(layers) if layers is not None else 0)
        if dist.get_world_size(self.pp_group) == 1:
            return [mine]
        stages: list[Any] = [None] * dist.get_world_size(self.pp_group)
        dist.all_gather_object(stages, mine, group=self.pp_group)
        return stages

    def _owner(self, name: str, stages: list[tuple[int, int]]) -> int:
        """The pipeline stage holding the Megatron tensor ``name`` (a global name)."""
        if name.startswith("embedding."):
            return 0
        if not name.startswith("decoder.layers."):
            return len(stages) - 1  # the final norm and the output layer
        layer = int(name.split(".")[2])
        return next(i for i, (first, count) in enumerate(stages) if first <= layer < first + count)

    def _full_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every Megatron tensor in ``megatron_shapes``' order, full (gathered over
        tensor-parallel ranks), on every rank: its pipeline stage broadcasts it."""
        from tandem.config.megatron import qkv_bias
        from tandem.trainer.megatron_weights import megatron_shapes, parallel_dim, tp_gather

        stages = self._stage_layers()
        my_stage = dist.get_rank(self.pp_group)
        pp_ranks = dist.get_process_group_ranks(self.pp_group) if len(stages) > 1 else []
        params = dict(self._megatron_names())
        dtype = torch.bfloat16 if self.bf16 else torch.float32
        for name, full in megatron_shapes(self.shape, qkv_bias(self.hf_config)).items():
            owner, dim = self._owner(name, stages), parallel_dim(name)
            if owner == my_stage:
                tensor = params[stage_name(name, self.layer_offset)].detach()
            else:
                local = list(full)
                if dim is not None:
                    local[dim] //= self.tp_size
                tensor = torch.empty(local, dtype=dtype, device=self.device)
            if len(stages) > 1:
                dist.broadcast(tensor, src=pp_ranks[owner], group=self.pp_group)
            if self.tp_size > 1 and dim is not None:
                shards = [torch.empty_like(tensor) for _ in range(self.tp_size)]
                dist.all_gather(shards, tensor.contiguous(), group=self.tp_group)
                tensor = tp_gather(name, shards)
            yield name, tensor

    def weight_metadata(
        self, dtype: torch.dtype | None = None
    ) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
        """(name, full shape, dtype) of every tensor ``iter_weights(dtype)`` yields, in its
        order; no communication, the same on every rank."""
        from tandem.config.megatron import qkv_bias
        from tandem.trainer.megatron_weights import hf_metadata

        model_dtype = torch.bfloat16 if self.bf16 else torch.float32
        layout = hf_metadata(self.shape, qkv_bias(self.hf_config))
        return [(name, shape, dtype or model_dtype) for name, shape in layout]

    @property
    def streams_live_weights(self) -> bool:
        """False: QKV and fc1 are split on the way, so the stream holds new tensors."""
        return False

    def iter_weights(self, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """Full weights in Hugging Face names, in ``weight_metadata``'s order, one Megatron
        tensor at a time, on this rank's device; every rank iterates to the end (the gathers
        are collectives), only rank 0 yields. No tied LM head (loaders tie it)."""
        self._require_resident("iter_weights")
        for name, tensor in self._full_tensors():
            for hf_name, part in megatron_tensor_to_hf(name, tensor, self.shape):
                if self.rank == 0:
                    yield hf_name, part if dtype is None else part.to(dtype)

    # -- checkpoints and export -----------------------------------------------------------------
    def inner_optimizers(self) -> list[Any]:
        """The torch optimizers under Megatron's (one per chained optimizer)."""
        if self.optimizer is None:
            return []
        chained = getattr(self.optimizer, "chained_optimizers", None) or [self.optimizer]
        return [opt.optimizer for opt in chained]

    def ranks(self) -> Ranks:
        return Ranks(self.rank, self.world_size, dist.is_initialized())

    def save_checkpoint(self, path: Path | str, extra: dict[str, Any] | None = None) -> None:
        """Each rank's slice and optimizer state, the step and ``extra``, atomically
        (``megatron_checkpoint.save``). A collective."""
        self._require_resident("save_checkpoint")
        megatron_checkpoint.save(self, Path(path), extra or {})

    def load_checkpoint(self, path: Path | str) -> dict[str, Any]:
        """Restores what ``save_checkpoint`` wrote (same layout); returns its ``extra``."""
        state = megatron_checkpoint.load(self, Path(path))
        self.step = state.step
        return state.extra

    def export_hf(
        self, path: Path | str, dtype: torch.dtype | None = None, merged: bool = False
    ) -> None:
        """A Hugging Face folder (config, safetensors, tokenizer) of the current weights;
        ``merged`` has no meaning without LoRA. A collective."""
        config = copy.deepcopy(self.hf_config)
        config.use_cache = self.hf_use_cache
        if dtype is not None:
            config.dtype = dtype
        source = Path(self.config.model_path)
        hf_export.export_hf(Path(path), self.iter_weights(dtype), config, source, self.ranks())

    # -- memory phases --------------------------------------------------------------------------
    def _device_tensors(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(what offload keeps, what it may drop): parameters, buffers, tensors modules hold
        as attributes, Megatron's flat parameter buffers and the optimizer's main parameters
        and state; the gradient buffers are zeroed before use, so they are dropped."""
        kept: list[torch.Tensor] = [*self.model.parameters(), *self.model.buffers()]
        for module in self.model.modules():
            kept += [v for v in vars(module).values() if isinstance(v, torch.Tensor)]
        dropped: list[torch.Tensor] = []
        for buffer in getattr(self.ddp, "buffers", []) if self.ddp is not None else []:
            kept += [buffer.param_data] if buffer.param_data is not None else []
            dropped.append(buffer.grad_data)
        dropped += [p.main_grad for p in self.model.parameters() if hasattr(p, "main_grad")]
        for opt in self.inner_optimizers():
            kept += [p for group in opt.param_groups for p in group["params"]]
            for per_param in opt.state.values():
                kept += [v for v in per_param.values() if isinstance(v, torch.Tensor)]
        # what Megatron's wrappers hold besides (found-inf flags, shard lists, buffers' views)
        chained = getattr(self.optimizer, "chained_optimizers", None) or [self.optimizer]
        for owner in [self.ddp, *chained] if self.optimizer is not None else []:
            kept += attribute_tensors(owner)
        return kept, dropped

    def offload_host_bytes(self) -> int:
        """The host memory the first ``offload`` will page-lock (0 once it has)."""
        if self._offload is not None:
            return 0
        kept, dropped = self._device_tensors()
        return StorageOffload(kept, self.device, dropped).nbytes

    def pin_offload_memory(self) -> None:
        """Host memory is pinned at the first ``offload`` (kept for the next ones); here its
        size is checked against the host's available memory (``check_offload_fits``)."""
        check_offload_fits(self.offload_host_bytes(), megatron=True)

    def offload(self) -> None:
        """Every device storage of the trainer to pinned host memory, resized to 0 bytes
        (``StorageOffload``): each tensor object, view and alias stays as it is. Megatron's
        cached rotary tables and causal masks are dropped (rebuilt on the next forward)."""
        if not self.resident:
            return
        _clear_megatron_caches()
        kept, dropped = self._device_tensors()
        self._offload = StorageOffload(kept, self.device, dropped, previous=self._offload)
        self._offload.offload()
        release_device_caches()  # cuBLAS workspaces (64 MiB on an H200) are allocator blocks
        self.resident = False

    def onload(self) -> None:
        """Back to the device, the inverse of ``offload``."""
        if self.resident or self._offload is None:
            self.resident = True
            return
        self._offload.onload()
        self.resident = True


def _clear_megatron_caches() -> None:
    """Drop what Megatron caches on the device between forwards: the rotary tables
    (``RotaryEmbedding.forward`` is memoised) and the global memory buffer's tensors."""
    from megatron.core import parallel_state
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    clear = getattr(RotaryEmbedding.forward, "cache_clear", None)
    if clear is not None:
        clear()
    memory = getattr(parallel_state, "_GLOBAL_MEMORY_BUFFER", None)
    if memory is not None:
        memory.buffer.clear()
