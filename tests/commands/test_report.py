"""`opsd report` on synthetic run directories: still-running, resumed, eval in either place."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
from PIL import Image

import opsd.report as report_mod
from opsd.cli import main
from opsd.errors import UserError
from opsd.metrics import OPTIONAL_KEYS, STEP_KEYS, TIME_KEYS, StepFigures, step_record
from opsd.records import write_best
from opsd.report import (
    PLOTS,
    Panel,
    add_report_arguments,
    load_run_metrics,
    plot_panels,
    run_report,
    write_report,
)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _train_record(step: int, loss: float) -> dict:
    """A metrics.jsonl line as the trainer writes it (opsd.metrics.step_record), so the keys are the
    contract."""
    return step_record(
        StepFigures(
            step=step,
            loss=loss,
            loss_stats={
                "divergence": loss / 2,
                "clip_frac": 0.1,
                "entropy_student": 1.5,
                "entropy_teacher": 1.2,
                "agreement": 0.8,
                "overlap_mass": 0.9,
            },
            grad_norm=0.7,
            lr=1e-5,
            response_lens=[100 + step, 256],
            truncated=0,
            tokens=900,
            real_tokens={"teacher": 90, "student": 90},
            padded_tokens={"teacher": 100, "student": 100},
            skipped=False,
            prompt_truncated={"teacher": 0, "student": 0},
            epoch=0,
            times={"rollout": 0.5, "teacher": 0.15, "student": 0.25, "loss": 0.05, "optim": 0.05},
            elapsed=1.0,
            peak_mem_gb=3.2,
            repetition=0.05 * step,
        )
    )


def _write_run(run_dir: Path) -> None:
    """Steps 1..6, crash, resume from step 4 (steps 4..8 re-logged with different loss), run still writing."""
    lines = [json.dumps(_train_record(s, 10.0 - s)) for s in range(1, 7)]
    lines.append(json.dumps({"step": 5, "eval/avg@1": 0.2, "eval/pass@1": 0.2, "eval/resp_len_mean": 80.0}))
    lines += [json.dumps(_train_record(s, 100.0 + s)) for s in range(4, 9)]
    lines.append(json.dumps({"step": 8, "loss": None, "note": "text values are ignored"}))
    lines.append('{"step": 9, "loss": 0.')  # partial last line
    run_dir.mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text("\n".join(lines))
    (run_dir / "config.yaml").write_text("model: tiny\nlr: 1.0e-05\n")


def _assert_png(path: Path) -> None:
    assert path.stat().st_size > 0
    assert path.read_bytes()[:8] == PNG_MAGIC
    with Image.open(path) as im:
        im.verify()
    with Image.open(path) as im:
        assert im.size[0] > 100 and im.size[1] > 100


def test_load_dedupes_resumed_steps_and_counts_partial_line(tmp_path: Path) -> None:
    _write_run(tmp_path / "run")
    m = load_run_metrics(tmp_path / "run")
    assert list(m.train) == list(range(1, 9))
    assert m.train[4]["loss"] == 104.0  # resumed record wins
    assert m.train[3]["loss"] == 7.0
    assert m.replaced_steps == 3  # steps 4, 5, 6 re-logged
    assert m.eval == {5: {"eval/avg@1": 0.2, "eval/pass@1": 0.2, "eval/resp_len_mean": 80.0}}
    assert len(m.bad_lines) == 1 and "partial" in m.bad_lines[0]


def test_write_report_makes_pngs_and_markdown(tmp_path: Path) -> None:
    run = tmp_path / "run"
    _write_run(run)
    report = write_report(run)
    assert report == run / "report" / "report.md"
    pngs = sorted(p.name for p in (run / "report").glob("*.png"))
    expected = ["agreement", "clip_frac", "entropy", "eval", "loss", "optim", "response_length", "throughput"]
    assert pngs == sorted(f"{s}.png" for s in [*expected, "repetition"])
    for name in pngs:
        _assert_png(run / "report" / name)
    md = report.read_text()
    for name in pngs:
        assert f"({name})" in md
    assert "model: tiny" in md  # config embedded
    assert "| loss | 108 | 8 |" in md  # final number is the resumed run's
    assert "| time_loss |" in md
    assert "| eval/avg@1 | 0.2 | 5 |" in md
    assert "1 line(s) skipped" in md and "superseded" in md


def test_best_checkpoint_and_guard_stops_are_marked(tmp_path: Path, monkeypatch) -> None:
    """checkpoints/best.json and guard.jsonl (opsd.guard) become dotted lines at their steps on every
    plot and lines in report.md; a run without them has no marks."""
    run = tmp_path / "run"
    _write_run(run)
    drawn: dict[str, list[Panel]] = {}
    real = report_mod.plot_panels

    def spy(path, title, panels, **kw):
        drawn[path.stem] = panels
        return real(path, title, panels, **kw)

    monkeypatch.setattr(report_mod, "plot_panels", spy)
    write_report(run)
    assert drawn and all(not p.vlines for panels in drawn.values() for p in panels)
    (run / "checkpoints").mkdir()
    write_best(run, 4, "eval/avg@1", 0.5, run / "checkpoints" / "step_000004")
    line = "guard.min_length_ratio stopped the run after step 7: mean response length ..."
    (run / "guard.jsonl").write_text(
        json.dumps({"guard": "guard.min_length_ratio", "step": 7, "line": line}) + "\n"
    )
    drawn.clear()
    md = write_report(run).read_text()
    marks = {"best checkpoint (step 4)": 4.0, "guard.min_length_ratio stop (step 7)": 7.0}
    assert set(drawn) == {
        "eval",
        *(stem for stem, _, _ in PLOTS if stem not in ("logprob_gap", "reward", "rlsd")),
    }
    assert all(p.vlines == marks for panels in drawn.values() for p in panels)
    assert "- best checkpoint: `checkpoints/step_000004`, eval/avg@1=0.5 at step 4" in md
    assert f"- guard stop: {line}" in md
    assert "| repetition | 0.4 | 8 |" in md  # 0.05 * 8, the resumed run's


def test_missing_keys_and_separate_eval_file(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text(
        "\n".join(json.dumps({"step": s, "loss": 1.0 / s, "tokens_per_s": 50.0}) for s in range(1, 4)) + "\n"
    )
    (run / "eval.jsonl").write_text(json.dumps({"step": 2, "avg@4": 0.5, "pass@4": 0.75}) + "\n")
    write_report(run)
    pngs = sorted(p.name for p in (run / "report").glob("*.png"))
    assert pngs == ["eval.png", "loss.png", "throughput.png"]
    assert load_run_metrics(run).eval[2] == {"eval/avg@4": 0.5, "eval/pass@4": 0.75}


def test_empty_run_still_reports_and_missing_run_errors(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    with pytest.raises(UserError, match="metrics.jsonl"):
        write_report(run)
    (run / "metrics.jsonl").write_text("")
    md = write_report(run).read_text()
    assert "none yet" in md
    with pytest.raises(UserError, match="does not exist"):
        write_report(tmp_path / "nope")


def test_cli_missing_run_dir_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "no_such_run"
    assert main(["report", str(missing)]) == 2
    err = capsys.readouterr().err
    assert str(missing) in err and "does not exist" in err and "Traceback" not in err


def test_plots_cover_the_trainers_metric_names() -> None:
    """Every key a plot asks for is one the trainer writes, and the step-time plot has every phase."""
    keys = {k.removeprefix("stack:") for _, _, panels in PLOTS for panel in panels for k in panel}
    assert keys <= set(STEP_KEYS) | set(OPTIONAL_KEYS), keys - set(STEP_KEYS) - set(OPTIONAL_KEYS)
    throughput = next(panels for stem, _, panels in PLOTS if stem == "throughput")
    assert [k.removeprefix("stack:") for k in throughput[1]] == list(TIME_KEYS)
    assert "time_loss" in TIME_KEYS


def test_plot_panels_for_other_callers(tmp_path: Path) -> None:
    """The plotting entry other commands (opsd demo) use: several curves, a constant level, own x axes."""
    path = plot_panels(
        tmp_path / "x.png",
        "title",
        [
            Panel(
                {"a": ([0, 1, 2], [1.0, 2.0, 3.0]), "b": ([0, 2], [0.5, 0.7])},
                hlines={"top": 3.0},
                ylim=(0, 4),
            ),
            Panel({"c": ([10, 20], [1.0, 0.0])}, xlabel="tokens"),
        ],
        sharex=False,
    )
    _assert_png(path)


def test_cli_glue(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 1.0}) + "\n")
    p = argparse.ArgumentParser()
    add_report_arguments(p)
    assert run_report(p.parse_args([str(tmp_path / "run")])) == 0
    assert "report.md" in capsys.readouterr().out
    assert (tmp_path / "run" / "report" / "loss.png").stat().st_size > 0
