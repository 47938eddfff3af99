"""Student and teacher prompts as token ids: chat templates, thinking toggles, raw splice, truncation.

The student sees the problem; the teacher sees the problem plus the privileged information (the
reference solution). :class:`PromptBuilder` tokenizes each example's pair once and counts how many
prompts had to be truncated. The default instruction and teacher template are the ``data`` section's
(:mod:`opsd.config.data`). Only the standard library is imported here: no torch, no transformers.
"""

from __future__ import annotations

import string
from collections.abc import Callable, Mapping
from typing import Any

from opsd.config.data import DEFAULT_INSTRUCTION, DEFAULT_TEACHER_TEMPLATE
from opsd.data.sources import Example, check_messages
from opsd.errors import UserError

TEMPLATE_FIELDS = ("problem", "solution", "instruction")
_REQUIRED_TEMPLATE_FIELDS = ("problem", "solution")
_TRUNCATION_MARK = "... "  # prefixed to a text whose beginning was cut


def check_teacher_template(template: str) -> None:
    """Fail early on a template that would hide the solution or format to garbage."""
    try:
        fields = [name for _, name, _, _ in string.Formatter().parse(template) if name is not None]
    except ValueError as err:
        raise UserError(
            f"teacher template is not a valid format string ({err}); write literal braces as {{{{ }}}}"
        ) from None
    for name in fields:
        if name not in TEMPLATE_FIELDS:
            raise UserError(
                f"teacher template has unknown field {{{name}}}; allowed fields: {list(TEMPLATE_FIELDS)} "
                "(write literal braces as {{ }})"
            )
    for name in _REQUIRED_TEMPLATE_FIELDS:
        if name not in fields:
            raise UserError(f"teacher template must contain the field {{{name}}}")


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
    messages = check_messages(problem, "problem")
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
        raise UserError(f"tokenizer {getattr(tokenizer, 'name_or_path', '')!r} has no chat template")
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
    raise UserError(
        f"max_len={max_len} is too small: the prompt is still {len(ids)} tokens with the problem and "
        "solution text removed (chat template + instruction alone)"
    )


def raw_splice_teacher_ids(student_prompt: list[int], privileged_ids: list[int]) -> list[int]:
    """Seed-style teacher prompt: the student's prompt ids followed by the privileged-info ids.

    Note the privileged text lands after the assistant generation prompt, i.e. inside the assistant turn.
    """
    return [int(t) for t in student_prompt] + [int(t) for t in privileged_ids]


class PromptBuilder:
    """Per-example (student ids, teacher ids), tokenized once, with counts of truncated prompts.

    Examples are cached by index because each one is drawn again every epoch and rendering a chat
    template is slow. ``privileged=False`` gives the teacher the student's prompt; ``raw_splice``
    appends the solution's tokens to the student prompt instead of using ``teacher_template``.
    Truncation is counted once per cached example; ``state_dict`` carries the counts across a resume.
    """

    def __init__(self, tokenizer: Any, data: Any, privileged: bool = True) -> None:
        """The ``data`` section's prompt settings (``cfg.data``, an ``opsd.config.DataConfig``, which
        imports this module's defaults) and ``cfg.teacher.privileged``."""
        if privileged and not data.raw_splice:
            check_teacher_template(data.teacher_template)
        self.tokenizer = tokenizer
        self.instruction = data.instruction
        self.teacher_template = data.teacher_template
        self.student_thinking = data.student_thinking
        self.teacher_thinking = data.teacher_thinking
        self.max_prompt_len = data.max_prompt_len
        self.max_teacher_prompt_len = data.max_teacher_prompt_len
        self.raw_splice = data.raw_splice
        self.privileged = privileged
        self._cache: dict[int, tuple[list[int], list[int]]] = {}
        self._truncated = {"student": 0, "teacher": 0}

    def __call__(self, example_index: int, example: Example) -> tuple[list[int], list[int]]:
        """Student and teacher prompt ids of the example at ``example_index``."""
        if example_index not in self._cache:
            s_ids, s_cut = student_prompt_ids(
                self.tokenizer,
                example.problem,
                instruction=self.instruction,
                enable_thinking=self.student_thinking,
                max_len=self.max_prompt_len,
            )
            t_ids, t_cut = self._teacher(example, s_ids)
            self._truncated["student"] += int(s_cut)
            self._truncated["teacher"] += int(t_cut)
            self._cache[example_index] = (s_ids, t_ids)
        return self._cache[example_index]

    def _teacher(self, example: Example, student_ids: list[int]) -> tuple[list[int], bool]:
        if not self.privileged:
            return student_ids, False
        if self.raw_splice:
            limit = self.max_teacher_prompt_len
            solution = self.tokenizer(example.solution, add_special_tokens=False)["input_ids"]
            ids = raw_splice_teacher_ids(student_ids, solution)
            return ids[:limit], limit is not None and len(ids) > limit
        return teacher_prompt_ids(
            self.tokenizer,
            example.problem,
            example.solution,
            template=self.teacher_template,
            instruction=self.instruction,
            enable_thinking=self.teacher_thinking,
            max_len=self.max_teacher_prompt_len,
        )

    @property
    def truncated(self) -> dict[str, int]:
        """How many distinct examples had their student / teacher prompt cut to fit."""
        return dict(self._truncated)

    def state_dict(self) -> dict[str, int]:
        return dict(self._truncated)

    def load_state_dict(self, state: dict[str, int] | None) -> None:
        """The counts a checkpoint saved; None (a rank the saving run did not have): none yet."""
        state = state or {"student": 0, "teacher": 0}
        self._truncated = {"student": int(state["student"]), "teacher": int(state["teacher"])}
