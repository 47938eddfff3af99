"""Where training problems come from: files, saved datasets and the hub, mapped to :class:`Example`.

Every user mistake in the data (a missing file, an unknown hub name, a bad row) is a
:class:`~opsd.errors.UserError` whose one line names the file, the row or line, and the key.
:class:`DataCursor` walks the examples in deterministic, resumable, rank-sharded epochs.
"""

from __future__ import annotations

import json
import logging
import math
import re
import tempfile
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from opsd.errors import UserError
from opsd.fetch import hub_reachable

if TYPE_CHECKING:
    pass

logger = logging.getLogger(__name__)

FILE_SUFFIXES = (".jsonl", ".ndjson", ".json", ".parquet", ".csv")
_MAX_LOGGED_SKIPS = 10


@dataclass
class Example:
    problem: str | list[dict]  # string or chat messages list
    solution: str  # privileged information (may be "")
    answer: str | None
    row: int  # 0-based row index in the source (for messages)
    target: str | None = None  # the SFT target (data.target_key), apart from the privileged text


@dataclass
class LoadReport:
    examples: list[Example]
    skipped_bad: int
    empty_solution: int
    dropped_empty: int
    source: str


class _BadRow(UserError):
    """A problem confined to one row: skippable with skip_bad_rows=True."""


@dataclass(frozen=True)
class RowKeys:
    """Which field of a row holds what: the problem (a string, or chat messages), the privileged
    information (None: there is none, every solution is ""), the gold answer (None: not read) and the
    SFT target (None: not read; a string every row must have, kept apart from the solution)."""

    problem: str = "problem"
    solution: str | None = "solution"
    answer: str | None = None
    target: str | None = None


def load_examples(
    source: str,
    keys: RowKeys | None = None,
    *,
    split: str = "train",
    skip_bad_rows: bool = False,
    drop_empty_solution: bool = False,
    require_answer: bool = False,
) -> LoadReport:
    """Load problems (+ privileged info, + optional gold answer) from a file, a save_to_disk dir or the hub.

    source: a .jsonl/.ndjson/.json/.parquet/.csv file, a `datasets` save_to_disk directory (a DatasetDict
    is indexed by `split`), or a hub dataset name, optionally `name:config` (needs network).
    ``keys``: which field holds what (default :class:`RowKeys`'s); ``keys.solution=None`` means there is
    no privileged information (external-teacher mode): solution = "".
    Rows are 0-based (as in `ds[i]`); JSONL errors also give the 1-based line number.
    Nothing is dropped silently: skipped bad rows and dropped empty-solution rows are counted in the
    report and announced with warnings.warn. Text files may start with a UTF-8 byte-order mark.
    Raises UserError for anything wrong with the data or the source name.
    """
    keys = keys or RowKeys()
    if drop_empty_solution and keys.solution is None:
        raise ValueError(
            "drop_empty_solution=True needs a solution key (keys.solution=None means every row is empty)"
        )
    if require_answer and keys.answer is None:
        raise ValueError("require_answer=True needs an answer key (keys.answer)")
    source = str(source)
    skipped: list[str] = []
    rows = _read_rows(source, split, skip_bad_rows, skipped)  # list of (row, location, record-or-error)

    examples: list[Example] = []
    empty_solution = dropped_empty = missing_answer = 0
    for row, where, record in rows:
        try:
            if isinstance(record, _BadRow):
                raise record
            ex = _row_to_example(
                record,
                row,
                f"{source}: {where}",
                keys,
                require_answer,
            )
        except _BadRow as err:
            if not skip_bad_rows:
                raise UserError(str(err)) from None
            skipped.append(str(err))
            if len(skipped) <= _MAX_LOGGED_SKIPS:
                logger.warning("skipping bad row: %s", err)
            continue
        if keys.answer is not None and ex.answer is None:
            missing_answer += 1
        if keys.solution is not None and not ex.solution.strip():
            empty_solution += 1
            if drop_empty_solution:
                dropped_empty += 1
                continue
        examples.append(ex)

    total = len(rows)
    if skipped:
        warnings.warn(
            f"{source}: skipped {len(skipped)} bad rows (skip_bad_rows=True); first: {skipped[0]}",
            stacklevel=2,
        )
    if empty_solution:
        action = "dropped them" if drop_empty_solution else "pass drop_empty_solution=True to drop them"
        warnings.warn(
            f"{source}: {empty_solution} of {total} rows have an empty {keys.solution!r} (privileged "
            "information); for those the teacher sees what the student sees and gives almost no "
            f"signal; {action}",
            stacklevel=2,
        )
    if missing_answer:
        warnings.warn(
            f"{source}: {missing_answer} of {total} rows have no {keys.answer!r} (answer = None)",
            stacklevel=2,
        )
    if not examples:
        why = f"; first skipped row: {skipped[0]}" if skipped else ""
        raise UserError(
            f"{source}: no usable rows ({total} read, {len(skipped)} skipped as bad, {dropped_empty} dropped "
            f"for an empty solution){why}"
        )
    return LoadReport(examples, len(skipped), empty_solution, dropped_empty, source)


def _read_rows(
    source: str, split: str, skip_bad_rows: bool, skipped: list[str]
) -> list[tuple[int, str, Any]]:
    """Dispatch on the kind of source; returns (row, human location, record dict or _BadRow)."""
    path = Path(source).expanduser()
    if path.is_dir():
        records = _read_saved_dataset(path, split)
    elif path.is_file():
        if path.stat().st_size == 0:
            raise UserError(f"{source}: empty file (0 bytes)")
        suffix = path.suffix.lower()
        if suffix in (".jsonl", ".ndjson"):
            rows = _read_jsonl(path)
            if not rows:
                raise UserError(f"{source}: empty file (no JSON lines, only blank lines)")
            return rows
        if suffix == ".json":
            records = _read_json(path)
        elif suffix == ".parquet":
            records = _read_parquet(path)
        elif suffix == ".csv":
            records = _read_csv(path, skip_bad_rows, skipped)
        else:
            raise UserError(
                f"{source}: unsupported file type {suffix!r}; expected one of {', '.join(FILE_SUFFIXES)}"
            )
    elif not _could_be_hub_name(source):
        where = "" if path.is_absolute() else f" (relative to {Path.cwd()})"
        raise UserError(f"{source}: no such file or directory{where}")
    else:
        records = _read_hub(source, split)
    if not records:
        raise UserError(f"{source}: empty file (no rows)" if path.is_file() else f"{source}: no rows")
    return [(i, f"row {i}", r) for i, r in enumerate(records)]


def _read_jsonl(path: Path) -> list[tuple[int, str, Any]]:
    # Parsed line by line with the stdlib json module (not datasets) so a malformed line is reported by
    # its line number and can be skipped alone, and per-row types (e.g. int answers) are kept as written.
    rows: list[tuple[int, str, Any]] = []
    with path.open(encoding="utf-8-sig") as f:  # utf-8-sig: tolerate a byte-order mark
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            row = len(rows)
            where = f"line {lineno} (row {row})"
            try:
                record: Any = json.loads(line)
            except json.JSONDecodeError as err:
                record = _BadRow(f"{path}: {where}: malformed JSON ({err.msg} at column {err.colno})")
            rows.append((row, where, record))
    return rows


def _read_json(path: Path) -> list[dict]:
    import datasets

    # A throwaway cache dir: a local file should leave nothing behind in ~/.cache/huggingface.
    with tempfile.TemporaryDirectory() as cache_dir:
        try:
            ds = datasets.load_dataset(
                "json", data_files=str(path), split="train", cache_dir=cache_dir, keep_in_memory=True
            )
        except Exception as err:
            raise UserError(
                f"{path}: could not read JSON (expected an array of objects or JSON Lines): "
                f"{_root_cause(err)}"
            ) from err
        return ds.to_list()


def _read_parquet(path: Path) -> list[dict]:
    import pyarrow.parquet as pq

    try:
        return pq.read_table(path).to_pylist()
    except Exception as err:
        raise UserError(f"{path}: could not read Parquet: {err}") from err


def _read_csv(path: Path, skip_bad_rows: bool, skipped: list[str]) -> list[dict]:
    import pyarrow as pa
    import pyarrow.csv as pcsv

    def on_invalid(bad: Any) -> str:
        msg = f"{path}: line {bad.number}: expected {bad.expected_columns} columns, got {bad.actual_columns}"
        if not skip_bad_rows:
            return "error"
        skipped.append(msg)
        if len(skipped) <= _MAX_LOGGED_SKIPS:
            logger.warning("skipping bad row: %s", msg)
        return "skip"

    parse = pcsv.ParseOptions(newlines_in_values=True, invalid_row_handler=on_invalid)
    header_only = pcsv.ParseOptions(newlines_in_values=True, invalid_row_handler=lambda bad: "skip")
    try:
        # CSV has no types: read every column as a string so "007" stays "007" (answers especially).
        names = pcsv.open_csv(path, parse_options=header_only).schema.names
        convert = pcsv.ConvertOptions(column_types={n: pa.string() for n in names})
        return pcsv.read_csv(path, parse_options=parse, convert_options=convert).to_pylist()
    except pa.ArrowInvalid as err:
        raise UserError(f"{path}: could not read CSV: {' '.join(str(err).split())}") from err


def _read_saved_dataset(path: Path, split: str) -> list[dict]:
    import datasets

    try:
        ds = datasets.load_from_disk(str(path))
    except Exception as err:
        raise UserError(
            f"{path}: not a Hugging Face datasets directory (save_to_disk output): {_root_cause(err)}"
        ) from err
    if isinstance(ds, datasets.DatasetDict):
        if split not in ds:
            raise UserError(f"{path}: no split {split!r}; available splits: {sorted(ds)}")
        ds = ds[split]
    return ds.to_list()


def _could_be_hub_name(source: str) -> bool:
    """`name` or `owner/name` as the hub allows, optionally with `:config`; else a missing local path."""
    from huggingface_hub.utils import validate_repo_id

    repo, _, config = source.partition(":")
    if Path(source).suffix.lower() in FILE_SUFFIXES or re.fullmatch(r"[\w.-]*", config) is None:
        return False
    try:
        validate_repo_id(repo)
    except Exception:
        return False
    return True


def _read_hub(name: str, split: str) -> list[dict]:
    import datasets
    from huggingface_hub import constants

    repo, _, config = name.partition(":")
    missing = f"{name}: no such local file or directory"
    hint = "pass a local .jsonl/.json/.parquet/.csv file or a save_to_disk directory"
    offline = bool(constants.HF_HUB_OFFLINE or getattr(datasets.config, "HF_HUB_OFFLINE", False))
    # huggingface_hub retries an unreachable host with backoff for ~20 s; one short probe fails fast.
    if not offline and not hub_reachable():
        raise UserError(
            f"{missing}, and the Hugging Face hub ({constants.ENDPOINT}) is unreachable, so it cannot be "
            f"loaded as a hub dataset either; {hint} (or set HF_HUB_OFFLINE=1 to use a cached hub copy)"
        )
    try:
        ds = datasets.load_dataset(repo, config or None, split=split)
    except Exception as err:
        if offline:
            raise UserError(
                f"{missing}, and offline mode is on (HF_HUB_OFFLINE=1) with no cached hub copy of it; {hint}"
            ) from err
        if isinstance(err, ConnectionError):
            raise UserError(
                f"{missing}, and the Hugging Face hub is unreachable ({_root_cause(err)}); {hint}"
            ) from err
        if isinstance(err, FileNotFoundError):  # datasets' DatasetNotFoundError included
            raise UserError(
                f"{missing}, and the Hugging Face hub has no dataset {repo!r} (unknown name, or private); "
                f"{hint}"
            ) from err
        raise UserError(
            f"{missing}; as a hub dataset {repo!r} (config {config or None!r}, split {split!r}) it could not "
            f"be loaded: {_root_cause(err)}"
        ) from err
    return ds.to_list()


def _root_cause(err: BaseException) -> str:
    """The innermost cause, on one line (library messages often span several)."""
    while err.__cause__ is not None:
        err = err.__cause__
    return f"{type(err).__name__}: {' '.join(str(err).split())}"


def _row_to_example(
    record: Any,
    row: int,
    where: str,
    keys: RowKeys,
    require_answer: bool,
) -> Example:
    """One row as an :class:`Example`; ``keys``: the problem, solution, answer and target fields."""
    problem_key = keys.problem
    solution_key = keys.solution
    answer_key = keys.answer
    target_key = keys.target
    if not isinstance(record, dict):
        raise _BadRow(f"{where}: expected a JSON object, got {type(record).__name__}")

    def field(key: str) -> Any:
        if key not in record:
            raise _BadRow(f"{where}: missing field {key!r}; available keys: {sorted(record)}")
        value = record[key]
        if value is None:
            raise _BadRow(f"{where}: field {key!r} is null")
        return value

    problem = field(problem_key)
    if isinstance(problem, str):
        if not problem.strip():
            raise _BadRow(f"{where}: field {problem_key!r} is an empty string")
    elif isinstance(problem, list):
        problem = check_messages(problem, f"{where}: field {problem_key!r}", _BadRow)
    else:
        raise _BadRow(
            f"{where}: field {problem_key!r} must be a string or a chat messages list, got "
            f"{type(problem).__name__}"
        )

    solution = ""
    if solution_key is not None:
        solution = field(solution_key)
        if not isinstance(solution, str):
            raise _BadRow(f"{where}: field {solution_key!r} must be a string, got {type(solution).__name__}")

    answer = None
    if answer_key is not None:
        if record.get(answer_key) is None:
            if require_answer:
                field(answer_key)  # raises with the available keys / null
        else:
            answer = _answer_to_str(record[answer_key], f"{where}: field {answer_key!r}")
            if not answer.strip():  # a blank gold answer grades nothing: same as a missing one
                if require_answer:
                    raise _BadRow(f"{where}: field {answer_key!r} is an empty string")
                answer = None
    target = None
    if target_key is not None:
        target = field(target_key)
        if not isinstance(target, str) or not target.strip():
            raise _BadRow(f"{where}: field {target_key!r} must be a non-empty string (data.target_key)")
    return Example(problem=problem, solution=solution, answer=answer, row=row, target=target)


def _answer_to_str(value: Any, where: str) -> str:
    # GSM8K/AIME files often store answers as numbers; grading works on strings.
    if isinstance(value, str):
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _BadRow(f"{where} must be a string or a number, got {type(value).__name__}")
    if isinstance(value, float):
        if not math.isfinite(value):
            raise _BadRow(f"{where} is not a finite number: {value}")
        if value.is_integer():
            return str(int(value))
    return str(value)


def check_messages(messages: list, where: str, error: type[Exception] = ValueError) -> list[dict]:
    """A chat problem: a non-empty list of {role: str, content: str} with at least one user turn."""
    if not messages:
        raise error(f"{where}: empty messages list")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise error(f"{where}: message {i} must be a {{role, content}} object, got {type(m).__name__}")
        for key in ("role", "content"):
            if not isinstance(m.get(key), str):
                raise error(
                    f"{where}: message {i} needs a string {key!r}, got {type(m.get(key)).__name__}; "
                    f"keys: {sorted(m)}"
                )
        out.append({"role": m["role"], "content": m["content"]})
    if not any(m["role"] == "user" for m in out):
        raise error(f"{where}: messages list has no 'user' message; roles: {[m['role'] for m in out]}")
    return out


def take_rows(examples: list[Example], rows: tuple[int, int] | None, key: str, source: str) -> list[Example]:
    """Rows ``START`` to ``END - 1`` (0-based, file order); every row for None. One line naming the key
    when the range is backwards or selects nothing. A dev slice of a training file is
    ``data.rows=[0,1869]`` for training and ``eval.rows=[1869,2069]`` for evaluation: never a shared row."""
    if rows is None:
        return examples
    start, end = rows
    if not 0 <= start < end:
        raise UserError(f"{key}=[{start}, {end}]: expected 0 <= START < END")
    kept = examples[start:end]
    if not kept:
        raise UserError(f"{key}=[{start}, {end}] selects no rows of {source} ({len(examples)} rows)")
    return kept
