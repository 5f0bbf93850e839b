"""Adapter refits of a many-layer LoRA policy (28 layers, adapters on all 7 projections: 392
tensors) on CPU: a handful of kernels however many tensors, the same values as the per-tensor
stream, and a transformers generator that then generates as one loaded from the merged weights.

Kernels are counted at the dispatcher (``bench/aten_calls.py``): every aten call that reads or
writes tensor data, which a GPU launches as (at least) one kernel; views and allocations are
left out."""

from __future__ import annotations

import sys
import threading
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
from lora_support import MERGED_ATOL, PROMPTS, encode, lora_policy, train_batch

from tandem.algorithms.losses import nll_loss
from tandem.assets import write_random_qwen2
from tandem.cluster.actors import GeneratorWorker, TrainerWorker
from tandem.cluster.groups import InlineGroup
from tandem.cluster.refit import CopyRefit
from tandem.config.models import GenerationConfig, RefitConfig
from tandem.generation import SamplingParams
from tandem.tensors import span
from tandem.tensors.packed import PackedStream
from tandem.tensors.storage_offload import StorageOffload
from tandem.trainer import PolicyTrainer

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from aten_calls import AtenCalls

SHAPE = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=28,
    num_attention_heads=2,
    num_key_value_heads=1,
)
NUM_ADAPTERS = 28 * 7 * 2
SCALED = Counter({"copy_": 1, "mul": 1})
"""The trainer's scaled copy, whatever the number of adapters: every A copied in one call, every
B (laid out after them) multiplied by alpha / rank in another, each casting as it writes."""


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_random_qwen2(tmp_path_factory.mktemp("lora") / "model", SHAPE)


def _policy(model: Path, **lora: Any) -> Any:
    return lora_policy(rank=8, **lora).model_copy(update={"model_path": model})


def _workers(model: Path, dtype: str = "float32") -> tuple[TrainerWorker, GeneratorWorker]:
    generation = GenerationConfig(backend="hf", dtype=dtype)  # type: ignore[arg-type]
    refit = RefitConfig(transport="colocated", lora="adapter")
    trainer = TrainerWorker(_policy(model), refit, generation)
    return trainer, GeneratorWorker(generation, str(model))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_an_adapter_refit_of_392_tensors_is_a_handful_of_kernels(model: Path, dtype: str) -> None:
    """The trainer copies its A's in one call and scales its B's in one (casting as they
    write), straight into the generator's layers: where a copy and a multiply per tensor took
    588 calls (980 with the cast), and a copy into a tensor of its own and another into the
    generator took 3."""
    trainer, generator = _workers(model, dtype)
    generator.load_weights(trainer.weight_stream(), 1)  # the first injects peft's layers
    trainer.train(train_batch(), nll_loss)
    sent = dict(trainer.weight_stream())
    assert len(sent) == NUM_ADAPTERS
    with AtenCalls() as kernels:
        generator.load_weights(trainer.weight_stream(), 2)
    assert kernels.calls == SCALED
    loaded = generator.generator.adapter  # type: ignore[attr-defined]
    for name, tensor in sent.items():
        assert torch.equal(loaded._params[name], tensor), name
    assert span(list(loaded._params.values())) is not None  # laid out in the stream's order


def test_the_in_process_runtimes_refit_copies_the_packed_adapters_at_once(model: Path) -> None:
    """The in-process runtime's refit (``CopyRefit``) hands the generator the trainer's packed
    stream as it is (counting its bytes): re-yielded tensor by tensor it took a data call more
    and a view, a name and a lookup per tensor on each side (0.85 against 0.18 ms a refit of
    these 392 adapters on a CPU)."""
    trainer, generator = _workers(model)
    received: list[Any] = []
    load = generator.load_weights
    generator.load_weights = lambda stream, version=None: (  # type: ignore[method-assign]
        received.append(stream),
        load(stream, version),
    )
    trainers, generators = InlineGroup([trainer], "trainer"), InlineGroup([generator], "generator")
    refit = CopyRefit()
    refit.send(trainers, generators, 1, wait_generators=True)  # the first injects peft's layers
    trainer.train(train_batch(), nll_loss)
    with AtenCalls() as kernels:
        stats = refit.send(trainers, generators, 2, wait_generators=True)
    assert kernels.calls == SCALED
    assert all(isinstance(stream, PackedStream) for stream in received)
    sent = dict(trainer.weight_stream())
    assert stats["bytes"] == sum(t.numel() * t.element_size() for t in sent.values())
    loaded = generator.generator.adapter  # type: ignore[attr-defined]
    for name, tensor in sent.items():
        assert torch.equal(loaded._params[name], tensor), name


def test_an_adapter_refit_through_the_colocated_transport_packs_and_lands_in_one_copy(
    model: Path,
) -> None:
    """Through the transport (shared memory here, CUDA IPC on a GPU) the sender packs the
    adapters into its bucket in one copy and the generator takes them out in one. Before: a
    multiply per B and a pack per tensor (588 calls), and a fused copy into 392 separate
    tensors (one call, several launches on a GPU)."""
    trainer, generator = _workers(model)
    for version in (1, 2):  # the first injects peft's layers
        trainer.train(train_batch(), nll_loss)
        spec = trainer.prepare_refit()
        sent = AtenCalls()

        def send(counter: AtenCalls = sent) -> None:
            with counter:  # dispatch modes are per thread
                trainer.send_weights()

        sender = threading.Thread(target=send)
        sender.start()
        with AtenCalls() as received:
            generator.receive_weights(spec, version)
        sender.join(timeout=60)
        assert not sender.is_alive()
    assert sent.calls == SCALED + Counter({"copy_": 1})
    assert received.calls == Counter({"copy_": 1})
    loaded = generator.generator.adapter  # type: ignore[attr-defined]
    for name, tensor in trainer.weight_stream():
        assert torch.equal(loaded._params[name], tensor), name


@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
def test_the_scaled_copy_is_the_per_tensor_stream_bit_for_bit(
    model: Path, dtype: torch.dtype | None
) -> None:
    """``Adapters.scaled_copy`` gives what scaling and casting each tensor gives; a parameter
    moved out of the layout sends the refit through the per-tensor stream, with the same
    values."""
    trainer = PolicyTrainer(_policy(model))
    trainer.train(train_batch(), nll_loss)
    adapters = trainer.adapters
    assert adapters is not None and len(adapters.names) == NUM_ADAPTERS
    copied = adapters.scaled_copy(trainer.device, dtype)
    assert copied is not None
    each = list(adapters.tensors(lambda t: t, scaled=True, dtype=dtype))
    assert [name for name, _ in copied] == [name for name, _ in each]
    for (name, got), (_, want) in zip(copied, each, strict=True):
        assert got.dtype == want.dtype and torch.equal(got, want), name
    assert any(not torch.equal(t, 0 * t) for name, t in copied if "lora_B" in name)
    # one parameter moved to an allocation of its own (as peft's own layers hold them)
    moved = adapters.params[5]
    torch.utils.swap_tensors(moved, torch.nn.Parameter(moved.detach().clone()))
    assert adapters.scaled_copy(trainer.device, dtype) is None
    streamed = list(trainer.iter_adapter(dtype))
    for (name, got), (_, want) in zip(streamed, each, strict=True):
        assert torch.equal(got, want), name


def test_an_onload_lays_the_adapters_out_in_the_streams_order(model: Path) -> None:
    """Every A, then every B (the stream's order, in which the scaled copy is one copy and one
    multiply), ahead of the frozen base, whatever the model's own order (A, B per layer)."""
    from tandem.trainer.offload import _parameters, layout_order

    trainer = PolicyTrainer(_policy(model))
    adapters = trainer.adapters
    assert adapters is not None
    names = adapters.names
    assert all("lora_A" in n for n in names[: len(names) // 2])
    assert all("lora_B" in n for n in names[len(names) // 2 :])
    model_order = list(_parameters(trainer.model))
    trainable = [id(p) for p in model_order if p.requires_grad]
    assert sorted(trainable) == sorted(id(p) for p in adapters.params)
    assert trainable != [id(p) for p in adapters.params]  # the model's order is A, B per layer
    ordered = layout_order(model_order, adapters.params)
    assert [id(p) for p in ordered[: len(adapters.params)]] == [id(p) for p in adapters.params]
    assert not any(p.requires_grad for p in ordered[len(adapters.params) :])
    assert layout_order(model_order) == sorted(model_order, key=lambda p: not p.requires_grad)


def test_an_adapter_refit_generates_as_the_merged_weights_do(model: Path, tmp_path: Path) -> None:
    """A generator refitted with the adapters and one loaded from the merged export sample the
    same tokens (seeded) with logprobs within the merged rounding (``MERGED_ATOL``)."""
    trainer, adapted = _workers(model)
    for _ in range(2):
        trainer.train(train_batch(), nll_loss)
    adapted.load_weights(trainer.weight_stream(), 1)
    trainer.export_hf(str(tmp_path / "merged"), merged=True)
    merged = GeneratorWorker(GenerationConfig(backend="hf"), str(tmp_path / "merged"))
    base = GeneratorWorker(GenerationConfig(backend="hf"), str(model))
    prompts = [encode(p) for p in PROMPTS]
    sampling = SamplingParams(temperature=1.0, max_tokens=6, n=2, seed=3)
    ours, theirs, before = (g.generate(prompts, sampling) for g in (adapted, merged, base))
    assert [r.response_token_ids for r in ours] == [r.response_token_ids for r in theirs]
    gaps = [
        abs(a - b)
        for x, y in zip(ours, theirs, strict=True)
        for a, b in zip(x.response_logprobs, y.response_logprobs, strict=True)
    ]
    assert max(gaps) <= MERGED_ATOL
    # the adapters do move the model: other tokens, or the same ones at other logprobs
    assert any(
        x.response_token_ids != y.response_token_ids
        or max(abs(a - b) for a, b in zip(x.response_logprobs, y.response_logprobs, strict=True))
        > 1e-3
        for x, y in zip(ours, before, strict=True)
    )


def test_a_packed_stream_is_checked_once_and_a_stream_laid_out_otherwise_still_lands(
    model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In one process the trainer's stream is a ``PackedStream``: the generator checks its
    layout against its own adapters once (one ``span`` walk over the 392 tensors), then has
    every later refit written into them at once, also after its adapters' storage moved (a
    sleep and wake: new addresses, the same layout); a stream of the same tensors laid out
    with gaps is not copied at once and still lands, tensor by tensor."""
    from tandem.tensors import packed
    from tandem.tensors.packed import PackedStream, layout_of

    walks: list[int] = []

    def counted(tensors: Any) -> Any:
        walks.append(len(tensors))
        return span(tensors)

    monkeypatch.setattr(packed, "span", counted)
    trainer, generator = _workers(model)
    generator.load_weights(trainer.weight_stream(), 1)  # injects peft's layers
    loaded = generator.generator.adapter  # type: ignore[attr-defined]
    first = next(iter(loaded._params.values()))
    for version in (2, 3, 4):
        if version == 4:  # the generator's adapters move, as a sleep and wake moves them
            moved = StorageOffload(list(loaded._params.values()), torch.device("cpu"))
            moved.offload()
            blocker = torch.empty(first.untyped_storage().nbytes() // 4 + 1)  # takes the old place
            before = first.data_ptr()
            moved.onload()
            assert first.data_ptr() != before
            del blocker
        trainer.train(train_batch(), nll_loss)
        stream = trainer.weight_stream()
        assert isinstance(stream, PackedStream)
        with AtenCalls() as kernels:
            generator.load_weights(stream, version)
        assert kernels.calls == SCALED
        for name, tensor in stream:
            assert torch.equal(loaded._params[name], tensor), name
    assert len(walks) == 1
    assert isinstance(stream, PackedStream)
    views = dict(stream)
    names = stream.names  # the same order, 3 elements apart: another layout
    tensors = [2 * views[n] for n in names]
    offsets = [0]
    for tensor in tensors[:-1]:
        offsets.append(offsets[-1] + tensor.numel() + 3)
    flat = torch.zeros(offsets[-1] + tensors[-1].numel())
    for tensor, at in zip(tensors, offsets, strict=True):
        flat[at : at + tensor.numel()] = tensor.flatten()
    generator.load_weights(PackedStream.of(names, layout_of(tensors, offsets), flat), 5)
    assert len(walks) == 2  # checked, and found laid out otherwise
    for name, tensor in zip(names, tensors, strict=True):
        assert torch.equal(loaded._params[name], tensor), name
