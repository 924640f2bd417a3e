"""A short τ measurement during training: the drafter being trained drafts for the real target.

Teacher-forced accuracy (trainer.validate) says how often each draft is right given true
context; τ (mean tokens per target forward) is what a user gets: the engine runs greedy
generation from a few held-out prompts with an inference drafter built around a copy of the
network (the same class as at inference, so training state is never touched).
"""

from __future__ import annotations

import copy

import torch

from moaspec.config import GenerationConfig, TreeConfig
from moaspec.drafters import drafter_class
from moaspec.engine import Engine
from moaspec.metrics import SpecStats
from moaspec.targets.hf import HFTarget
from moaspec.train.features import TrainSample

TAU_PROMPTS = 2  # held-out prompts per measurement
TAU_NEW_TOKENS = 32  # greedy tokens generated from each


def measure_tau(
    net: torch.nn.Module, method: str, target: HFTarget, samples: list[TrainSample], tree: TreeConfig
) -> float:
    """τ of greedy generation from the prompts (response excluded) of the first TAU_PROMPTS samples."""
    engine = Engine(target, drafter_class(method)(copy.deepcopy(net).eval(), target, tree))
    total = SpecStats()
    for sample in samples[:TAU_PROMPTS]:
        prompt = sample.input_ids[: sample.response_start]  # [P]
        stats = engine.generate(prompt, generation=GenerationConfig(max_new_tokens=TAU_NEW_TOKENS)).stats
        total.forward_tokens += stats.forward_tokens
        total.target_forwards += stats.target_forwards
    target.reset()
    return total.tau
