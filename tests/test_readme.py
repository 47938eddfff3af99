"""The README's commands run as written, in order, in a fresh directory, on a tiny offline model.

`opsd fetch-model smollm2-135m-instruct` is replaced by planting a tiny model under that name in a
temporary `$OPSD_HOME` (no network); step counts over 2 are cut to 2; `opsd demo` is left to
tests/test_demo.py (minutes); commands that read `../shared/data` run only when it exists.
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
from pathlib import Path

import pytest

from opsd.cli import main
from opsd.tiny import build_tiny_model, build_tiny_tokenizer

ROOT = Path(__file__).resolve().parents[1]
SKIP = {"demo": "tests/test_demo.py runs the demo", "fetch-model": "replaced by a planted tiny model"}


def readme_commands(text: str) -> list[list[str]]:
    """Every `opsd ...` line of the README's bash blocks, comments stripped, as argv lists."""
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        for line in block.splitlines():
            line = line.split(" # ")[0].strip()
            for part in line.split("&&"):
                part = part.strip()
                if part.startswith("opsd "):
                    commands.append(shlex.split(part)[1:])
    return commands


def test_the_extractor_finds_the_train_block():
    cmds = readme_commands((ROOT / "README.md").read_text())
    assert ["train", "--config", "examples/smollm2-math.yaml"] in cmds
    assert any(c[0] == "eval" for c in cmds) and any(c[0] == "report" for c in cmds)


def heading_anchors(markdown: str) -> set[str]:
    """The anchors GitHub gives a Markdown file's headings (lower case, punctuation dropped, spaces to -)."""
    anchors = set()
    for line in markdown.splitlines():
        if m := re.match(r"#{1,6} (.*)", line):
            text = re.sub(r"[^\w\- ]", "", m[1].strip().lower())
            anchors.add(text.replace(" ", "-"))
    return anchors


def test_heading_anchors_follow_githubs_rule():
    assert heading_anchors("## Soak: 1,000 steps with a resume\n") == {"soak-1000-steps-with-a-resume"}
    memory = heading_anchors("### Train step memory (bench/step_memory.py)")
    assert memory == {"train-step-memory-benchstep_memorypy"}


def test_the_readmes_links_lead_somewhere():
    """Every relative link of the README names a file of the repository, and its #anchor a heading there."""
    text = (ROOT / "README.md").read_text()
    links = re.findall(r"\]\(([^)\s]+)\)", text)
    assert any(link.startswith("docs/results.md#") for link in links)
    for link in links:
        if re.match(r"[a-z]+://", link):
            continue
        path, _, anchor = link.partition("#")
        target = ROOT / path
        assert target.exists(), f"README links to {path}, which does not exist"
        if anchor and target.suffix == ".md":
            assert anchor in heading_anchors(target.read_text()), f"{path} has no heading for #{anchor}"


@pytest.mark.slow
def test_readme_commands_run_as_written(tmp_path, monkeypatch, capsys):
    home = tmp_path / "home"
    model_dir = home / "models" / "smollm2-135m-instruct"
    tok = build_tiny_tokenizer()
    build_tiny_model(tok, hidden_size=32, seed=0).save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    (model_dir / "opsd_fetch.json").write_text(json.dumps({"planted_by": "tests/test_readme.py"}))
    work = tmp_path / "clone"
    shutil.copytree(ROOT / "examples", work / "examples")
    monkeypatch.setenv("OPSD_HOME", str(home))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(work)
    shared = (ROOT.parent / "shared" / "data").is_dir()
    if shared:
        (tmp_path / "shared").symlink_to(ROOT.parent / "shared")
    ran = 0
    for argv in readme_commands((ROOT / "README.md").read_text()):
        if argv[0] in SKIP or argv[0] == "--version":
            continue
        if any("../shared/" in a for a in argv) and not shared:
            continue
        argv = [
            re.sub(
                r"^optim\.max_steps=(\d+)$", lambda m: f"optim.max_steps={2 if int(m[1]) > 10 else m[1]}", a
            )
            for a in argv
        ]
        if argv[0] == "train":
            argv += ["rollout.max_new_tokens=8", "logging.progress=false"]
        if argv[0] == "eval":
            argv += ["--max-new-tokens", "8"]
        code = main(argv)
        err = capsys.readouterr().err
        assert code == 0, f"`opsd {' '.join(argv)}` exited {code}:\n{err[-2000:]}"
        ran += 1
    assert ran >= 4
