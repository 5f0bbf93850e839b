"""What the runtime needs of a group of workers, and groups of plain workers in this process.

``WorkerGroup`` (``worker_group.py``) runs each worker in a Ray actor; ``LocalGroup`` holds plain
worker objects and calls them in threads, so a whole ``Runtime`` (memory phases, refit through
the real transports) runs in one process for tests and tools; ``InlineGroup`` calls them on the
caller's thread (a run in the driver's process). No ray import here.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Sequence
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any, Protocol

from tandem.config.load import ConfigError


class WorkerError(RuntimeError):
    """A worker actor died, or one of its methods raised."""

    def __init__(self, kind: str, rank: int, method: str, message: str):
        self.kind, self.rank, self.method = kind, rank, method
        super().__init__(f"{kind} worker rank {rank} failed in {method}(): {message}")

    @property
    def from_setting(self) -> bool:
        """Whether the worker raised ``ConfigError``: a setting that cannot work, the user's to
        change (``raise ... from`` the worker's exception, or from Ray's error carrying it)."""
        cause = self.__cause__
        return isinstance(getattr(cause, "cause", None) or cause, ConfigError)


OUT_OF_MEMORY_FIX = {
    "trainer": "lower policy.micro_batch_size or policy.max_tokens_per_micro_batch, or set "
    "policy.activation_checkpointing=true",
    "generator": "lower algorithm.prompts_per_step or generation.sampling.max_tokens (vLLM: "
    "generation.gpu_memory_utilization)",
}
"""What to change when a worker of a kind runs out of device or host memory."""


HOST_ALLOCATION = re.compile(
    r"DefaultCPUAllocator: can't allocate memory: you tried to allocate (\d+) bytes"
)
"""How torch says that an allocation in host memory failed (a plain RuntimeError)."""


def failure_message(kind: str, cause: BaseException, remote: str | None = None) -> str:
    """What a ``WorkerError`` says of a method that raised ``cause`` (``remote``: the worker's
    traceback, kept for a failure nobody can fix from the config). Running out of device or
    host memory is a setting's doing: its message says what the worker tried to allocate and
    which settings to change, without the traceback."""
    if isinstance(cause, ConfigError):  # a setting's doing, and its message names it
        return str(cause)
    detail = f"{type(cause).__name__}: {cause}"
    fix = OUT_OF_MEMORY_FIX.get(kind, "give it less work at once")
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(cause, torch.OutOfMemoryError):
        tried = ". ".join(str(cause).split(". ")[:2]).rstrip(".")
        return (
            f"out of device memory ({tried}): {fix}; with cluster.memory_phases=false the "
            "trainers and generators hold the device at once (true lets them take turns)"
        )
    host = HOST_ALLOCATION.search(str(cause)) if isinstance(cause, RuntimeError) else None
    if host is not None:
        return f"out of host memory (tried to allocate {int(host[1]) / 2**30:,.2f} GiB): {fix}"
    return detail if remote is None else f"{detail}\n{remote}"


class Group(Protocol):
    """N workers of one kind; ``run*`` call a method on every rank (``per_rank``: with its own
    arguments) and return the results in rank order; ``run_async`` / ``run_per_rank_async``
    start a call and ``get`` returns its results. Where ``concurrent``, ``run_async`` returns
    before the call ends, so two groups work at once (a transport refit's sender and
    receivers, async GRPO's generators and trainers); otherwise it returns once the call has
    run, and its caller must not need the overlap."""

    kind: str
    num_workers: int
    concurrent: bool

    def run(self, method: str, *args: Any, **kwargs: Any) -> list[Any]: ...

    def run_async(self, method: str, *args: Any, **kwargs: Any) -> Any: ...

    def get(self, futures: Any) -> list[Any]: ...

    def ready(self, futures: Any, timeout_s: float) -> bool:
        """Whether ``get(futures)`` would return or raise at once: every rank done, or one
        failed; waits up to ``timeout_s`` for that."""
        ...

    def run_per_rank(
        self,
        method: str,
        args_list: Sequence[Sequence[Any]],
        kwargs_list: Sequence[dict[str, Any]] | None = None,
    ) -> list[Any]: ...

    def run_per_rank_async(self, method: str, args_list: Sequence[Sequence[Any]]) -> Any: ...

    def shutdown(self) -> None: ...


@dataclass(frozen=True)
class LocalFutures:
    method: str
    futures: list[Future[Any]]


class LocalGroup:
    """Plain worker objects (``TrainerWorker``, ``GeneratorWorker``...) as a ``Group``.

    Every call runs in a worker thread, so ``run_async`` on two groups overlaps them as Ray
    actors would; an exception is raised as a ``WorkerError`` naming kind, rank and method.
    ``max_concurrency``: calls a worker may run at once, as for ``WorkerGroup``."""

    def __init__(self, workers: Sequence[Any], kind: str, max_concurrency: int = 1):
        if not workers:
            raise ValueError(f"a {kind} group needs at least one worker")
        self.workers = list(workers)
        self.kind, self.num_workers = kind, len(self.workers)
        self.concurrent = True
        self._threads = self.num_workers * max_concurrency
        self._pool: ThreadPoolExecutor | None = None  # at the first call

    def _submit(self, method: str, calls: Sequence[tuple[Sequence[Any], dict[str, Any]]]) -> Any:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self._threads, thread_name_prefix=self.kind)
        futures = [
            self._pool.submit(getattr(worker, method), *args, **kwargs)
            for worker, (args, kwargs) in zip(self.workers, calls, strict=False)
        ]
        return LocalFutures(method, futures)

    def run_async(self, method: str, *args: Any, **kwargs: Any) -> LocalFutures:
        return self._submit(method, [(args, kwargs)] * self.num_workers)

    def get(self, futures: LocalFutures) -> list[Any]:
        results = []
        for rank, future in enumerate(futures.futures):
            try:
                results.append(future.result())
            except Exception as err:
                raise WorkerError(
                    self.kind, rank, futures.method, failure_message(self.kind, err)
                ) from err
        return results

    def ready(self, futures: LocalFutures, timeout_s: float) -> bool:
        done, pending = wait(futures.futures, timeout=timeout_s, return_when=FIRST_EXCEPTION)
        return not pending or any(f.exception() is not None for f in done)

    def run(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        return self.get(self.run_async(method, *args, **kwargs))

    def run_per_rank(
        self,
        method: str,
        args_list: Sequence[Sequence[Any]],
        kwargs_list: Sequence[dict[str, Any]] | None = None,
    ) -> list[Any]:
        if len(args_list) > self.num_workers:
            raise ValueError(f"{len(args_list)} argument sets for {self.num_workers} workers")
        kwargs_list = kwargs_list or [{}] * len(args_list)
        return self.get(self._submit(method, list(zip(args_list, kwargs_list, strict=True))))

    def run_per_rank_async(self, method: str, args_list: Sequence[Sequence[Any]]) -> LocalFutures:
        """``run_per_rank`` without waiting; collect with ``get``."""
        if len(args_list) > self.num_workers:
            raise ValueError(f"{len(args_list)} argument sets for {self.num_workers} workers")
        return self._submit(method, [(args, {}) for args in args_list])

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)


def get_together(calls: Sequence[tuple[Group, Any]], poll_s: float = 0.5) -> list[list[Any]]:
    """``group.get(futures)`` of every call, the first failure of any raised at once: two groups
    that work together (a refit's sender and receivers) wait on each other, so waiting on one
    first would hang on it when the other's actor died."""
    results: dict[int, list[Any]] = {}
    while len(results) < len(calls):
        for index, (group, futures) in enumerate(calls):
            if index not in results and group.ready(futures, poll_s / len(calls)):
                results[index] = group.get(futures)
    return [results[index] for index in range(len(calls))]


class InlineGroup(LocalGroup):
    """Plain worker objects called on the caller's thread: ``run_async`` returns once the call
    has run (not ``concurrent``: two groups never overlap, so a run in this process refits
    by a copy, ``refit.CopyRefit``). All torch work stays on one thread, as it should on a CPU:
    once a second thread has run OpenMP regions, both threads' small ops slow down (libgomp
    keeps a team per such thread; figures in docs/architecture.md)."""

    def __init__(self, workers: Sequence[Any], kind: str):
        super().__init__(workers, kind)  # its thread pool is never made: nothing runs elsewhere
        self.concurrent = False

    def _submit(self, method: str, calls: Sequence[tuple[Sequence[Any], dict[str, Any]]]) -> Any:
        futures: list[Future[Any]] = []
        for worker, (args, kwargs) in zip(self.workers, calls, strict=False):
            future: Future[Any] = Future()
            try:
                future.set_result(getattr(worker, method)(*args, **kwargs))
            except Exception as err:
                future.set_exception(err)
            futures.append(future)
        return LocalFutures(method, futures)
