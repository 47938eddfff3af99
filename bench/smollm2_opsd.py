"""OPSD on a real model, briefly: SmolLM2-135M-Instruct on MATH train problems, before and after.

The claim under test is modest: after N OPSD steps the teacher-student divergence on held-out
problems falls, and MATH-500 accuracy does not fall. Reported, before and after training:

* held-out divergence: on 64 MATH train rows the run never trains on (the last 64 of the file), the
  student samples one response to each problem (the training temperature, a fixed seed) and the
  trainer's own pieces score it: the prompts (PromptBuilder), the splice (make_sample), the
  micro-batches, the teacher (the base model reading the reference solution) and the fused loss,
  under torch.no_grad with no optimizer step. It is the number training minimises, measured on
  problems training never saw, on the student's current samples;
* MATH-500 accuracy on a fixed subset (the first K problems in file order), greedy, graded strictly
  (math-verify on the last \\boxed{}, as `opsd eval`) and leniently (math-verify on the response's tail)
  from the same responses.

Training: `opsd train`'s Trainer with the settings of examples/smollm2-math.yaml (LoRA r=16 on all
projections, fixed teacher, forward KL with entry clip 0.05, T=1.1) and 8 problems a step, 256 new
tokens. bf16 where the hardware has bf16 matrix units (a CUDA GPU, or a CPU with AVX512-BF16 or AMX),
float32 otherwise.

    opsd fetch-model smollm2-135m-instruct
    python bench/smollm2_opsd.py                      # 50 steps; hours on 2 CPU cores, minutes on a GPU
    python bench/smollm2_opsd.py --steps 1 --prompts 2 --max-new-tokens 16 --heldout 2 --math500 2 \\
        --eval-tokens 16 --no-write                   # a smoke test
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

import _common
import torch
from _md import write_section

ROOT = _common.ROOT
SHARED = ROOT.parent / "shared" / "data"
HEADING = "SmolLM2-135M OPSD on MATH (bench/smollm2_opsd.py)"


@torch.no_grad()
def heldout_divergence(trainer, examples: list, *, seed: int = 0) -> dict:
    """The training loss and its statistics on ``examples`` for the trainer's current student: one
    sampled response per problem, scored as a training step scores it, with no gradient or update."""
    from opsd.data import PromptBuilder, make_microbatches, make_sample
    from opsd.data.batching import TokenWeights
    from opsd.rollout import SamplingParams

    cfg = trainer.cfg
    prompts = PromptBuilder(trainer.run.tokenizer, cfg.data, privileged=True)  # its own cache
    pairs = [prompts(i, ex) for i, ex in enumerate(examples)]
    params = SamplingParams.from_rollout(cfg.rollout, seed)
    trainer.run.engine.wake()
    completions = trainer.run.engine.generate([s for s, _ in pairs], 1, params)
    trainer.run.engine.sleep()
    samples = [
        make_sample(*pairs[c.prompt_index], c.token_ids, c.prompt_index, c.finish_reason)
        for c in completions
        if c.token_ids
    ]
    tokens = sum(s.response_len for s in samples)
    batches = make_microbatches(
        samples,
        max_tokens=trainer.run.mb_tokens,
        pad_id=trainer.run.pad_id,
        weights=TokenWeights(trainer.run.spec.reduction, tokens, len(samples)),
        device=trainer.run.dist.device,
    )
    loss_sum, stats = trainer.run.forward_backward(
        batches, backward=False
    )  # the step's own loop, no gradient
    loss = float(loss_sum)
    trainer.run.teacher.release()
    return {
        "loss": loss,
        **stats.means(),
        "response_tokens": tokens,
        "responses": len(samples),
        "truncated": sum(c.finish_reason == "length" for c in completions),
    }


def math500_accuracy(trainer, examples: list, max_new_tokens: int, batch_size: int) -> dict:
    """Greedy accuracy of the trainer's current student, strict and lenient, from the same responses."""
    from opsd.config import DataConfig, EvalConfig
    from opsd.eval import EvalRun, evaluate_model
    from opsd.grading import grade_lenient

    e = EvalConfig(k=1, temperature=0.0, max_new_tokens=max_new_tokens)
    data = DataConfig(instruction=trainer.cfg.data.instruction, max_prompt_len=1 << 20)  # prompts uncut
    run = EvalRun(engine=trainer.run.engine, batch_size=batch_size, name="MATH-500", progress=True)
    res = evaluate_model(trainer.run.model, trainer.run.tokenizer, examples, e, data, run)
    lenient = sum(grade_lenient(r, it["gold"]).correct for it in res.items for r in it["responses"])
    return {
        "strict": res.avg_at_k,
        "lenient": lenient / len(res.items),
        "no_boxed": res.no_answer_frac,
        "truncated": res.truncated_frac,
        "resp_len_mean": res.resp_len_mean,
        "seconds": res.seconds,
    }


def _parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--prompts", type=int, default=8, help="problems per step")
    ap.add_argument("--max-new-tokens", type=int, default=256, help="rollout length in training and held-out")
    ap.add_argument("--lr", type=float, default=1e-4, help="LoRA learning rate (constant)")
    ap.add_argument(
        "--heldout", type=int, default=64, help="held-out MATH train problems (the file's last N)"
    )
    ap.add_argument("--math500", type=int, default=64, help="MATH-500 subset: the first N problems")
    ap.add_argument("--eval-tokens", type=int, default=512, help="max new tokens for MATH-500")
    ap.add_argument("--eval-batch", type=int, default=32)
    ap.add_argument("--device", default="auto", help="auto, cpu or cuda")
    ap.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / "bench-smollm2-opsd")
    ap.add_argument("--md", type=Path, default=ROOT / "docs" / "results.md")
    ap.add_argument("--no-write", action="store_true", help="print the section instead of writing it")
    return ap.parse_args()


def _write_data(args: argparse.Namespace) -> tuple[list, list]:
    """OUT/train.jsonl and OUT/heldout.jsonl (the last --heldout rows of MATH train, held out; training
    draws from the rest), and the held-out and MATH-500 examples."""
    from opsd.data import RowKeys, load_examples

    if args.out.exists():
        shutil.rmtree(args.out)
    args.out.mkdir(parents=True)
    rows = (SHARED / "math_train.jsonl").read_text().splitlines()
    (args.out / "train.jsonl").write_text("\n".join(rows[: -args.heldout]) + "\n")
    (args.out / "heldout.jsonl").write_text("\n".join(rows[-args.heldout :]) + "\n")
    heldout = load_examples(str(args.out / "heldout.jsonl"), RowKeys(answer="answer")).examples
    math500 = load_examples(
        str(SHARED / "math500_test.jsonl"), RowKeys(solution=None, answer="answer"), require_answer=True
    ).examples
    return heldout, math500[: args.math500]


def _overrides(args: argparse.Namespace, model: Path, device: str, dtype: str) -> list[str]:
    """The run's config: examples/smollm2-math.yaml's settings at this benchmark's sizes."""
    return [
        f"seed={args.seed}",
        f"device={device}",
        f"model.path={model}",
        f"model.dtype={dtype}",
        "model.lora.r=16",
        "model.lora.alpha=32",
        f"data.path={args.out / 'train.jsonl'}",
        "data.skip_bad_rows=true",
        "data.max_prompt_len=512",
        "data.max_teacher_prompt_len=1024",
        f"rollout.prompts_per_step={args.prompts}",
        "rollout.n=1",
        "rollout.temperature=1.1",
        f"rollout.max_new_tokens={args.max_new_tokens}",
        "rollout.batch_size=32",
        "loss.mode=jsd",
        "loss.beta=0",
        "loss.clip_mode=entry",
        "loss.clip=0.05",
        "teacher.mode=fixed",
        f"optim.lr={args.lr}",
        "optim.grad_clip=0.1",
        f"optim.max_steps={args.steps}",
        "optim.max_tokens_per_microbatch=4096",
        "checkpoint.every=0",
        "checkpoint.keep_last=1",
        f"logging.run_dir={args.out / 'run'}",
        "logging.sample_every=10",
    ]


def _before_and_after(trainer, args: argparse.Namespace, heldout: list, math500: list) -> dict:
    """The held-out divergence and MATH-500 accuracy before and after training, the training's step
    records, and each phase's seconds (printed as each ends)."""
    timing: dict[str, float] = {}

    def timed(name: str, fn):
        t = time.time()
        out = fn()
        timing[name] = time.time() - t
        print(
            f"{name}: {json.dumps(out) if isinstance(out, dict) else ''} ({timing[name]:.0f} s)", flush=True
        )
        return out

    div_before = timed(
        "held-out divergence before", lambda: heldout_divergence(trainer, heldout, seed=args.seed)
    )
    acc_before = timed(
        "MATH-500 before", lambda: math500_accuracy(trainer, math500, args.eval_tokens, args.eval_batch)
    )
    history = timed("training", trainer.train)
    div_after = timed(
        "held-out divergence after", lambda: heldout_divergence(trainer, heldout, seed=args.seed)
    )
    acc_after = timed(
        "MATH-500 after", lambda: math500_accuracy(trainer, math500, args.eval_tokens, args.eval_batch)
    )
    return {
        "heldout_divergence": {"before": div_before, "after": div_after},
        "math500": {"before": acc_before, "after": acc_after},
        "train_divergence": [rec["divergence"] for rec in history],
        "timing_s": timing,
    }


def main() -> None:
    args = _parse_args()

    from opsd.config import load_config
    from opsd.devices import resolve_device
    from opsd.fetch import cached_model_path
    from opsd.precision import compute_dtype, dtype_name
    from opsd.trainer import Trainer

    model = cached_model_path("smollm2-135m-instruct")
    if model is None:
        sys.exit("SmolLM2 is not fetched: run `opsd fetch-model smollm2-135m-instruct` first")
    for f in ("math_train.jsonl", "math500_test.jsonl"):
        if not (SHARED / f).is_file():
            sys.exit(f"{SHARED / f} not found (see ../shared/data/README.md)")
    dev = resolve_device(args.device)
    device = str(dev)
    dtype = dtype_name(compute_dtype(args.dtype, dev)[0])  # auto: bf16 where there are bf16 units
    heldout, math500 = _write_data(args)
    overrides = _overrides(args, model, device, dtype)
    cfg = load_config(None, overrides)
    started, load_before = time.strftime("%Y-%m-%d %H:%M"), _common.load_avgs()
    print(f"load average before: {load_before}; device {device}, {dtype}", flush=True)
    t0 = time.time()
    trainer = Trainer(cfg, overwrite=True)
    measured = _before_and_after(trainer, args, heldout, math500)
    load_after = _common.load_avgs()
    print(f"load average after: {load_after}", flush=True)

    result = {
        "settings": vars(args) | {"out": str(args.out), "md": str(args.md), "device": device, "dtype": dtype},
        "overrides": overrides,
        **measured,
        "seconds": time.time() - t0,
        "load": {"before": load_before, "after": load_after},
    }
    (args.out / "result.json").write_text(json.dumps(result, indent=2))
    body = render(result, started, _common.describe_machine())
    print(body)
    if not args.no_write:
        write_section(args.md, HEADING, body)
        print(f"wrote {args.md}")


def render(r: dict, started: str, where: str) -> str:
    s, d, a, t = r["settings"], r["heldout_divergence"], r["math500"], r["timing_s"]
    cmd = (
        f"python bench/smollm2_opsd.py --steps {s['steps']} --prompts {s['prompts']} --max-new-tokens "
        f"{s['max_new_tokens']} --lr {s['lr']} --heldout {s['heldout']} --math500 {s['math500']} "
        f"--eval-tokens {s['eval_tokens']} --device {s['device']} --dtype {s['dtype']} --seed {s['seed']}"
    )
    train = r["train_divergence"]
    k = max(1, min(5, len(train) // 2))
    pct = lambda x: f"{100 * x:.1f}%"  # noqa: E731
    lines = [
        f"Run {started} on {where}, {s['dtype']}; load average (1/5/15 min) before {r['load']['before']}, "
        f"after {r['load']['after']}. Reproduce: `opsd fetch-model smollm2-135m-instruct && {cmd}`.",
        "",
        f"SmolLM2-135M-Instruct, LoRA r=16 on all projections, OPSD for {s['steps']} steps of {s['prompts']} "
        f"MATH train problems, 1 sample each at T=1.1, <= {s['max_new_tokens']} new tokens, fixed teacher "
        f"(the base model reading the reference solution), forward KL with entry clip 0.05, lr {s['lr']} "
        "constant, grad clip 0.1.",
        "",
        "| | before | after |",
        "|---|---|---|",
        f"| held-out divergence: mean per-token KL(teacher \\|\\| student), {s['heldout']} MATH train "
        f"problems never trained on, the student's own samples | {d['before']['divergence']:.4f} | "
        f"{d['after']['divergence']:.4f} |",
        f"| held-out teacher-student agreement (argmax) | {d['before']['agreement']:.3f} | "
        f"{d['after']['agreement']:.3f} |",
        f"| held-out response tokens (truncated at {s['max_new_tokens']}) | {d['before']['response_tokens']} "
        f"({d['before']['truncated']}) | {d['after']['response_tokens']} ({d['after']['truncated']}) |",
        f"| MATH-500, first {s['math500']}, greedy, strict `\\boxed{{}}` | {pct(a['before']['strict'])} "
        f"| {pct(a['after']['strict'])} |",
        f"| MATH-500, same responses, lenient (math-verify on the tail) | {pct(a['before']['lenient'])} "
        f"| {pct(a['after']['lenient'])} |",
        f"| MATH-500: no `\\boxed{{}}` / truncated at {s['eval_tokens']} tokens | "
        f"{pct(a['before']['no_boxed'])} / {pct(a['before']['truncated'])} | {pct(a['after']['no_boxed'])} / "
        f"{pct(a['after']['truncated'])} |",
        "",
        f"Training divergence (per step, on that step's problems): mean of the first {k} steps "
        f"{sum(train[:k]) / k:.4f}, of the last {k} {sum(train[-k:]) / k:.4f}. Time: training "
        f"{t['training'] / 60:.1f} min, held-out divergence {t['held-out divergence before']:.0f} s + "
        f"{t['held-out divergence after']:.0f} s, MATH-500 {t['MATH-500 before'] / 60:.1f} + "
        f"{t['MATH-500 after'] / 60:.1f} min.",
        "",
        "The held-out divergence is the training loss's statistic computed by the trainer's own pieces "
        "(prompts, splice, micro-batches, teacher, fused loss) under no_grad, with no optimizer step, on "
        "one response per problem sampled by the current student at the training temperature with a fixed "
        "seed.",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
