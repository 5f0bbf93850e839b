"""Objects a user names in a config: a built-in name or an import path ``package.module:name``."""

from __future__ import annotations

import importlib
from collections.abc import Iterable


def import_named(kind: str, spec: str, builtins: Iterable[str], example: str) -> object:
    """The object at ``spec`` (``package.module:name``); otherwise a ValueError naming ``kind``,
    ``spec``, the built-ins and what is wrong (no path, no module, no such name)."""
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ValueError(
            f"{kind} {spec!r} is neither a built-in ({', '.join(builtins)}) nor an import path "
            f"'package.module:{example}'"
        )
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(
            f"{kind} {spec!r}: cannot import module {module_name!r} ({exc}); check the path and "
            "that the module is installed or on PYTHONPATH"
        ) from exc
    found = getattr(module, attr, None)
    if found is None:
        raise ValueError(f"{kind} {spec!r}: module {module_name!r} has no attribute {attr!r}")
    return found
