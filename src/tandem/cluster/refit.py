"""How a runtime moves the trainers' weights into its generators: a strategy chosen at launch.

``TransportRefit``: the trainers send their weights through the refit transport (shared memory
or CUDA IPC handles colocated, a process group split) while the generators receive them: two
groups at work at once, so both groups must be concurrent (``Group.concurrent``).
``CopyRefit``: the generator loads the trainer's weight stream directly, one tensor after
another: for workers in this process (``InlineGroup``), where a transport would copy twice.

Either returns the transfer's figures (seconds, bytes, GB/s as the trainer side counts them).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any, Protocol

import torch

from tandem.cluster.groups import Group, get_together
from tandem.tensors.packed import PackedStream


class RefitStrategy(Protocol):
    def send(
        self, trainers: Group, generators: Group, version: int, wait_generators: bool
    ) -> dict[str, float]:
        """The trainers' weights into every generator, labelled ``version``. With
        ``wait_generators=False`` it may return while the generators still load (``settle``
        waits for them)."""
        ...

    def settle(self, generators: Group) -> None:
        """Wait for the generators' side of a refit that did not wait for it; raise its
        failure."""
        ...


class TransportRefit:
    """Metadata once, then buckets through the transport, sender and receivers concurrently."""

    def __init__(self) -> None:
        self._loading: Any = None
        """The generators' pending side of a refit that did not wait for it."""
        self._lock = threading.Lock()  # collect may settle from another thread

    def send(
        self, trainers: Group, generators: Group, version: int, wait_generators: bool
    ) -> dict[str, float]:
        if not (trainers.concurrent and generators.concurrent):
            raise ValueError("a transport refit needs groups whose calls overlap (CopyRefit)")
        spec = trainers.run("prepare_refit")[0]
        sending = trainers.run_async("send_weights")
        receiving = generators.run_async("receive_weights", spec, version)
        if wait_generators:
            sent, _ = get_together([(trainers, sending), (generators, receiving)])
        else:
            sent = self._sent_while_loading(trainers, generators, sending, receiving)
        return dict(sent[0])

    def _sent_while_loading(
        self, trainers: Group, generators: Group, sending: Any, receiving: Any, poll_s: float = 0.25
    ) -> list[Any]:
        """The trainers' send results; the generators' receive stays pending, but a generator
        that fails before the send ends is raised at once."""
        with self._lock:
            self._loading = receiving
        while not trainers.ready(sending, poll_s):
            if generators.ready(receiving, 0.0):
                self.settle(generators)
                break
        return trainers.get(sending)

    def settle(self, generators: Group) -> None:
        with self._lock:
            loading, self._loading = self._loading, None
        if loading is not None:
            generators.get(loading)


class CopyRefit:
    """The generator loads the trainer's ``weight_stream`` (cast and quantised as a transport
    would carry it) tensor by tensor: no buffers, no rendezvous. One trainer and one generator,
    both in this process; it is done when ``send`` returns."""

    def send(
        self, trainers: Group, generators: Group, version: int, wait_generators: bool
    ) -> dict[str, float]:
        if trainers.num_workers != 1 or generators.num_workers != 1:
            raise ValueError("a copy refit takes one trainer and one generator (TransportRefit)")
        counted = [0]

        def stream(tensors: Iterator[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, Any]]:
            for name, tensor in tensors:
                counted[0] += tensor.numel() * tensor.element_size()
                yield name, tensor

        start = time.perf_counter()
        (tensors,) = trainers.run("weight_stream")
        if isinstance(tensors, PackedStream):  # passed on whole: the generator copies it at once
            counted[0] = tensors.nbytes
            generators.run("load_weights", tensors, version)
        else:
            generators.run("load_weights", stream(tensors), version)
        seconds = time.perf_counter() - start
        return {
            "seconds": seconds,
            "bytes": float(counted[0]),
            "gb_per_s": counted[0] / seconds / 1e9 if seconds > 0 else 0.0,
        }

    def settle(self, generators: Group) -> None:
        return None
