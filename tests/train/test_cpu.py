"""The CPU plan (opsd.cpu): what it turns on where, that ``cpu.tuning: off`` and a GPU get the plain
path, and each mechanism's own contract (heap, OpenMP waiting, packing threshold)."""

from __future__ import annotations

import platform
import sys
from types import SimpleNamespace

import pytest
import torch

from opsd import cpu
from opsd.cpu import heap
from opsd.cpu.openmp import OPENMP_SPIN, openmp_waiting
from opsd.cpu.packing import pack_from

CPU = torch.device("cpu")
CUDA = torch.device("cuda")
ON_GLIBC = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"


def settings(**kw) -> SimpleNamespace:
    """The ``cpu`` config section's fields, at their defaults unless given."""
    base = dict(
        tuning="auto",
        pack_rows=True,
        bucket_widths=True,
        frozen_layout=True,
        trim_heap=True,
        tune_malloc=None,
    )
    return SimpleNamespace(**(base | kw))


def test_a_gpu_gets_an_empty_plan_whatever_the_settings():
    plan = cpu.resolve_plan(settings(tune_malloc=True), CUDA, torch.bfloat16, engine="hf")
    assert plan.empty and plan == cpu.CpuPlan()
    assert plan.describe() == "none"


def test_tuning_off_is_the_plain_path_on_a_cpu():
    plan = cpu.resolve_plan(settings(tuning="off", tune_malloc=True), CPU, torch.bfloat16, engine="hf")
    assert plan.empty
    assert plan.loss_chunk_rows is None and plan.loss_slab_elements is None and not plan.pack_rows
    assert "cpu.tuning=off" in plan.describe()


def test_auto_on_a_cpu_with_the_hf_engine():
    plan = cpu.resolve_plan(settings(), CPU, torch.bfloat16, engine="hf")
    assert plan.frozen_layout == "column-major"
    assert plan.pack_rows and plan.pack_from is None  # sized by apply_plan from the model
    assert plan.bucket_widths  # bf16 attention's per-length kernels
    assert (
        plan.loss_chunk_rows == cpu.LOSS_CHUNK_ROWS_HF and plan.loss_slab_elements == cpu.LOSS_SLAB_ELEMENTS
    )
    assert plan.trim_heap is ON_GLIBC
    assert not plan.tune_malloc  # opt-in: a Python caller leaves glibc's settings alone
    assert plan.static_cache and plan.fold_lora_bytes > 0
    assert "packed" in plan.describe()


def test_auto_beside_vllm_sharded_compiled_and_float32():
    beside = cpu.resolve_plan(settings(tune_malloc=True), CPU, torch.float32, engine="vllm")
    assert beside.frozen_layout == "copied"  # a weight sync would transpose a column-major weight
    assert not beside.bucket_widths and beside.loss_chunk_rows is None
    assert not beside.trim_heap and not beside.static_cache and beside.fold_lora_bytes == 0
    assert beside.tune_malloc is ON_GLIBC and beside.keep_pages is ON_GLIBC
    assert beside.size_kv_cache and beside.engine_settings().size_kv_cache
    sharded = cpu.resolve_plan(settings(), CPU, torch.float32, engine="hf", sharded=True)
    assert sharded.frozen_layout is None and not sharded.pack_rows
    compiled = cpu.resolve_plan(settings(), CPU, torch.float32, engine="hf", compiled=True)
    assert not compiled.pack_rows and "model.compile: rows batched" in compiled.notes


def test_sizing_holds_with_tuning_off():
    """The vLLM engine's KV cache is sized to its batch on a CPU with ``cpu.tuning: off`` too (sizing, as
    the micro-batch budget is): the plan is still the plain path."""
    plan = cpu.resolve_plan(settings(tuning="off"), CPU, torch.float32, engine="vllm")
    assert plan.empty and plan.size_kv_cache
    assert not cpu.resolve_plan(settings(), CUDA, torch.float32, engine="vllm").size_kv_cache


def test_engine_settings_reach_each_mechanism_through_the_plan(tiny_model):
    """A rollout engine sees the plan's mechanisms only through its settings' methods: off, each is
    the plain path (the width as it is, no cache argument, nothing folded)."""
    from opsd.cpu.buckets import bucket_width

    on = cpu.resolve_plan(settings(), CPU, torch.bfloat16, engine="hf").engine_settings()
    off = cpu.CpuPlan().engine_settings()
    assert on.width(43) == bucket_width(43) == 44 and off.width(43) == 43
    assert off.decode_cache(tiny_model, 64) == {} and len(on.decode_cache(tiny_model, 64)) == 1
    with off.lora_folded(tiny_model) as folded:
        assert not folded  # no LoRA here, and a budget of 0
    assert cpu.CpuPlan(fold_lora_bytes=8).engine_settings(fold_lora_bytes=0).fold_lora_bytes == 0
    assert (
        off.vllm_kwargs(tiny_model.config, "float32", 4, 64, llm_kwargs={}, gpu_memory_utilization=None) == {}
    )


def test_the_default_plan_is_the_config_sections_defaults():
    """``default_plan`` resolves :data:`opsd.cpu.SECTION_DEFAULTS`, the ``cpu`` section's defaults (the
    room imports no config; the section reads its defaults from there)."""
    from opsd.config import CpuTuning

    assert dict(cpu.SECTION_DEFAULTS) == CpuTuning().model_dump()
    for device, dtype, engine in [
        (CPU, torch.bfloat16, "hf"),
        (CPU, torch.float32, "vllm"),
        (CUDA, None, "hf"),
    ]:
        want = cpu.resolve_plan(CpuTuning(), device, dtype, engine=engine)
        assert cpu.default_plan(device, dtype, engine=engine) == want


def test_the_trainers_hooks_say_what_the_plan_means():
    """Outside ``opsd/cpu/`` the plan is read through hooks: the micro-batches' row layout, the loss's
    chunking, ``rollout.fold_lora: on``'s budget; the plain path's are the plain values."""
    plan = cpu.resolve_plan(settings(), CPU, torch.bfloat16, engine="hf")
    applied = cpu.CpuPlan(bucket_widths=True, pack_rows=True, pack_from=100)
    assert applied.row_widths() == cpu.RowWidths(bucket=True, pack_from=100)
    assert cpu.CpuPlan().row_widths() == cpu.RowWidths()
    assert plan.loss_chunking(None) == (cpu.LOSS_CHUNK_ROWS_HF, cpu.LOSS_SLAB_ELEMENTS)
    assert plan.loss_chunking(64) == (64, cpu.LOSS_SLAB_ELEMENTS)  # loss.chunk_size stands where set
    assert cpu.CpuPlan().loss_chunking(None) == (None, None)
    assert plan.forced_fold_bytes() == plan.fold_lora_bytes > 0
    assert cpu.CpuPlan().forced_fold_bytes() == 1 << 62  # no budget: every LoRA-wrapped weight


def test_row_widths_bucket_and_pack_only_where_it_saves_work():
    plain = cpu.RowWidths()
    assert plain.width(43) == 43 and plain.packed([40, 50]) is None
    bucketed = cpu.RowWidths(bucket=True, pack_from=40)
    assert bucketed.width(43) == 44
    assert bucketed.packed([43, 50]) == [44, 50]  # each row its own bucket width
    assert bucketed.packed([37, 50]) is None  # the shortest (38 wide) under pack_from: batched
    assert bucketed.packed([49, 50]) is None  # one bucket width: nothing to save
    assert cpu.RowWidths(pack_from=1).packed([3, 5]) == [3, 5]


def test_the_package_loads_no_torch():
    """``opsd.cpu`` is light: the ``opsd`` command imports it (OpenMP's waiting) before torch loads,
    and its torch names load on first use."""
    import subprocess

    code = "import sys, opsd.cpu; assert 'torch' not in sys.modules; opsd.cpu.packed_hidden; "
    code += "print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "True"
    with pytest.raises(AttributeError, match="no attribute 'heap_of'"):
        cpu.heap_of  # noqa: B018


def test_each_switch_turns_its_mechanism_off():
    off = dict(pack_rows=False, bucket_widths=False, frozen_layout=False, trim_heap=False, tune_malloc=False)
    plan = cpu.resolve_plan(settings(**off), CPU, torch.bfloat16, engine="hf")
    assert not plan.pack_rows and not plan.bucket_widths and plan.frozen_layout is None
    assert not plan.trim_heap and not plan.tune_malloc


def test_a_users_malloc_variables_win(monkeypatch):
    monkeypatch.setenv("MALLOC_MMAP_MAX_", "65536")
    plan = cpu.resolve_plan(settings(tune_malloc=True), CPU, torch.float32, engine="hf")
    assert not plan.tune_malloc
    assert any("MALLOC_" in n for n in plan.notes)


def test_apply_plan_sizes_packing_from_the_model_and_falls_back_to_batched(tiny_model):
    """``pack_from``: 128 tokens, or 2**29 FLOPs of the model's forward; a model that does not attend
    with sdpa cannot pack, and its rows stay batched."""
    plan = cpu.resolve_plan(settings(frozen_layout=False), CPU, torch.float32, engine="hf")
    assert pack_from(106_203_456) == 128  # SmolLM2-135M
    assert pack_from(295_552) == 909  # the demo's model: 2**29 / (2 * params)
    tiny_model.config._attn_implementation = "eager"
    applied = cpu.apply_plan(plan, tiny_model, params=1000)
    assert not applied.pack_rows and applied.pack_from is None
    assert "rows batched" in applied.describe()


def test_openmp_waiting_is_set_unless_the_user_chose():
    env: dict[str, str] = {}
    assert openmp_waiting(env)
    assert env == {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": OPENMP_SPIN}
    mine = {"OMP_WAIT_POLICY": "ACTIVE"}
    assert not openmp_waiting(mine)
    assert mine == {"OMP_WAIT_POLICY": "ACTIVE"}


def test_trim_heap_runs_on_glibc_only(monkeypatch):
    assert heap.trim_heap() is ON_GLIBC
    monkeypatch.setattr(platform, "system", lambda: "Darwin")
    assert heap.trim_heap() is False


_REUSE_PROBE = """
import resource, torch
from opsd.cpu.heap import reuse_freed_blocks

def faults_on_second_block(first_mib, second_mib):
    # Above the 32 MiB that glibc's mmap threshold reaches, so normally mapped and unmapped; the second
    # block is the smaller, as the loss's blocks are at most its first chunk's (an equal size may not
    # fit the freed one: posix_memalign asks for its alignment on top).
    torch.empty(first_mib << 20, dtype=torch.uint8).fill_(1)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    torch.empty(second_mib << 20, dtype=torch.uint8).fill_(1)
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

with reuse_freed_blocks() as on:
    inside = faults_on_second_block(48, 40)
# Larger than anything the heap kept inside, so glibc's restored settings decide: mapped afresh.
print(on, inside, faults_on_second_block(96, 80))
"""


@pytest.mark.skipif(not (sys.platform == "linux" and ON_GLIBC), reason="glibc only")
@pytest.mark.parametrize("user_env", [{}, {"MALLOC_MMAP_MAX_": "65536"}])
def test_reused_blocks_come_from_resident_pages(user_env):
    """Inside the context a 40 MiB block takes the pages of a freed 48 MiB one without page faults; after
    it, glibc maps and faults an 80 MiB one afresh; a user's own ``MALLOC_*_`` setting turns it off. Its
    own process: mallopt is process-wide. Error model: filling N MiB of fresh pages faults at least
    once per page, N / 2 times even with transparent huge pages (20 for 40 MiB, 40 for 80); resident
    pages fault never, and the probe's own Python and bookkeeping touch far fewer than 20 new pages."""
    import os
    import subprocess

    theirs = {k for k in os.environ if k.startswith("MALLOC_") or k == "GLIBC_TUNABLES"}  # this machine's
    env = {k: v for k, v in os.environ.items() if k not in theirs} | user_env
    res = subprocess.run([sys.executable, "-c", _REUSE_PROBE], capture_output=True, text=True, env=env)
    assert res.returncode == 0, res.stderr
    on, inside, after = res.stdout.split()
    assert on == ("False" if user_env else "True")
    assert int(after) >= 40
    if not user_env:
        assert int(inside) < 20
    else:
        assert int(inside) >= 20


@pytest.mark.parametrize("keep_pages", [False, True])
def test_reused_blocks_restore_the_trim_threshold_unless_keeping_pages(keep_pages, monkeypatch):
    """What the context asks of glibc: inside, no mapping and (almost) no trimming; after it, mapping and
    the threshold glibc's dynamic rule reaches, and the 64 MiB trim threshold back unless
    ``keep_pages`` (beside vLLM). Whether glibc then trims depends on the heap's layout, which a probe
    cannot fix, so this checks the settings asked for."""
    calls = []

    class Libc:
        def mallopt(self, param: int, value: int) -> int:
            calls.append((param, value))
            return 1

    monkeypatch.setattr(heap, "glibc", lambda: Libc())
    monkeypatch.setattr(heap, "user_malloc_settings", lambda: False)
    with heap.reuse_freed_blocks(keep_pages=keep_pages) as on:
        assert on is True
        assert calls == [(heap._M_MMAP_MAX, 0), (heap._M_TRIM_THRESHOLD, heap._TRIM_ALMOST_NEVER)]
    after = dict(calls[2:])
    assert after[heap._M_MMAP_MAX] == heap._MMAP_MAX_DEFAULT
    assert after[heap._M_MMAP_THRESHOLD] == 32 << 20
    if keep_pages:
        assert heap._M_TRIM_THRESHOLD not in after
    else:
        assert after[heap._M_TRIM_THRESHOLD] == 64 << 20


@pytest.fixture
def assets(tmp_path_factory):
    from helpers import build_assets

    return build_assets(tmp_path_factory.mktemp("cpu_assets"))


def test_the_trainer_names_its_plan_and_saves_it(assets, tmp_path, capsys):
    import json

    from helpers import make_cfg

    from opsd import Trainer

    tr = Trainer(make_cfg(assets, tmp_path / "run"))
    err = capsys.readouterr().err
    assert f"cpu plan: {tr.run.plan.describe()}" in err and "packed" in err
    saved = json.loads((tmp_path / "run" / "cpu_plan.json").read_text())
    assert saved == tr.run.plan.as_dict() and saved["pack_rows"] is True


def test_tuning_off_changes_no_global_state(assets, tmp_path, monkeypatch):
    """A Trainer built and stepped with ``cpu.tuning: off`` leaves the environment, transformers'
    attention registry and glibc's malloc settings as they were, and attends as the config says."""
    import os

    from helpers import make_cfg
    from transformers import AttentionInterface

    from opsd import Trainer

    def refuse():
        raise AssertionError("glibc touched")

    monkeypatch.setattr(heap, "glibc", refuse)
    env = dict(os.environ)
    registry = dict(AttentionInterface._global_mapping)
    modules = set(sys.modules)
    tr = Trainer(make_cfg(assets, tmp_path / "run", **{"cpu.tuning": "off", "optim.max_steps": 1}))
    tr.train()
    assert tr.run.plan.empty
    assert dict(os.environ) == env
    assert dict(AttentionInterface._global_mapping) == registry
    hidden = {name for name in set(sys.modules) - modules if sys.modules[name] is None}
    assert not hidden  # nothing made absent behind the caller's back
    assert tr.run.model.get_base_model().config._attn_implementation == "sdpa"


def test_the_opsd_command_tunes_malloc_unless_the_user_chose(monkeypatch):
    """``opsd train`` owns its process: it turns ``cpu.tune_malloc`` on where the config leaves it unset
    and no ``MALLOC_*`` variable is set; a set key or a user's variable wins."""
    from opsd.config import Config

    for k in heap.USER_MALLOC_ENV + ("GLIBC_TUNABLES",):
        monkeypatch.delenv(k, raising=False)
    unset = Config.model_validate({"model": {"path": "m"}, "data": {"path": "d.jsonl"}})
    assert unset.cpu.tune_malloc is None
    assert cpu.command_defaults(unset).cpu.tune_malloc is True
    off = unset.model_copy(update={"cpu": unset.cpu.model_copy(update={"tune_malloc": False})})
    assert cpu.command_defaults(off).cpu.tune_malloc is False
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "0")
    assert cpu.command_defaults(unset).cpu.tune_malloc is None
