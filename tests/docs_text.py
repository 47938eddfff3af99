"""Reading the README and docs/*.md as tests need them: the commands their fenced blocks show and the
anchors of their headings (tests/meta/test_readme.py, tests/meta/test_freshness.py; test modules import shared
code from plain modules, never from one another)."""

from __future__ import annotations

import re
import shlex

# The languages of fenced blocks that hold shell commands ("" is a block without one).
SHELLS = ("", "bash", "sh", "shell", "console")
# The programs whose lines are commands; any other first word in a shell block is output.
PROGRAMS = ("opsd", "torchrun", "pip", "python", "bash")


def shown_commands(markdown: str) -> list[list[str]]:
    """Every command of the shell blocks, as argv lists (program first): continuation lines joined,
    comments stripped, each side of ``&&`` a command of its own, a trailing ``&`` dropped."""
    commands = []
    for lang, block in re.findall(r"```(\w*)\n(.*?)```", markdown, flags=re.S):
        if lang not in SHELLS:
            continue
        for line in block.replace("\\\n", " ").splitlines():
            for part in line.split("&&"):
                if part.split()[:1] and part.split()[0] not in PROGRAMS:
                    continue  # output, not a command (it may not even split as shell words)
                words = shlex.split(part, comments=True)
                if words and words[-1] == "&":
                    words = words[:-1]
                if words and words[0] in PROGRAMS:
                    commands.append(words)
    return commands


def heading_anchors(markdown: str) -> set[str]:
    """The anchors GitHub gives a Markdown file's headings (lower case, punctuation dropped, spaces to -)."""
    anchors = set()
    for line in markdown.splitlines():
        if m := re.match(r"#{1,6} (.*)", line):
            text = re.sub(r"[^\w\- ]", "", m[1].strip().lower())
            anchors.add(text.replace(" ", "-"))
    return anchors
