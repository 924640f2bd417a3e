"""Training configuration (no heavy imports, so the CLI can validate flags before torch loads)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TrainConfig:
    method: str = "moa"  # "moa" | "eagle"
    tli_layers: int = 0
    memory_layers: int = 0  # MoA: the memory reads the last N target layers, 0 = all (MoAConfig)
    memory_hidden: bool = False  # MoA: the memory also reads the target's last hidden state (no loss at anchors)
    layer_attention: bool = True  # MoA: the LSA over layers; False pools the raw keys/values (ablation)
    cross_attention: bool = True  # MoA: the CA over the memory; False leaves the target unread (ablation)
    intermediate_size: int = 0  # MoA: width of its two feed-forward layers, 0 = 3/2 x the target's hidden size
    tli_rms_scaled: bool = True  # pre-TLI feature term relative to the stream's RMS (losses.py)
    ce_weight: float = 0.1  # weight of the soft cross-entropy with the target's distribution (the paper's)
    feature_weight: float = 1.0  # weight of the SmoothL1 feature term (the paper's)
    steps: int = 1000
    batch_size: int = 8  # sequences per optimizer step
    lr: float = 5e-4
    min_lr: float = 5e-5
    warmup_steps: int = 50
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 1.0
    anchor_min: int = 6
    anchor_max: int = 14
    anchor_loss_weight: float = 1.0  # MoA: loss weight where i = s(i) (the CA sees i's own memory: never at inference)
    staircase_fraction: float = 0.5
    eagle_noise: float = 0.2
    max_seq_len: int = 768
    val_every: int = 100
    ckpt_every: int = 100
    seed: int = 0

    def __post_init__(self) -> None:
        if self.method not in ("moa", "eagle"):
            raise ValueError(f"method must be moa or eagle, got {self.method}")
        if not 1 <= self.anchor_min <= self.anchor_max:
            raise ValueError("need 1 <= anchor_min <= anchor_max")
        if not 0.0 <= self.anchor_loss_weight <= 1.0:
            raise ValueError("anchor_loss_weight must be within [0, 1]")
        if self.ce_weight < 0 or self.feature_weight < 0 or not self.ce_weight + self.feature_weight > 0:
            raise ValueError("ce_weight and feature_weight must be >= 0, not both 0")
        if self.memory_layers < 0:
            raise ValueError("memory_layers must be >= 0")
        if self.intermediate_size < 0:
            raise ValueError("intermediate_size must be >= 0")
        if not 0 < self.min_lr <= self.lr:
            raise ValueError(f"the final learning rate must be in (0, lr = {self.lr:g}], got {self.min_lr:g}")
        if self.warmup_steps < 0:
            raise ValueError(f"warm-up steps must be >= 0, got {self.warmup_steps}")
        moa_only = (
            self.memory_layers or self.memory_hidden or not self.layer_attention or not self.cross_attention
            or self.intermediate_size
        )
        if self.method != "moa" and moa_only:
            raise ValueError(
                "memory_layers, memory_hidden, layer_attention, cross_attention and intermediate_size apply to the moa method only"
            )
