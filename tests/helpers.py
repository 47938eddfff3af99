"""Plain helpers shared by several test modules (fixtures live in conftest.py).

Test modules import from here, never from one another. Processes spawned by ``spawn`` import this
module by name (pytest puts tests/ on sys.path and spawned children inherit it).
"""

from __future__ import annotations

import json
import multiprocessing
import os
import random
import socket
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from opsd import Config, load_config
from opsd import distributed as D
from opsd.config import RolloutConfig
from opsd.rollout import Completion, HFEngine
from opsd.rollout.base import EngineRun
from opsd.rollout.make import make_engine
from opsd.tiny import build_tiny_model, build_tiny_tokenizer

# Where the tests stand: the tests folder (on sys.path for spawned children), the repository, and
# ../shared/data beside the clone (absent on a fresh user machine; the tests that need it skip).
TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
SHARED_DATA = ROOT.parent / "shared" / "data"

# --- the trainer's tiny assets and config (tests/train/test_regression.py pins numbers made with these) ---


def build_assets(root: Path) -> dict:
    """Two tiny models (the student, and another for an external teacher) and 8 addition problems."""
    tok = build_tiny_tokenizer()
    for name, seed in (("model", 0), ("other", 1)):
        m = build_tiny_model(tok, hidden_size=32, seed=seed)
        m.save_pretrained(root / name)
        tok.save_pretrained(root / name)
    rows = [
        {
            "problem": f"What is {a} + {b}?",
            "solution": f"{a} + {b} = {a + b}. The answer is {a + b}.",
            "answer": str(a + b),
        }
        for a, b in [(1, 2), (3, 4), (5, 6), (7, 8), (9, 1), (2, 2), (4, 5), (6, 1)]
    ]
    (root / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return {"model": str(root / "model"), "other": str(root / "other"), "data": str(root / "train.jsonl")}


def make_cfg(assets: dict, run_dir: Path, **over) -> Config:
    base = [
        f"model.path={assets['model']}",
        f"data.path={assets['data']}",
        f"logging.run_dir={run_dir}",
        "model.lora.r=4",
        "model.lora.alpha=8",
        "rollout.prompts_per_step=2",
        "rollout.n=2",
        "rollout.max_new_tokens=6",
        "rollout.temperature=1.0",
        "optim.lr=0.01",
        "optim.max_steps=2",
        "checkpoint.every=1",
        "logging.progress=false",
        "logging.sample_every=1",
        "data.max_prompt_len=256",
        "loss.clip_mode=none",
        "model.dtype=float32",
        "rollout.engine=hf",  # auto would pick vLLM where it is installed
    ]
    return load_config(None, base + [f"{k}={v}" for k, v in over.items()])


# --- gloo ranks the tests spawn themselves -----------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world: int, replicate: int, port: int, test: tuple, fn, args: tuple) -> None:
    local = world // replicate  # ranks per "node"
    pid, env = test  # the test's process and its environment, not the fork server's (see spawn)
    for fd in (1, 2):  # the test's stdout and stderr as they are now: pytest's capture of this test
        try:
            now = os.open(f"/proc/{pid}/fd/{fd}", os.O_WRONLY | os.O_APPEND)
        except OSError:
            continue  # the fork server's, where the test's cannot be opened
        os.dup2(now, fd)
        os.close(now)
    os.environ.clear()
    os.environ.update(env)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank % local),
        WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(local),
    )
    torch.set_num_threads(1)
    d = D.init_distributed("cpu", replicate=replicate)
    try:
        fn(d, *args)
    finally:
        D.shutdown()
    D.exit_rank(0)  # as `opsd train` under torchrun ends a rank: no finalization (see exit_rank)


# What every rank imports before its test's worker runs, imported once per pytest process by the fork
# server that the ranks fork from: a rank starting with `spawn` imported torch, transformers and opsd
# afresh, a few seconds of CPU each, two or four ranks at a time, in every multi-rank test.
SPAWN_PRELOAD = ["torch", "torch.distributed", "transformers", "peft", "opsd.trainer", "opsd.checkpoint"]


def spawn(fn, *args, world: int = 2, replicate: int = 1) -> None:
    """Run ``fn`` on ``world`` gloo ranks; any error, wrong result or crash (a signal) fails the test.

    ``fn`` is pickled by reference: define it at module level of a test module (or here). Each rank is
    a fresh process forked from the fork server (no state of the test's own process, no collective or
    thread pool run before the fork), with the test's environment, stdout and stderr of the moment:
    the fork server keeps those it started with, so ``_entry`` sets the caller's."""
    multiprocessing.set_forkserver_preload(SPAWN_PRELOAD)
    mp.start_processes(
        _entry,
        args=(world, replicate, free_port(), (os.getpid(), dict(os.environ)), fn, args),
        nprocs=world,
        join=True,
        start_method="forkserver",
    )


# --- mixed precision in training -----------------------------------------------------------------


class ScriptedEngine(HFEngine):
    """The same responses for the same prompts and seed, whatever the model's dtype: a bf16 run and a
    float32 run then differ only by arithmetic, not by which tokens their rollouts sampled."""

    def __init__(self, rollout, model, tokenizer, **kwargs) -> None:
        super().__init__(model, tokenizer)

    def generate(self, prompts, n, params):
        out = []
        for i, p in enumerate(prompts):
            for j in range(n):
                rng = random.Random(f"{p}-{j}-{params.seed}")
                toks = [rng.randrange(0, 500) for _ in range(params.max_new_tokens)]  # most embedding rows
                out.append(Completion(i, toks, [0.0] * len(toks), "length"))
        return out


class WritingEngine(HFEngine):
    """Writes a fixed text per problem, as an engine would: up to the token limit, its end token or the
    first of the stop strings its new text holds; a prompt that already ends with the text's first
    tokens (a sequence continued from its own tokens) gets the rest. ``write(a, b)`` is the text for
    "What is a + b?"; ``written`` counts the tokens it generated, ``asked`` the sampling it was given."""

    def __init__(self, rollout, model, tokenizer, write=None, **kwargs) -> None:
        super().__init__(model, tokenizer)
        self.write = write or (lambda a, b: f"Working: {a} + {b} = {a + b}. The answer is {a + b}.")
        self.written = 0
        self.asked: list = []

    def response(self, prompt: list[int]) -> list[int]:
        """The whole response to ``prompt``'s problem, its end token last."""
        import re

        a, b = re.search(r"What is (\d+) \+ (\d+)\?", self.tokenizer.decode(prompt)).groups()
        text = self.write(int(a), int(b))
        return self.tokenizer(text, add_special_tokens=False)["input_ids"] + [self.tokenizer.eos_token_id]

    def generate(self, prompts, n, params):
        self.asked.append(params)
        out = []
        for i, p in enumerate(prompts):
            whole = self.response(p)
            done = max(k for k in range(len(whole) + 1) if k == 0 or p[-k:] == whole[:k])
            new: list[int] = []
            reason = "length"
            for t in whole[done : done + params.max_new_tokens]:
                new.append(t)
                text = self.tokenizer.decode(new)
                if t == self.tokenizer.eos_token_id or any(s in text for s in params.stop_strings):
                    reason = "stop"
                    break
            self.written += n * len(new)
            out += [Completion(i, list(new), [-0.5] * len(new), reason) for _ in range(n)]
        return out


FULL_FT = {
    "model.lora.enabled": "false",
    "optim.lr": 5e-6,
    "optim.max_steps": 10,
    "teacher.frozen_copy": "cpu",
    "checkpoint.every": 0,
    "logging.sample_every": 0,
    "optim.grad_clip": 0,
    "rollout.max_new_tokens": 24,
}


# --- a small fake `vllm` for VLLMEngine: call order and arguments (the fake_vllm fixture in conftest.py
# installs it). tests/rollout/test_vllm.py runs the same engine on the real vLLM (CPU build).


class FakeVLLMModel(torch.nn.Module):
    """vLLM's view of a Llama: q/k/v and gate/up packed into one parameter each."""

    packed_modules_mapping = {
        "qkv_proj": ["q_proj", "k_proj", "v_proj"],
        "gate_up_proj": ["gate_proj", "up_proj"],
    }

    def __init__(self, hf_names: list[str]) -> None:
        super().__init__()
        first = {parts[0]: packed for packed, parts in self.packed_modules_mapping.items()}
        names = []
        for n in hf_names:
            module, leaf = n.split(".")[-2:]
            if module in first:
                names.append(n.replace(f".{module}.", f".{first[module]}."))
            elif not any(module in parts for parts in self.packed_modules_mapping.values()):
                names.append(n)
        self.params = torch.nn.ParameterDict(
            {n.replace(".", "__"): torch.nn.Parameter(torch.zeros(1)) for n in names}
        )
        self.names = names

    def named_parameters(self, *args, **kwargs):
        return iter([(n, self.params[n.replace(".", "__")]) for n in self.names])


class FakeLLM:
    def __init__(self, hf_names: list[str], log: list, **kwargs) -> None:
        self.kwargs, self.log, self.model = kwargs, log, FakeVLLMModel(hf_names)
        self.loaded: dict[str, torch.Tensor] = {}
        self.syncs: list[list[str]] = []  # the names each reload_weights call received
        self.group_at_init = (
            dist.is_initialized() and dist.get_backend(),
            os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING"),
        )
        self.llm_engine = SimpleNamespace(
            engine_core=SimpleNamespace(shutdown=lambda: log.append(("shutdown",)))
        )
        torch.manual_seed(12345)  # like vLLM's set_random_seed: the engine must shield the caller's RNG
        log.append(("LLM",))

    def apply_model(self, fn):
        self.log.append(("apply_model",))
        return [fn(self.model)]

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        self.log.append(("rpc", method))
        assert method == "reload_weights" and kwargs["is_checkpoint_format"] is True
        self.syncs.append([])
        for name, t in kwargs["weights_iterator"]:
            self.loaded[name] = t.clone()
            self.syncs[-1].append(name)

    def reset_prefix_cache(self):
        self.log.append(("reset_prefix_cache",))

    def sleep(self, level):
        self.log.append(("sleep", level))

    def wake_up(self, tags=None):
        self.log.append(("wake_up", tags))

    def generate(self, prompts, sampling_params, use_tqdm=True):
        self.log.append(("generate", len(prompts)))
        sp = sampling_params
        self.last_params = sp
        outs = []
        for _ in prompts:
            samples = []
            for j in range(sp.kwargs["n"]):
                toks = torch.randint(0, 100, (sp.kwargs["max_tokens"],)).tolist()  # the global RNG
                lps = [{t: SimpleNamespace(logprob=-0.5)} for t in toks]
                samples.append(SimpleNamespace(index=j, token_ids=toks, logprobs=lps, finish_reason="length"))
            outs.append(SimpleNamespace(outputs=samples[::-1]))  # vLLM does not promise index order
        self.last_outs = outs
        return outs


def vllm_engine(model, tokenizer, **rollout):
    cfg = RolloutConfig(engine="vllm", batch_size=16, max_new_tokens=6, **rollout)
    return make_engine(cfg, model, tokenizer, EngineRun(seed=3, max_prompt_len=100))


# --- a grader named by module path in configs (`grpo.grader: helpers:letter_e_reward`) ---


def letter_e_reward(response: str, answer: str) -> float:
    """A dense, deterministic reward for the GRPO case: the fraction of 'e' characters in the response
    (the tiny random model never answers correctly, so a correctness reward would pin only zeros)."""
    return response.count("e") / max(1, len(response))


# --- a user mistake on the command line: exit status 2, one line, no traceback ---


def cli_error(capsys, argv: list[str]) -> str:
    """Runs ``opsd ARGV``, which must fail as a user mistake does; returns its one error line."""
    from opsd.cli import main

    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    return err
