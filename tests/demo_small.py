"""`opsd demo`'s settings at a size that builds its base in a second, for the tests that run the demo's
commands as written (tests/commands/test_demo.py, tests/meta/test_readme.py)."""

from __future__ import annotations

from dataclasses import make_dataclass

from opsd.demo.base import DemoSettings

SMALL = dict(
    digits=2,
    hidden=32,
    layers=1,
    sft_steps=5,
    n_sft=64,
    n_train=64,
    n_heldout=8,
    eval_every=2,
    prompts_per_step=8,
    grpo_n=4,
)


def small_demo_settings() -> type[DemoSettings]:
    """DemoSettings with :data:`SMALL` as its defaults: what `opsd demo`'s command line builds when the
    test puts it in place of the real one."""
    return make_dataclass(
        "SmallDemoSettings", [(k, type(v), v) for k, v in SMALL.items()], bases=(DemoSettings,)
    )
