"""The tiny offline tokenizer and model with Qwen3's own chat template, for tests/data/test_thinking.py and
tests/commands/test_recipe.py (test modules import shared code from plain modules, never from one another).

``tests/data/qwen3_chat_template.jinja`` is the ``chat_template`` of Qwen3's ``tokenizer_config.json``
(the hybrid-thinking template the Qwen3 models were released with; this copy is Qwen/Qwen3-0.6B's), copied
verbatim from the copy the Hugging Face Jinja implementation tests against: repository
huggingface/huggingface.js, file packages/jinja/test/e2e.test.js, entry "Qwen/Qwen3-0.6B" (commit
622b12b59a7d5a3b5215a8ac7704c7d04372334a). That entry's expected output is
:data:`VENDORED_MESSAGES` rendered to :data:`VENDORED_TARGET`, which tests/data/test_thinking.py checks.
"""

from __future__ import annotations

import json
from pathlib import Path

from opsd.tiny import build_tiny_model, build_tiny_tokenizer

TEMPLATE_PATH = Path(__file__).resolve().parent / "data" / "qwen3_chat_template.jinja"
# The file ends without a newline in the original; an editor's final newline is dropped again here.
QWEN3_CHAT_TEMPLATE = TEMPLATE_PATH.read_text(encoding="utf-8").rstrip("\n")
# Qwen3's tokenizer has these as single added tokens (ids 151667 and 151668, not "special").
THINK_TOKENS = ["<think>", "</think>"]
EMPTY_THINK_BLOCK = "<think>\n\n</think>\n\n"  # what enable_thinking=False renders after the assistant turn
ASSISTANT_TURN = "<|im_start|>assistant\n"

VENDORED_MESSAGES = [{"role": "user", "content": "Give me a short introduction to large language model."}]
VENDORED_TARGET = (
    "<|im_start|>user\nGive me a short introduction to large language model.<|im_end|>\n"
    "<|im_start|>assistant\n"
)

ROWS = [
    {
        "problem": f"What is {a} + {b}?",
        "solution": f"We add: {a} + {b} = {a + b}. The answer is \\boxed{{{a + b}}}.",
        "answer": str(a + b),
    }
    for a, b in [(1, 2), (3, 4), (5, 6), (7, 8)]
]


def qwen3_tokenizer():
    """The tiny byte-level BPE tokenizer with Qwen3's chat template and its <think> tokens."""
    tok = build_tiny_tokenizer()
    tok.add_tokens(THINK_TOKENS)
    tok.chat_template = QWEN3_CHAT_TEMPLATE
    return tok


def save_qwen3_assets(root: Path) -> dict[str, str]:
    """A tiny model saved with the Qwen3-template tokenizer, and the addition problems as JSONL."""
    tok = qwen3_tokenizer()
    model = build_tiny_model(tok, hidden_size=32, seed=0)
    model.save_pretrained(root / "model")
    tok.save_pretrained(root / "model")
    data = root / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS), encoding="utf-8")
    return {"model": str(root / "model"), "data": str(data)}
