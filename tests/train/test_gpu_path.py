"""Defects of the GPU path found by reading (no GPU here), each checked on the CPU by faking the one
CUDA call it is about. docs/gpu.md lists what is executed, what is read, and what waits for a GPU."""

from __future__ import annotations

import pytest
import torch
from helpers import build_assets, make_cfg, vllm_engine

from opsd import Trainer, distributed, models, parallel
from opsd.teacher import Teacher


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> dict:
    return build_assets(tmp_path_factory.mktemp("gpu_path"))


def test_vllm_wake_empties_torch_cache_before_each_wake_up(
    fake_vllm,
    tiny_model,
    tiny_tokenizer,
    monkeypatch,
):
    """vLLM allocates outside PyTorch's caching allocator: what the step reserved must be returned to
    the driver before vLLM asks for its weights, and again before its KV cache."""
    engine = vllm_engine(tiny_model, tiny_tokenizer)
    engine._device = torch.device("cuda", 0)  # as on a GPU
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: fake_vllm.log.append(("empty_cache",)))
    engine.sleep()
    fake_vllm.log.clear()
    engine.wake()
    assert [e[0] if e[0] != "wake_up" else e for e in fake_vllm.log] == [
        "empty_cache",
        ("wake_up", ["weights"]),
        "rpc",
        "reset_prefix_cache",
        "empty_cache",
        ("wake_up", ["kv_cache"]),
    ]


def test_evaluation_puts_the_engine_back_to_sleep(assets, tmp_path):
    tr = Trainer(
        make_cfg(
            assets,
            tmp_path / "run",
            **{"eval.path": assets["data"], "eval.limit": 2, "eval.max_new_tokens": 3},
        )
    )
    calls = []
    generate, sleep = tr.run.engine.generate, tr.run.engine.sleep
    tr.run.engine.generate = lambda *a: calls.append("generate") or generate(*a)
    tr.run.engine.sleep = lambda: calls.append("sleep") or sleep()
    tr.evaluate()
    assert calls and calls[-1] == "sleep" and "generate" in calls


def test_one_process_on_cuda_n_makes_it_the_current_device(monkeypatch):
    seen = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: seen.append(d))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert distributed.init_distributed("cuda:1").device == torch.device("cuda", 1)
    assert seen == [torch.device("cuda", 1)]
    distributed.init_distributed("cuda")  # no index: the current device stays what it is
    assert seen == [torch.device("cuda", 1)]


def test_microbatch_budget_leaves_room_for_adamw_state(tiny_model, monkeypatch):
    """Measured before AdamW's moments exist, the free memory overstated what activations may use."""
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (8 << 30, 80 << 30))
    cuda = torch.device("cuda", 0)
    full, _ = models.microbatch_budget("auto", tiny_model.config, torch.bfloat16, cuda, False)
    less, why = models.microbatch_budget(
        "auto", tiny_model.config, torch.bfloat16, cuda, False, reserve=6 << 30
    )
    per_token = models.activation_bytes_per_token(tiny_model.config, torch.bfloat16, False)
    assert less == max(256, min(16384, (2 << 30) // 4 // per_token)) and less <= full
    assert "after AdamW's state" in why


def test_cpu_offloaded_frozen_copy_is_copied_one_way(tiny_model, monkeypatch):
    """The frozen copy lives in host memory (page-locked where CUDA exists) and is copied to the device
    per micro-batch; it is never copied back (it does not change) and never moved with .to()."""
    teacher = Teacher("fixed", tiny_model, lora=False, frozen_copy="cpu")
    host = {id(t): t.data_ptr() for t, _ in teacher._host}
    ids = torch.tensor([[5, 6, 7, 8]])
    want = models.final_hidden(teacher.model, ids, torch.ones_like(ids), torch.arange(4))

    def no_move(*args, **kwargs):
        raise AssertionError("the frozen copy was moved with Module.to")

    monkeypatch.setattr(torch.nn.Module, "to", no_move)
    hidden, _ = teacher.score(ids, torch.ones_like(ids), torch.arange(4))
    assert torch.equal(hidden, want)
    assert {id(t): t.data_ptr() for t, _ in teacher._host} == host  # back on the same host storage


def test_a_torch_without_sum_reductions_is_one_line_before_sharding(tiny_model, monkeypatch):
    from torch.distributed.fsdp import FSDPModule

    from opsd.errors import UserError

    monkeypatch.delattr(FSDPModule, "set_force_sum_reduction_for_comms")
    with pytest.raises(UserError, match="lacks FSDPModule.set_force_sum_reduction_for_comms"):
        parallel.shard_model(tiny_model, mesh=None, param_dtype=None)


def test_merged_export_streams_shards_and_loads_as_the_merged_model(
    tiny_model, tiny_tokenizer, tmp_path, monkeypatch
):
    """checkpoint.save_merged wrote every merged weight at once (a second copy of each LoRA target);
    now one shard at a time, each at most shard_bytes, into a sharded HF directory transformers loads."""
    import safetensors.torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from opsd.checkpoint import write_merged

    lora = get_peft_model(tiny_model, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    with torch.no_grad():
        for name, p in lora.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)  # a non-zero delta
    written = []
    real = safetensors.torch.save_file
    monkeypatch.setattr(
        safetensors.torch,
        "save_file",
        lambda t, path, **kw: written.append(sum(x.nbytes for x in t.values())) or real(t, path, **kw),
    )
    limit = 40_000
    write_merged(lora, tiny_tokenizer, tmp_path / "merged", shard_bytes=limit)
    biggest = max(p.numel() * p.element_size() for p in tiny_model.parameters())
    assert len(written) > 1 and max(written) <= max(limit, biggest)
    assert (tmp_path / "merged" / "model.safetensors.index.json").is_file()
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    with torch.no_grad():
        got = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")(ids).logits
        want = lora.merge_and_unload()(ids).logits
    # W + B A computed by the same get_delta_weight in both, in float32: equal up to the order of the
    # merged model's own forward (identical here); 1e-6 allows for a reassociated sum of 32 terms.
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("mode", ["jsd", "topk", "sampled"])
def test_loss_kernel_gives_the_sampled_tokens_log_probs(mode):
    """The fused loss's own student logits give log softmax(z/T)[y] over the full vocabulary (top-k too),
    as token_logprobs does with a second product: in float64 they agree to rounding (1e-12)."""
    from opsd.loss import DistillSpec, fused_linear_distill, token_logprobs

    g = torch.Generator().manual_seed(0)
    h, w = (
        torch.randn(40, 16, generator=g, dtype=torch.float64),
        torch.randn(64, 16, generator=g, dtype=torch.float64),
    )
    y = torch.randint(0, 64, (40,), generator=g)
    spec = DistillSpec(mode=mode, temperature=0.7, topk=5, clip_mode="none")
    got = torch.full((40,), float("nan"), dtype=torch.float64)
    fused_linear_distill(h, w, h + 0.1, w, targets=y, spec=spec, chunk_size=16, target_logprobs=got)
    torch.testing.assert_close(got, token_logprobs(h, w, y, temperature=0.7), rtol=0, atol=1e-12)


@pytest.mark.parametrize("clip_mode", ["none", "entry", "token"])
def test_loss_reads_its_statistics_back_once_not_per_chunk(clip_mode, monkeypatch):
    """On a GPU every float() of a device tensor waits for the stream. The loss kept ~5 per chunk; now its
    statistics stay on the device and come back in one read, however many chunks there are."""
    from opsd.loss import DistillSpec, fused_linear_distill

    reads = []

    def counting(name: str):
        real = getattr(torch.Tensor, name)

        def read(self, *args, **kwargs):
            reads.append(name)
            return real(self, *args, **kwargs)

        return read

    for name in ("__float__", "item", "tolist", "__bool__"):
        monkeypatch.setattr(torch.Tensor, name, counting(name))
    g = torch.Generator().manual_seed(0)
    h, w = torch.randn(64, 16, generator=g), torch.randn(50, 16, generator=g)
    spec = DistillSpec(beta=0.5, clip_mode=clip_mode, clip=0.05)
    counts = []
    for chunk in (64, 8):  # 1 chunk, then 8
        reads.clear()
        loss, _ = fused_linear_distill(
            h.requires_grad_(), w, h.detach() + 0.1, w, spec=spec, chunk_size=chunk
        )
        counts.append(len(reads))
    assert counts[0] == counts[1] <= 2, counts


def test_a_cuda_index_beyond_the_visible_gpus_is_one_line(monkeypatch):
    from opsd.devices import resolve_device
    from opsd.errors import UserError

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(UserError, match="only 1 CUDA devices are visible"):
        resolve_device("cuda:3")


# --- the memory and kernels of the GPU path, read off the CPU run of the same code -------------------


def _allocations(fn, keep: list[torch.Tensor] = ()) -> list[tuple[torch.dtype, int]]:
    """``(dtype, bytes)`` of every storage the aten ops under ``fn()`` create (views and in-place results
    of existing storages, ``keep``'s included, are not counted): what a GPU's allocator would be asked
    for, whatever device the same code runs on."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    seen = {t.untyped_storage().data_ptr() for t in keep}
    out: list[tuple[torch.dtype, int]] = []

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            res = func(*args, **(kwargs or {}))
            for t in tree_flatten(res)[0]:
                if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in seen:
                    seen.add(t.untyped_storage().data_ptr())
                    out.append((t.dtype, t.untyped_storage().nbytes()))
            return res

    with Count():
        fn()
    return out


def test_adamw_is_fused_where_every_parameter_is_on_cuda(monkeypatch):
    """The default (foreach) AdamW makes several passes over parameters, moments and gradients per step;
    on CUDA the fused kernel makes one. ``Tensor.is_cuda`` is faked: the fused CPU kernel then runs."""
    from opsd.config import OptimConfig
    from opsd.optim import make_optimizer

    params = [torch.nn.Parameter(torch.randn(8, 4)), torch.nn.Parameter(torch.randn(4))]
    cpu, _ = make_optimizer(params, OptimConfig(lr=1e-3, max_steps=2))
    assert not cpu.defaults["fused"]  # a CPU keeps PyTorch's default, whose numbers the CPU tests pin
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    cuda, _ = make_optimizer(params, OptimConfig(lr=1e-3, max_steps=2))
    assert cuda.defaults["fused"] is True
    for p in params:
        p.grad = torch.ones_like(p)
    cuda.step()  # the fused kernel's own checks pass (floating point, one device per group)
    assert "exp_avg" in cuda.state[params[0]]


def test_full_finetuning_frozen_copy_is_made_in_the_compute_dtype(tiny_model):
    """bf16 compute over float32 masters: the frozen teacher was ``deepcopy`` (a float32 clone of every
    weight, 6.9 GB beside the masters at Qwen3-1.7B on the GPU) and then ``.to(bf16)``. Now each linear
    weight is cast as it is copied: the storages made are its bf16 copy and the float32 rest the student
    computes with in float32 (embedding, norms, buffers), nothing else."""
    from torch import nn

    linear = {id(m.weight) for m in tiny_model.modules() if isinstance(m, nn.Linear)}
    embedding = {id(m.weight) for m in tiny_model.modules() if isinstance(m, nn.Embedding)}
    weights = [p for p in tiny_model.parameters()]
    bf16_bytes = sum(p.numel() * 2 for p in weights if id(p) in linear - embedding)
    fp32_rest = sum(p.numel() * 4 for p in weights if id(p) not in linear - embedding)
    made = _allocations(
        lambda: Teacher("fixed", tiny_model, lora=False, copy_dtype=torch.bfloat16),
        keep=[*weights, *tiny_model.buffers()],
    )
    fp32 = sum(b for d, b in made if d == torch.float32)
    buffers = sum(b.untyped_storage().nbytes() for b in tiny_model.buffers())
    assert fp32 <= buffers + fp32_rest, f"{fp32} bytes of float32 made (buffers: {buffers}, rest {fp32_rest})"
    assert sum(b for d, b in made if d == torch.bfloat16) == bf16_bytes > 0


def _qwen3_tiny_student():
    from transformers import AutoModelForCausalLM, Qwen3Config

    cfg = Qwen3Config(
        vocab_size=300,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg)


def test_frozen_copy_keeps_ties_buffers_and_the_students_function():
    """Tied head and embedding stay one tensor; the rotary ``inv_freq`` stays float32 as the student's
    (the old ``.to(bf16)`` rounded it, and each position's angle with it); the linear weights are bf16,
    the embedding, the head tied to it and the norms float32 as the student computes with them; with
    ``frozen_copy=cpu`` the copy is made in host memory directly."""
    from opsd.teacher import frozen_copy_of

    student = _qwen3_tiny_student()
    copy = frozen_copy_of(student, torch.bfloat16)
    assert copy.lm_head.weight is copy.model.embed_tokens.weight
    assert copy.lm_head.weight.dtype == torch.float32 and not copy.lm_head.weight.requires_grad
    layer = copy.model.layers[0]
    assert layer.self_attn.q_proj.weight.dtype == layer.mlp.down_proj.weight.dtype == torch.bfloat16
    assert layer.input_layernorm.weight.dtype == copy.model.norm.weight.dtype == torch.float32
    assert {n: b.dtype for n, b in copy.named_buffers()} == {n: b.dtype for n, b in student.named_buffers()}
    assert not copy.training and all(p.requires_grad for p in student.parameters())
    teacher = Teacher("fixed", student, lora=False, copy_dtype=torch.bfloat16, frozen_copy="cpu")
    assert teacher.offload and teacher.model.model.layers[0].mlp.up_proj.weight.dtype == torch.bfloat16


def test_frozen_copy_computes_the_students_function_at_step_0_bit_for_bit():
    """bf16 autocast over float32 masters, as a step's forwards run: the frozen teacher and the student
    give the same logits on the same tokens, bit for bit. The pure bf16 copy did not: its norms and its
    residual stream were bf16 where the student's are float32."""
    from opsd.teacher import frozen_copy_of

    student = _qwen3_tiny_student()
    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11]])
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        want = student(ids).logits
        got = frozen_copy_of(student, torch.bfloat16)(ids).logits
        pure = frozen_copy_of(student, None).to(torch.bfloat16)(ids).logits
    assert torch.equal(got, want)
    assert not torch.equal(pure, want)  # what the copy used to be


def test_lora_rollouts_compute_the_adapters_as_training_does(assets, tmp_path):
    """LoRA over a bf16 base computes its float32 adapters' products in bf16 in training (autocast, peft's
    input cast off); the HF engine generated without autocast, so peft cast each input up and the
    rollout's adapters ran in float32: at step 0 the policy sampled was not the policy trained."""
    over = {
        "model.lora.enabled": "true",
        "model.dtype": "bfloat16",
        "cpu.tuning": "off",
        "rollout.engine": "hf",
    }
    tr = Trainer(make_cfg(assets, tmp_path / "run", **over))
    seen: dict[str, set] = {"rollout": set(), "training": set()}
    phase = ["rollout"]
    lora_b = next(m for n, m in tr.run.model.named_modules() if n.endswith("lora_B.default"))
    lora_b.register_forward_hook(lambda m, args, out: seen[phase[0]].add(out.dtype))
    inner = tr.run.forward_backward

    def forward_backward(*a, **k):
        phase[0] = "training"
        return inner(*a, **k)

    tr.run.forward_backward = forward_backward
    tr.step()
    tr.close()
    assert seen["rollout"] == seen["training"] == {torch.bfloat16}, seen


def _bf16_head(n: int = 24, h: int = 16, v: int = 40, seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g).to(torch.bfloat16)
    weight = (torch.randn(v, h, generator=g) / 2).to(torch.bfloat16)
    y = torch.randint(0, v, (n,), generator=g)
    coef = torch.randn(n, generator=g)
    coef[::5] = 0
    return hidden, weight, y, coef


@pytest.mark.parametrize("head_grad", [False, True])
def test_policy_gradient_casts_a_bf16_head_a_block_at_a_time(head_grad, monkeypatch):
    """GRPO's loss cast the whole head to float32 at every call (1.2 GB at Qwen3-1.7B's head); now one
    block of rows at a time, with float32 numbers: against float64 autograd on the same bf16 values."""
    from opsd.loss import fused_linear_policy_gradient
    from opsd.loss import policy_gradient as pg

    hidden, weight, y, coef = _bf16_head()
    monkeypatch.setattr(pg, "HEAD_BLOCK_ELEMENTS", 7 * hidden.shape[1])  # 6 blocks of 7 rows (the last 5)
    hidden.requires_grad_(True)
    weight.requires_grad_(head_grad)

    def run():
        loss, _ = fused_linear_policy_gradient(hidden, weight, y, coef, temperature=0.7, chunk_size=8)
        loss.backward()
        return loss

    made = _allocations(run, keep=[hidden, weight, y, coef])
    # The head's own float32 gradient (full fine-tuning) is the one head-sized float32 block allowed.
    head_sized = [b for d, b in made if d == torch.float32 and b >= weight.numel() * 4]
    assert len(head_sized) == int(head_grad), head_sized
    h64, w64 = hidden.detach().double().requires_grad_(), weight.detach().double().requires_grad_()
    log_s = torch.log_softmax(h64 @ w64.t() / 0.7, -1)
    ref = -(coef.double() * log_s.gather(-1, y[:, None]).squeeze(-1)).sum()
    ref.backward()
    loss = fused_linear_policy_gradient(hidden, weight, y, coef, temperature=0.7, chunk_size=8)[0]
    # float32 products over H=16 of bf16 values (exact in float32): ~1e-7 relative per logit
    torch.testing.assert_close(loss.double(), ref, rtol=1e-5, atol=1e-5)
    hidden.grad = weight.grad = None
    loss.backward()
    # the gradients come back in the inputs' dtype (bf16): 2^-8 relative
    torch.testing.assert_close(hidden.grad.double(), h64.grad, rtol=1e-2, atol=1e-3)
    if head_grad:
        torch.testing.assert_close(weight.grad.double(), w64.grad, rtol=1e-2, atol=1e-3)


def test_token_logprobs_cast_a_bf16_head_a_block_at_a_time(monkeypatch):
    from opsd.loss import policy_gradient as pg
    from opsd.loss import token_logprobs

    hidden, weight, y, _ = _bf16_head()
    whole = token_logprobs(hidden, weight, y, temperature=0.7, chunk_size=8)
    monkeypatch.setattr(pg, "HEAD_BLOCK_ELEMENTS", 7 * hidden.shape[1])
    made = _allocations(
        lambda: token_logprobs(hidden, weight, y, temperature=0.7, chunk_size=8), [hidden, weight]
    )
    assert all(not (d == torch.float32 and b >= weight.numel() * 4) for d, b in made)
    got = token_logprobs(hidden, weight, y, temperature=0.7, chunk_size=8)
    ref = (
        torch.log_softmax(hidden.double() @ weight.double().t() / 0.7, -1).gather(-1, y[:, None]).squeeze(-1)
    )
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), ref, rtol=0, atol=1e-5)
    torch.testing.assert_close(got, whole, rtol=0, atol=1e-6)  # the blocks change no number beyond rounding


def test_step_timer_synchronizes_once_a_phase(monkeypatch):
    """On CUDA a phase ends with one synchronization and the step's first phase also starts with one:
    a micro-batch's four phases cost four, not eight (the next phase starts on an empty queue)."""
    from opsd.metrics import StepTimer

    calls = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: calls.append(1))
    timer = StepTimer(sync=True)
    for _ in range(2):  # two micro-batches
        for phase in ("teacher", "student", "loss", "student"):
            with timer(phase):
                pass
    assert len(calls) == 1 + 8
    assert set(timer.times) == {"teacher", "student", "loss"}
    StepTimer(sync=False)("loss").__enter__()  # a CPU timer never synchronizes
    assert len(calls) == 9
