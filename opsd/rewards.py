"""Rewards and group-relative advantages for the GRPO objective (the RL baseline).

The reward of a response is its grade against the example's answer (1 correct, 0 not): math-verify
for math data, or any ``(response, answer) -> Grade | bool | float`` function named as
``package.module:function`` (the demo passes its task's exact-answer grader).
"""

from __future__ import annotations

from collections.abc import Callable

Reward = Callable[[str, str], float]


def make_reward(grader: str) -> Reward:
    """``math`` (math-verify on the last ``\\boxed{}``), ``lenient`` (math-verify on the response's
    tail), or ``package.module:function``."""
    from opsd.grading import resolve_grader

    fn = resolve_grader(grader, "grpo.grader")

    def reward(response: str, answer: str) -> float:
        g = fn(response, answer)
        return float(getattr(g, "correct", g))

    return reward


def group_advantages(rewards: list[float], groups: list[int], *, scale: bool = False) -> list[float]:
    """``A_i = r_i - mean(r of i's group)``, optionally divided by the group's standard deviation.

    A group whose rewards are all equal carries no signal: its advantages are exactly 0, so it adds
    nothing to the gradient. ``groups[i]`` names the group (the problem) of response ``i``.
    """
    members: dict[int, list[int]] = {}
    for i, g in enumerate(groups):
        members.setdefault(g, []).append(i)
    adv = [0.0] * len(rewards)
    for idx in members.values():
        rs = [rewards[i] for i in idx]
        mean = sum(rs) / len(rs)
        std = (sum((r - mean) ** 2 for r in rs) / max(1, len(rs) - 1)) ** 0.5
        for i in idx:
            a = rewards[i] - mean
            adv[i] = a / (std + 1e-6) if scale and std > 0 else (0.0 if std == 0 else a)
    return adv


def flat_group_fraction(rewards: list[float], groups: list[int]) -> float:
    """The fraction of groups whose rewards are all equal (no learning signal)."""
    by: dict[int, set[float]] = {}
    for r, g in zip(rewards, groups):
        by.setdefault(g, set()).add(r)
    return sum(len(v) == 1 for v in by.values()) / max(1, len(by))
