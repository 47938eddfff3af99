"""The commands the README, docs/*.md and docs/studies/*.md show, each run on a tiny offline model, or
named with the test that runs it on one; the links of the README, docs/results.md and the study pages.

The README's run as written, in order, in a fresh directory: `opsd fetch-model smollm2-135m-instruct`
is replaced by planting a tiny model under that name in a temporary `$OPSD_HOME` (no network); step
counts over 2 are cut to 2; commands that read `../shared/data` run only when it exists. docs/*.md's
run the same way, made small (:func:`shrink`): fewer steps, seeds, held-out problems and tokens, the
HF engine where a config says `rollout.engine: auto` (a vLLM-CPU start takes a minute), the demo on a
smaller base, and a user's `run.yaml` written from examples/smollm2-math.yaml. Those that need a GPU,
torchrun, a vLLM server or the paper's model are named with the test that runs them on the tiny model
(:data:`ELSEWHERE`); installing and testing are not opsd's commands (:data:`NOT_OPSD`). A command shown
in part (`...` and a note in parentheses for the arguments it leaves out) runs its shown part
(:func:`shown_part`).
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import yaml
from demo_small import small_demo_settings
from docs_text import heading_anchors, shown_commands
from helpers import ROOT, SHARED_DATA

from opsd.cli import main
from opsd.compare.plan import METHODS
from opsd.tiny import build_tiny_model, build_tiny_tokenizer

DOCS = sorted((ROOT / "docs").glob("*.md")) + sorted((ROOT / "docs" / "studies").glob("*.md"))
SKIP = {"fetch-model": "replaced by a planted tiny model"}
# Commands another test runs on a tiny model, by how they begin: that test, and why not here.
ELSEWHERE = {
    ("opsd", "train", "--config", "examples/qwen3-1.7b-reference.yaml"): (
        "tests/commands/test_recipe.py::test_the_recipe_runs_one_step_on_a_tiny_model",
        "the paper's recipe needs Qwen3's chat template: that test's tiny model has it",
    ),
    ("opsd", "eval", "--config", "examples/eval/"): (
        "tests/commands/test_recipe.py::test_reproduce_md_eval_commands_run_avg_at_12_with_thinking",
        "evaluates the recipe's checkpoints of Qwen3-1.7B: that test runs these lines as written",
    ),
    ("opsd", "serve"): (
        "tests/rollout/test_vllm_serve.py::test_opsd_serve_defaults_on_a_cpu",
        "starts a vLLM server",
    ),
    ("opsd", "train", "--config", "examples/smollm2-math.yaml", "rollout.engine=vllm_server"): (
        "tests/rollout/test_vllm_serve.py::test_three_steps_through_a_real_server",
        "trains against the vLLM server of the line before",
    ),
    ("opsd", "train", "--config", "run.yaml", "device=cuda"): (
        "tests/train/test_gpu.py::test_bf16_full_finetuning_on_cuda_keeps_float32_masters",
        "needs a CUDA GPU",
    ),
    ("torchrun",): (
        "tests/train/test_train_distributed.py::test_two_ranks_match_one_and_resume_across_world_sizes",
        "torchrun over GPUs and nodes: that test runs two CPU ranks",
    ),
}
NOT_OPSD = {
    "pip": "installs the package",
    "python": "runs this test suite",
    "bash": "builds .venv-vllm from the network",
}


def readme_commands(text: str) -> list[list[str]]:
    """Every `opsd ...` command of the README's shell blocks, as argv lists without the program."""
    return [argv[1:] for argv in shown_commands(text) if argv[0] == "opsd"]


def elsewhere(argv: list[str]) -> tuple[str, str] | None:
    """The test that runs ``argv`` instead, and why, where :data:`ELSEWHERE` names one (its last word
    may begin an argument: `examples/eval/` names each of the evaluation configs)."""
    for begin, where in ELSEWHERE.items():
        n = len(begin) - 1
        if tuple(argv[:n]) == begin[:n] and len(argv) > n and argv[n].startswith(begin[n]):
            return where
    return None


def test_the_extractor_finds_the_train_block():
    cmds = readme_commands((ROOT / "README.md").read_text())
    assert ["train", "--config", "examples/smollm2-math.yaml"] in cmds
    assert any(c[0] == "eval" for c in cmds) and any(c[0] == "report" for c in cmds)


def test_heading_anchors_follow_githubs_rule():
    assert heading_anchors("## Soak: 1,000 steps with a resume\n") == {"soak-1000-steps-with-a-resume"}
    memory = heading_anchors("### Train step memory (bench/step_memory.py)")
    assert memory == {"train-step-memory-benchstep_memorypy"}


def broken_links(page: Path) -> list[str]:
    """The relative links of a Markdown page (from its own folder; `#anchor` alone is the page itself)
    that name no file of the repository, or no heading of the file for their #anchor."""
    text, broken = page.read_text(), []
    for link in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+://", link):
            continue
        path, _, anchor = link.partition("#")
        target = page.parent / path if path else page
        if not target.exists():
            broken.append(f"{link}: no such file")
        elif anchor and target.suffix == ".md" and anchor not in heading_anchors(target.read_text()):
            broken.append(f"{link}: no heading for #{anchor}")
    return broken


def test_the_readmes_links_lead_somewhere():
    """Every relative link of the README names a file of the repository, and its #anchor a heading there."""
    links = re.findall(r"\]\(([^)\s]+)\)", (ROOT / "README.md").read_text())
    assert any(link.startswith("docs/results.md#") for link in links)
    assert any(link.startswith("docs/studies/") for link in links)
    assert not broken_links(ROOT / "README.md"), broken_links(ROOT / "README.md")


def test_the_results_and_study_links_lead_somewhere():
    """docs/results.md links each study page, and the pages link one another and results.md's sections:
    each link names a file and its #anchor a heading there."""
    pages = [ROOT / "docs" / "results.md", *sorted((ROOT / "docs" / "studies").glob("*.md"))]
    assert len(pages) > 4
    broken = {p.name: b for p in pages if (b := broken_links(p))}
    assert not broken, broken


@pytest.fixture
def tiny_home(tmp_path, monkeypatch) -> Path:
    """A fresh directory with the examples, a tiny model planted as `smollm2-135m-instruct` in
    `$OPSD_HOME`, and `../shared` linked where it exists; the working directory while the test runs."""
    home = tmp_path / "home"
    model_dir = home / "models" / "smollm2-135m-instruct"
    tok = build_tiny_tokenizer()
    build_tiny_model(tok, hidden_size=32, seed=0).save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    (model_dir / "opsd_fetch.json").write_text(json.dumps({"planted_by": "tests/meta/test_readme.py"}))
    work = tmp_path / "clone"
    shutil.copytree(ROOT / "examples", work / "examples")
    monkeypatch.setenv("OPSD_HOME", str(home))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(work)
    if (SHARED_DATA).is_dir():
        (tmp_path / "shared").symlink_to(ROOT.parent / "shared")
    return work


def shared_here(argv: list[str]) -> bool:
    """Whether every `../shared/` file ``argv`` names, or its config reads, is here."""
    text = " ".join(argv)
    config = next((argv[i + 1] for i, a in enumerate(argv[:-1]) if a == "--config"), None)
    if config and Path(config).is_file():
        text += json.dumps(yaml.safe_load(Path(config).read_text()))  # its values, not its comments
    return "../shared/" not in text or Path("../shared/data").is_dir()


@pytest.mark.slow
def test_readme_commands_run_as_written(tiny_home, capsys):
    ran = 0
    for argv in readme_commands((ROOT / "README.md").read_text()):
        if argv[0] in SKIP or argv[0] in ("--version", "demo") or not shared_here(argv):
            continue  # `opsd demo`: docs/demo.md's first command, run below
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


def docs_commands() -> list[tuple[str, list[str]]]:
    """Every command of docs/*.md's and docs/studies/*.md's shell blocks, with its file's path under docs/."""
    return [
        (path.relative_to(ROOT / "docs").as_posix(), argv)
        for path in DOCS
        for argv in shown_commands(path.read_text())
    ]


def test_every_docs_command_runs_here_or_in_a_named_test():
    """Each command is opsd's and run by :func:`test_docs_commands_run_on_the_tiny_model`, or named in
    :data:`ELSEWHERE` with a test that exists, or not opsd's (:data:`NOT_OPSD`)."""
    commands = docs_commands()
    shown = {"demo.md", "training.md", "reproduce.md", "vllm.md", "studies/arith.md", "studies/gsm8k.md"}
    assert shown | {"studies/probe.md", "studies/facts.md"} <= {f for f, _ in commands}
    for name, argv in commands:
        where = elsewhere(argv)
        if where:
            path, test = where[0].split("::")
            assert f"def {test}(" in (ROOT / path).read_text(), f"{name}: {where[0]} does not exist"
        else:
            assert argv[0] in ("opsd", *NOT_OPSD), f"{name}: {argv} is neither run here nor named elsewhere"
    assert elsewhere(["opsd", "eval", "--config", "examples/eval/aime24.yaml"])
    assert elsewhere(["opsd", "train", "--config", "examples/smollm2-math.yaml"]) is None


def shown_part(argv: list[str]) -> list[str]:
    """The part of a command a doc shows: `...` and the note in parentheses after it stand for arguments
    it leaves out, so they are dropped, and `--methods` keeps the methods the shown part has (its
    `--variant` names and `opsd compare`'s own :data:`~opsd.compare.plan.METHODS`)."""
    if "..." not in argv:
        return argv
    i = j = argv.index("...")
    if j + 1 < len(argv) and argv[j + 1].startswith("("):
        j = next(k for k in range(j + 1, len(argv)) if argv[k].endswith(")"))
    out = argv[:i] + argv[j + 1 :]
    names = set(METHODS) | {v.split("=", 1)[0] for k, v in zip(out, out[1:]) if k == "--variant"}
    return [
        ",".join(m for m in a.split(",") if m in names) if before == "--methods" else a
        for before, a in zip(["", *out], out)
    ]


def test_a_command_shown_in_part_runs_its_shown_part():
    argv = "opsd compare --variant a_1=opsd:lr=1 ... (one --variant per lr) --methods a_1,a_2,sft".split()
    assert shown_part(argv) == "opsd compare --variant a_1=opsd:lr=1 --methods a_1,sft".split()
    assert shown_part(["opsd", "train"]) == ["opsd", "train"]


def shrink(argv: list[str], cache: Path) -> list[str]:
    """A docs command at the tiny model's size: at most 2 steps (a training run's too), 1 tuning step,
    its first seed, 2 held-out problems of 8 tokens, the HF engine, a demo cache under the test's
    directory."""
    small = {"--steps": "2", "--eval-every": "2", "--tune-steps": "1", "--limit": "2"}
    out = []
    for i, a in enumerate(argv):
        before = argv[i - 1] if i else ""
        if before in small:
            a = small[before]
        elif before in ("--seeds", "--tune-seeds"):
            a = a.split(",")[0]
        elif before == "--cache":
            a = str(cache)
        elif before == "--variant":  # a variant's lengths within the tiny run's 8 tokens
            a = re.sub(r"(rollout\.horizon\.start|rollout\.max_new_tokens)=\d+", r"\1=4", a)
            a = re.sub(r"rollout\.horizon\.end=\d+", "rollout.horizon.end=8", a)
        out.append(a)
    if argv[1] == "demo" and "--steps" not in argv:
        out += ["--steps", "2"]
    if argv[1] == "train" and not any(a.startswith("optim.max_steps=") for a in argv):
        out += ["optim.max_steps=2", "rollout.max_new_tokens=8", "logging.progress=false"]
    if argv[1] in ("compare", "probe"):
        tiny = ["rollout.engine=hf", "rollout.max_new_tokens=8", "eval.max_new_tokens=8", "eval.limit=2"]
        out += [*tiny, *(["--no-progress"] if argv[1] == "compare" else ["--limit", "2"])]
    return out


def write_run_yaml(work: Path) -> None:
    """The user's `run.yaml` of docs/training.md: examples/smollm2-math.yaml with a held-out set."""
    cfg = yaml.safe_load((work / "examples" / "smollm2-math.yaml").read_text())
    cfg["eval"] = {"path": "examples/math_sample.jsonl", "limit": 2, "max_new_tokens": 8}
    cfg["rollout"]["max_new_tokens"] = 8
    (work / "run.yaml").write_text(yaml.safe_dump(cfg))


@pytest.mark.slow
def test_docs_commands_run_on_the_tiny_model(tiny_home, monkeypatch, capsys):
    from opsd.demo import cli as demo_cli

    monkeypatch.setattr(demo_cli, "DemoSettings", small_demo_settings())
    write_run_yaml(tiny_home)
    ran = []
    for name, argv in docs_commands():
        if argv[0] != "opsd" or argv[1] in SKIP or elsewhere(argv) or not shared_here(argv):
            continue
        argv = shrink(shown_part(argv), tiny_home / "demo-cache")
        code = main(argv[1:])
        err = capsys.readouterr().err
        assert code == 0, f"{name}: `{' '.join(argv)}` exited {code}:\n{err[-2000:]}"
        ran.append(argv[1])
    assert ran.count("demo") == 5 and ran.count("compare") >= 3, ran
