"""The configuration reference, read from the config dataclasses themselves: every field's YAML path, type,
default, current value, what it may hold (its declared constraint) and its one-line description - the comment on (or the comment block above) its line
in the dataclass's source, or the class docstring for a section. ``megatron-kl config show`` prints it;
``--format md`` writes the Markdown reference (docs/configuration.md is generated that way and a test keeps
it current), so the reference cannot drift from the code.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import io
import sys
import textwrap
import tokenize
import typing
from typing import Any, Optional

from megatron_kl.cli_help import Parser, help_when_bare, normalize_overrides
from megatron_kl.constraints import DERIVED, constraint_of


def _comments(source: str) -> dict[int, str]:
    """Line number -> the text of the comment on it."""
    return {
        token.start[0]: token.string.lstrip("#").strip()
        for token in tokenize.generate_tokens(io.StringIO(source).readline)
        if token.type == tokenize.COMMENT
    }


def field_docs(cls) -> dict[str, str]:
    """Field name -> description from the source comments of the class: the comments on the lines of the field's
    statement, else the comment block right above it; or of the base class that describes it (a subclass that only
    changes a field's default inherits its description: DistillObjective's KLConfig fields)."""
    docs: dict[str, str] = {}
    names = {f.name for f in dataclasses.fields(cls)}
    for klass in cls.__mro__:
        if not dataclasses.is_dataclass(klass):
            continue
        try:
            source = textwrap.dedent(inspect.getsource(klass))
        except (OSError, TypeError):
            continue
        comments, lines = _comments(source), source.splitlines()
        for node in ast.parse(source).body[0].body:
            if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
                continue
            name = node.target.id
            if name not in names or docs.get(name):
                continue
            text = [comments[i] for i in range(node.lineno, node.end_lineno + 1) if i in comments]
            above = node.lineno - 1
            while not text and above >= 1 and lines[above - 1].strip().startswith("#"):
                above -= 1
            text = text or [comments[i] for i in range(above + 1, node.lineno) if i in comments]
            if " ".join(text).strip():
                docs[name] = " ".join(text).strip()
    return docs


def _type_name(hint) -> str:
    if isinstance(hint, type):
        return hint.__name__
    return str(hint).replace("typing.", "").replace("NoneType", "None")


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        return f.default_factory()  # type: ignore[misc]
    return None


def allowed(f: dataclasses.Field) -> str:
    """What the field may hold (its declared constraint, ``megatron_kl.constraints``); "" where none is declared."""
    rule = constraint_of(f)
    return rule.describe() if rule is not None else ""


def rows(cls, value=None, prefix: str = "") -> list[tuple[str, str, Any, Any, str, str]]:
    """(path, type, default, current value, description, allowed values) for every leaf field under ``cls``."""
    hints = typing.get_type_hints(cls)
    docs = field_docs(cls)
    out = []
    for f in dataclasses.fields(cls):
        if not f.init or f.metadata.get(DERIVED):  # resolved at load, never given
            continue
        hint, current = hints[f.name], getattr(value, f.name) if value is not None else _default(f)
        if dataclasses.is_dataclass(hint):
            out += rows(hint, current, f"{prefix}{f.name}.")
            continue
        out.append((f"{prefix}{f.name}", _type_name(hint), _default(f), current, docs.get(f.name, ""), allowed(f)))
        item = typing.get_args(hint)[0] if typing.get_origin(hint) is list and typing.get_args(hint) else None
        if item is not None and dataclasses.is_dataclass(item):  # a list of sections: each item's fields
            out += rows(item, None, f"{prefix}{f.name}[].")
    return out


def _show(v: Any) -> str:
    return "null" if v is None else repr(v) if isinstance(v, str) else str(v)


def section_docs(cls, prefix: str = "") -> dict[str, str]:
    """Section path -> the first line of its dataclass's docstring (or its field comment)."""
    out = {}
    hints = typing.get_type_hints(cls)
    docs = field_docs(cls)
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        if dataclasses.is_dataclass(hint):
            doc = inspect.getdoc(hint) or ""
            generated = doc.startswith(hint.__name__ + "(")  # dataclass's synthesized signature, not a docstring
            out[prefix + f.name] = docs.get(f.name) or ("" if generated else doc.split("\n\n")[0].replace("\n", " "))
            out.update(section_docs(hint, prefix + f.name + "."))
    return out


def markdown(cls, title: str) -> str:
    """The whole reference as Markdown, one table per top-level section."""
    lines = [
        f"# {title}",
        "",
        "Generated from the config dataclasses by `megatron-kl config show --format md` (do not edit by hand).",
        "Every field can be set in the YAML file or as a dotted override: `megatron-kl train --config X "
        "section.field=value`. The column *allowed* is each field's declared constraint: a value outside it, NaN, "
        "an infinity, true/false for a number, null for a required field or a key given twice is refused when "
        "the config is loaded (`train`, `--check`, `study`, `launch`; `launch` leaves paths to the job, which checks "
        "them where it starts), in one line naming the field.",
        "",
    ]
    sections = section_docs(cls)
    current = None
    for path, type_name, default, _, doc, rule in rows(cls):
        top = path.split(".")[0]
        if top != current:
            current = top
            lines += ["", f"## `{top}`", ""]
            if sections.get(top):
                lines += [sections[top], ""]
            lines += ["| field | type | default | allowed | description |", "|---|---|---|---|---|"]
        cell = doc.replace("|", "\\|")
        lines.append(f"| `{path}` | `{type_name}` | `{_show(default)}` | {rule} | {cell} |")
    return "\n".join(lines) + "\n"


def main(argv: Optional[list[str]] = None) -> int:
    """``megatron-kl config show ...``; ``megatron-kl config`` alone prints this command's help."""
    parser = Parser(prog="megatron-kl config", description="The training configuration's fields.")
    sub = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    show = sub.add_parser(
        "show",
        help="every field: type, default, current value, description",
        description="Every field of the training configuration: type, default, current value, description.",
    )
    show.add_argument("--config", default=None, help="a YAML config to show the values of (default: the defaults)")
    show.add_argument("--section", default=None, help="only this section, e.g. kl or rollout.sglang")
    show.add_argument(
        "--format",
        choices=("text", "md"),
        default="text",
        help="text (a table for the terminal) or md (the Markdown of docs/configuration.md)",
    )
    show.add_argument("overrides", nargs="*", help="dotted overrides, e.g. kl.estimator=k3")
    argv = sys.argv[1:] if argv is None else list(argv)
    if help_when_bare(parser, argv):
        return 0
    args = parser.parse_args(normalize_overrides(argv))
    from megatron_kl.config import ConfigError, apply_overrides, from_dict, read_yaml_file
    from megatron_kl.train.config import TrainConfig

    if args.format == "md":
        sys.stdout.write(markdown(TrainConfig, "Configuration reference"))
        return 0
    try:
        data = apply_overrides(read_yaml_file(args.config) if args.config else {}, args.overrides)
        cfg = from_dict(TrainConfig, data)
    except ConfigError as err:
        print(f"megatron-kl config: config error: {err}", file=sys.stderr)
        return 2
    shown = [r for r in rows(TrainConfig, cfg) if not args.section or r[0].startswith(args.section.rstrip(".") + ".")]
    if not shown:
        print(
            f"megatron-kl config: no section {args.section!r}; sections: "
            f"{sorted({r[0].split('.')[0] for r in rows(TrainConfig)})}",
            file=sys.stderr,
        )
        return 2
    width = max(len(r[0]) for r in shown)
    for path, type_name, default, value, doc, rule in shown:
        changed = "" if value == default else f"   (default {_show(default)})"
        print(f"{path:<{width}}  {_show(value)}{changed}")
        kind = f"{type_name}, {rule}" if rule else type_name
        print(f"{'':<{width}}  {kind}. {doc}" if doc else f"{'':<{width}}  {kind}")
    return 0
