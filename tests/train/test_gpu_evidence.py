"""bench/gpu/evidence.sh --tiny: the GPU evidence run's own code, on the CPU at tiny shapes, so that the
script the GPU machine runs cannot rot between GPU calls; and its stop, in one line, where opsd does
not import."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys

import pytest
from helpers import ROOT

CHECKS = ["1-pytest", "2-trainer", "3-torchrun", "4-qwen3", "5-loss"]


def _evidence():
    spec = importlib.util.spec_from_file_location("evidence", ROOT / "bench" / "gpu" / "evidence.py")
    evidence = importlib.util.module_from_spec(spec)
    sys.modules["evidence"] = evidence
    spec.loader.exec_module(evidence)
    return evidence


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("timeout") is None, reason="needs GNU coreutils' timeout")
def test_evidence_script_dry_runs_on_the_cpu(tmp_path):
    out = tmp_path / "out"
    res = subprocess.run(
        ["bash", str(ROOT / "bench" / "gpu" / "evidence.sh"), "--tiny", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=1200,
        cwd=tmp_path,  # the script finds the repository itself
    )
    assert res.returncode == 0, (res.stdout + res.stderr)[-4000:]
    lines = (out / "summary.tsv").read_text().splitlines()
    assert lines[0].split("\t") == ["check", "status", "seconds", "figures"]
    rows = {r.split("\t")[0]: r.split("\t") for r in lines[1:]}
    assert list(rows) == CHECKS, lines
    assert all(r[1] in ("ok", "skipped") for r in rows.values()), lines
    assert all(rows[c][1] == "ok" for c in CHECKS[1:]), lines  # on the CPU with --tiny nothing is skipped
    # What comes back from the GPU machine: at most 8 plain files, one folder down.
    assert sorted(p.name for p in out.iterdir()) == sorted(
        ["env.log", "summary.tsv", "evidence.jsonl", *(f"{c}.log" for c in CHECKS)]
    )
    assert "opsd imports from" in (out / "env.log").read_text()
    evidence = [json.loads(x) for x in (out / "evidence.jsonl").read_text().splitlines()]
    order = [(e["check"], e["what"]) for e in evidence]
    # Full fine-tuning before LoRA in every check.
    for check, full, lora in [
        ("trainer", "full", "lora"),
        ("torchrun", "full", "lora"),
        ("qwen3", "full step", "lora step"),
    ]:
        assert order.index((check, full)) < order.index((check, lora)), order
    assert {
        ("qwen3", "model"),
        ("qwen3", "matmul peak"),
        ("qwen3", "baseline"),
        ("qwen3", "opsd / baseline"),
    } <= set(order)
    resumes = [e for e in evidence if e["check"] == "trainer"]
    assert all(e["resume_exact"] and e["steps"] == [1, 2, 3, 4] for e in resumes)  # a CPU is deterministic
    steps = [e for e in evidence if e["what"] in ("full step", "lora step")]
    assert len(steps) == 6
    assert all(e["student_tokens"] > 0 and e["teacher_tokens"] > e["response_tokens"] > 0 for e in steps)
    assert all(0 < e["flops"]["head"] < e["flops"]["total"] for e in steps)
    # torchrun's ranks said which precision they ran in (bf16 compute, float32 masters for full fine-tuning)
    assert all("bfloat16" in e["precision"] for e in evidence if e["check"] == "torchrun")
    # The baseline: the same first loss as opsd's on the same batch and weights, and the ratio summarized.
    base = next(e for e in evidence if e["what"] == "baseline")
    assert base["passed"] and base["loss_rdiff"] < 0.05
    figures = dict(f.split("=", 1) for f in rows["4-qwen3"][3].split())
    assert float(figures["opsd_over_baseline_s"]) > 0
    assert [figures[f"{p}_status"] for p in ("full", "lora", "baseline")] == ["ok", "ok", "ok"]
    assert "n256_time_ratio" in rows["5-loss"][3]


def test_evidence_stops_in_one_line_where_opsd_does_not_import(tmp_path):
    """No wheels carried and no pydantic: the run stops before its first check, in one line that names
    the missing module and the folder to carry, instead of spending every check's budget on failing."""
    shadow = tmp_path / "shadow" / "pydantic"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'pydantic'\", name='pydantic')\n"
    )
    wheels = tmp_path / "no-wheels"
    out = tmp_path / "out"
    path = os.pathsep.join(p for p in (str(shadow.parent), os.environ.get("PYTHONPATH")) if p)
    res = subprocess.run(
        ["bash", str(ROOT / "bench" / "gpu" / "evidence.sh"), "--tiny", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": path, "OPSD_WHEELS": str(wheels), "PYTHON": sys.executable},
    )
    assert res.returncode == 3, (res.stdout + res.stderr)[-3000:]
    stops = [x for x in res.stderr.splitlines() if x.startswith("evidence: stopped")]
    assert len(stops) == 1, res.stderr[-3000:]
    assert "missing pydantic" in stops[0] and f"carry {wheels}" in stops[0]
    assert sorted(p.name for p in out.iterdir()) == ["env.log", "summary.tsv"]  # no check ran
    assert (out / "summary.tsv").read_text().splitlines()[1].startswith("import\tfail\t")


def test_a_resume_within_the_floor_passes_where_a_rerun_matched_exactly():
    """SDPA's backward on CUDA is nondeterministic: a second straight run may match the first exactly
    while the resumed one differs in the last bits. The floor tells that from a resume defect."""
    evidence = _evidence()
    exact = {"record": 0.0, "weights": 0.0}
    assert evidence.resume_passes(exact, None)
    assert evidence.resume_passes({"record": 3e-7, "weights": 2e-8}, exact)
    assert not evidence.resume_passes({"record": 3e-7, "weights": 2e-8}, None)  # no rerun: bit-exact only
    assert not evidence.resume_passes({"record": 0.2, "weights": 2e-8}, exact)
    assert evidence.resume_passes({"record": 1e-3, "weights": 1e-3}, {"record": 2e-4, "weights": 2e-4})


def test_evidence_checks_say_skipped_without_cuda_unless_tiny(monkeypatch, capsys):
    """On a machine without CUDA each Python check exits 77 (evidence.sh: skipped) rather than failing."""
    import torch

    evidence = _evidence()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for check in evidence.CHECKS:
        assert evidence.main([check]) == evidence.SKIP
    assert "needs one" in capsys.readouterr().out
