"""Published figures against the code they measure, and the layout readers find them in.

Every section of docs/results.md (one per benchmark script) opens with one ``Measured:`` line (commit,
date, CPU, load), and so does every study page of docs/studies/ under its title; a part of a study with
a ``Measured:`` line of its own is a section of its own. A README results row that gives a figure as
current must cite a section whose commit is no older than the last change to the files that section's
script measures (:data:`MEASURES`); a row that says ``measured at C, before ...`` gives an older figure
as such, and C must be the section's own commit. Without git history (a tarball install, a shallow
clone) the comparison with history is skipped. docs/results.md stays short (:data:`MAX_RESULTS_LINES`)
and lists every study; each README results row is one line of at most :data:`MAX_ROW` characters.
"""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest
from docs_text import heading_anchors
from helpers import ROOT

RESULTS = ROOT / "docs" / "results.md"
STUDIES = ROOT / "docs" / "studies"
MAX_RESULTS_LINES = 500
MAX_ROW = 200
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

# Per section, the source paths its script measures: docs/results.md's by anchor; a study's as
# `studies/NAME.md` (the page) or `studies/NAME.md#anchor` (a part with a Measured line of its own).
MEASURES: dict[str, tuple[str, ...]] = {
    "loss-cpu-benchlosspy": ("opsd/loss", "bench/loss.py"),
    "studies/precision.md": ("opsd/loss", "tests/loss/test_loss_precision.py"),
    "loss-products-on-this-cpu-benchcpuloss_productspy": (
        "opsd/loss",
        "opsd/cpu",
        "bench/cpu/loss_products.py",
    ),
    "studies/cpus.md#loss-products-intel-xeon-amx-bf16": (
        "opsd/loss",
        "opsd/cpu",
        "bench/cpu/loss_products.py",
    ),
    "rollout-benchrolloutpy": ("opsd/rollout", "opsd/models.py", "bench/rollout.py"),
    "hf-engine-benchcpuhf_enginepy": ("opsd/rollout", "opsd/cpu", "opsd/models.py", "bench/cpu/hf_engine.py"),
    "vllm-cpu-vs-hf-engine-benchvllm_rolloutpy": ("opsd/rollout", "opsd/cpu", "bench/vllm_rollout.py"),
    "studies/cpus.md#vllm-cpu-vs-hf-engine-intel-xeon-avx512": (
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
    "studies/cpus.md#opsd-vs-trl-sdft-amd-epyc": (*STEP, "bench/vs_trl.py"),
    "studies/cpus.md#opsd-vs-trl-sdft-intel-xeon-avx512": (*STEP, "bench/vs_trl.py"),
    "demo-benchdemopy": (*COMPARE, "opsd/demo", "bench/demo.py"),
    "demo-comparison-opsd-grpo-sft-controls-benchcomparepy": (*COMPARE, "opsd/demo", "bench/compare.py"),
    "smollm2-135m-opsd-on-math-benchsmollm2_opsdpy": (*STEP, "opsd/eval", "bench/smollm2_opsd.py"),
    "studies/gsm8k.md": (*COMPARE, "examples/gsm8k-compare.yaml"),
    "studies/probe.md": (*STEP, "opsd/probe.py", "examples/arith.yaml", "examples/gsm8k-compare.yaml"),
    "studies/probe.md#the-solutions-pull-on-the-students-own-tokens": (
        *STEP,
        "opsd/probe.py",
        "examples/arith.yaml",
        "opsd/demo",
    ),
    "probe-wall-time-benchprobe_speedpy": (
        *STEP,
        "opsd/probe.py",
        "opsd/eval",
        "opsd/grading.py",
        "examples/arith.yaml",
        "bench/probe_speed.py",
    ),
    "studies/arith.md": (*COMPARE, "examples/arith.yaml"),
    "studies/arith.md#why-the-student-learns-not-to-stop-the-end-token-is-not-it": (
        *STEP,
        "examples/arith.yaml",
    ),
    "studies/arith.md#why-the-student-learns-not-to-stop-a-teacher-that-would-correct-a-wrong-answer": (
        *STEP,
        "examples/arith.yaml",
    ),
    "studies/arith.md#tuning-on-the-dev-slice": (*STEP, "examples/arith.yaml"),
    "studies/arith.md#plan-and-its-arithmetic": (*COMPARE, "examples/arith.yaml"),
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
    "studies/cpus.md": (*STEP, "bench/vs_trl.py", "bench/vllm_rollout.py", "bench/cpu/loss_products.py"),
    "studies/facts.md": (*COMPARE, "opsd/probe.py", "examples/facts.yaml"),
}


def headings(markdown: str) -> list[tuple[int, str, dict[str, str]]]:
    """Each heading outside fenced code: (its level, its anchor, the ``Measured:`` fields of its first
    line, empty where that line is not one)."""
    lines, out, fenced = markdown.splitlines(), [], False
    for i, line in enumerate(lines):
        fenced ^= line.startswith("```")
        if not fenced and (m := re.match(r"(#{1,6}) ", line)):
            (anchor,) = heading_anchors(line)
            first = next((x for x in lines[i + 1 :] if x.strip()), "")
            m2 = MEASURED.match(first)
            out.append((len(m[1]), anchor, m2.groupdict() if m2 else {}))
    return out


def sections(markdown: str) -> dict[str, dict[str, str]]:
    """docs/results.md: each ## or ### section's anchor -> its ``Measured:`` fields (empty where the line
    is missing or is not the first line after the heading)."""
    return {anchor: fields for level, anchor, fields in headings(markdown) if level in (2, 3)}


def study_sections(name: str, markdown: str) -> dict[str, dict[str, str]]:
    """A study page's sections: ``studies/NAME`` -> the fields of the line under its ``# `` title (empty
    where it is not a ``Measured:`` line), and ``studies/NAME#anchor`` -> those of each part that opens
    with one of its own; the other parts (its question, settings, tables) belong to the page."""
    found = headings(markdown)
    out = {f"studies/{name}": next((f for level, _, f in found if level == 1), {})}
    out |= {f"studies/{name}#{anchor}": f for level, anchor, f in found if level > 1 and f}
    return out


def all_sections() -> dict[str, dict[str, str]]:
    """docs/results.md's sections and every study page's (:func:`study_sections`)."""
    out = sections(RESULTS.read_text())
    for page in sorted(STUDIES.glob("*.md")):
        out |= study_sections(page.name, page.read_text())
    return out


def cited(link: str, found: dict[str, dict[str, str]]) -> str | None:
    """The section a README link cites: a docs/results.md anchor, a study part with a Measured line of
    its own, or the study page (its link, or an anchor of a part without one); None for other links."""
    if m := re.fullmatch(r"docs/results\.md#([\w-]+)", link):
        return m[1]
    if m := re.fullmatch(r"docs/(studies/[\w-]+\.md)(?:#([\w-]+))?", link):
        return f"{m[1]}#{m[2]}" if f"{m[1]}#{m[2]}" in found else m[1]
    return None


def results_part(readme: str) -> str:
    return readme.split("\n## Results\n", 1)[1].split("\n## ", 1)[0]


def table_rows(part: str) -> list[str]:
    """The rows of a Markdown table, without its header and separator."""
    lines = [x for x in part.splitlines() if x.startswith("|")]
    return lines[2:] if len(lines) > 1 and re.fullmatch(r"\|[-|: ]+\|", lines[1]) else lines


def readme_rows(readme: str, found: dict[str, dict[str, str]] | None = None) -> list[tuple[str, str]]:
    """The README's results rows: (the section each cites, :func:`cited`; the whole row). A row that
    cites none is given with the section ``""``."""
    found = all_sections() if found is None else found
    rows = []
    for line in table_rows(results_part(readme)):
        keys = [k for link in re.findall(r"\]\(([^)\s]+)\)", line) if (k := cited(link, found))]
        rows.append((keys[0] if keys else "", line))
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
    found = all_sections()
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
    found = all_sections()
    rows = readme_rows((ROOT / "README.md").read_text(), found)
    assert rows, "the README's results table has no rows"
    assert {a.startswith("studies/") for a, _ in rows} == {True, False}, "rows cite results.md and studies"
    for anchor, row in rows:
        assert anchor, f"a README results row cites no section of docs/results.md or docs/studies/: {row}"
        assert anchor in found, f"the README cites {anchor}, which is no section"
        said = re.search(r"measured at ([0-9a-f]{7,40})", row)
        if said:  # an older figure given as such: the section's own commit
            assert said[1] == first_commit(found[anchor]["commit"]), (
                anchor,
                said[1],
                found[anchor]["commit"],
            )


@pytest.mark.skipif(not history(), reason="needs the git history (not there in a tarball or shallow clone)")
def test_figures_the_readme_gives_as_current_are_from_todays_code():
    found = all_sections()
    old = []
    for anchor, row in readme_rows((ROOT / "README.md").read_text(), found):
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
    found, checked = all_sections(), 0
    rows = readme_rows((ROOT / "README.md").read_text(), found)
    for anchor, row in rows:
        said = re.search(r"measured at ([0-9a-f]{7,40})(?: or earlier)?, before ([0-9a-f]{7,40})", row)
        if not said:
            continue
        checked += 1
        assert said[1] == first_commit(found[anchor]["commit"]), (anchor, said[1])
        assert not git("merge-base", "--is-ancestor", said[1], said[2]).returncode, (anchor, said[2])
        changed = git("diff-tree", "--no-commit-id", "--name-only", "-r", said[2], "--", *MEASURES[anchor])
        assert changed.stdout.strip(), f"#{anchor}: {said[2]} changed none of {MEASURES[anchor]}"
    assert checked == sum("measured at " in row for _, row in rows)


@pytest.mark.skipif(not history(), reason="needs the git history (not there in a tarball or shallow clone)")
def test_a_section_older_than_its_code_is_found_stale():
    assert stale("1556e5f", MEASURES["train-step-memory-benchstep_memorypy"])  # before the CPU plan
    head = git("rev-parse", "--short", "HEAD").stdout.strip()
    assert stale(head, MEASURES["train-step-memory-benchstep_memorypy"]) is None


def test_results_stay_short_and_every_study_is_listed_and_measured():
    """docs/results.md holds each benchmark's latest table in at most :data:`MAX_RESULTS_LINES` lines and
    links every study page; every study page opens with its Measured line; each README results row is
    one line of at most :data:`MAX_ROW` characters."""
    text = RESULTS.read_text()
    assert len(text.splitlines()) <= MAX_RESULTS_LINES, (
        f"docs/results.md has {len(text.splitlines())} lines (at most {MAX_RESULTS_LINES}): move a study's "
        "narrative, tuning logs or older tables to its page in docs/studies/"
    )
    pages = sorted(STUDIES.glob("*.md"))
    assert {"facts.md", "arith.md", "gsm8k.md", "probe.md"} <= {p.name for p in pages}
    for page in pages:
        assert f"](studies/{page.name})" in text, f"docs/results.md's studies do not link {page.name}"
        assert study_sections(page.name, page.read_text())[f"studies/{page.name}"], (
            f"docs/studies/{page.name} does not open with `Measured: commit ...; date ...; cpu ...; "
            "load ...` under its title"
        )
    rows = readme_rows((ROOT / "README.md").read_text())
    long = [f"{len(row)}: {row[:80]}..." for _, row in rows if len(row) > MAX_ROW]
    assert not long, f"README results rows over {MAX_ROW} characters:\n" + "\n".join(long)


def test_a_study_part_with_its_own_measured_line_is_a_section_and_code_is_not_a_heading():
    page = (
        "# Study: a question\n\nMeasured: commit abc1234; date 2026-01-01; cpu X; load 1 -> 2\n\n"
        "## The answer\n\n"
        "```\n# a comment in a command block\n```\n\n### A tuning log\n\n"
        "Measured: commit def5678; date not recorded; cpu X; load not recorded\n"
    )
    found = study_sections("q.md", page)
    assert set(found) == {"studies/q.md", "studies/q.md#a-tuning-log"}
    assert found["studies/q.md"]["commit"] == "abc1234"
    assert found["studies/q.md#a-tuning-log"]["commit"] == "def5678"
    assert cited("docs/studies/q.md#the-answer", found) == "studies/q.md"
    assert cited("docs/studies/q.md#a-tuning-log", found) == "studies/q.md#a-tuning-log"
    assert cited("docs/results.md#loss-cpu-benchlosspy", found) == "loss-cpu-benchlosspy"
    assert cited("docs/demo.md", found) is None
    assert not study_sections("q.md", "# Study\n\nNo measured line.\n")["studies/q.md"]


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
