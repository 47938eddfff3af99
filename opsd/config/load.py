"""Reading a configuration: YAML in, dotted command-line overrides on top, one UserError line naming
each bad key."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from opsd.errors import UserError


def _set_dotted(tree: dict, key: str, value: Any) -> None:
    parts = key.split(".")
    node = tree
    for p in parts[:-1]:
        node = node.setdefault(p, {})
        if not isinstance(node, dict):
            raise UserError(f"override {key!r}: {p!r} is not a section")
    node[parts[-1]] = value


def _override_value(item: str, raw: str) -> Any:
    """An override's value read as YAML, except text with ": " that YAML would read as a block mapping
    or not at all (``data.instruction=Finish with: The answer is N.``): a mapping on the command line is
    written in braces (``rollout.horizon={start: 48, end: 192, over_steps: 40}``), so such text is the
    string it reads as."""
    if not raw.strip():
        return ""
    braced = raw.lstrip().startswith(("{", "["))
    try:
        value = yaml.safe_load(raw)
    except yaml.YAMLError:
        if ": " in raw and not braced:
            return raw
        raise UserError(f"override {item!r}: the value is not valid YAML") from None
    if isinstance(value, dict) and not braced:
        return raw
    return value


def load_config(
    path: str | Path | None = None,
    overrides: list[str] | tuple[str, ...] = (),
    schema: type[BaseModel] | None = None,
) -> Any:
    """YAML file plus ``section.key=value`` overrides (values parsed as YAML), validated against
    ``schema`` (the training :class:`Config` by default; `opsd eval` and `opsd sft` pass their own)."""
    if schema is None:
        from opsd.config.root import Config

        schema = Config
    tree: dict = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise UserError(f"config file not found: {path}")
        try:
            tree = yaml.safe_load(path.read_text(encoding="utf-8-sig")) or {}
        except yaml.YAMLError as e:
            raise UserError(f"{path}: not valid YAML: {' '.join(str(e).split())}") from None
        if not isinstance(tree, dict):
            raise UserError(f"{path}: the top level must be a mapping of sections, got {type(tree).__name__}")
    for item in overrides:
        if "=" not in item:
            raise UserError(f"override {item!r} must look like section.key=value, e.g. loss.beta=0")
        key, raw = item.split("=", 1)
        _set_dotted(tree, key.strip(), _override_value(item, raw))
    return validate(schema, tree, where=str(path) if path else None)


def validate(schema: type[BaseModel], tree: dict, where: str | None = None) -> Any:
    """``schema.model_validate(tree)``, with pydantic's errors as one UserError naming each key."""
    try:
        return schema.model_validate(tree)
    except ValidationError as e:
        raise UserError(f"invalid config{f' ({where})' if where else ''}: {_describe(e)}") from None


def _describe(e: ValidationError) -> str:
    lines = []
    for err in e.errors():
        key = ".".join(str(x) for x in err["loc"]) or "(top level)"
        msg = err["msg"].removeprefix("Value error, ")
        got = (
            f" (got {err['input']!r})"
            if err["type"] != "missing" and not isinstance(err["input"], dict)
            else ""
        )
        lines.append(f"{key}: {msg}{got}")
    return "; ".join(lines)


def save_config(cfg: BaseModel, path: Path) -> None:
    """``cfg`` as the YAML file a later ``load_config`` (a resume) reads back."""
    path.write_text(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))


def flag_overrides(args: argparse.Namespace, flags: dict[str, str]) -> list[str]:
    """Dotted overrides for a command's shorthand flags that were given (argparse dest -> config key).

    Values are written as JSON, which YAML reads back unchanged (a path stays a string, a list a list).
    """
    return [
        f"{key}={json.dumps(str(v) if isinstance(v, Path) else v)}"
        for dest, key in flags.items()
        if (v := getattr(args, dest, None)) is not None
    ]
