"""The rollout engine contract, structurally: every engine class implements every method of
:class:`RolloutEngine`, and the protocol holds every method the rollout queue, the trainer and the
evaluation call on an engine. Nothing here starts an engine or needs vLLM."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

import opsd
from opsd.rollout.base import RolloutEngine
from opsd.rollout.hf import HFEngine
from opsd.rollout.remote import VLLMServerEngine
from opsd.rollout.vllm import VLLMEngine

ENGINES = [HFEngine, VLLMEngine, VLLMServerEngine]
ENGINE_NAMES = ("engine", "eng")  # what callers name an engine: self.engine, trainer.run.engine, eng


def protocol_methods() -> list[str]:
    return sorted(
        n for n, v in vars(RolloutEngine).items() if inspect.isfunction(v) and not n.startswith("_")
    )


def parameters(fn) -> list[tuple[str, object]]:
    """The parameters' names and kinds: what a caller relies on (annotations may narrow a handle). An
    engine's own keyword-only options with defaults (the HF engine's ``stop_text``) are left out: a
    caller of the protocol never passes them."""
    return [
        (p.name, p.kind)
        for p in inspect.signature(fn).parameters.values()
        if not (p.kind is p.KEYWORD_ONLY and p.default is not p.empty)
    ]


@pytest.mark.parametrize("engine", ENGINES, ids=lambda e: e.__name__)
def test_every_engine_implements_every_protocol_method(engine):
    """A method the protocol lists but an engine lacks fails here, not mid-run on the engine the
    tests did not start."""
    for name in protocol_methods():
        method = getattr(engine, name, None)
        assert callable(method), f"{engine.__name__} has no {name}()"
        assert parameters(method) == parameters(getattr(RolloutEngine, name)), f"{engine.__name__}.{name}"
    assert issubclass(engine, RolloutEngine)


def engine_calls() -> dict[str, str]:
    """Each method called on something named ``engine`` or ``eng`` in opsd, with one file calling it."""
    root = Path(opsd.__file__).parent
    calls: dict[str, str] = {}
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
                continue
            owner = node.func.value
            name = owner.attr if isinstance(owner, ast.Attribute) else getattr(owner, "id", None)
            if name in ENGINE_NAMES:
                calls.setdefault(node.func.attr, str(path.relative_to(root.parent)))
    return calls


def test_the_protocol_holds_every_method_called_on_an_engine():
    calls = engine_calls()
    assert {"generate", "submit", "collect", "sync_weights", "sleep", "wake"} <= set(calls)
    missing = {name: where for name, where in calls.items() if name not in protocol_methods()}
    assert not missing, f"called on an engine but not in RolloutEngine: {missing}"
