"""Recipe loading: YAML files with an optional ``defaults:`` parent, dotted CLI overrides,
validation into the typed models, and error messages that name the key and the fix."""

from __future__ import annotations

import difflib
import json
import types
import typing
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ValidationError

RECIPES_DIR = Path(__file__).resolve().parent.parent / "recipes"
"""Recipes shipped inside the package; ``--config NAME`` finds ``NAME.yaml`` here."""

ModelT = TypeVar("ModelT", bound=BaseModel)


class ConfigError(ValueError):
    """A recipe or override is invalid; the message says which key and what is allowed."""


def resolve_recipe(name_or_path: str | Path) -> Path:
    """A recipe path as given, or the name of a shipped recipe (``grpo_arithmetic``)."""
    path = Path(name_or_path)
    if path.is_file():
        return path
    shipped = RECIPES_DIR / f"{path.name.removesuffix('.yaml')}.yaml"
    if path.parent == Path(".") and shipped.is_file():
        return shipped
    names = sorted(p.stem for p in RECIPES_DIR.glob("*.yaml"))
    raise ConfigError(
        f"recipe file not found: {name_or_path} (shipped recipes: {', '.join(names) or 'none'})"
    )


def read_recipe(path: Path, _seen: tuple[Path, ...] = ()) -> dict[str, Any]:
    """The recipe's mapping with its ``defaults:`` parents merged underneath it."""
    path = path.resolve()
    if path in _seen:
        raise ConfigError(f"recipe {path} includes itself through 'defaults:'")
    data = parse_yaml(path) or {}
    if not isinstance(data, dict):
        raise ConfigError(f"recipe {path} must be a mapping of sections, got {type(data).__name__}")
    parent = data.pop("defaults", None)
    if parent is None:
        return data
    parent_path = Path(parent)
    if not parent_path.is_absolute() and (path.parent / parent_path).is_file():
        parent_path = path.parent / parent_path
    base = read_recipe(resolve_recipe(parent_path), (*_seen, path))
    return deep_merge(base, data)


class _UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's safe loader, but a key given twice in one mapping is an error (PyYAML keeps the
    last value silently, so a recipe that sets a key twice would run with the one not meant)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)  # type: ignore[no-untyped-call]
            line = key_node.start_mark.line + 1
            if key in seen:
                raise ConfigError(
                    f"{self.name}: {key!r} given twice (line {line}; first on line {seen[key]}): "
                    "keep one"
                )
            seen[key] = line
        return super().construct_mapping(node, deep=deep)


def read_text(path: Path, what: str) -> str:
    """The text of ``path`` as UTF-8, with a byte-order mark (Windows tools write one) dropped;
    text in another encoding is an error saying so."""
    raw = path.read_bytes()
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        utf16 = raw[:2] in (b"\xff\xfe", b"\xfe\xff")
        guess = " (it is UTF-16: save it as UTF-8)" if utf16 else ""
        raise ConfigError(
            f"{what} {path} is not UTF-8 text{guess}: byte {err.start} is {raw[err.start]:#x}"
        ) from None


def parse_yaml(path: Path) -> Any:
    """The YAML document of ``path``; a key given twice, bad syntax or an encoding other than
    UTF-8 is a ``ConfigError`` naming the file and the line."""
    text = read_text(path, "recipe")
    loader = _UniqueKeyLoader(text)
    loader.name = str(path)
    try:
        return loader.get_single_data()
    except yaml.YAMLError as err:
        raise ConfigError(f"recipe {path} is not valid YAML: {err}") from None
    finally:
        loader.dispose()


def deep_merge(base: dict[str, Any], update: dict[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = deep_merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply ``section.key=value`` overrides; values are parsed as YAML scalars/lists."""
    data = dict(data)
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            hint = ""
            if item.endswith((".yaml", ".yml")) or (RECIPES_DIR / f"{item}.yaml").is_file():
                hint = f" (a recipe is given as --config {item})"
            raise ConfigError(f"override {item!r} must look like section.key=value{hint}")
        value = _override_value(raw)
        node = data
        parts = key.split(".")
        for part in parts[:-1]:
            child = node.get(part)
            child = dict(child) if isinstance(child, dict) else {}
            node[part] = child
            node = child
        node[parts[-1]] = value
    return data


def _override_value(raw: str) -> Any:
    """An override's value as a YAML scalar or flow collection (``3e-6``, ``true``, ``[a, b]``,
    ``{k: 1}``). Text that YAML would read otherwise (``Q: {question}`` as a mapping, an
    unclosed bracket) is kept as the string it is."""
    if not raw:
        return ""
    try:
        value = yaml.safe_load(raw)
    except yaml.YAMLError:
        return raw
    if isinstance(value, dict | list) and not raw.lstrip().startswith(("{", "[")):
        return raw
    return value


def load_config(
    model: type[ModelT], recipe: str | Path | None = None, overrides: list[str] | None = None
) -> ModelT:
    """Build ``model`` from a recipe (or the model's defaults) plus dotted overrides."""
    data = read_recipe(resolve_recipe(recipe)) if recipe is not None else {}
    data = apply_overrides(data, overrides or [])
    try:
        return model.model_validate(data)
    except ValidationError as err:
        raise ConfigError(format_validation_error(model, err)) from None


def format_validation_error(model: type[BaseModel], err: ValidationError) -> str:
    lines = [f"invalid configuration ({err.error_count()} problem(s)):"]
    for error in err.errors():
        loc = [str(part) for part in error["loc"]]
        key = ".".join(loc) or "<root>"
        if error["type"] == "extra_forbidden":
            lines.append(f"  {key}: unknown key{_suggestion(model, loc)}")
            continue
        value = json.dumps(error.get("input"), default=str)
        lines.append(f"  {key}: {error['msg']} (got {value})")
    return "\n".join(lines)


def _suggestion(model: type[BaseModel], loc: list[str]) -> str:
    parent = _model_at(model, loc[:-1])
    if parent is None:
        return ""
    valid = list(parent.model_fields)
    close = difflib.get_close_matches(loc[-1], valid, n=1, cutoff=0.5)
    prefix = ".".join(loc[:-1])
    hint = f"; did you mean '{prefix + '.' if prefix else ''}{close[0]}'?" if close else ""
    return f"{hint} (valid keys here: {', '.join(valid)})"


def _model_at(model: type[BaseModel], path: list[str]) -> type[BaseModel] | None:
    current: type[BaseModel] = model
    for part in path:
        field = current.model_fields.get(part)
        if field is None:
            return None
        sub = _submodel(field.annotation)
        if sub is None:
            return None
        current = sub
    return current


def _submodel(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        for arg in typing.get_args(annotation):
            sub = _submodel(arg)
            if sub is not None:
                return sub
    return None


def save_resolved(config: BaseModel, run_dir: Path) -> None:
    """Write the resolved config (every default filled in) as YAML and JSON into the run dir."""
    run_dir.mkdir(parents=True, exist_ok=True)
    data = config.model_dump(mode="json")
    (run_dir / "config.yaml").write_text(yaml.safe_dump(data, sort_keys=False))
    (run_dir / "config.json").write_text(json.dumps(data, indent=2))
