"""Published figures against the code they measure.

Every section of docs/results.md opens with one ``Measured:`` line (commit, date, CPU, load). A README
results row that gives a figure as current must cite a section whose commit is no older than the last
change to the files that section's script measures (:data:`MEASURES`); a row that says
``measured at C, before ...`` gives an older figure as such, and C must be the section's own commit.
Without git history (a tarball install, a shallow clone) the comparison with history is skipped.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
from docs_text import heading_anchors

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "results.md"
MEASURED = re.compile(
    r"^Measured: commit (?P<commit>.+?); date (?P<date>.+?); cpu (?P<cpu>.+?); load (?P<load>.+)$"
)
NOT_RECORDED = "not recorded"

# What a training step runs through: a change to any of these can move a step's time or memory.
STEP = (
    "opsd/trainer.py",
    "opsd/setup.py",
    "opsd/microbatch.py",
    "opsd/loss",
    "opsd/models.py",
    "opsd/teacher.py",
    "opsd/objectives.py",
    "opsd/precision.py",
    "opsd/parallel.py",
    "opsd/optim.py",
    "opsd/cpu",
    "opsd/rollout",
    "opsd/data",
)
COMPARE = (*STEP, "opsd/compare", "opsd/eval", "opsd/grading.py", "opsd/sft.py")

# Per section of docs/results.md (its anchor), the source paths its script measures.
MEASURES: dict[str, tuple[str, ...]] = {
    "loss-cpu-benchlosspy": ("opsd/loss", "bench/loss.py"),
    "loss-precision-against-the-float64-oracle": ("opsd/loss", "tests/test_loss.py"),
    "loss-products-on-this-cpu-benchcpuloss_productspy": (
        "opsd/loss",
        "opsd/cpu",
        "bench/cpu/loss_products.py",
    ),
    "loss-products-on-an-intel-xeon-with-amx-bf16": ("opsd/loss", "opsd/cpu", "bench/cpu/loss_products.py"),
    "rollout-benchrolloutpy": ("opsd/rollout", "opsd/models.py", "bench/rollout.py"),
    "hf-engine-benchcpuhf_enginepy": ("opsd/rollout", "opsd/cpu", "opsd/models.py", "bench/cpu/hf_engine.py"),
    "vllm-cpu-vs-hf-engine-benchvllm_rolloutpy": ("opsd/rollout", "opsd/cpu", "bench/vllm_rollout.py"),
    "vllm-cpu-vs-hf-engine-on-an-intel-xeon-with-avx512-no-bf16-units": (
        "opsd/rollout",
        "opsd/cpu",
        "bench/vllm_rollout.py",
    ),
    "train-step-benchtrain_steppy": (*STEP, "bench/train_step.py"),
    "train-step-memory-benchstep_memorypy": (*STEP, "bench/step_memory.py"),
    "attention-kernels-kept-per-length-benchcpusdpa_lengthspy": ("opsd/cpu", "bench/cpu/sdpa_lengths.py"),
    "step-profile-benchcpuprofile_steppy": (*STEP, "bench/cpu/profile_step.py"),
    "openmp-waiting-and-the-student-pass-benchcpuomp_waitpy": (*STEP, "bench/cpu/omp_wait.py"),
    "opsd-vs-trl-sdft-benchvs_trlpy": (*STEP, "bench/vs_trl.py"),
    "opsd-on-vllm-cpu-amd-epyc-with-avx512-bf16": (*STEP, "bench/vs_trl.py"),
    "opsd-on-its-hf-engine-intel-xeon-with-avx512-no-bf16-units": (*STEP, "bench/vs_trl.py"),
    "demo-benchdemopy": (*COMPARE, "opsd/demo", "bench/demo.py"),
    "demo-comparison-opsd-grpo-sft-controls-benchcomparepy": (*COMPARE, "opsd/demo", "bench/compare.py"),
    "smollm2-135m-opsd-on-math-benchsmollm2_opsdpy": (*STEP, "opsd/eval", "bench/smollm2_opsd.py"),
    "gsm8k-comparison-opsd-compare": (*COMPARE, "examples/gsm8k-compare.yaml"),
    "opsd-probe": (*STEP, "opsd/probe.py", "examples/arith.yaml", "examples/gsm8k-compare.yaml"),
    "the-solutions-pull-on-the-students-own-tokens": (
        *STEP,
        "opsd/probe.py",
        "examples/arith.yaml",
        "opsd/demo",
    ),
    "arithmetic-word-problems-opsd-compare": (*COMPARE, "examples/arith.yaml"),
    "why-the-student-learns-not-to-stop-the-end-token-is-not-it": (*STEP, "examples/arith.yaml"),
    "why-the-student-learns-not-to-stop-a-teacher-that-would-correct-a-wrong-answer": (
        *STEP,
        "examples/arith.yaml",
    ),
    "tuning-on-the-dev-slice": (*STEP, "examples/arith.yaml"),
    "plan-and-its-arithmetic": (*COMPARE, "examples/arith.yaml"),
    "eval-baseline-bencheval_baselinepy": (
        "opsd/eval",
        "opsd/rollout",
        "opsd/grading.py",
        "bench/eval_baseline.py",
    ),
    "soak-1000-steps-with-a-resume": (*STEP, "opsd/checkpoint.py", "bench/soak.py"),
    "clean-exits-of-two-rank-torchrun-runs": (
        "opsd/distributed.py",
        "opsd/cli.py",
        "bench/torchrun_exits.py",
    ),
}


def sections(markdown: str) -> dict[str, dict[str, str]]:
    """Each ## or ### section's anchor -> its ``Measured:`` fields (empty where the line is missing or
    is not the first line after the heading)."""
    out: dict[str, dict[str, str]] = {}
    lines = markdown.splitlines()
    for i, line in enumerate(lines):
        if re.match(r"#{2,3} ", line):
            (anchor,) = heading_anchors(line)
            first = next((x for x in lines[i + 1 :] if x.strip()), "")
            m = MEASURED.match(first)
            out[anchor] = m.groupdict() if m else {}
    return out


def readme_rows(readme: str) -> list[tuple[str, str]]:
    """The README's results rows: (the docs/results.md anchor each cites, the whole row)."""
    part = readme.split("\n## Results\n", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in part.splitlines():
        for anchor in re.findall(r"\]\(docs/results\.md#([\w-]+)\)", line) if line.startswith("|") else ():
            rows.append((anchor, line))
    return rows


def first_commit(field: str) -> str | None:
    """The commit a ``commit`` field names first (a hash of 7 to 40 hex digits), or None."""
    m = re.match(r"([0-9a-f]{7,40})\b", field)
    return m[1] if m else None


def git(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=False)


def history() -> bool:
    """Whether this checkout has the full git history the comparison needs."""
    if shutil.which("git") is None or git("rev-parse", "--git-dir").returncode:
        return False
    return git("rev-parse", "--is-shallow-repository").stdout.strip() == "false"


def stale(commit: str, paths: tuple[str, ...]) -> str | None:
    """Why figures measured at ``commit`` are older than the code at ``paths`` (None: they are not): the
    last commit that changed any of them is not ``commit`` or one of its ancestors."""
    if git("cat-file", "-e", f"{commit}^{{commit}}").returncode:
        return f"commit {commit} is not in this repository's history"
    last = git("log", "-1", "--format=%h %s", "--", *paths).stdout.strip()
    if not last:
        return None
    if git("merge-base", "--is-ancestor", last.split()[0], commit).returncode:
        return f"measured at {commit}, before {last[:100]}"
    return None


def test_every_section_says_what_it_was_measured_on():
    found = sections(RESULTS.read_text())
    missing = [a for a, fields in found.items() if not fields]
    assert not missing, (
        f"sections without a first line `Measured: commit ...; date ...; cpu ...; load ...`: {missing}"
    )
    for anchor, f in found.items():
        assert f["commit"] == NOT_RECORDED or first_commit(f["commit"]), (anchor, f["commit"])
        assert f["date"] == NOT_RECORDED or re.fullmatch(r"20\d\d-\d\d-\d\d", f["date"]), (anchor, f["date"])
    assert set(found) == set(MEASURES), "declare in MEASURES the paths each section's script measures"
    for paths in MEASURES.values():
        assert all((ROOT / p).exists() for p in paths), [p for p in paths if not (ROOT / p).exists()]


def test_the_readme_cites_sections_that_exist():
    found = sections(RESULTS.read_text())
    rows = readme_rows((ROOT / "README.md").read_text())
    assert rows, "the README's results table cites no docs/results.md section"
    for anchor, row in rows:
        assert anchor in found, f"the README cites docs/results.md#{anchor}, which is no section"
        said = re.search(r"measured at ([0-9a-f]{7,40})", row)
        if said:  # an older figure given as such: the section's own commit
            assert said[1] == first_commit(found[anchor]["commit"]), (
                anchor,
                said[1],
                found[anchor]["commit"],
            )


@pytest.mark.skipif(not history(), reason="needs the git history (not there in a tarball or shallow clone)")
def test_figures_the_readme_gives_as_current_are_from_todays_code():
    found = sections(RESULTS.read_text())
    old = []
    for anchor, row in readme_rows((ROOT / "README.md").read_text()):
        if "measured at " in row:
            continue
        commit = found[anchor]["commit"]
        if not re.fullmatch(r"[0-9a-f]{7,40}", commit):  # "or earlier", "not recorded", several
            old.append(f"#{anchor}: commit {commit!r} is not one exact commit")
        elif why := stale(commit, MEASURES[anchor]):
            old.append(f"#{anchor}: {why}")
    assert not old, (
        "README rows give older figures as current (rerun them, or say `measured at C, before ...`):\n"
        + "\n".join(old)
    )


@pytest.mark.skipif(not history(), reason="needs the git history (not there in a tarball or shallow clone)")
def test_an_older_figure_names_a_later_change_to_its_code():
    """`measured at C, before D`: D comes after C and changed a file the section's script measures."""
    found, checked = sections(RESULTS.read_text()), 0
    for anchor, row in readme_rows((ROOT / "README.md").read_text()):
        said = re.search(r"measured at ([0-9a-f]{7,40})(?: or earlier)?, before ([0-9a-f]{7,40})", row)
        if not said:
            continue
        checked += 1
        assert said[1] == first_commit(found[anchor]["commit"]), (anchor, said[1])
        assert not git("merge-base", "--is-ancestor", said[1], said[2]).returncode, (anchor, said[2])
        changed = git("diff-tree", "--no-commit-id", "--name-only", "-r", said[2], "--", *MEASURES[anchor])
        assert changed.stdout.strip(), f"#{anchor}: {said[2]} changed none of {MEASURES[anchor]}"
    assert checked == sum("measured at " in row for _, row in readme_rows((ROOT / "README.md").read_text()))


@pytest.mark.skipif(not history(), reason="needs the git history (not there in a tarball or shallow clone)")
def test_a_section_older_than_its_code_is_found_stale():
    assert stale("1556e5f", MEASURES["train-step-memory-benchstep_memorypy"])  # before the CPU plan
    head = git("rev-parse", "--short", "HEAD").stdout.strip()
    assert stale(head, MEASURES["train-step-memory-benchstep_memorypy"]) is None


def test_a_benchmark_writes_the_measured_line_this_test_reads(tmp_path):
    """bench/_md.py, which every benchmark writes its section through, opens the section with it."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_md", ROOT / "bench" / "_md.py")
    md = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(md)
    out = tmp_path / "results.md"
    md.write_section(out, "A benchmark (bench/a.py)", "Command: `python bench/a.py`.\n\n| a |\n|---|\n| 1 |")
    fields = sections(out.read_text())["a-benchmark-benchapy"]
    assert set(fields) == {"commit", "date", "cpu", "load"}, out.read_text()
    assert re.fullmatch(r"20\d\d-\d\d-\d\d", fields["date"]) and " -> " in fields["load"]
