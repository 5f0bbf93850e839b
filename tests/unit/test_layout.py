"""The package's shape: what a newcomer relies on when reading it (read with ``ast``)."""

from __future__ import annotations

import ast
from pathlib import Path

import tandem

PACKAGE = Path(tandem.__file__).parent


def _modules() -> dict[str, Path]:
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        modules[name] = path
    return modules


def import_graph() -> dict[str, set[str]]:
    """Each module of tandem -> the modules of tandem it imports, anywhere in it (at the top,
    in a function, under ``TYPE_CHECKING``). ``from package import submodule`` names the
    submodule, not the package."""
    modules = _modules()
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                for alias in node.names:
                    child = f"{node.module}.{alias.name}"
                    targets.append(child if child in modules else node.module)
            for target in targets:
                while target and target not in modules:
                    target = target.rpartition(".")[0]
                if target.startswith("tandem") and target != name:
                    graph[name].add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import cycles: every path from a module back to itself, one per module it visits
    first (depth-first search with colours)."""
    found: list[list[str]] = []
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                found.append([*path[path.index(nxt) :], nxt])
            elif nxt not in state:
                visit(nxt, [*path, nxt])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    return found


def test_the_cycle_finder_finds_a_cycle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c", "a"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_the_package_imports_no_cycle() -> None:
    graph = import_graph()
    assert "tandem.cluster.runtime" in graph["tandem.cluster.launch"]  # the graph is read
    assert cycles(graph) == []


def test_the_seam_types_are_defined_once() -> None:
    defined: dict[str, list[str]] = {}
    for name, path in _modules().items():
        for node in ast.parse(path.read_text()).body:
            targets = []
            if isinstance(node, ast.ClassDef | ast.FunctionDef):
                targets = [node.name]
            elif isinstance(node, ast.Assign):
                targets = [t.id for t in node.targets if isinstance(t, ast.Name)]
            for target in targets:
                defined.setdefault(target, []).append(name)
    for seam in ("LossFn", "RewardFn", "PendingGeneration", "default_device", "DTYPES"):
        assert len(defined.get(seam, [])) == 1, (seam, defined.get(seam))


def test_the_runtime_is_one_small_class_and_few_modules_name_the_in_process_launcher() -> None:
    tree = ast.parse((PACKAGE / "cluster" / "runtime.py").read_text())
    (runtime,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Runtime"]
    assert runtime.end_lineno is not None and runtime.end_lineno - runtime.lineno + 1 < 250
    naming = sorted(name for name, path in _modules().items() if "in_process" in path.read_text())
    assert len(naming) <= 3, naming


def test_a_generators_process_imports_no_trainer() -> None:
    """The generator's modules (and the actors that host it) import nothing of the trainer at
    their top: a generator process starts without FSDP2, peft's trainer side or Megatron, and
    its environment need not have them; what a generator borrows (``decoder_layers`` for
    ``generation.compile``) it imports where it is used."""
    import subprocess
    import sys

    script = (
        "import sys, tandem.generation.hf_generator, tandem.generation.static_decode, "
        "tandem.cluster.actors; "
        "print(sorted(m for m in sys.modules if m.startswith('tandem.trainer')))"
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]", result.stdout
