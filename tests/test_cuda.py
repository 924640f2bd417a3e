"""The CUDA code paths on a real GPU: training with bfloat16 autocast, distillation, the
transformers runtime verifying drafts there, and model drafters running on the target's GPU.
Skipped where no GPU is visible (CI, the project's CPU machines); `tests/test_train.py` runs the
same training path with autocast on the CPU, and the drafter tests the same drafting code on the
CPU (where its device moves are no-ops)."""

from __future__ import annotations

import pytest
import torch
from conftest import make_random_drafter_net, make_tiny_target
from test_train import samples, unequal_samples

from moaspec.config import GenerationConfig, SamplingConfig, TreeConfig
from moaspec.drafters import make_drafter
from moaspec.engine import Engine
from moaspec.targets.hf import HFTarget
from moaspec.train import distill as ds
from moaspec.train.config import TrainConfig
from moaspec.train.run import build_net
from moaspec.train.trainer import train

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


def on_gpu(target: HFTarget) -> HFTarget:
    return HFTarget(target.model.to("cuda"), target.tokenizer, target.name)


@pytest.mark.parametrize("method", ["moa", "eagle"])
def test_training_on_the_gpu_matches_the_cpu_within_bfloat16_and_resumes_on_the_cpu(tmp_path, method: str) -> None:
    """The GPU run goes in padded micro-batches (--micro-batch), the CPU run one sequence at a time."""
    cpu_target = make_tiny_target("llama", num_hidden_layers=3, dtype=torch.float32)
    data = [*unequal_samples(11), *samples(1, 11)]
    config = TrainConfig(method=method, steps=3, batch_size=3, warmup_steps=1, val_every=3, ckpt_every=1000)
    torch.manual_seed(0)
    cpu_net = build_net(method, cpu_target, 0, None)
    initial = {name: tensor.clone() for name, tensor in cpu_net.state_dict().items()}
    cpu_state = train(cpu_net, cpu_target, data[:3], data[3:], config, tmp_path / "cpu", progress=False)
    gpu_target = on_gpu(make_tiny_target("llama", num_hidden_layers=3, dtype=torch.float32))
    gpu_net = build_net(method, gpu_target, 0, None)
    gpu_net.load_state_dict(initial)
    gpu_state = train(gpu_net, gpu_target, data[:3], data[3:], config, tmp_path / "gpu", progress=False, micro_batch=3)
    assert next(gpu_net.parameters()).device.type == "cuda"
    assert gpu_state.history[0]["loss"] == pytest.approx(cpu_state.history[0]["loss"], rel=0.05)
    assert "acc_depth1" in gpu_state.history[-1] and "val_tau" not in gpu_state.history[-1]
    state = train(build_net(method, cpu_target, 0, None), cpu_target, data[:3], data[3:], config, tmp_path / "gpu", progress=False)
    assert state.step == 3  # the GPU run's state loads on the CPU


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_greedy_with_prompt_lookup_on_the_gpu_equals_plain_decoding_there(family: str) -> None:
    target = on_gpu(make_tiny_target(family))
    prompt = torch.tensor([5, 9, 13, 5, 9, 13, 5, 9, 13, 5, 9, 21, 5, 9, 13, 5])
    generation = GenerationConfig(max_new_tokens=40)
    plain = Engine(target, make_drafter("none", target)).generate(prompt, SamplingConfig(), generation)
    looked_up = Engine(target, make_drafter("ngram", target)).generate(prompt, SamplingConfig(), generation)
    assert looked_up.token_ids == plain.token_ids
    assert looked_up.stats.target_forwards < plain.stats.target_forwards  # drafts were verified there


def test_distillation_on_the_gpu_writes_the_cpu_greedy_rows(tmp_path) -> None:
    model = make_tiny_target("llama").model
    model.config._attn_implementation = "sdpa"
    config = ds.DistillConfig(max_new_tokens=8, batch_size=3, sampled_fraction=0.0, shard_size=4, seed=1)
    prompts = [ds.Prompt(f"p{i}", [3 + (7 * i + j) % 90 for j in range(4 + i)]) for i in range(6)]
    ds.distill(model, prompts, config, tmp_path / "cpu", pad_id=0, eos_ids={96}, progress=False)
    ds.distill(model.to("cuda"), prompts, config, tmp_path / "gpu", pad_id=0, eos_ids={96}, progress=False)
    assert ds.read_shards(tmp_path / "gpu") == ds.read_shards(tmp_path / "cpu")


@pytest.mark.parametrize("lookup_tokens", [None, 4])
def test_the_bench_hf_baselines_generate_on_the_gpu(lookup_tokens) -> None:
    """`moaspec bench --device cuda` runs `hf` / `hf-pld` (transformers' own generate) on the
    target's device; their greedy tokens equal plain decoding there."""
    from moaspec.bench.methods import HFGenerateMethod

    target = on_gpu(make_tiny_target("llama"))
    prompt = [5, 9, 13, 5, 9, 13, 5, 9, 13, 5, 9, 21, 5, 9, 13, 5]
    plain = Engine(target, make_drafter("none", target)).generate(
        torch.tensor(prompt), SamplingConfig(), GenerationConfig(max_new_tokens=24)
    )
    run = HFGenerateMethod("hf", target, lookup_tokens, set()).run(prompt, SamplingConfig(), 24, seed=0)
    assert run.token_ids == plain.token_ids


@pytest.mark.parametrize("method, tli, lookup", [("moa", 0, False), ("moa", 1, False), ("moa", 0, True), ("eagle", 0, False)])
def test_a_model_drafter_on_the_gpu_drafts_as_on_the_cpu_and_stays_lossless(method: str, tli: int, lookup: bool) -> None:
    """The same random float64 drafter next to the same target, on the CPU and on the GPU: the
    greedy text equals plain decoding on the GPU, and the GPU drafter proposed what the CPU one
    did (the same verifications and accepted drafts), so its net, caches and the target modules
    it borrows (TLI) all ran on the GPU without a device mismatch."""
    from moaspec.drafters.eagle import EagleDrafter
    from moaspec.drafters.moa import MoADrafter
    from moaspec.nn.eagle import EagleConfig, EagleDrafterNet
    from moaspec.nn.moa import MoAConfig, MoADrafterNet

    cpu_target = make_tiny_target("llama", num_hidden_layers=3)
    gpu_target = on_gpu(make_tiny_target("llama", num_hidden_layers=3))
    draft_vocab = torch.arange(0, 97, 2)
    if method == "moa":
        config = MoAConfig.for_target(cpu_target.config, tli_layers=tli, draft_vocab_size=draft_vocab.numel())
        net_class, drafter_class = MoADrafterNet, MoADrafter
    else:
        config = EagleConfig.for_target(cpu_target.config, draft_vocab_size=draft_vocab.numel())
        net_class, drafter_class = EagleDrafterNet, EagleDrafter
    prompt = torch.tensor([5, 9, 13, 5, 9, 13, 5, 9, 13, 5, 9, 21, 5, 9, 13, 5])
    generation, tree = GenerationConfig(max_new_tokens=32), TreeConfig(depth=3, top_k=2, budget=5)
    results = []
    for target in (cpu_target, gpu_target):
        drafter = drafter_class(make_random_drafter_net(net_class, config, target, draft_vocab), target, tree)
        if lookup:
            drafter.enable_lookup()
        assert next(drafter.net.parameters()).device.type == target.device.type
        results.append(Engine(target, drafter).generate(prompt, SamplingConfig(), generation))
    plain = Engine(gpu_target, make_drafter("none", gpu_target)).generate(prompt, SamplingConfig(), generation)
    on_cpu, on_gpu_ = results
    assert on_gpu_.token_ids == plain.token_ids == on_cpu.token_ids
    assert on_gpu_.stats.num_verifications == on_cpu.stats.num_verifications
    assert on_gpu_.stats.accepted_depth == on_cpu.stats.accepted_depth


def test_a_gpu_servers_context_goes_on_the_wire() -> None:
    """A split server whose target is on a GPU sends its context tensors from there."""
    from moaspec.split import protocol

    memory = torch.randn(3, 8, device="cuda")
    for wire_dtype in ("f32", "i8"):
        decoded = protocol.decode_context(protocol.encode_context({"memory": memory}, wire_dtype), 3)["memory"]
        torch.testing.assert_close(decoded.float(), memory.cpu(), rtol=0.02, atol=0.05)


def test_tune_on_the_gpu_saves_a_choice_that_gpu_targets_use(tmp_path, monkeypatch) -> None:
    from test_bench import char_tokenizer

    import moaspec.api
    import moaspec.model_store
    from moaspec.cli import main
    from moaspec.nn.checkpoint import save_checkpoint
    from moaspec.nn.moa import MoAConfig, MoADrafterNet
    from moaspec.tuned import tuned_path

    monkeypatch.setenv("MOASPEC_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("MOASPEC_NO_TUNED", raising=False)
    target = make_tiny_target("llama", max_position_embeddings=1024, dtype=torch.float32)
    target.tokenizer = char_tokenizer()
    net = make_random_drafter_net(MoADrafterNet, MoAConfig.for_target(target.config), target)
    checkpoint = save_checkpoint(tmp_path / "moa-ckpt", "moa", net, target, {"depth": 2, "top_k": 1, "budget": 2})
    gpu_target = on_gpu(target)
    monkeypatch.setattr(moaspec.model_store, "resolve_target", lambda spec: ("tiny-llama", tmp_path))
    monkeypatch.setattr(moaspec.model_store, "target_name", lambda spec: "tiny-llama")
    monkeypatch.setattr(moaspec.api, "load_target", lambda name, dtype=None, attn_implementation=None, **kwargs: gpu_target)
    args = ["tune", "--drafters", str(checkpoint), "--target", "tiny", "--device", "cuda", "--repeats", "1",
            "--context", "32", "--calibration-prompts", "1", "--calibration-tokens", "8"]
    assert main(args) == 0
    assert tuned_path("tiny-llama", checkpoint, "cuda").is_file() and not tuned_path("tiny-llama", checkpoint).is_file()
    assert make_drafter(str(checkpoint), gpu_target).tree_source == "tuned"


def test_a_reduced_precision_gpu_target_lends_float32_parts_on_its_gpu(tmp_path) -> None:
    """A bfloat16 target on the GPU reads the parts its drafters borrow from its float32 files
    (targets/load.py: rows read on demand on the CPU, nn/file_rows.py) and hands them out on the
    GPU whole: the files' values there, the same fingerprint as the float32 target's, and a MoA
    drafter with Target Layer Inference drafting on them without a device mismatch."""
    import functools

    from test_reduced_precision import PROMPT

    from moaspec.drafters.moa import MoADrafter
    from moaspec.nn.checkpoint import target_fingerprint
    from moaspec.nn.moa import MoAConfig, MoADrafterNet
    from moaspec.targets.load import _torch_parts

    exact = make_tiny_target("llama", dtype=torch.float32)
    exact.model.save_pretrained(tmp_path)
    reduced_model = make_tiny_target("llama", dtype=torch.float32).model.to(torch.bfloat16).to("cuda")
    reduced = HFTarget(reduced_model, None, exact.name, functools.partial(_torch_parts, tmp_path, reduced_model.config))
    parts = reduced.parts(1)
    assert parts.embed_tokens.weight.device.type == parts.lm_head_weight.device.type == "cuda"
    assert torch.equal(parts.embed_tokens.weight.cpu(), exact.embed_tokens.weight)
    assert torch.equal(parts.lm_head_weight.cpu(), exact.lm_head.weight)
    assert target_fingerprint(reduced) == target_fingerprint(exact)
    draft_vocab = torch.arange(0, 97, 2)
    config = MoAConfig.for_target(exact.config, tli_layers=1, draft_vocab_size=draft_vocab.numel())
    drafter = MoADrafter(make_random_drafter_net(MoADrafterNet, config, reduced, draft_vocab), reduced, TreeConfig(depth=3, top_k=2, budget=5))
    result = Engine(reduced, drafter).generate(PROMPT, SamplingConfig(), GenerationConfig(max_new_tokens=24))
    assert len(result.token_ids) == 24 and result.stats.num_verifications < 24
