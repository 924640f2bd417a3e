"""The CUDA code paths on a real GPU: training with bfloat16 autocast, distillation, and the
transformers runtime verifying drafts there. Skipped where no GPU is visible (CI, the project's
CPU machines); `tests/test_train.py` runs the same training path with autocast on the CPU."""

from __future__ import annotations

import pytest
import torch
from conftest import make_tiny_target
from test_train import samples, unequal_samples

from moaspec.config import GenerationConfig, SamplingConfig
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
