"""Prompts and reference answers from local jsonl, json or parquet files, loaded with ``datasets``.

    rows = load_rows(["data/train.jsonl"], prompt_column="question", answer_column="answer",
                     prompt_template="Question: {prompt}\\nAnswer:")   # Dataset of {"prompt", "answer"}

Every file is loaded on its own with ``datasets.load_dataset("json" | "parquet", data_files=...)``,
by extension (``.jsonl``/``.json`` or ``.parquet``; one kind per list), from the local disk only: a
path that is not an existing file is an error, never a dataset name looked up on a hub. Each row
becomes ``{"prompt": prompt_template.format(**row, prompt=<prompt column>), "answer": <answer column>}``,
so the template may use any column of the row; ``{prompt}`` is always the prompt column.

The reward functions may take columns of the row by name (``hpcrl.reward.registry``): the columns they take
(``takes``; None: every column, for a function with ``**kwargs``) go with each row, as the JSON text of an object
in a ``columns`` column (``decode_columns`` makes it a dict again); a column one of them needs (``needs``: a
parameter without a default) that a file lacks is an error, as the prompt's and the answer's are. A value that
is not JSON (bytes, a date in a parquet file) in a column the rewards take is an error naming it.

``peek`` reads a file's columns and row count cheaply (a parquet file's metadata, a JSON-lines file's first line
and its count of lines) for the checks before a run (``hpcrl.config.preflight``); ``check_columns`` is the one
check of a file's columns, which ``load_rows`` makes too.

A prompt may also be a conversation, a list of ``{"role": ..., "content": ...}`` messages (chat format): such
a row's messages go, as JSON text, in a ``messages`` column (``""`` for the string prompts beside them), and
``hpcrl.data.chat.render_prompts`` turns them into the prompt text with the tokenizer's chat template, once the
model is known. There ``prompt_template`` applies to the content of the conversation's last user message
(``{prompt}``), which is where the question is.

Checked, with an error naming the file, the 0-based row (and for ``.jsonl`` the 1-based line) and the
column: a column that is missing or null, a prompt that is not a string, an answer that is not a
string or a number (numbers become strings: ``3`` -> ``"3"``, ``3.0`` -> ``"3"``, ``2.5`` ->
``"2.5"``), a message without a string role or content, invalid JSON, a template naming an unknown column or
failing on a row, an empty file.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import string
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import datasets
from datasets import Dataset

from hpcrl.data.mod10 import FEATURES
from hpcrl.errors import UserError

COLUMNS = "columns"  # the row's columns the rewards take, as the JSON text of an object ("{}" when none)

log = logging.getLogger(__name__)

KINDS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}  # extension -> datasets builder


class DataError(UserError, ValueError):
    """Bad dataset input; the message names the file, the row and the column."""


def load_rows(
    files: Sequence[str],
    prompt_column: str = "prompt",
    answer_column: str = "answer",
    prompt_template: str = "{prompt}",
    cache_dir: str | None = None,  # where datasets keeps its Arrow cache; None = its default (HF_DATASETS_CACHE)
    *,
    takes: Sequence[str] | None = (),  # columns the rewards take, carried with each row; None: every column
    needs: Mapping[str, str] | None = None,  # columns the rewards need -> what names them: a file must have them
) -> Dataset:
    """The rows of ``files``, in order, as ``{"prompt", "answer"}`` strings (and ``messages`` when some row is in chat
    format, ``columns`` when the rewards take some); ``DataError`` for bad input."""
    kind = _check_files(files)
    fields = template_fields(prompt_template)
    prompts: list[str] = []
    answers: list[str] = []
    messages: list[str] = []  # JSON text of a chat-format row's messages, "" for a string prompt
    carried: list[str] = []  # JSON text of the columns the rewards take
    for file in files:
        rows = _Rows(file, kind, cache_dir)
        check_columns(file, rows.columns, wanted_columns(prompt_column, answer_column, prompt_template, needs))
        take = [c for c in rows.columns if takes is None or c in takes]
        for i, row in enumerate(rows.values([prompt_column, answer_column, *sorted(fields - {"prompt"}), *take])):
            try:
                prompt = _prompt(prompt_column, row[prompt_column])
                answers.append(_answer(answer_column, row[answer_column]))
                carried.append(_columns_json({c: row[c] for c in take}))
                if isinstance(prompt, list):
                    prompts.append("")
                    messages.append(json.dumps(_template_last_user(prompt_template, prompt, row)))
                else:
                    prompts.append(_apply(prompt_template, {**row, "prompt": prompt}))
                    messages.append("")
            except _BadRow as e:
                raise DataError(f"{rows.where(i)}: {e}") from e.__cause__
    table, features = {"prompt": prompts, "answer": answers}, dict(FEATURES)
    if any(messages):
        table["messages"], features["messages"] = messages, datasets.Value("string")
    if takes is None or takes:
        table[COLUMNS], features[COLUMNS] = carried, datasets.Value("string")
    return Dataset.from_dict(table, features=datasets.Features(features))


def wanted_columns(
    prompt_column: str, answer_column: str, prompt_template: str, needs: Mapping[str, str] | None = None
) -> dict[str, str]:
    """The columns every file must have, each with the setting that names it (``check_columns``)."""
    fields = sorted(template_fields(prompt_template) - {"prompt"})
    return {
        **dict.fromkeys(fields, "dataset.prompt_template"),
        prompt_column: "dataset.prompt_column",
        answer_column: "dataset.answer_column",
        **{c: source for c, source in (needs or {}).items() if c not in (prompt_column, answer_column)},
    }


def check_columns(
    file: str, columns: Sequence[str], wanted: Mapping[str, str], holds: str = "the file's columns are"
) -> None:
    """``DataError`` naming the first column of ``wanted`` (column -> what names it) that ``columns`` lacks."""
    for column, source in wanted.items():
        if column not in columns:
            raise DataError(f"{file}: row 0: no column {column!r} (named by {source}); {holds}: {', '.join(columns)}")


def decode_columns(row: Mapping[str, Any]) -> dict[str, Any]:
    """A loaded row as the run uses it: its ``columns`` (JSON text in the dataset) as a dict."""
    out = dict(row)
    out[COLUMNS] = json.loads(row[COLUMNS]) if row.get(COLUMNS) else {}
    return out


@dataclass(frozen=True)
class Shape:
    """What ``peek`` reads of a data file."""

    columns: list[str]  # its columns (a JSON file's: the first row's keys)
    rows: int | None  # its rows; None when not counted


def peek(file: str, count: bool = True) -> Shape:
    """A data file's columns and (with ``count``) its number of rows, read cheaply: a parquet file's metadata, a
    JSON-lines file's first line and a count of its lines that are not blank, a JSON array parsed whole; a file
    that is none of these (a JSON value over several lines, say) is loaded as ``load_rows`` loads it. Raises
    ``DataError`` as ``load_rows`` would for a missing, empty or row-less file."""
    kind = _check_files([file])
    path = Path(file).expanduser()
    if path.stat().st_size == 0:
        raise DataError(f"{file}: the file is empty")
    shape = _peek_parquet(path) if kind == "parquet" else _peek_json_lines(path, count) or _peek_json_array(file)
    if shape is None:  # neither: what datasets makes of it
        rows = _Rows(file, kind, None)
        shape = Shape(rows.columns, len(rows))
    if shape.rows == 0:
        raise DataError(f"{file}: the file has no rows")
    return shape


def _peek_parquet(path: Path) -> Shape | None:
    import pyarrow.parquet as pq

    try:
        meta = pq.ParquetFile(path)
    except Exception:  # not parquet: load_rows says what datasets says
        return None
    return Shape(list(meta.schema_arrow.names), meta.metadata.num_rows)


def _peek_json_lines(path: Path, count: bool) -> Shape | None:
    with open(path, "rb") as f:
        first = next((line for line in f if line.strip()), b"")
        if first.lstrip().startswith(b"["):
            return None
        try:
            record = json.loads(first)
        except ValueError:
            return None
        if not isinstance(record, dict):
            return None
        rows = 1 + sum(1 for line in f if line.strip()) if count else None
    return Shape(list(record), rows)


def _peek_json_array(file: str) -> Shape | None:
    try:
        records = read_json_rows(file)
    except DataError:
        return None
    return Shape(list(records[0]) if records else [], len(records))


def _columns_json(columns: dict[str, Any]) -> str:
    """The columns the rewards take as JSON text; ``_BadRow`` naming a value that is not JSON."""
    for column, value in columns.items():
        try:
            json.dumps(value, allow_nan=False)
        except (TypeError, ValueError) as e:
            raise _BadRow(
                f"column {column!r} is {_describe(value)}, which a reward function takes as a JSON value (str, number, "
                f"bool, list, dict, null) and this is not: {e}"
            ) from e
    return json.dumps(columns)


def template_fields(template: str) -> set[str]:
    """The names ``template`` uses (``{name}``, ``{name.attr}``, ``{name[0]}`` all give ``name``)."""
    try:
        parsed = list(string.Formatter().parse(template))
    except ValueError as e:
        raise DataError(f"dataset.prompt_template={template!r} is not a valid format string: {e}") from e
    names = set()
    for _, name, _, _ in parsed:
        if name is None:
            continue
        root = name.split(".", 1)[0].split("[", 1)[0]
        if not root.isidentifier():
            raise DataError(
                f"dataset.prompt_template={template!r} has a field {{{name}}}; use named fields such as "
                "{prompt} or {column_name}"
            )
        names.add(root)
    return names


def _check_files(files: Sequence[str]) -> str:
    if isinstance(files, str) or not files:
        raise DataError(f"dataset files: expected a non-empty list of local file paths, got {files!r}")
    kinds = {}
    for file in files:
        path = Path(file).expanduser()
        kind = KINDS.get(path.suffix.lower())
        if kind is None:
            raise DataError(f"{file}: unknown extension {path.suffix!r}; expected one of {', '.join(KINDS)}")
        if not path.is_file():
            why = "is not a file" if path.exists() else "does not exist"
            raise DataError(f"{file}: {why} (resolved to {path.resolve()}); dataset files must be local files")
        kinds[file] = kind
    if len(set(kinds.values())) > 1:
        listing = ", ".join(f"{f} ({k})" for f, k in kinds.items())
        raise DataError(f"dataset files mix json and parquet: {listing}; use files of one kind in one list")
    return next(iter(kinds.values()))


class _Rows:
    """One loaded file: its columns, its rows' values, and where row i is, for messages."""

    def __init__(self, file: str, kind: str, cache_dir: str | None):
        self.file, self.kind = file, kind
        self.path = Path(file).expanduser().resolve()
        self._lines: list[int] | None = None
        self._records: list[dict[str, Any]] | None = None  # set when the json module read the file
        if self.path.stat().st_size == 0:
            raise DataError(f"{file}: the file is empty")
        try:
            with _quiet():
                self.ds = datasets.load_dataset(kind, data_files=str(self.path), split="train", cache_dir=cache_dir)
            self.columns = list(self.ds.column_names)
        except Exception as e:
            if kind != "json":
                raise DataError(f"{file}: datasets cannot load it as {kind}: {_cause(e)}") from e
            # Invalid JSON fails here, naming the row. Valid JSON that datasets cannot load (a blank
            # line next to values whose type varies, say) is read with the json module instead.
            self._records = read_json_rows(file)
            log.warning("%s: datasets cannot load it (%s); read it with the json module instead", file, _cause(e))
            self.columns = list(dict.fromkeys(key for record in self._records for key in record))
        if len(self) == 0:
            raise DataError(f"{file}: the file has no rows")

    def __len__(self) -> int:
        return len(self._records) if self._records is not None else len(self.ds)

    def values(self, columns: list[str]) -> Iterator[dict[str, Any]]:
        """Each row's values of ``columns``, as Python objects."""
        columns = list(dict.fromkeys(columns))
        if self._records is not None:
            yield from ({c: record.get(c) for c in columns} for record in self._records)
            return
        table = self.ds.select_columns(columns).to_dict()
        # datasets stores a JSON column whose type varies from row to row as JSON text and reads strings
        # that look like JSON back as what they spell ("01" -> 1, "[1, 2]" -> a list): such columns are
        # read again from the file with the json module, which keeps every value as written.
        mixed = [c for c in table if isinstance(self.ds.features[c], datasets.Json)]
        if mixed and self.kind == "json":
            exact = read_json_rows(self.file)
            for c in mixed:
                table[c] = [record.get(c) for record in exact]
        for values in zip(*table.values(), strict=True):
            yield dict(zip(columns, values, strict=True))

    def where(self, i: int) -> str:
        if self.path.suffix.lower() != ".jsonl":
            return f"{self.file}: row {i}"
        if self._lines is None:
            self._lines = _record_lines(self.path)
        line = f" (line {self._lines[i]})" if i < len(self._lines) else ""
        return f"{self.file}: row {i}{line}"


def read_json_rows(file: str) -> list[dict[str, Any]]:
    """The records of a JSON-lines file (blank lines skipped) or of a JSON array, read with ``json``."""
    path = Path(file).expanduser()
    text = path.read_text(encoding="utf-8")
    if text.lstrip().startswith("["):
        try:
            records = json.loads(text)
        except ValueError as e:
            raise DataError(f"{file}: not valid JSON: {e}") from e
        where = [f"{file}: row {i}" for i in range(len(records))]
    else:
        records, where = [], []
        for n, line in enumerate(text.splitlines(), start=1):
            if not line.strip():
                continue
            at = f"{file}: row {len(records)} (line {n})"
            try:
                records.append(json.loads(line))
            except ValueError as e:
                raise DataError(f"{at}: not valid JSON: {e}") from e
            where.append(at)
    for at, record in zip(where, records, strict=True):
        if not isinstance(record, dict):
            raise DataError(f"{at}: expected a JSON object (one row), got {type(record).__name__}")
    return records


def _record_lines(path: Path) -> list[int]:
    """The 1-based line number of each record of a JSON-lines file (blank lines hold none)."""
    with open(path, encoding="utf-8") as f:
        return [n for n, line in enumerate(f, start=1) if line.strip()]


class _BadRow(Exception):
    """What is wrong with one row; ``load_rows`` adds where the row is."""


def _prompt(column: str, value: Any) -> str | list[dict[str, str]]:
    if isinstance(value, str):
        return value
    expected = "expected a string prompt, or a list of {role, content} messages"
    if not isinstance(value, list) or not value:
        raise _BadRow(f"column {column!r} is {_describe(value)}; {expected}")
    for n, message in enumerate(value):
        ok = isinstance(message, dict) and all(isinstance(message.get(k), str) for k in ("role", "content"))
        if not ok:
            raise _BadRow(f"column {column!r}: message {n} is {_describe(message)}; {expected}, each a string")
    return [{"role": m["role"], "content": m["content"]} for m in value]


def _template_last_user(template: str, messages: list[dict[str, str]], row: dict[str, Any]) -> list[dict[str, str]]:
    """The conversation with ``template`` applied to its last user message (``{prompt}`` is that message)."""
    if template == "{prompt}":
        return messages
    users = [i for i, m in enumerate(messages) if m["role"] == "user"]
    if not users:
        why = "applies to a conversation's last user message, and this one has none"
        raise _BadRow(f"dataset.prompt_template={template!r} {why}")
    last = users[-1]
    content = _apply(template, {**row, "prompt": messages[last]["content"]})
    return [*messages[:last], {**messages[last], "content": content}, *messages[last + 1 :]]


def _answer(column: str, value: Any) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    if isinstance(value, float) and math.isfinite(value):
        return str(int(value)) if value.is_integer() else repr(value)
    raise _BadRow(f"column {column!r} is {_describe(value)}; expected a string or a number")


def _apply(template: str, row: dict[str, Any]) -> str:
    try:
        return template.format(**row)
    except (KeyError, IndexError, AttributeError, TypeError, ValueError) as e:
        why = f"{type(e).__name__}: {e}"
        raise _BadRow(f"dataset.prompt_template={template!r} fails on this row: {why}") from e


def _describe(value: Any) -> str:
    if value is None:
        return "missing or null"
    text = repr(value)
    return f"a {type(value).__name__} ({text if len(text) <= 60 else text[:57] + '...'})"


def _cause(e: BaseException) -> str:
    while e.__cause__ is not None or (e.__context__ is not None and not str(e)):
        e = e.__cause__ or e.__context__  # type: ignore[assignment]
    return f"{type(e).__name__}: {e}"


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """No progress bars while loading (they would fill the controller's log)."""
    was_enabled = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        if was_enabled:
            datasets.enable_progress_bars()
