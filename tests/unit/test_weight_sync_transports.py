"""Colocated and split refit end to end: the sender here, receivers in spawned processes."""

from __future__ import annotations

import contextlib
import gc
import glob
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp

from tandem import rendezvous
from tandem.config.models import RefitConfig
from tandem.tensors import TargetRuns
from tandem.weight_sync import (
    RefitError,
    bucket_bytes_for,
    make_receiver,
    make_sender,
    metadata_of,
)
from tandem.weight_sync.buckets import flat_bytes
from tandem.weight_sync.signals import connect_store, wait_signals

BUCKET_BYTES = 2**16
TIMEOUT_S = 4.0


def random_state_dict(seed: int) -> dict[str, torch.Tensor]:
    """~20 tensors of mixed dtypes spanning several 64 KiB buckets (one split across three)."""
    gen = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {
        "embed.weight": torch.randn(400, 100, generator=gen).to(torch.bfloat16),  # 80 KB: split
    }
    for layer in range(4):
        prefix = f"layers.{layer}."
        tensors[prefix + "q.weight"] = torch.randn(64, 96, generator=gen)
        tensors[prefix + "q.weight_fp8"] = torch.randint(
            0, 256, (96, 64), generator=gen, dtype=torch.uint8
        ).view(torch.float8_e4m3fn)
        tensors[prefix + "q.scale"] = torch.rand((), generator=gen)
        tensors[prefix + "norm.weight"] = torch.randn(96, generator=gen).to(torch.bfloat16)
    tensors["step"] = torch.tensor(seed * 10**12, dtype=torch.int64)
    tensors["head.weight"] = torch.randn(200, 90, generator=gen)  # 72 KB: split
    return tensors


def _receiver_main(rank: int, transport_specs: Any, results: Any, die_after: int) -> None:
    """Receive refits until None; report (rank, refit_id, count, mismatches) per refit."""
    results.put(("ready", rank))
    while (spec := transport_specs.get()) is not None:
        try:
            expected = random_state_dict(spec.refit_id)
            count, mismatches = 0, []
            for name, tensor in make_receiver(spec, "cpu", rank).iter_weights():
                ref = expected[name]
                same = tensor.shape == ref.shape and tensor.dtype == ref.dtype
                if not (same and torch.equal(flat_bytes(tensor), flat_bytes(ref))):
                    mismatches.append(name)
                count += 1
                if count == die_after:
                    os._exit(3)  # a generator worker crashing mid-refit
            results.put((rank, spec.refit_id, count, mismatches))
        except Exception as error:  # report, so the test fails with the cause
            results.put((rank, spec.refit_id, -1, [repr(error)]))


def _leftover_shm() -> list[str]:
    return glob.glob(f"/dev/shm/tandem-refit-{os.getpid()}-*")


@pytest.fixture(autouse=True)
def _own_leftovers_only() -> Iterator[None]:
    """Each test starts with no refit file of this process: one that failed and left its file
    fails alone, not every test after it."""
    for path in _leftover_shm():
        os.unlink(path)
    yield


class Receivers:
    """Spawned receiver processes fed one spec per refit."""

    def __init__(self, num: int, die_after: int = 0) -> None:
        ctx = mp.get_context("spawn")
        self.results = ctx.Queue()
        self.queues = [ctx.Queue() for _ in range(num)]
        self.procs = [
            ctx.Process(target=_receiver_main, args=(rank, q, self.results, die_after))
            for rank, q in enumerate(self.queues, start=1)
        ]
        for proc in self.procs:
            proc.start()
        # Spawning imports torch (seconds here): not part of the refit timeouts under test.
        assert sorted(self.results.get(timeout=60) for _ in self.procs) == [
            ("ready", rank) for rank in range(1, num + 1)
        ]

    def refit(self, sender: Any) -> list[tuple]:
        state = random_state_dict(sender._refit_id + 1)
        spec = sender.prepare(metadata_of(state.items()))
        for q in self.queues:
            q.put(spec)
        stats = sender.send(iter(state.items()))
        assert stats.num_buckets == len(spec.plan.buckets) >= 5
        assert stats.num_bytes == sum(t.numel() * t.element_size() for t in state.values())
        return [self.results.get(timeout=30) for _ in self.queues]

    def close(self) -> None:
        for q in self.queues:
            q.put(None)
        for proc in self.procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()


def _sender(transport: str, num_receivers: int = 1) -> Any:
    config = RefitConfig(transport=transport, bucket_bytes=BUCKET_BYTES)  # type: ignore[arg-type]
    return make_sender(config, "cpu", num_receivers=num_receivers, timeout_s=TIMEOUT_S)


@pytest.mark.parametrize(("transport", "num_receivers"), [("colocated", 1), ("split", 2)])
def test_two_refits_bit_exact(transport: str, num_receivers: int) -> None:
    sender = _sender(transport, num_receivers)
    receivers = Receivers(num_receivers)
    try:
        num_tensors = len(random_state_dict(0))
        keys = []
        for refit_id in (1, 2):  # the second refit reuses the cached store / process group
            reports = sorted(receivers.refit(sender))
            assert reports == [(r, refit_id, num_tensors, []) for r in range(1, num_receivers + 1)]
            assert _leftover_shm() == []
            keys.append(sender._store.num_keys())
        assert keys[0] == keys[1]  # a refit leaves no signal behind in the store
    finally:
        receivers.close()
        sender.close()


@pytest.mark.parametrize("transport", ["colocated", "split"])
def test_receiver_dying_mid_refit_fails_the_sender(transport: str) -> None:
    sender = _sender(transport)
    receivers = Receivers(1, die_after=6)
    try:
        start = time.monotonic()
        with pytest.raises(RefitError, match=r"died|aborted|failed|timed out"):
            receivers.refit(sender)
        assert time.monotonic() - start < 3 * TIMEOUT_S
        assert _leftover_shm() == []
    finally:
        receivers.close()


def _send_in_thread(sender: Any, stream: Any = None) -> tuple[threading.Thread, dict]:
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["stats"] = sender.send(stream)
        except Exception as error:
            outcome["error"] = error

    thread = threading.Thread(target=run)
    thread.start()
    return thread, outcome


def test_a_sender_on_the_port_of_a_gone_one_gets_a_new_client() -> None:
    """The kernel gives a new sender's store the port of one closed before it (a restarted
    trainer; earlier tests in this process): a receiver connects afresh instead of reusing the
    cached client of the gone server, and waiting on that client fails with a RefitError."""
    port = rendezvous.free_port("127.0.0.1")
    server = rendezvous.serve("127.0.0.1", port, None, TIMEOUT_S)
    gone = connect_store("127.0.0.1", port, "first", TIMEOUT_S)
    server.set("ready", "1")
    assert wait_signals(gone, ["ready"], TIMEOUT_S, "the trainer") == [b"1"]
    del server
    gc.collect()
    start = time.monotonic()
    with pytest.raises(RefitError, match="lost the sender's store while waiting for the trainer"):
        wait_signals(gone, ["ready"], TIMEOUT_S, "the trainer")
    assert time.monotonic() - start < TIMEOUT_S  # a closed connection, not a timeout
    server = rendezvous.serve("127.0.0.1", port, None, TIMEOUT_S)
    client = connect_store("127.0.0.1", port, "second", TIMEOUT_S)
    server.set("ready", "2")
    assert client is not gone
    assert wait_signals(client, ["ready"], TIMEOUT_S, "the trainer") == [b"2"]
    assert connect_store("127.0.0.1", port, "second", TIMEOUT_S) is client  # cached


def test_wrong_stream_fails_both_sides_without_leftovers() -> None:
    sender = _sender("colocated")
    state = random_state_dict(0)
    spec = sender.prepare(metadata_of(state.items()))
    assert len(_leftover_shm()) == 1  # one file, both slots: it exists until the receiver attaches
    stream = ((("oops" if n == "layers.1.q.scale" else n), t) for n, t in state.items())
    thread, outcome = _send_in_thread(sender, stream)
    with pytest.raises(RefitError, match=r"expects 'layers\.1\.q\.scale'"):
        for _ in make_receiver(spec, "cpu").iter_weights():
            pass
    thread.join(timeout=30)
    assert isinstance(outcome["error"], ValueError)
    assert _leftover_shm() == []


KILLED_SENDER = """
import os, signal
from tandem import rendezvous
from tandem.config.models import RefitConfig
from tandem.weight_sync import make_sender, metadata_of
import torch
sender = make_sender(RefitConfig(transport="colocated"), "cpu", timeout_s=4.0)
sender.prepare(metadata_of([("w", torch.zeros(64, 64))]))  # the file exists until attached
print(sender._prepared[0]._path, flush=True)
os.kill(os.getpid(), signal.SIGKILL)  # no finalizer runs: the file stays
"""


def test_the_next_sender_removes_the_file_of_a_killed_one() -> None:
    """A trainer killed before its generators attached (a generator died first) leaves its
    refit file in /dev/shm; a later sender on the host removes it once it is older than the
    refit timeout, and never a live sender's."""
    killed = subprocess.run(
        [sys.executable, "-c", KILLED_SENDER], capture_output=True, text=True, timeout=120
    )
    assert killed.returncode == -9, killed.stderr[-2000:]
    orphan = killed.stdout.strip()
    _sender("colocated")
    assert os.path.exists(orphan)  # younger than a refit's timeout: its receivers may still come
    an_hour_ago = time.time() - 3600
    os.utime(orphan, (an_hour_ago, an_hour_ago))
    live = _sender("colocated")
    live.prepare(metadata_of(random_state_dict(1).items()))
    (ours,) = _leftover_shm()
    assert not os.path.exists(orphan)  # removed when the live sender was created
    _sender("colocated")  # another sender in a live process leaves ours alone
    assert _leftover_shm() == [ours]
    live._prepared[0].close()
    assert _leftover_shm() == []


def test_consumer_stopping_early_fails_the_sender_fast() -> None:
    sender = _sender("colocated")
    state = random_state_dict(0)
    spec = sender.prepare(metadata_of(state.items()))
    thread, outcome = _send_in_thread(sender, iter(state.items()))
    start = time.monotonic()
    weights = make_receiver(spec, "cpu").iter_weights()
    next(weights)
    weights.close()  # the consumer gives up after one tensor
    thread.join(timeout=30)
    assert isinstance(outcome["error"], RefitError), outcome
    assert time.monotonic() - start < TIMEOUT_S  # signalled, not timed out
    assert _leftover_shm() == []


def test_live_tensors_given_to_prepare_are_sent_without_a_stream() -> None:
    """``prepare(metadata, live_tensors)`` names what ``send()`` sends; on the CPU they are
    packed (nothing is read in place)."""
    sender = _sender("colocated")
    state = random_state_dict(0)
    spec = sender.prepare(metadata_of(state.items()), live_tensors=state.values())
    assert spec.runs == ()
    thread, outcome = _send_in_thread(sender)
    targets = [torch.zeros_like(t) for t in state.values()]
    make_receiver(spec, "cpu").copy_into(targets)
    thread.join(timeout=30)
    assert outcome["stats"].in_place_bytes == 0 and outcome["stats"].num_bytes > 0
    for target, tensor in zip(targets, state.values(), strict=True):
        assert torch.equal(flat_bytes(target), flat_bytes(tensor))
    assert _leftover_shm() == []


def test_a_live_tensor_moved_after_prepare_fails_both_sides() -> None:
    """A live tensor that moved between ``prepare()`` and ``send()`` (an onload in between)
    fails the sender before it announces anything, and the receiver through the abort; the
    next refit lands. A stream next to live tensors, or none without them, fails too."""
    sender = _sender("colocated")
    state = random_state_dict(0)
    spec = sender.prepare(metadata_of(state.items()), live_tensors=state.values())
    moved = state["layers.2.q.weight"]
    torch.utils.swap_tensors(moved, moved.clone())  # same object, new memory
    thread, outcome = _send_in_thread(sender)
    start = time.monotonic()
    with pytest.raises(RefitError, match=r"'layers\.2\.q\.weight'.*not where prepare\(\) found"):
        make_receiver(spec, "cpu").copy_into([torch.zeros_like(t) for t in state.values()])
    thread.join(timeout=30)
    assert isinstance(outcome["error"], ValueError), outcome
    assert time.monotonic() - start < TIMEOUT_S  # signalled, not timed out
    for live, stream in ((state.values(), iter(state.items())), ((), None)):
        spec = sender.prepare(metadata_of(state.items()), live_tensors=live)
        thread, outcome = _send_in_thread(sender, stream)
        with pytest.raises(RefitError, match="send"):
            list(make_receiver(spec, "cpu").iter_weights())
        thread.join(timeout=30)
        assert isinstance(outcome["error"], ValueError), outcome
    spec = sender.prepare(metadata_of(state.items()), live_tensors=state.values())
    thread, outcome = _send_in_thread(sender)
    names = [name for name, _ in make_receiver(spec, "cpu").iter_weights()]
    thread.join(timeout=30)
    assert "stats" in outcome and names == list(state)
    assert _leftover_shm() == []
    with pytest.raises(ValueError, match="live_tensors for metadata"):
        sender.prepare(metadata_of(state.items()), live_tensors=list(state.values())[:3])


def test_copy_into_lands_every_tensor_and_names_a_wrong_target() -> None:
    """``copy_into`` fills the targets bit-exact; a target of the wrong shape fails the
    receiver with the tensor's name, and the sender fast (not by timeout)."""
    sender = _sender("colocated")
    state = random_state_dict(0)
    spec = sender.prepare(metadata_of(state.items()))
    thread, outcome = _send_in_thread(sender, iter(state.items()))
    targets = [torch.zeros_like(t) for t in state.values()]
    assert make_receiver(spec, "cpu").copy_into(targets) >= len(spec.plan.buckets)
    thread.join(timeout=30)
    for target, tensor in zip(targets, state.values(), strict=True):
        assert torch.equal(flat_bytes(target), flat_bytes(tensor))
    spec = sender.prepare(metadata_of(state.items()))
    thread, outcome = _send_in_thread(sender, iter(state.items()))
    start = time.monotonic()
    targets[5] = torch.zeros(3)
    with pytest.raises(ValueError, match=r"'layers\.1\.q\.weight' is \(3,\)"):
        make_receiver(spec, "cpu").copy_into(targets)
    thread.join(timeout=30)
    assert isinstance(outcome["error"], RefitError), outcome
    assert time.monotonic() - start < TIMEOUT_S
    spec = sender.prepare(metadata_of(state.items()))
    thread, outcome = _send_in_thread(sender, iter(state.items()))
    with pytest.raises(ValueError, match="2 targets for a refit of"):
        make_receiver(spec, "cpu").copy_into(targets[:2])
    thread.join(timeout=30)
    assert isinstance(outcome["error"], RefitError), outcome
    assert _leftover_shm() == []
    with pytest.raises(RefitError, match="stale spec"):  # that refit is over: nothing to map
        make_receiver(spec, "cpu").copy_into(targets)
    assert _leftover_shm() == []


def test_a_receiver_attaching_as_the_sender_aborts_leaves_no_file() -> None:
    """The sender's abort (here: no stream) unlinks the refit's file at any moment of a
    receiver's attach, also between its finding the file and mapping it: the receiver fails
    with a RefitError and never creates the file anew. The sender starts 0-2 ms after the
    receiver, so the abort lands all over the attach (a leftover in ~2 of 1,000 rounds when the
    receiver created what it mapped)."""
    sender = _sender("colocated")
    state = {"w": torch.zeros(64, 64)}
    leftovers, errors = [], []
    for round_ in range(1000):
        spec = sender.prepare(metadata_of(state.items()))

        def send(delay: float = (round_ % 100) * 2e-5) -> None:
            time.sleep(delay)
            try:
                sender.send()
            except ValueError as error:
                errors.append(error)

        thread = threading.Thread(target=send)
        thread.start()
        with contextlib.suppress(RefitError):
            list(make_receiver(spec, "cpu").iter_weights())
        thread.join(timeout=30)
        leftovers += _leftover_shm()
        for path in _leftover_shm():
            os.unlink(path)
    assert leftovers == []
    assert len(errors) == 1000 and "needs the weight stream" in str(errors[0])


def test_kept_targets_are_checked_once_per_plan() -> None:
    """A ``TargetRuns`` kept across refits (as ``HfGenerator`` keeps its parameters') is checked
    against the first plan and reused for the next with the same key; a stream whose tensors
    changed is checked again, and a target that no longer fits fails both sides."""
    sender = _sender("colocated")
    targets = TargetRuns([torch.zeros_like(t) for t in random_state_dict(0).values()])
    for seed in (1, 2):
        state = random_state_dict(seed)
        spec = sender.prepare(metadata_of(state.items()))
        thread, outcome = _send_in_thread(sender, iter(state.items()))
        make_receiver(spec, "cpu").copy_into(targets)
        thread.join(timeout=30)
        assert "stats" in outcome, outcome
        assert targets.checked == spec.plan.key
        for target, tensor in zip(targets.tensors, state.values(), strict=True):
            assert torch.equal(flat_bytes(target), flat_bytes(tensor))
    state["step"] = torch.zeros(2, dtype=torch.int64)  # a new shape: a new plan key
    spec = sender.prepare(metadata_of(state.items()))
    thread, outcome = _send_in_thread(sender, iter(state.items()))
    with pytest.raises(ValueError, match="refit target of 'step' is"):
        make_receiver(spec, "cpu").copy_into(targets)
    thread.join(timeout=30)
    assert isinstance(outcome["error"], RefitError), outcome
    assert _leftover_shm() == []


def test_prepare_plans_once_per_metadata() -> None:
    """The bucket plan is reused while the metadata stays the same, and made anew when not."""
    sender = _sender("colocated")
    plans = []
    for seed in (0, 1, 2):
        state = random_state_dict(0)
        if seed == 2:  # one tensor changes shape
            state["step"] = torch.zeros(3, dtype=torch.int64)
        spec = sender.prepare(metadata_of(state.items()))
        thread, outcome = _send_in_thread(sender, iter(state.items()))
        names = [name for name, _ in make_receiver(spec, "cpu").iter_weights()]
        thread.join(timeout=30)
        assert "error" not in outcome and names == list(state)
        plans.append(spec.plan)
    assert plans[1] is plans[0] and plans[2] is not plans[0]
    assert plans[2].tensors[-2].shape == (3,)


def test_empty_stream_and_auto_transport() -> None:
    sender = _sender("colocated")
    spec = sender.prepare([])
    thread, outcome = _send_in_thread(sender, iter([]))
    assert list(make_receiver(spec, "cpu").iter_weights()) == []
    thread.join(timeout=30)
    assert outcome["stats"].num_buckets == 0
    with pytest.raises(ValueError, match="placement"):
        make_sender(RefitConfig(), "cpu")
    assert make_sender(RefitConfig(), "cpu", placement="split").transport == "split"
    with pytest.raises(ValueError, match="rank"):
        make_receiver(spec, "cpu", rank=2)


def test_bucket_size_defaults_by_device() -> None:
    unset = RefitConfig(transport="colocated")
    assert make_sender(unset, "cpu").bucket_bytes == 64 * 2**20
    assert bucket_bytes_for(unset, torch.device("cuda", 0)) == 512 * 2**20
    explicit = RefitConfig(transport="colocated", bucket_bytes=2**20)
    assert make_sender(explicit, "cpu").bucket_bytes == 2**20
    assert bucket_bytes_for(explicit, torch.device("cuda", 0)) == 2**20
    with pytest.raises(ValueError, match="bucket_bytes"):
        RefitConfig(bucket_bytes=1024)
