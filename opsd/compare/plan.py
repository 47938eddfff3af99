"""What a comparison compares, and at what budget: the methods and the config keys each changes,
the budget every method gets, GRPO's own settings, and the comparison's directory."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from opsd.errors import UserError

METHODS: dict[str, str] = {
    "opsd": "OPSD",
    "grpo": "GRPO",
    "mixed": "GRPO + distillation",
    "sft": "SFT on the solutions (or data.target_key)",
    "context_distill": "context distillation: SFT on the teacher's own greedy answers",
    "control_a": "control A: teacher without the solution",
    "control_b": "control B: teacher with another problem's solution",
    "control_wrong": "wrong-answer control: teacher with its solution's final answer made wrong",
}
NOTES = {
    "control_a": "with teacher.mode=fixed its teacher is the initial student reading the same prompt: the "
    "divergence starts at zero and the gradient is rounding noise, which AdamW scales to full-size steps, so "
    "its row shows how far noise alone moves the student",
}
MARKER = "compare.json"  # only a directory holding it is written into again


@dataclass(frozen=True)
class Variant:
    """A method of :data:`METHODS` under a name of its own with some config keys changed
    (``--variant opsd_entry=opsd:loss.clip_mode=entry,loss.clip=0.05``): several settings of one method
    side by side at the same budget, on the same base evaluation."""

    name: str
    method: str
    overrides: tuple[str, ...]

    @classmethod
    def parse(cls, text: str) -> Variant:
        name, sep, rest = text.partition("=")
        method, sep2, keys = rest.partition(":")
        overrides = tuple(k.strip() for k in keys.split(",") if k.strip())
        if not (sep and sep2 and name.strip() and overrides) or any("=" not in k for k in overrides):
            raise UserError(f"--variant {text!r}: expected NAME=METHOD:KEY=VALUE[,KEY=VALUE...]")
        if method not in METHODS:
            raise UserError(f"--variant {text!r}: unknown method {method!r}; choose from {list(METHODS)}")
        if name in METHODS:
            raise UserError(f"--variant {text!r}: {name!r} is a method's own name; choose another")
        return cls(name.strip(), method, overrides)

    def label(self) -> str:
        return f"{METHODS[self.method]} ({', '.join(self.overrides)})"


def label(result: dict, method: str) -> str:
    """A method's name in the report: its description, or a variant's method and keys."""
    variant = result.get("variants", {}).get(method)
    return (
        Variant(method, variant["method"], tuple(variant["overrides"])).label()
        if variant
        else METHODS[method]
    )


@dataclass(frozen=True)
class ComparePlan:
    """What `opsd compare` runs (:func:`opsd.compare.run_compare`): these ``methods`` (and
    ``variants``, each named in ``methods`` like the others) on these ``seeds``.

    ``steps`` (default the config's optim.max_steps) and ``eval_every`` (default a quarter of them)
    make the budget. ``grpo_n``: GRPO's samples per problem when not tuned; ``grpo_lr``, ``sft_lr``:
    GRPO's and SFT's learning rates (default the config's); ``distill_coef``: GRPO + distillation's
    (:func:`distill_coefficient`). ``ceiling``: also evaluate the base model once with each held-out
    problem's solution in its prompt (``OUT/ceiling.json``) before the first method trains."""

    methods: list[str]
    seeds: list[int]
    steps: int | None = None
    eval_every: int | None = None
    grpo_n: int = 8
    grpo_lr: float | None = None
    sft_lr: float | None = None
    distill_coef: float | None = None
    progress: bool = True
    ceiling: bool = False
    variants: tuple[Variant, ...] = ()


@dataclass(frozen=True)
class TunePlan:
    """What `opsd compare --tune` runs (:func:`opsd.compare.run_tune`): ``method`` (``grpo``, or
    ``mixed`` at ``distill_coef``) for ``steps`` on each of ``tune_seeds``, which may not be among the
    ``reported`` ones, at each setting of :func:`opsd.compare.tune_grid` around ``lr``."""

    tune_seeds: list[int]
    reported: list[int]
    steps: int
    lr: float | None = None
    progress: bool = True
    method: str = "grpo"
    distill_coef: float | None = None


@dataclass(frozen=True)
class MethodJob:
    """One method on one seed (:func:`opsd.compare.run_trainer_method`): its name, its seed, the config
    it trains (the file, then dotted keys: the comparison's, then the method's own) and its run
    directory."""

    method: str
    seed: int
    config: Path | None
    overrides: list[str]
    run_dir: Path


TUNED = ("grpo", "mixed")  # the methods `opsd compare --tune` chooses settings for


def tune_file(method: str) -> Path:
    """Where `opsd compare --tune METHOD` writes its choice, relative to the comparison's directory."""
    return Path("tune") / f"{method}.json"


@dataclass(frozen=True)
class Budget:
    """What every method gets: optimizer steps, responses (or worked solutions) per step, and the
    held-out evaluations in between."""

    steps: int
    responses_per_step: int
    eval_every: int

    def describe(self) -> str:
        return (
            f"equal budget: {self.steps} optimizer steps and {self.responses_per_step} responses per step "
            f"for every method (SFT: {self.responses_per_step} worked solutions per step, its data); "
            f"held-out evaluation every {self.eval_every} steps"
        )


@dataclass(frozen=True)
class GRPOSettings:
    """GRPO's own choices within the budget: learning rate, sampling temperature, samples per
    problem (``n`` divides the responses per step), and std scaling of the advantages."""

    lr: float
    temperature: float
    n: int
    scale_rewards: bool

    def overrides(self, budget: Budget) -> list[str]:
        return [
            "objective=grpo",
            "grpo.distill_coef=0",
            f"optim.lr={self.lr}",
            f"rollout.temperature={self.temperature}",
            f"rollout.n={self.n}",
            f"rollout.prompts_per_step={budget.responses_per_step // self.n}",
            f"grpo.scale_rewards={str(self.scale_rewards).lower()}",
        ]


def method_overrides(
    method: str,
    grpo: GRPOSettings,
    distill_coef: float,
    budget: Budget,
    mixed: GRPOSettings | None = None,
    sft_lr: float | None = None,
) -> list[str]:
    """What a method changes in the user's config. ``mixed``: GRPO + distillation's own settings
    (default GRPO's); ``sft_lr``: SFT's learning rate (default the config's)."""
    if method == "sft":
        return sft_overrides(budget, sft_lr)
    if method == "context_distill":  # off-policy: the initial model's answers with the solution read
        return [*sft_overrides(budget, None), "data.sft_targets=teacher"]
    if method == "opsd":
        return ["objective=opsd"]
    if method == "control_a":
        return ["objective=opsd", "teacher.privileged=false"]
    if method == "control_b":
        return ["objective=opsd", "teacher.solution_source=other"]
    if method == "control_wrong":
        return ["objective=opsd", "teacher.solution_source=wrong_answer"]
    if method == "grpo":
        return grpo.overrides(budget)
    if method == "mixed":
        return [*(mixed or grpo).overrides(budget), f"grpo.distill_coef={distill_coef}"]
    raise UserError(f"unknown method {method!r}; choose from {list(METHODS)}")


def sft_overrides(budget: Budget, lr: float | None) -> list[str]:
    """``objective: sft`` on as many worked solutions a step as the others' responses, the token mean
    of its cross-entropy, with the settings that add a second SFT term or generate ahead switched off
    (nothing is generated for SFT to train on)."""
    return [
        "objective=sft",
        *([f"optim.lr={lr}"] if lr is not None else []),
        f"rollout.prompts_per_step={budget.responses_per_step}",
        "rollout.n=1",
        "loss.reduction=token",
        "loss.sft_coef=0",
        "rollout.overlap=0",
        "rollout.reuse.refresh_every=null",
        "rollout.reuse.refresh_below_agreement=null",
    ]


def default_grpo(cfg, budget: Budget, n: int) -> GRPOSettings:
    """GRPO's settings from the config, with ``n`` samples per problem."""
    check_group_size(n, budget)
    return GRPOSettings(cfg.optim.lr, cfg.rollout.temperature, n, cfg.grpo.scale_rewards)


def check_group_size(n: int, budget: Budget) -> None:
    r = budget.responses_per_step
    if n < 2 or r % n:
        raise UserError(
            f"--grpo-n {n}: GRPO needs at least 2 samples per problem, and a divisor of the {r} responses "
            "per step (rollout.prompts_per_step x rollout.n) so that every method samples as many"
        )


def distill_coefficient(cfg, given: float | None) -> float:
    """GRPO + distillation's grpo.distill_coef: ``given`` (--distill-coef), else the config's, else 1."""
    return given if given is not None else (cfg.grpo.distill_coef or 1.0)


def claim_dir(out: Path) -> None:
    """Only an `opsd compare` directory (or an empty one) is written into; the marker goes in first."""
    if out.exists() and any(out.iterdir()) and not (out / MARKER).is_file():
        raise UserError(f"{out} exists and is not an `opsd compare` directory; pass another --out")
    out.mkdir(parents=True, exist_ok=True)
    if not (out / MARKER).is_file():
        (out / MARKER).write_text("{}")
