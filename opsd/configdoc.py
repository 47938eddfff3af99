"""docs/configuration.md, rendered from the pydantic models of :mod:`opsd.config` (one module per section).

Each section class's docstring and each field's ``description``, type, bounds and default become one
``##`` section with a table of dotted keys, in declaration order (nested sections after their
parent). ``python -m opsd.configdoc`` writes the file; ``--check`` exits 1 where it differs from what
the models render. Light on purpose: pydantic and the standard library, no torch.
"""

from __future__ import annotations

import argparse
import inspect
import json
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin

import annotated_types
from pydantic import BaseModel
from pydantic.fields import FieldInfo

DOC = Path(__file__).resolve().parents[1] / "docs" / "configuration.md"
STALE = "docs/configuration.md is out of date: run python -m opsd.configdoc"
_INLINE_DEFAULT = 40  # characters; a longer or multi-line default is printed under its table

_INTRO = """\
Every key of the training configuration (`opsd train`), with its type, default and meaning; `opsd eval`
and `opsd sft` (at the end) read the same sections. A key is
set in its section of the YAML file (`loss:` then `beta: 0.5`) or on the command line as a dotted
override (`opsd train --config run.yaml loss.beta=0.5`); `null` is YAML's None. An unknown key, a
value of the wrong type or out of range, or a combination that makes no sense is refused before
anything loads, in one line naming the key.

Generated from the section modules of `opsd/config/` by `python -m opsd.configdoc`: edit the
descriptions there, not here."""


def sections(root: type[BaseModel], prefix: str = "") -> Iterator[tuple[str, type[BaseModel]]]:
    """``(dotted prefix, model)`` for ``root`` (prefix "") and every section nested in it, depth first."""
    yield prefix, root
    for name, field in root.model_fields.items():
        if _is_section(field.annotation):
            yield from sections(field.annotation, f"{prefix}{name}.")


def leaves(model: type[BaseModel]) -> list[tuple[str, FieldInfo]]:
    """The fields of ``model`` that are settings rather than sections, in declaration order, each by the
    name a config file spells it (its alias: ``rlsd.lambda`` is the field ``lambda_``)."""
    return [(f.alias or name, f) for name, f in model.model_fields.items() if not _is_section(f.annotation)]


def section_doc(model: type[BaseModel]) -> str:
    """The model's own docstring as one paragraph ("" where it has none; a docstring is not inherited)."""
    doc = model.__dict__.get("__doc__") or ""
    return " ".join(inspect.cleandoc(doc).split())


def render(root: type[BaseModel] | None = None, title: str = "Configuration") -> str:
    """The Markdown reference of ``root`` (by default the training :class:`opsd.config.Config`, then
    what `opsd eval` and `opsd sft` add to the same sections)."""
    if root is not None:
        return _render_tree(root, title)
    from opsd.config import EVAL_DEFAULTS, SFT_DEFAULTS, Config, EvalCommand, SFTCommand

    out = [_render_tree(Config, title).rstrip()]
    for command, schema, defaults in (
        ("eval", EvalCommand, EVAL_DEFAULTS),
        ("sft", SFTCommand, SFT_DEFAULTS),
    ):
        out += ["", *_command_section(command, schema, defaults, Config)]
    return "\n".join(out).rstrip() + "\n"


def _command_section(
    command: str, schema: type[BaseModel], defaults: dict, root: type[BaseModel]
) -> list[str]:
    """A command's schema as the training sections it reads, the keys of its own and the defaults it
    changes."""
    shared = [name for name in schema.model_fields if name in root.model_fields]
    own = [(name, f) for name, f in leaves(schema) if name not in root.model_fields]
    out = [f"## `opsd {command}`", "", section_doc(schema), ""]
    out += [f"It reads these keys and sections of `opsd train`'s: {', '.join(f'`{n}`' for n in shared)}."]
    if own:
        out += ["", "| key | type | default | description |", "|---|---|---|---|"]
        for name, field in own:
            cells = (f"`{name}`", _type(field.annotation, _bounds(field)), _default(field), field.description)
            out.append("| " + " | ".join(_cell(c or "") for c in cells) + " |")
    changed = ", ".join(f"`{key}: {_value(v)}`" for key, v in _dotted(defaults))
    return [*out, "", f"Its defaults where they differ from `opsd train`'s: {changed}."]


def _dotted(tree: dict, prefix: str = "") -> list[tuple[str, Any]]:
    """A nested mapping's leaves as (dotted key, value)."""
    out = []
    for key, value in tree.items():
        if isinstance(value, dict):
            out += _dotted(value, f"{prefix}{key}.")
        else:
            out.append((prefix + key, value))
    return out


def _render_tree(root: type[BaseModel], title: str) -> str:
    """The reference of one model and the sections nested in it."""
    out = [f"# {title}", "", _INTRO]
    for prefix, model in sections(root):
        out += ["", f"## {prefix[:-1] or 'Top level'}"]
        if doc := section_doc(model):
            out += ["", doc]
        rows = leaves(model)
        if not rows:
            continue
        out += ["", "| key | type | default | description |", "|---|---|---|---|"]
        below = []
        for name, field in rows:
            key = prefix + name
            default = _default(field)
            if default is None:
                below.append((key, field.get_default(call_default_factory=True)))
                default = "see below"
            cells = (f"`{key}`", _type(field.annotation, _bounds(field)), default, field.description or "")
            out.append("| " + " | ".join(_cell(c) for c in cells) + " |")
        for key, value in below:
            out += ["", f"Default of `{key}`:", "", "```text", *str(value).splitlines(), "```"]
    return "\n".join(out).rstrip() + "\n"


def _is_section(annotation: Any) -> bool:
    return isinstance(annotation, type) and issubclass(annotation, BaseModel)


def _value(v: Any) -> str:
    """A value as YAML reads it back: true, null, "auto", [0.9, 0.999]."""
    return json.dumps(v, ensure_ascii=False)


def _default(field: FieldInfo) -> str | None:
    """The default as inline code; "required" where there is none; None where it is printed below."""
    if field.is_required():
        return "required"
    value = field.get_default(call_default_factory=True)
    if isinstance(value, str) and ("\n" in value or len(value) > _INLINE_DEFAULT):
        return None
    return f"`{_value(value)}`"


def _bounds(field: FieldInfo) -> str:
    """The numeric bounds of a field: ``>= 1``, ``> 0``, or an interval such as ``in [0, 1)``."""
    low = high = None
    for m in field.metadata:
        if isinstance(m, annotated_types.Ge):
            low = ("[", ">=", m.ge)
        elif isinstance(m, annotated_types.Gt):
            low = ("(", ">", m.gt)
        elif isinstance(m, annotated_types.Le):
            high = ("]", "<=", m.le)
        elif isinstance(m, annotated_types.Lt):
            high = (")", "<", m.lt)
    if low and high:
        return f"in {low[0]}{_value(low[2])}, {_value(high[2])}{high[0]}"
    if low or high:
        _, op, v = low or high
        return f"{op} {_value(v)}"
    return ""


def _type(tp: Any, bounds: str = "") -> str:
    """A type in words: ``int >= 1``, ``float or null``, ``"auto", "off"``, ``list of str``."""
    origin, args = get_origin(tp), get_args(tp)
    if origin is Literal:
        return ", ".join(f"`{_value(a)}`" for a in args)
    if origin in (Union, types.UnionType):
        return " or ".join(_type(a, bounds) for a in args)
    if tp is type(None):
        return "null"
    if tp is Any:
        return "any"
    if origin is list:
        return f"list of {_type(args[0])}"
    if origin is dict:
        return "mapping"
    if origin is tuple:
        return "[" + ", ".join(_type(a) for a in args) + "]"
    name = getattr(tp, "__name__", str(tp))
    return f"{name} {bounds}" if bounds and tp in (int, float) else name


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def main(argv: list[str] | None = None) -> int:
    """Write docs/configuration.md, or with ``--check`` say whether it is current."""
    p = argparse.ArgumentParser(prog="python -m opsd.configdoc", description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="exit 1 if the file differs from the models")
    p.add_argument("--out", type=Path, default=DOC, help="the file (default: docs/configuration.md)")
    args = p.parse_args(argv)
    text = render()
    if args.check:
        current = args.out.read_text(encoding="utf-8") if args.out.is_file() else None
        if current != text:
            print(STALE, file=sys.stderr)
            return 1
        return 0
    args.out.write_text(text, encoding="utf-8", newline="\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
