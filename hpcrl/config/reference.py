"""The config reference, ``docs/config.md``, generated from the schemas: ``python -m hpcrl.config.reference [--write]``.

    hpcrl/config/schema.py --ast, tokenize--> the comment ending each dataclass field's line: its meaning
    Config() and dataclasses.fields      ----> each field's name, type (as annotated) and default (live)
    -> a table per section: one per field of Config, one per nested dataclass (``cluster.net``), and one
       per dict of dataclasses (``cluster.roles.<role>``, whose default keys are listed in its parent's row)
    -> Markdown on stdout, or into docs/config.md with --write

The defaults come from the live dataclasses, not the source text, so a ``default_factory`` shows what it
makes. A field without a comment is an error that names it: the reference (and STYLE.md) needs one for
every field. tests/test_docs.py fails while docs/config.md differs from what this renders.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import io
import json
import re
import tokenize
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hpcrl.config import schema

DOC = Path(__file__).resolve().parents[2] / "docs" / "config.md"
COMMAND = "python -m hpcrl.config.reference --write"
INTRO = f"""\
<!-- generated from hpcrl/config/schema.py by `{COMMAND}`; edit the schema's comments, not this file -->
# Configuration reference

Every field of hpcrl's config, with its type, its default and the comment it carries in
`hpcrl/config/schema.py`. Set a field on the command line as `section.field=value` (for example
`run.max_steps=20` or `cluster.roles.server.setup_timeout_s=1800`), or pick a YAML file of a group
(`cluster=slurm_local`, `allocation=1node_8gpu`, ...) that sets several; `python -m hpcrl.main --cfg job`
prints the composed config. Ranges and cross-field rules are checked before anything starts
(`hpcrl/config/checks.py`): a bad value exits with code 2 and one line naming the field. A field that only some
modes use (`hpcrl/config/applies.py`, e.g. `workflow.max_turns` with `workflow.name=multi_turn`) is refused the
same way when given on the command line where it does not apply, and named in a warning line when a file sets it
there.

Defaults here are the schema's; the default groups of `hpcrl/conf/config.yaml` (`cluster=local`,
`allocation=cpu_tiny`, ...) override some of them.
"""


@dataclass(frozen=True)
class Row:
    key: str  # the field's name in its section
    type: str  # its annotation, as written in the schema
    default: str  # its default, as one would write it in an override (Markdown)
    meaning: str  # its comment


@dataclass(frozen=True)
class Section:
    path: str  # e.g. "cluster.net", or "cluster.roles.<role>"
    about: str  # the comment of the field that holds it
    rows: tuple[Row, ...]


def field_comments(source: str) -> dict[tuple[str, str], str]:
    """``(class name, field name) -> comment`` for every annotated field of every class in ``source``.

    The comment is the one on the field's line (on any of its lines, when the formatter wraps it)."""
    tokens = tokenize.generate_tokens(io.StringIO(source).readline)
    comments = {t.start[0]: t.string.removeprefix("#").strip() for t in tokens if t.type == tokenize.COMMENT}
    found: dict[tuple[str, str], str] = {}
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.ClassDef):
            continue
        for stmt in node.body:
            if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                lines = range(stmt.lineno, (stmt.end_lineno or stmt.lineno) + 1)
                found[(node.name, stmt.target.id)] = next((comments[n] for n in lines if n in comments), "")
    return found


def sections(cls: type, instance: Any, path: str, about: str, comments: dict[tuple[str, str], str]) -> list[Section]:
    """The section of ``instance`` (a ``cls``) at ``path``, then the sections nested in it."""
    rows: list[Row] = []
    nested: list[Section] = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        meaning = comments.get((cls.__name__, f.name))
        if not meaning:
            raise ValueError(
                f"{cls.__name__}.{f.name} in hpcrl/config/schema.py has no comment: write its unit or meaning "
                "after it (# ...), for the config reference"
            )
        value, where = getattr(instance, f.name), f"{path}.{f.name}" if path else f.name
        inner = _dict_value_type(hints[f.name])
        if dataclasses.is_dataclass(value):
            nested += sections(type(value), value, where, meaning, comments)
            default = f"see [{where}](#{anchor(where)})"
        elif inner is not None:
            nested += sections(inner, inner(), f"{where}.<{_singular(f.name)}>", meaning, comments)
            default = _dict_default(value, inner())
        else:
            default = f"`{escape_code(render(value))}`"
        rows.append(Row(f.name, str(f.type), default, meaning))
    return [Section(path, about, tuple(rows)), *nested] if path else nested


def render(value: Any) -> str:
    """A default as one writes it in an override or YAML: true, null, 0.0005, "runs", ["a", "b"]."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, int | float):
        return repr(value)
    return json.dumps(value, ensure_ascii=False)


def markdown(all_sections: list[Section]) -> str:
    parts = [INTRO, "Sections: " + ", ".join(f"[`{s.path}`](#{anchor(s.path)})" for s in all_sections) + ".\n"]
    for section in all_sections:
        level = "##" if "." not in section.path else "###"
        about = section.about[:1].upper() + section.about[1:]
        parts += [f"{level} {escape_text(section.path)}\n", f"{escape_text(about)}.\n"]
        parts += ["| field | type | default | meaning |", "|---|---|---|---|"]
        parts += [
            f"| `{r.key}` | `{escape_code(r.type)}` | {r.default} | {escape_text(r.meaning)} |" for r in section.rows
        ]
        parts.append("")
    return "\n".join(parts)


def reference() -> str:
    """docs/config.md as the live schema makes it."""
    comments = field_comments(Path(schema.__file__).read_text())
    return markdown(sections(schema.Config, schema.Config(), "", "", comments))


def anchor(title: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped (``cluster.net`` -> ``clusternet``)."""
    return re.sub(r"[^a-z0-9 _-]", "", title.lower()).replace(" ", "-")


def escape_text(text: str) -> str:
    """``text`` in a table cell: outside its code spans, characters Markdown would take as markup are escaped."""
    pieces = text.split("`")
    for i in range(0, len(pieces), 2):  # the even pieces are outside code spans
        pieces[i] = re.sub(r"([\\<*|])", r"\\\1", pieces[i])
    return "`".join(escape_code(p) if i % 2 else p for i, p in enumerate(pieces))


def escape_code(text: str) -> str:
    """``text`` inside a code span in a table cell: only the cell separator needs its backslash."""
    return text.replace("|", "\\|")


def _dict_value_type(hint: Any) -> type | None:
    """``X`` for a ``dict[str, X]`` whose X is a dataclass; else None."""
    args = typing.get_args(hint)
    if typing.get_origin(hint) is dict and len(args) == 2 and isinstance(args[1], type):
        return args[1] if dataclasses.is_dataclass(args[1]) else None
    return None


def _dict_default(value: dict[str, Any], base: Any) -> str:
    """The default keys of a dict of dataclasses, each with the fields where it differs from ``base``."""
    entries = []
    for key, item in value.items():
        fields = dataclasses.fields(item)
        changed = [
            f"{f.name}={render(getattr(item, f.name))}"
            for f in fields
            if getattr(item, f.name) != getattr(base, f.name)
        ]
        entries.append(f"`{key}`" + (f" (`{escape_code(', '.join(changed))}`)" if changed else ""))
    return ", ".join(entries) or "`{}`"


def _singular(name: str) -> str:
    return name.removesuffix("s")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m hpcrl.config.reference", description=__doc__.split("\n\n")[0])
    parser.add_argument("--write", action="store_true", help=f"write {DOC.relative_to(DOC.parents[1])}")
    args = parser.parse_args(argv)
    text = reference()
    if args.write:
        DOC.parent.mkdir(parents=True, exist_ok=True)
        DOC.write_text(text)
        print(f"wrote {DOC}")
    else:
        print(text, end="")


if __name__ == "__main__":
    main()
