"""bench/gpu/evidence.sh --tiny: the GPU evidence run's own code, on the CPU at tiny shapes, so that the
script the GPU machine runs cannot rot between GPU calls."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CHECKS = ["1-pytest", "2-trainer", "3-torchrun", "4-qwen3"]


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("timeout") is None, reason="needs GNU coreutils' timeout")
def test_evidence_script_dry_runs_on_the_cpu(tmp_path):
    out = tmp_path / "out"
    res = subprocess.run(
        ["bash", str(ROOT / "bench" / "gpu" / "evidence.sh"), "--tiny", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
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
    by = {(e["check"], e["what"]) for e in evidence}
    assert {("trainer", "lora"), ("trainer", "full"), ("torchrun", "full"), ("torchrun", "lora")} <= by
    assert {("qwen3", "model"), ("qwen3", "lora step"), ("qwen3", "full step")} <= by
    resumes = [e for e in evidence if e["check"] == "trainer"]
    assert all(e["resume_exact"] and e["steps"] == [1, 2, 3, 4] for e in resumes)  # a CPU is deterministic
    steps = [e for e in evidence if e["what"].endswith(" step")]
    assert all(e["student_tokens"] > 0 and e["teacher_tokens"] > e["response_tokens"] > 0 for e in steps)
    # torchrun's ranks said which precision they ran in (bf16 compute, float32 masters for full fine-tuning)
    assert all("bfloat16" in e["precision"] for e in evidence if e["check"] == "torchrun")


def test_evidence_checks_say_skipped_without_cuda_unless_tiny(monkeypatch, capsys):
    """On a machine without CUDA each Python check exits 77 (evidence.sh: skipped) rather than failing."""
    import importlib.util

    import torch

    spec = importlib.util.spec_from_file_location("evidence", ROOT / "bench" / "gpu" / "evidence.py")
    evidence = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(evidence)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for check in evidence.CHECKS:
        assert evidence.main([check]) == evidence.SKIP
    assert "needs one" in capsys.readouterr().out
