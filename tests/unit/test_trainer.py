"""PolicyTrainer in one process: chunked logprobs, micro-batch accumulation, schedules, weights."""

from __future__ import annotations

import traceback
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from test_trainer_support import make_batch, policy, token_nll, write_tiny_qwen2
from torch.utils._python_dispatch import TorchDispatchMode

from tandem.config.models import OptimizerConfig
from tandem.data.batch import TrainBatch
from tandem.trainer import PolicyTrainer
from tandem.trainer.logprobs import right_padded
from tandem.trainer.schedule import lr_factor


@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied"])
def model_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_qwen2(tmp_path_factory.mktemp("tiny"), tied=request.param)


def full_logits_logprobs(lm: torch.nn.Module, batch) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[no-untyped-def]
    with torch.no_grad():
        logits = lm(batch.input_ids, attention_mask=batch.attention_mask).logits.float()
    logp = torch.log_softmax(logits, -1)
    expected = torch.zeros(batch.input_ids.shape)
    expected[:, 1:] = logp[:, :-1].gather(-1, batch.input_ids[:, 1:, None]).squeeze(-1)
    entropy = torch.zeros(batch.input_ids.shape)
    entropy[:, 1:] = -(logp.exp() * logp).sum(-1)[:, :-1]
    return expected * batch.attention_mask, entropy * batch.attention_mask


def test_logprobs_equal_full_logits_for_any_chunk_size(model_dir: Path) -> None:
    batch = make_batch(size=5)
    trainer = PolicyTrainer(policy(model_dir, logprob_chunk_size=7, micro_batch_size=2))
    chunked, entropy = trainer.logprobs(batch, with_entropy=True)
    expected, expected_entropy = full_logits_logprobs(trainer.lm, batch)
    assert chunked.shape == batch.input_ids.shape and chunked.dtype == torch.float32
    assert torch.all(chunked[:, 0] == 0) and torch.all(chunked[batch.attention_mask == 0] == 0)
    assert torch.allclose(chunked, expected, atol=1e-6, rtol=0)
    assert torch.allclose(entropy, expected_entropy, atol=1e-5, rtol=0)
    for chunk_size in (1, 1000):
        trainer.model.chunk_size = chunk_size
        assert torch.allclose(trainer.logprobs(batch), chunked, atol=1e-6, rtol=0)


def test_right_padding_runs_causal_without_a_mask_other_padding_keeps_it(model_dir: Path) -> None:
    """A right-padded batch (the trainer's layout) is computed without its mask and gives the
    masked call's logprobs; a mask with padding before real tokens is still applied."""
    batch = make_batch(size=6)
    assert right_padded(batch.attention_mask)
    trainer = PolicyTrainer(policy(model_dir))
    expected, _ = full_logits_logprobs(trainer.lm, batch)
    assert torch.allclose(trainer.logprobs(batch), expected, atol=1e-6, rtol=0)

    left = TrainBatch(
        batch.input_ids.flip(-1), batch.attention_mask.flip(-1), batch.loss_mask.flip(-1)
    )
    assert not right_padded(left.attention_mask)
    expected_left, _ = full_logits_logprobs(trainer.lm, left)
    got = trainer.model(left.input_ids, left.attention_mask)[0].detach()
    assert torch.allclose(got, expected_left, atol=1e-6, rtol=0)
    unmasked = trainer.model(left.input_ids, None)[0].detach() * left.attention_mask
    assert not torch.allclose(unmasked, expected_left, atol=1e-3, rtol=0)  # the mask matters


def grads_at_step(trainer: PolicyTrainer) -> dict[str, torch.Tensor]:
    """The gradients the optimizer sees (captured by a step pre-hook)."""
    grads: dict[str, torch.Tensor] = {}
    prefix = "_checkpoint_wrapped_module."
    names = {id(p): n.replace(prefix, "") for n, p in trainer.lm.named_parameters()}

    def capture(optimizer: torch.optim.Optimizer, *_: object) -> None:
        for group in optimizer.param_groups:
            for p in group["params"]:
                grads[names[id(p)]] = p.grad.detach().clone()

    assert trainer.optimizer is not None
    trainer.optimizer.register_step_pre_hook(capture)
    return grads


def test_micro_batches_equal_the_full_batch_step(model_dir: Path) -> None:
    batch = make_batch(size=7)
    full = PolicyTrainer(policy(model_dir, micro_batch_size=7))
    micro = PolicyTrainer(policy(model_dir, micro_batch_size=3))  # 3 + 3 + 1 rows
    full_grads, micro_grads = grads_at_step(full), grads_at_step(micro)
    a, b = full.train(batch, token_nll), micro.train(batch, token_nll)
    assert a["num_tokens"] == b["num_tokens"] == batch.num_tokens
    assert a["tokens_seen"] == pytest.approx(1.0) and b["tokens_seen"] == pytest.approx(1.0)
    assert a["loss"] == pytest.approx(b["loss"], rel=1e-6)
    assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5)
    assert full_grads.keys() == micro_grads.keys() and full_grads
    for name, grad in full_grads.items():
        assert torch.allclose(grad, micro_grads[name], atol=1e-6, rtol=1e-5), name
    for (name, x), (_, y) in zip(full.iter_weights(), micro.iter_weights(), strict=True):
        assert torch.allclose(x, y, atol=1e-6), name


def test_training_lowers_the_loss_and_clips(model_dir: Path) -> None:
    batch = make_batch(size=4)
    trainer = PolicyTrainer(policy(model_dir, micro_batch_size=2))
    losses = [trainer.train(batch, token_nll) for _ in range(4)]
    assert losses[-1]["loss"] < losses[0]["loss"]
    assert trainer.step == 4 and losses[0]["grad_norm"] > 1.0  # clipped to max_grad_norm=1
    # the loss equals the mean NLL of the logprobs before the step
    fresh = PolicyTrainer(policy(model_dir))
    logprobs = fresh.logprobs(batch)
    nll = -(logprobs * batch.loss_mask).sum() / batch.loss_mask.sum()
    assert fresh.train(batch, token_nll)["loss"] == pytest.approx(float(nll), rel=1e-5)


def test_train_hands_entropy_to_the_loss(model_dir: Path) -> None:
    batch = make_batch(size=4)
    trainer = PolicyTrainer(policy(model_dir, micro_batch_size=3))
    _, entropy = trainer.logprobs(batch, with_entropy=True)
    expected = float((entropy * batch.loss_mask).sum() / batch.loss_mask.sum())

    def entropy_bonus(logprobs, micro_batch, num_tokens, num_sequences, entropy):  # type: ignore[no-untyped-def]
        mask = micro_batch.loss_mask
        mean_entropy = (entropy * mask).sum() / num_tokens
        return -mean_entropy, {"entropy": mean_entropy.detach()}

    metrics = trainer.train(batch, entropy_bonus, with_entropy=True)
    assert metrics["entropy"] == pytest.approx(expected, rel=1e-5)
    assert metrics["loss"] == pytest.approx(-expected, rel=1e-5) and metrics["grad_norm"] > 0
    _, after = trainer.logprobs(batch, with_entropy=True)
    assert float((after * batch.loss_mask).sum() / batch.loss_mask.sum()) > expected


def test_activation_checkpointing_keeps_names_and_gradients(model_dir: Path) -> None:
    batch = make_batch(size=3)
    plain = PolicyTrainer(policy(model_dir))
    recomputed = PolicyTrainer(policy(model_dir, activation_checkpointing=True))
    assert plain.weight_metadata() == recomputed.weight_metadata()
    a, b = grads_at_step(plain), grads_at_step(recomputed)
    assert plain.train(batch, token_nll)["loss"] == recomputed.train(batch, token_nll)["loss"]
    for name, grad in a.items():
        assert torch.allclose(grad, b[name], atol=1e-7), name


@pytest.mark.xdist_group("inductor")  # one worker, one after another: Inductor compiles once
def test_compiled_layers_keep_names_and_train_like_eager(model_dir: Path) -> None:
    """policy.compile with checkpointing: the same names, logprobs and gradients as the eager
    trainer (Inductor's fused kernels round differently: 1e-5), and rows of another length, or
    sequences that share a prompt, run the graphs already compiled instead of compiling again."""
    from torch._dynamo.utils import counters

    eager = PolicyTrainer(policy(model_dir, activation_checkpointing=True))
    compiled = PolicyTrainer(policy(model_dir, activation_checkpointing=True, compile=True))
    assert eager.weight_metadata() == compiled.weight_metadata()
    assert list(eager.lm.state_dict()) == list(compiled.lm.state_dict())
    a, b = grads_at_step(eager), grads_at_step(compiled)
    batch = make_batch(size=3)
    assert compiled.train(batch, token_nll)["loss"] == pytest.approx(
        eager.train(batch, token_nll)["loss"], rel=1e-5
    )
    for name, grad in a.items():
        assert torch.allclose(grad, b[name], atol=1e-5), name
    compiled.logprobs(batch)  # the third kind of call: no autograd, inputs without gradients
    graphs = counters["stats"]["unique_graphs"]
    assert graphs > 0
    longer = make_batch(seed=1, size=5, width=19)
    assert torch.allclose(compiled.logprobs(longer), eager.logprobs(longer), atol=1e-5)
    assert compiled.train(longer, token_nll)["loss"] == pytest.approx(
        eager.train(longer, token_nll)["loss"], rel=1e-5
    )
    assert counters["stats"]["unique_graphs"] == graphs
    # GRPO's groups: one long prompt, short completions, where the eager trainer computes the
    # prompt once under a mask; the compiled layers run them padded, as every other batch
    shared = prompt_group(prompt=14, completions=[2, 3, 1, 3])
    assert any(mb.packed is not None for mb, _ in eager._micro_batches(shared))
    assert all(mb.packed is None for mb, _ in compiled._micro_batches(shared))
    assert compiled.train(shared, token_nll)["loss"] == pytest.approx(
        eager.train(shared, token_nll)["loss"], rel=1e-5
    )
    assert counters["stats"]["unique_graphs"] == graphs


@pytest.mark.xdist_group("inductor")
def test_a_compiled_trainer_reports_the_graphs_each_step_built(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``compile/graphs`` and ``compile/seconds`` of a step: the first builds the graphs, a
    step of other lengths builds none, and one with a form of call not seen before builds
    more: a micro-batch of one row (torch specialises sizes of 1) or another intra-op thread
    count (torch's guards check it). With torch's limit of graphs lowered to 2, the third is
    built too (``COMPILE_FORMS``: a policy with a reference and one-row micro-batches
    builds 8, torch's default limit, past which a form would run eagerly)."""
    from tandem.cluster.actors import TrainerWorker, intra_op_threads
    from tandem.config.models import GenerationConfig, RefitConfig

    monkeypatch.setattr(torch._dynamo.config, "recompile_limit", 2)
    config = policy(write_tiny_qwen2(tmp_path, tied=True), compile=True)
    worker = TrainerWorker(config, RefitConfig(transport="colocated"), GenerationConfig())
    torch._dynamo.reset()  # graphs earlier tests built would serve this one
    first = worker.train(make_batch(size=3), token_nll)
    assert first["compile/graphs"] > 0 and first["compile/seconds"] > 0
    again = worker.train(make_batch(seed=1, size=5, width=19), token_nll)
    assert again["compile/graphs"] == 0 and again["compile/seconds"] == 0
    one_row = worker.train(make_batch(seed=2, size=1), token_nll)
    assert one_row["compile/graphs"] > 0 and one_row["compile/seconds"] > 0
    assert worker.train(make_batch(seed=3, size=1, width=7), token_nll)["compile/graphs"] == 0
    with intra_op_threads(torch.get_num_threads() + 1):
        other = worker.train(make_batch(seed=4, size=3), token_nll)
    assert other["compile/graphs"] > 0 and other["compile/seconds"] > 0
    steps = (first, again, one_row, other)
    assert sum(step["compile/graphs"] for step in steps) > 2  # past the lowered limit


def prompt_group(prompt: int, completions: list[int]) -> TrainBatch:
    """Sequences that start with one ``prompt``-token prompt, right-padded, the loss on their
    own tokens."""
    width = prompt + max(completions)
    generator = torch.Generator().manual_seed(2)
    ids = torch.randint(1, 50, (len(completions), width), generator=generator)
    ids[:, :prompt] = ids[0, :prompt]
    lengths = torch.tensor([prompt + n for n in completions])
    attention = (torch.arange(width)[None] < lengths[:, None]).long()
    loss_mask = attention.float()
    loss_mask[:, :prompt] = 0
    return TrainBatch(ids * attention, attention, loss_mask)


def test_iter_weights_round_trip_into_a_fresh_hf_model(model_dir: Path) -> None:
    trainer = PolicyTrainer(policy(model_dir))
    trainer.train(make_batch(), token_nll)
    weights = dict(trainer.iter_weights())
    metadata = trainer.weight_metadata(torch.bfloat16)
    assert [(n, s) for n, s, _ in metadata] == [(n, tuple(t.shape)) for n, t in weights.items()]
    assert all(dtype == torch.bfloat16 for _, _, dtype in metadata)
    assert all(t.dtype == torch.bfloat16 for _, t in trainer.iter_weights(torch.bfloat16))
    config = transformers.AutoConfig.from_pretrained(model_dir)
    fresh = transformers.Qwen2ForCausalLM(config)
    result = fresh.load_state_dict(weights, strict=False)
    tied = config.tie_word_embeddings
    assert ("lm_head.weight" in weights) is not tied
    assert result.missing_keys == (["lm_head.weight"] if tied else [])
    assert not result.unexpected_keys
    fresh_state = fresh.state_dict()
    for name, tensor in trainer.lm.state_dict().items():
        assert torch.equal(fresh_state[name], tensor), name


def test_frozen_trainer_refuses_to_train(model_dir: Path) -> None:
    frozen = PolicyTrainer(policy(model_dir), trainable=False)
    assert all(not p.requires_grad for p in frozen.model.parameters())
    with pytest.raises(ValueError, match="trainable=False"):
        frozen.train(make_batch(), token_nll)


def test_schedules() -> None:
    def lrs(total: int | None = 10, **kwargs: object) -> list[float]:
        factor = lr_factor(OptimizerConfig(**kwargs), total)  # type: ignore[arg-type]
        return [factor(step) for step in range(12)]

    assert lrs(warmup_steps=4)[:5] == [0.25, 0.5, 0.75, 1.0, 1.0]
    cosine = lrs(warmup_steps=2, schedule="cosine", min_lr_ratio=0.1)
    assert cosine[2] == 1.0 and cosine[6] == pytest.approx(0.55) and cosine[10:] == [0.1, 0.1]
    linear = lrs(schedule="linear")
    assert linear[5] == pytest.approx(0.5) and linear[10] == 0.0
    assert lrs(None, schedule="linear", total_steps=20)[10] == pytest.approx(0.5)
    with pytest.raises(ValueError, match="total_steps"):
        lrs(None, schedule="cosine")


class _ValueReads(TorchDispatchMode):
    """Records where tandem's own code reads tensor values on the host (``.item()``, ``bool``,
    a boolean index): on a GPU each waits for the device's queue to drain."""

    READS = ("aten._local_scalar_dense", "aten.nonzero")

    def __init__(self) -> None:
        super().__init__()
        self.sites: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        boolean_index = str(func.overloadpacket) == "aten.index" and any(
            t is not None and t.dtype == torch.bool for t in args[1]
        )
        if str(func.overloadpacket) in self.READS or boolean_index:
            # the innermost caller outside torch (transformers' own reads are not ours)
            frames = [f for f in traceback.extract_stack()[:-1] if "/torch/" not in f.filename]
            innermost = frames[-1]
            if "/src/tandem/" in innermost.filename:
                self.sites.append(f"{innermost.name}:{innermost.lineno}")
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("packing", [False, True], ids=["padded", "packed"])
def test_micro_batch_loop_reads_no_device_values(model_dir: Path, packing: bool) -> None:
    trainer = PolicyTrainer(policy(model_dir, micro_batch_size=3, packing=packing))
    batch = make_batch(size=7)
    placed = [trainer._on_device(mb) for mb, _ in trainer._micro_batches(batch)]
    assert any(p.mb.packed is not None for p in placed) == packing
    num_tokens = float(batch.num_tokens)
    with _ValueReads() as reads:
        sums = trainer._accumulate(placed, token_nll, num_tokens, 7.0, False)
    assert reads.sites == []
    assert set(sums) == {"loss", "tokens_seen"}
