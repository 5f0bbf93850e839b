"""N Ray actors of one plain worker class, in the environment of their actor kind.

The worker class knows nothing of Ray: each actor is a small host that sets the
``torch.distributed`` rendezvous variables (``MASTER_ADDR``, ``MASTER_PORT``, ``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``) and then builds the worker, passing ``rank``, ``world_size`` and
``node_ip`` (the address other nodes reach its node at; loopback on one node) to its
constructor when it takes them. The worker's module must be importable in the actor's
interpreter (tandem comes from the driver's source tree, first on every actor's ``PYTHONPATH``;
anything else can be put on ``PYTHONPATH`` through ``env_vars``).

Public API
----------
``WorkerGroup(worker_cls, num_workers, kind, args=(), kwargs=None, bundles=None, env_vars=None,
env_mode=None, num_cpus=1.0)``
  ``.run(method, *args, **kwargs) -> list`` (every rank, results in rank order),
  ``.run_rank0(method, ...)``, ``.run_async(method, ...) -> Futures`` + ``.get(futures) -> list``,
  ``.run_per_rank(method, args_list, kwargs_list=None) -> list``,
  ``.run_per_rank_async(method, args_list) -> Futures``, ``.shutdown()``,
  ``.num_workers``, ``.kind``, ``.actors``.
``WorkerError`` (from ``groups``): an actor died or a method raised; names kind, rank and method.
"""

from __future__ import annotations

import inspect
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import ray
from ray.exceptions import ActorUnavailableError, RayActorError, RayTaskError

from tandem.cluster.envs import build_on_all_nodes, runtime_env_for
from tandem.cluster.envs import env_mode as resolve_env_mode
from tandem.cluster.groups import WorkerError, failure_message
from tandem.cluster.placement import ActorSlot
from tandem.cluster.ray_cluster import LOOPBACK, alive_nodes, bind_to, node_ip
from tandem.imports import pause_gc, resume_gc

_ANSI = re.compile(r"\x1b\[[0-9;]*m")


class _WorkerHost:
    """The actor itself: sets the process environment, then hosts one worker instance."""

    def __init__(self) -> None:
        # ``start``'s arguments import the worker's module (torch and more) while Ray unpickles
        # them, before its body runs; the collector is off until then (``imports.without_gc``).
        pause_gc()
        self.worker: Any = None

    def address(self) -> tuple[str, int]:
        """(node id, a free TCP port on this node) for the rendezvous."""
        # here, not at the module's import: that runs as the actor is created, before the host
        # pauses the collector, and tandem.rendezvous imports torch.distributed (0.9 s)
        from tandem import rendezvous

        return ray.get_runtime_context().get_node_id(), rendezvous.free_port()

    def start(
        self, cls: type, args: tuple, kwargs: dict[str, Any], env: dict[str, str], node_ip: str
    ) -> None:
        resume_gc()
        os.environ.update(env)
        bind_to(node_ip)  # gloo, NCCL and vLLM listen on the node's address (loopback on one)
        self.worker = cls(*args, **kwargs)

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return getattr(self.worker, method)(*args, **kwargs)


@dataclass(frozen=True)
class Futures:
    """Pending results of one method on every addressed rank."""

    method: str
    ranks: list[int]
    refs: list[ray.ObjectRef]


def _accepted(cls: type, names: Sequence[str]) -> set[str]:
    params = inspect.signature(cls).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return set(names)
    return {name for name in names if name in params}


class WorkerGroup:
    """``num_workers`` actors of ``worker_cls`` for actor ``kind`` (``trainer``, ``generator``...).

    ``bundles`` (from ``tandem.cluster.placement``) place rank ``i`` in ``bundles[i]``; without
    them every actor asks ``num_cpus``. ``env_mode`` (``isolated``/``shared``, overridden by
    ``TANDEM_ENV_MODE``) picks the interpreter; ``env_vars`` are added to the actors' environment.
    ``call_timeout_s`` bounds the wait for each rank's result of every call (None: no bound).
    ``max_concurrency`` > 1 makes threaded actors that run that many calls at once (in the
    order they start, not necessarily the order they were made). ``timeout_setting``: the config
    key a timed-out call's error names.
    """

    def __init__(
        self,
        worker_cls: type,
        num_workers: int,
        kind: str,
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
        bundles: Sequence[ActorSlot] | None = None,
        env_vars: dict[str, str] | None = None,
        env_mode: str | None = None,
        num_cpus: float = 1.0,
        call_timeout_s: float | None = None,
        max_concurrency: int = 1,
        timeout_setting: str = "cluster.call_timeout_s",
    ):
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        if bundles is not None and len(bundles) < num_workers:
            raise ValueError(
                f"{num_workers} {kind} workers need as many bundles, got {len(bundles)}"
            )
        self.kind, self.num_workers = kind, num_workers
        self.concurrent = True  # each actor runs its calls in its own process
        self.call_timeout_s = call_timeout_s
        self.timeout_setting = timeout_setting
        """The config key that sets ``call_timeout_s`` (named when a call times out)."""
        self.actors: list[Any] = []
        runtime_env = self._runtime_env(kind, env_vars, env_mode)
        host_cls = ray.remote(_WorkerHost)
        for rank in range(num_workers):
            options = bundles[rank].options() if bundles is not None else {"num_cpus": num_cpus}
            options["max_concurrency"] = max_concurrency
            name = f"{kind}-{rank}-{os.getpid()}-{id(self):x}"
            self.actors.append(
                host_cls.options(runtime_env=runtime_env, name=name, **options).remote()
            )
        try:
            self._start(worker_cls, tuple(args), dict(kwargs or {}))
        except BaseException:
            self.shutdown()
            raise

    @staticmethod
    def _runtime_env(kind: str, env_vars: dict[str, str] | None, mode: str | None) -> dict:
        variables = dict(env_vars or {})
        single_node = len(alive_nodes()) == 1
        resolved = resolve_env_mode(mode)
        if resolved == "isolated" and not single_node:
            build_on_all_nodes([kind])  # the local build below then finds it cached
        return runtime_env_for(kind, resolved, variables)

    def _start(self, worker_cls: type, args: tuple, kwargs: dict[str, Any]) -> None:
        addresses = self.get(self._submit("address", list(range(self.num_workers)), "address"))
        node_ids = [node for node, _ in addresses]
        # One node: rendezvous on loopback (nothing leaves the machine); else rank 0's node.
        master_ip = LOOPBACK if len(set(node_ids)) == 1 else node_ip(node_ids[0])
        master_port = addresses[0][1]
        single_node = len(alive_nodes()) == 1
        extra = _accepted(worker_cls, ["rank", "world_size", "node_ip"])
        refs = []
        for rank, actor in enumerate(self.actors):
            env = {
                "MASTER_ADDR": master_ip,
                "MASTER_PORT": str(master_port),
                "RANK": str(rank),
                "WORLD_SIZE": str(self.num_workers),
                "LOCAL_RANK": str(node_ids[:rank].count(node_ids[rank])),
                "LOCAL_WORLD_SIZE": str(node_ids.count(node_ids[rank])),
            }
            ip = LOOPBACK if single_node else node_ip(node_ids[rank])
            dist = {"rank": rank, "world_size": self.num_workers, "node_ip": ip}
            init_kwargs = {**kwargs, **{k: v for k, v in dist.items() if k in extra}}
            refs.append(actor.start.remote(worker_cls, args, init_kwargs, env, ip))
        self.get(Futures(f"{worker_cls.__name__}.__init__", list(range(self.num_workers)), refs))

    def _submit(
        self, host_method: str, ranks: list[int], label: str, *a: Any, **kw: Any
    ) -> Futures:
        refs = [getattr(self.actors[rank], host_method).remote(*a, **kw) for rank in ranks]
        return Futures(label, ranks, refs)

    # -- calls -----------------------------------------------------------------------------------
    def run_async(self, method: str, *args: Any, **kwargs: Any) -> Futures:
        """Call ``method`` on every rank; collect with ``get``."""
        return self._submit("call", list(range(self.num_workers)), method, method, *args, **kwargs)

    def run(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        """Call ``method`` on every rank and return the results in rank order."""
        return self.get(self.run_async(method, *args, **kwargs))

    def run_rank0(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """Call ``method`` on rank 0 only."""
        return self.get(self._submit("call", [0], method, method, *args, **kwargs))[0]

    def run_per_rank(
        self,
        method: str,
        args_list: Sequence[Sequence[Any]],
        kwargs_list: Sequence[dict[str, Any]] | None = None,
    ) -> list[Any]:
        """Call ``method`` on ranks ``0..len(args_list)-1``, rank ``i`` with ``args_list[i]``."""
        if len(args_list) > self.num_workers:
            raise ValueError(f"{len(args_list)} argument sets for {self.num_workers} workers")
        kwargs_list = kwargs_list or [{}] * len(args_list)
        if len(kwargs_list) != len(args_list):
            raise ValueError(f"{len(args_list)} args but {len(kwargs_list)} kwargs sets")
        refs = [
            self.actors[rank].call.remote(method, *args, **kw)
            for rank, (args, kw) in enumerate(zip(args_list, kwargs_list, strict=True))
        ]
        return self.get(Futures(method, list(range(len(refs))), refs))

    def run_per_rank_async(self, method: str, args_list: Sequence[Sequence[Any]]) -> Futures:
        """``run_per_rank`` without waiting; collect with ``get``."""
        if len(args_list) > self.num_workers:
            raise ValueError(f"{len(args_list)} argument sets for {self.num_workers} workers")
        refs = [self.actors[rank].call.remote(method, *args) for rank, args in enumerate(args_list)]
        return Futures(method, list(range(len(refs))), refs)

    def get(self, futures: Futures) -> list[Any]:
        """Results in rank order. Raises ``WorkerError`` on the first failure seen, without
        waiting for the other ranks (which may be blocked in a collective with the failed one),
        and when a rank gives no result within ``call_timeout_s``."""
        rank_of = {ref: rank for rank, ref in zip(futures.ranks, futures.refs, strict=True)}
        results: dict[int, Any] = {}
        pending = list(futures.refs)
        while pending:
            ready, pending = ray.wait(pending, num_returns=1, timeout=self.call_timeout_s)
            if not ready:
                raise WorkerError(
                    self.kind,
                    rank_of[pending[0]],
                    futures.method,
                    f"no result after {self.call_timeout_s:g} s ({self.timeout_setting}); "
                    "it hangs or is far slower than expected",
                )
            rank = rank_of[ready[0]]
            results[rank] = self._result(ready[0], rank, futures.method)
        return [results[rank] for rank in futures.ranks]

    def ready(self, futures: Futures, timeout_s: float) -> bool:
        """Whether ``get(futures)`` would return or raise at once (every rank done, or one
        failed); waits up to ``timeout_s``."""
        done, pending = ray.wait(
            list(futures.refs), num_returns=len(futures.refs), timeout=timeout_s
        )
        if not pending:
            return True
        for ref in done:
            try:
                ray.get(ref, timeout=0)
            except Exception:
                return True
        return False

    def _result(self, ref: ray.ObjectRef, rank: int, method: str) -> Any:
        try:
            return ray.get(ref)
        except RayTaskError as err:
            cause = err.cause if err.cause is not None else err
            remote = _ANSI.sub("", str(err))  # Ray colours the remote traceback's header
            message = failure_message(self.kind, cause, remote)
            raise WorkerError(self.kind, rank, method, message) from err
        except (RayActorError, ActorUnavailableError) as err:
            raise WorkerError(self.kind, rank, method, f"actor died: {err}") from err

    def shutdown(self) -> None:
        """Kill the actors (idempotent)."""
        for actor in self.actors:
            ray.kill(actor, no_restart=True)
        self.actors = []
