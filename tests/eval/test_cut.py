"""The answer cut (opsd.eval.cut, opsd.grading.ANSWER_ENDS): a response stopped once its graded answer is
complete grades as the whole response, and the engines stop a sequence there."""

from __future__ import annotations

from dataclasses import replace

import pytest
from helpers import WritingEngine
from hypothesis import given, settings
from hypothesis import strategies as st

from opsd.config import EvalConfig
from opsd.data import Example
from opsd.eval import EvalRun, evaluate_model
from opsd.eval.cut import generate_to_answer
from opsd.grading import ANSWER_ENDS, AnswerEnd, grade_answer_is
from opsd.rollout import HFEngine, SamplingParams
from opsd.rollout.base import end_token_ids

END = ANSWER_ENDS["answer_is"]
PHRASES = ["The answer is ", "the answer is: ", "The answer is $", "The answer is\t", "The answer is "]
NUMBERS = ["42", "-7", "0", "1,234", "1,234.5", "3.25", "12,34", "1,2345", "100,000,000", "7."]
# Text after the answer that writes no other answer: digits, separators, spaces and a few others.
REST = st.text(alphabet="0123456789,.  \n\t$-x!\ufffd", max_size=12)


def _cut(text: str) -> str | None:
    at = END.settled(text)
    return None if at is None else text[:at]


@settings(max_examples=400, deadline=None)
@given(
    before=st.sampled_from(["", "3 + 4 = 7. ", "So 1,000 - 1 = 999.\n"]),
    phrase=st.sampled_from(PHRASES),
    number=st.sampled_from(NUMBERS),
    rest=REST,
    gold=st.sampled_from(["42", "1234", "1234.5", "7", "0", "12"]),
)
def test_a_cut_answer_grades_as_the_whole_response(before, phrase, number, rest, gold):
    """Wherever the cut triggers on a response that writes one answer, the cut grades as the whole; and
    it triggers at one place: no shorter prefix settles, every longer prefix settles at the same place."""
    text = before + phrase + number + rest
    at = END.settled(text)
    if at is None:
        return
    assert grade_answer_is(text[:at], gold) == grade_answer_is(text, gold)
    assert all(END.settled(text[:j]) is None for j in range(at))
    assert all(END.settled(text[:j]) == at for j in range(at, len(text) + 1))


@pytest.mark.parametrize(
    "text, cut",
    [
        ("The answer is 42", None),  # 420 may come
        ("The answer is 42.", None),  # 42.5 may come
        ("The answer is 42.\n", "The answer is 42.\n"),
        ("The answer is 42. So", "The answer is 42. "),
        ("The answer is 42!", "The answer is 42!"),
        ("The answer is 1,23", None),
        ("The answer is 1,234 apples", "The answer is 1,234 a"),
        ("The answer is 42 .5", None),  # a tokenizer's clean-up of " ." may make it 42.5
        ("The answer is 42 apples", "The answer is 42 a"),
        ("The answer is 4\ufffd", None),  # a character still being decoded
        ("The answer is not known.", None),
        ("The answer is 12,34x. The answer is 5. ", "The answer is 12,34x. The answer is 5. "),
    ],
)
def test_where_the_cut_falls(text, cut):
    assert _cut(text) == cut


def test_the_cut_keeps_the_first_answer_where_a_second_would_have_been_read():
    """The documented cost: the grader reads the last "The answer is"; the cut keeps the first."""
    text = "The answer is 5. Wait, the answer is 6."
    assert _cut(text) == "The answer is 5. "
    assert grade_answer_is(_cut(text), "5").correct and not grade_answer_is(text, "5").correct


@pytest.mark.parametrize(
    "text, pending",
    [
        ("So the answer is", True),
        ("The answer is 1,2", True),
        ("The answer is 4 ", True),
        ("The answer", False),
    ],
)
def test_pending_answers(text, pending):
    assert END.pending(text) is pending


def _examples(pairs) -> list[Example]:
    return [Example(f"What is {a} + {b}?", "", str(a + b), i) for i, (a, b) in enumerate(pairs)]


def _prompts(tok, examples) -> list[list[int]]:
    return [tok(ex.problem, add_special_tokens=False)["input_ids"] for ex in examples]


def _generate(engine, tok, prompts, max_new_tokens=120):
    params = SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens)
    return generate_to_answer(engine, tok, prompts, 1, params, END, {tok.eos_token_id})


@pytest.mark.parametrize(
    "write, reason, graded",
    [
        # Goes on after its answer: stopped there, its text up to the character that settles it.
        (
            lambda a, b: f"So {a + b}. The answer is {a + b}. Then 1, 2, 3, 4, 5, 6, 7, 8, 9 and on.",
            "answer",
            True,
        ),
        # Ends right after its answer: the whole response, its end token included.
        (lambda a, b: f"So {a + b}. The answer is {a + b}.", "stop", True),
        (lambda a, b: f"The answer is {a + b}.\n", "stop", True),
        # A number written over several rounds (digits, separators): graded whole.
        (lambda a, b: "The answer is 1,234.5 and more, and more, and more.", "answer", False),
        # No answer: generated to its end.
        (lambda a, b: "No idea. 1, 2, 3.", "stop", False),
    ],
)
def test_the_loop_stops_where_the_answer_is_complete(tiny_model, tiny_tokenizer, write, reason, graded):
    tok = tiny_tokenizer
    engine = WritingEngine(None, tiny_model, tok, write=write)
    examples = _examples([(1, 2), (30, 4)])
    prompts = _prompts(tok, examples)
    out = _generate(engine, tok, prompts)
    for ex, p, c in zip(examples, prompts, out, strict=True):
        whole = engine.response(p)
        text = tok.decode(c.token_ids, skip_special_tokens=True)
        assert c.finish_reason == reason and whole[: len(c.token_ids)] == c.token_ids
        assert len(c.logprobs) == len(c.token_ids)
        assert grade_answer_is(text, ex.answer) == grade_answer_is(tok.decode(whole[:-1]), ex.answer)
        assert grade_answer_is(text, ex.answer).correct is graded
        if reason == "answer":  # the shortest token prefix that settles the answer
            assert END.settled(text) is not None
            assert END.settled(tok.decode(c.token_ids[:-1])) is None
    if reason == "answer":
        assert engine.written < sum(len(engine.response(p)) for p in prompts)
    assert any(a.stop_strings == ["he answer is"] for a in engine.asked)


def test_the_loop_keeps_the_token_limit(tiny_model, tiny_tokenizer):
    tok = tiny_tokenizer
    engine = WritingEngine(
        None, tiny_model, tok, write=lambda a, b: "1, 2, 3, 4, 5, 6. The answer is 7. More."
    )
    prompts = _prompts(tok, _examples([(1, 2)]))
    (c,) = _generate(engine, tok, prompts, max_new_tokens=6)
    assert c.finish_reason == "length" and c.token_ids == engine.response(prompts[0])[:6]
    (c,) = _generate(engine, tok, prompts, max_new_tokens=1)
    assert c.finish_reason == "length" and len(c.token_ids) == 1


def test_evaluate_model_cuts_only_when_asked(tiny_model, tiny_tokenizer):
    tok = tiny_tokenizer
    engine = WritingEngine(None, tiny_model, tok, write=lambda a, b: f"The answer is {a + b}. And then more.")
    examples = _examples([(1, 2), (3, 4), (5, 6)])
    e = EvalConfig(k=1, temperature=0.0, max_new_tokens=64)
    run = EvalRun(engine=engine, grader=grade_answer_is)
    whole = evaluate_model(tiny_model, tok, examples, e, run=run)
    cut = evaluate_model(tiny_model, tok, examples, e, run=replace(run, answer_end=END))
    assert [it["finish_reasons"] for it in whole.items] == [["stop"]] * 3
    assert [it["finish_reasons"] for it in cut.items] == [["answer"]] * 3
    assert cut.avg_at_k == whole.avg_at_k == 1.0 and cut.resp_len_mean < whole.resp_len_mean
    for a, b in zip(cut.items, whole.items, strict=True):
        assert b["responses"][0].startswith(a["responses"][0]) and a["responses"][0] != b["responses"][0]


def test_the_hf_engine_stops_a_sequence_where_its_answer_settles(tiny_model, tiny_tokenizer):
    """On the real HF engine: an "answer" whose marker is a piece of the tiny model's own greedy text and
    which settles 3 characters after it. Both ways to the cut give the uncut greedy response's shortest
    prefix that settles it: the engine checking the text at every token (one call), and rounds through
    the protocol alone (to the marker, then the answer's tail, continuing from the sequence's tokens)."""
    tok = tiny_tokenizer
    engine = HFEngine(tiny_model, tok)
    prompt = tok("What is 3 + 4? Let us compute the sum", add_special_tokens=False)["input_ids"]
    free = engine.generate([prompt], 1, SamplingParams(temperature=0.0, max_new_tokens=24))[0]
    ids, text = free.token_ids, tok.decode(free.token_ids)
    for k in range(2, 12):  # a marker the greedy text writes early, settled 3 characters after it
        marker = tok.decode(ids[k - 1 : k + 1])
        usable = marker.strip() and "\ufffd" not in marker and marker in text
        if usable and text.find(marker) + len(marker) + 3 <= len(tok.decode(ids[:16])):
            break
    else:
        pytest.skip("no usable marker in this continuation")

    def settled(t: str) -> int | None:
        at = t.find(marker)
        return at + len(marker) + 3 if at >= 0 and len(t) >= at + len(marker) + 3 else None

    end = AnswerEnd((marker,), settled, lambda t: t.find(marker) >= 0, "test")
    j = next(j for j in range(1, len(ids) + 1) if settled(tok.decode(ids[:j])) is not None)
    ends = set(end_token_ids(tok, tiny_model, []))
    params = SamplingParams(0.0, max_new_tokens=24)
    generate = engine.generate
    calls: list[tuple[SamplingParams, bool]] = []

    def checking(prompts, n, params, *, stop_text=None):
        calls.append((params, stop_text is not None))
        return generate(prompts, n, params, stop_text=stop_text)

    engine.generate = checking
    (c,) = generate_to_answer(engine, tok, [prompt], 1, params, end, ends)
    assert (c.finish_reason, c.token_ids) == ("answer", ids[:j])
    assert [(p.stop_strings, checked) for p, checked in calls] == [([], True)]

    calls.clear()
    engine.generate = lambda prompts, n, params: checking(prompts, n, params)  # the protocol alone
    (c,) = generate_to_answer(engine, tok, [prompt], 1, params, end, ends)
    assert (c.finish_reason, c.token_ids) == ("answer", ids[:j])
    assert [(p.stop_strings, checked) for p, checked in calls][:2] == [([marker], False), ([], False)]
