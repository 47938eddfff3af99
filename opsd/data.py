"""Datasets, prompt construction and token-budget micro-batching for OPSD.

The trainer needs, per problem, a student prompt (problem only) and a teacher prompt (problem plus
privileged information), both as token ids, with the student's sampled response appended to both
*as the same ids*. Everything here works on token ids so the response positions line up exactly.
"""

from __future__ import annotations

import json
import logging
import math
import string
import tempfile
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

logger = logging.getLogger(__name__)

FILE_SUFFIXES = (".jsonl", ".ndjson", ".json", ".parquet", ".csv")
_MAX_LOGGED_SKIPS = 10

# ----------------------------------------------------------------------------------------------------
# 1. Datasets


@dataclass
class Example:
    problem: str | list[dict]  # string or chat messages list
    solution: str  # privileged information (may be "")
    answer: str | None
    row: int  # 0-based row index in the source (for messages)


@dataclass
class LoadReport:
    examples: list[Example]
    skipped_bad: int
    empty_solution: int
    dropped_empty: int
    source: str


class _BadRow(ValueError):
    """A problem confined to one row: skippable with skip_bad_rows=True."""


def load_examples(
    source: str,
    *,
    problem_key: str = "problem",
    solution_key: str | None = "solution",
    answer_key: str | None = None,
    split: str = "train",
    skip_bad_rows: bool = False,
    drop_empty_solution: bool = False,
    require_answer: bool = False,
) -> LoadReport:
    """Load problems (+ privileged info, + optional gold answer) from a file, a save_to_disk dir or the hub.

    source: a .jsonl/.ndjson/.json/.parquet/.csv file, a `datasets` save_to_disk directory (a DatasetDict
    is indexed by `split`), or a hub dataset name, optionally `name:config` (needs network).
    solution_key=None means there is no privileged information (external-teacher mode): solution = "".
    Rows are 0-based (as in `ds[i]`); JSONL errors also give the 1-based line number.
    Nothing is dropped silently: skipped bad rows and dropped empty-solution rows are counted in the
    report and announced with warnings.warn.
    """
    if drop_empty_solution and solution_key is None:
        raise ValueError(
            "drop_empty_solution=True needs a solution_key (solution_key=None means every row is empty)"
        )
    if require_answer and answer_key is None:
        raise ValueError("require_answer=True needs an answer_key")
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
                record, row, f"{source}: {where}", problem_key, solution_key, answer_key, require_answer
            )
        except _BadRow as err:
            if not skip_bad_rows:
                raise ValueError(str(err)) from None
            skipped.append(str(err))
            if len(skipped) <= _MAX_LOGGED_SKIPS:
                logger.warning("skipping bad row: %s", err)
            continue
        if answer_key is not None and ex.answer is None:
            missing_answer += 1
        if solution_key is not None and not ex.solution.strip():
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
            f"{source}: {empty_solution} of {total} rows have an empty {solution_key!r} (privileged information); "
            f"for those the teacher sees what the student sees and gives almost no signal; {action}",
            stacklevel=2,
        )
    if missing_answer:
        warnings.warn(
            f"{source}: {missing_answer} of {total} rows have no {answer_key!r} (answer = None)", stacklevel=2
        )
    if not examples:
        why = f"; first skipped row: {skipped[0]}" if skipped else ""
        raise ValueError(
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
            raise ValueError(f"{source}: empty file (0 bytes)")
        suffix = path.suffix.lower()
        if suffix in (".jsonl", ".ndjson"):
            rows = _read_jsonl(path)
            if not rows:
                raise ValueError(f"{source}: empty file (no JSON lines, only blank lines)")
            return rows
        if suffix == ".json":
            records = _read_json(path)
        elif suffix == ".parquet":
            records = _read_parquet(path)
        elif suffix == ".csv":
            records = _read_csv(path, skip_bad_rows, skipped)
        else:
            raise ValueError(
                f"{source}: unsupported file type {suffix!r}; expected one of {', '.join(FILE_SUFFIXES)}"
            )
    elif path.suffix.lower() in FILE_SUFFIXES or source.startswith(("/", "./", "../", "~")):
        raise FileNotFoundError(f"{source}: no such file or directory")
    else:
        records = _read_hub(source, split)
    if not records:
        raise ValueError(f"{source}: empty file (no rows)" if path.is_file() else f"{source}: no rows")
    return [(i, f"row {i}", r) for i, r in enumerate(records)]


def _read_jsonl(path: Path) -> list[tuple[int, str, Any]]:
    # Parsed line by line with the stdlib json module (not datasets) so a malformed line is reported by
    # its line number and can be skipped alone, and per-row types (e.g. int answers) are kept as written.
    rows: list[tuple[int, str, Any]] = []
    with path.open(encoding="utf-8") as f:
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
            raise ValueError(
                f"{path}: could not read JSON (expected an array of objects or JSON Lines): {_root_cause(err)}"
            ) from err
        return ds.to_list()


def _read_parquet(path: Path) -> list[dict]:
    import pyarrow.parquet as pq

    try:
        return pq.read_table(path).to_pylist()
    except Exception as err:
        raise ValueError(f"{path}: could not read Parquet: {err}") from err


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
        raise ValueError(f"{path}: could not read CSV: {err}") from err


def _read_saved_dataset(path: Path, split: str) -> list[dict]:
    import datasets

    try:
        ds = datasets.load_from_disk(str(path))
    except Exception as err:
        raise ValueError(
            f"{path}: not a Hugging Face datasets directory (save_to_disk output): {_root_cause(err)}"
        ) from err
    if isinstance(ds, datasets.DatasetDict):
        if split not in ds:
            raise ValueError(f"{path}: no split {split!r}; available splits: {sorted(ds)}")
        ds = ds[split]
    return ds.to_list()


def _read_hub(name: str, split: str) -> list[dict]:
    import datasets
    from huggingface_hub import constants

    repo, _, config = name.partition(":")
    hint = "pass a local .jsonl/.json/.parquet/.csv file or a save_to_disk directory instead"
    offline = bool(constants.HF_HUB_OFFLINE or getattr(datasets.config, "HF_HUB_OFFLINE", False))
    # huggingface_hub retries an unreachable host with backoff for ~20 s; one short probe fails fast.
    if not offline and not _hub_reachable():
        raise ConnectionError(
            f"{name!r} is not a local file or directory, so it was taken as a hub dataset name, but the "
            f"Hugging Face hub ({constants.ENDPOINT}) is unreachable; {hint} "
            "(or set HF_HUB_OFFLINE=1 to use a copy already in the local cache)"
        )
    try:
        ds = datasets.load_dataset(repo, config or None, split=split)
    except ConnectionError as err:
        raise ConnectionError(
            f"hub dataset {repo!r}: the Hugging Face hub is unreachable or offline mode is on and the dataset "
            f"is not cached ({err}); {hint}"
        ) from err
    except Exception as err:
        raise ValueError(
            f"hub dataset {repo!r} (config {config or None!r}, split {split!r}) could not be loaded: "
            f"{_root_cause(err)}. If the hub is unreachable, {hint}"
        ) from err
    return ds.to_list()


def _hub_reachable(timeout_s: float = 5.0) -> bool:
    from huggingface_hub import constants
    from huggingface_hub.utils import get_session

    try:
        get_session().head(constants.ENDPOINT, timeout=timeout_s)  # any HTTP answer means reachable
    except Exception:
        return False
    return True


def _root_cause(err: BaseException) -> str:
    while err.__cause__ is not None:
        err = err.__cause__
    return f"{type(err).__name__}: {err}"


def _row_to_example(
    record: Any,
    row: int,
    where: str,
    problem_key: str,
    solution_key: str | None,
    answer_key: str | None,
    require_answer: bool,
) -> Example:
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
        problem = _check_messages(problem, f"{where}: field {problem_key!r}", _BadRow)
    else:
        raise _BadRow(
            f"{where}: field {problem_key!r} must be a string or a chat messages list, got {type(problem).__name__}"
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
    return Example(problem=problem, solution=solution, answer=answer, row=row)


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


def _check_messages(messages: list, where: str, error: type[Exception] = ValueError) -> list[dict]:
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


class DataCursor:
    """Deterministic shuffled epochs with a seed, sharded by rank, exactly resumable.

    Epoch e uses the permutation numpy.random.default_rng([seed, e]).permutation(num_examples), so
    order depends only on (seed, epoch). The cursor walks one global stream of indices: each call draws
    the next k * world_size indices (crossing epoch boundaries seamlessly) and rank r keeps the
    contiguous slice [r*k, (r+1)*k). Every rank's cursor therefore holds the same state, so the state
    of any rank resumes all of them, even under a different world_size.
    Ranks are disjoint within a global batch unless that batch crosses an epoch boundary or is larger
    than the dataset (then an example can appear once per epoch it spans).
    """

    def __init__(
        self, num_examples: int, seed: int, rank: int = 0, world_size: int = 1, shuffle: bool = True
    ):
        if num_examples <= 0:
            raise ValueError(f"num_examples must be > 0, got {num_examples}")
        if seed < 0:
            raise ValueError(f"seed must be >= 0, got {seed}")
        if world_size <= 0 or not 0 <= rank < world_size:
            raise ValueError(f"need 0 <= rank < world_size, got rank={rank} world_size={world_size}")
        self.num_examples = num_examples
        self.seed = seed
        self.rank = rank
        self.world_size = world_size
        self.shuffle = shuffle
        self.epoch = 0  # epoch of the next index to be drawn
        self._pos = 0  # position of the next index within this epoch's permutation
        self._perm: np.ndarray | None = None

    def _permutation(self) -> np.ndarray:
        if self._perm is None:
            n = self.num_examples
            self._perm = (
                np.random.default_rng([self.seed, self.epoch]).permutation(n)
                if self.shuffle
                else np.arange(n)
            )
        return self._perm

    def next_indices(self, k: int) -> list[int]:
        if k <= 0:
            raise ValueError(f"k must be > 0, got {k}")
        need = k * self.world_size
        drawn: list[int] = []
        while len(drawn) < need:
            take = min(need - len(drawn), self.num_examples - self._pos)
            drawn.extend(self._permutation()[self._pos : self._pos + take].tolist())
            self._pos += take
            if self._pos == self.num_examples:
                self.epoch, self._pos, self._perm = self.epoch + 1, 0, None
        return drawn[self.rank * k : (self.rank + 1) * k]

    def state_dict(self) -> dict:
        return {
            "num_examples": self.num_examples,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "epoch": self.epoch,
            "position": self._pos,
        }

    def load_state_dict(self, s: dict) -> None:
        missing = {"num_examples", "seed", "shuffle", "epoch", "position"} - set(s)
        if missing:
            raise ValueError(f"cursor state is missing keys {sorted(missing)}; got {sorted(s)}")
        if s["num_examples"] != self.num_examples:
            raise ValueError(
                f"cursor state is for {s['num_examples']} examples but this dataset has {self.num_examples}; "
                "the data changed since the checkpoint"
            )
        if not 0 <= s["position"] < self.num_examples:
            raise ValueError(f"cursor state position {s['position']} is outside [0, {self.num_examples})")
        self.seed, self.shuffle = int(s["seed"]), bool(s["shuffle"])
        self.epoch, self._pos, self._perm = int(s["epoch"]), int(s["position"]), None


# ----------------------------------------------------------------------------------------------------
# 2. Prompt construction

DEFAULT_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."

DEFAULT_TEACHER_TEMPLATE = (
    "{problem}\n\n"
    "Below is a reference solution to this problem.\n"
    "===== BEGIN REFERENCE SOLUTION =====\n"
    "{solution}\n"
    "===== END REFERENCE SOLUTION =====\n\n"
    "Use the reference only to check your understanding. Do not copy it or mention it: solve the problem "
    "yourself and derive the answer in your own reasoning.\n"
    "{instruction}"
)

TEMPLATE_FIELDS = ("problem", "solution", "instruction")
_REQUIRED_TEMPLATE_FIELDS = ("problem", "solution")
_TRUNCATION_MARK = "... "  # prefixed to a text whose beginning was cut


def check_teacher_template(template: str) -> None:
    """Fail early on a template that would hide the solution or format to garbage."""
    try:
        fields = [name for _, name, _, _ in string.Formatter().parse(template) if name is not None]
    except ValueError as err:
        raise ValueError(
            f"teacher template is not a valid format string ({err}); write literal braces as {{{{ }}}}"
        ) from None
    for name in fields:
        if name not in TEMPLATE_FIELDS:
            raise ValueError(
                f"teacher template has unknown field {{{name}}}; allowed fields: {list(TEMPLATE_FIELDS)} "
                "(write literal braces as {{ }})"
            )
    for name in _REQUIRED_TEMPLATE_FIELDS:
        if name not in fields:
            raise ValueError(f"teacher template must contain the field {{{name}}}")


def student_prompt_ids(
    tokenizer: Any,
    problem: str | list[dict],
    *,
    instruction: str = DEFAULT_INSTRUCTION,
    enable_thinking: bool | None = None,
    max_len: int | None = None,
) -> tuple[list[int], bool]:
    """Problem + instruction as one user turn, through the chat template with a generation prompt.

    If the problem is a messages list, the instruction is appended to its last user message.
    With max_len, the problem text loses its beginning (the question is usually at the end) until the
    prompt fits; the chat structure is kept. Returns (ids, truncated).
    """
    messages, slot = _problem_messages(problem)

    def build(texts: list[str]) -> list[dict]:
        return _with_content(messages, slot, _join(texts[0], instruction))

    return _fit(tokenizer, build, [messages[slot]["content"]], enable_thinking, max_len)


def teacher_prompt_ids(
    tokenizer: Any,
    problem: str | list[dict],
    solution: str,
    *,
    template: str = DEFAULT_TEACHER_TEMPLATE,
    instruction: str = DEFAULT_INSTRUCTION,
    enable_thinking: bool | None = None,
    max_len: int | None = None,
) -> tuple[list[int], bool]:
    """Problem + delimited reference solution + "derive it yourself" + instruction, as one user turn.

    For a messages-list problem the template replaces the last user message's content. With max_len the
    solution is cut first, then the problem, each losing its beginning (final answers and questions sit
    at the end); the chat structure is kept. Returns (ids, truncated).
    """
    check_teacher_template(template)
    if not isinstance(solution, str):
        raise ValueError(f"solution must be a string, got {type(solution).__name__}")
    messages, slot = _problem_messages(problem)

    def build(texts: list[str]) -> list[dict]:
        return _with_content(
            messages, slot, template.format(problem=texts[1], solution=texts[0], instruction=instruction)
        )

    return _fit(tokenizer, build, [solution, messages[slot]["content"]], enable_thinking, max_len)


def _problem_messages(problem: str | list[dict]) -> tuple[list[dict], int]:
    """The problem as chat messages plus the index of the user message that receives the instruction."""
    if isinstance(problem, str):
        return [{"role": "user", "content": problem}], 0
    if not isinstance(problem, list):
        raise ValueError(f"problem must be a string or a chat messages list, got {type(problem).__name__}")
    messages = _check_messages(problem, "problem")
    slot = max(i for i, m in enumerate(messages) if m["role"] == "user")
    return messages, slot


def _with_content(messages: list[dict], slot: int, content: str) -> list[dict]:
    out = [dict(m) for m in messages]
    out[slot]["content"] = content
    return out


def _join(text: str, instruction: str) -> str:
    return f"{text}\n\n{instruction}" if instruction else text


def apply_chat_template_ids(
    tokenizer: Any, messages: list[dict], enable_thinking: bool | None = None
) -> list[int]:
    """Chat template with a generation prompt, as plain ints across transformers 4.x and 5.x."""
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError(f"tokenizer {getattr(tokenizer, 'name_or_path', '')!r} has no chat template")
    kwargs: dict[str, Any] = {}
    if enable_thinking is not None:  # only Qwen3-style templates know the flag; others never see it
        kwargs["enable_thinking"] = enable_thinking
    out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, **kwargs)
    if isinstance(out, Mapping) or hasattr(out, "input_ids"):  # transformers 5 returns a BatchEncoding
        out = out["input_ids"]
    if hasattr(out, "tolist"):
        out = out.tolist()
    if out and isinstance(out[0], list):
        out = out[0]
    return [int(t) for t in out]


def _fit(
    tokenizer: Any,
    build: Callable[[list[str]], list[dict]],
    texts: list[str],
    enable_thinking: bool | None,
    max_len: int | None,
) -> tuple[list[int], bool]:
    """Render; if too long, cut the beginning of texts[0], then texts[1], ... until it fits.

    Cutting works on token ids of the text alone; the kept tail is decoded and the prompt re-rendered, so
    the chat template's special tokens are never cut. This never touches response tokens.
    """
    if max_len is not None and max_len <= 0:
        raise ValueError(f"max_len must be > 0, got {max_len}")
    ids = apply_chat_template_ids(tokenizer, build(texts), enable_thinking)
    if max_len is None or len(ids) <= max_len:
        return ids, False
    texts = list(texts)
    for i, original in enumerate(list(texts)):
        orig_ids = tokenizer.encode(original, add_special_tokens=False)
        keep = len(orig_ids)
        while keep > 0:
            keep = max(0, min(keep - 1, keep - (len(ids) - max_len)))  # strictly shrinks: always terminates
            texts[i] = _TRUNCATION_MARK + tokenizer.decode(orig_ids[-keep:]) if keep else ""
            ids = apply_chat_template_ids(tokenizer, build(texts), enable_thinking)
            if len(ids) <= max_len:
                return ids, True
    raise ValueError(
        f"max_len={max_len} is too small: the prompt is still {len(ids)} tokens with the problem and "
        "solution text removed (chat template + instruction alone)"
    )


# ----------------------------------------------------------------------------------------------------
# Aligned sequences


@dataclass
class Sample:
    student_ids: list[int]
    teacher_ids: list[int]
    response_len: int  # response occupies the LAST response_len positions of both
    example_index: int
    finish_reason: str


def make_sample(
    student_prompt: list[int],
    teacher_prompt: list[int],
    response: list[int],
    example_index: int,
    finish_reason: str,
) -> Sample:
    """Append the same response ids to both prompts; nothing is decoded and re-encoded."""
    if not response:
        raise ValueError(f"example {example_index}: empty response; there is nothing to distill")
    if not student_prompt or not teacher_prompt:
        raise ValueError(f"example {example_index}: empty student or teacher prompt")
    if finish_reason not in ("stop", "length"):
        raise ValueError(
            f"example {example_index}: finish_reason must be 'stop' or 'length', got {finish_reason!r}"
        )
    response = [int(t) for t in response]
    sample = Sample(
        student_ids=[int(t) for t in student_prompt] + response,
        teacher_ids=[int(t) for t in teacher_prompt] + response,
        response_len=len(response),
        example_index=example_index,
        finish_reason=finish_reason,
    )
    check_alignment(sample)
    return sample


def check_alignment(sample: Sample) -> None:
    """The loss compares position t of student and teacher: both must hold the same response token."""
    n = sample.response_len
    if n <= 0 or n > min(len(sample.student_ids), len(sample.teacher_ids)):
        raise ValueError(
            f"example {sample.example_index}: response_len {n} does not fit sequences of length "
            f"{len(sample.student_ids)} (student) and {len(sample.teacher_ids)} (teacher)"
        )
    s, t = sample.student_ids[-n:], sample.teacher_ids[-n:]
    if s != t:
        pos = next(i for i, (a, b) in enumerate(zip(s, t, strict=True)) if a != b)
        raise ValueError(
            f"example {sample.example_index}: student and teacher responses differ at response position {pos} "
            f"(student token {s[pos]}, teacher token {t[pos]})"
        )


def raw_splice_teacher_ids(student_prompt: list[int], privileged_ids: list[int]) -> list[int]:
    """Seed-style teacher prompt: the student's prompt ids followed by the privileged-info ids.

    Note the privileged text lands after the assistant generation prompt, i.e. inside the assistant turn.
    """
    return [int(t) for t in student_prompt] + [int(t) for t in privileged_ids]


# ----------------------------------------------------------------------------------------------------
# 3. Token-budget micro-batching


def pack_microbatches(lengths: list[int], max_tokens: int) -> list[list[int]]:
    """Group sample indices so each micro-batch fits max_tokens once padded.

    lengths[i] must be max(len(student_i), len(teacher_i)): the teacher is longer by the whole solution.
    Each sample is its own padded row, so attention never crosses samples; a group therefore costs
    len(group) * max(lengths in group) tokens, and that padded size is what the budget bounds.
    Samples are sorted longest first (ties by index) and chunked greedily, which is first-fit-decreasing
    for this cost. A sample longer than max_tokens goes alone. Groups come longest first (an OOM shows up
    on the first micro-batch) with indices ascending inside each group; the result is deterministic.
    """
    if max_tokens <= 0:
        raise ValueError(f"max_tokens must be > 0, got {max_tokens}")
    for i, n in enumerate(lengths):
        if n <= 0:
            raise ValueError(f"sample {i} has length {n}; lengths must be > 0")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    groups: list[list[int]] = []
    current: list[int] = []
    for i in order:
        longest = lengths[current[0]] if current else lengths[i]
        if current and (len(current) + 1) * longest > max_tokens:
            groups.append(current)
            current = []
        current.append(i)
    if current:
        groups.append(current)
    return [sorted(g) for g in groups]
