"""Drafter losses (moa_reference.md §2.3): 0.1 x soft cross-entropy + SmoothL1 feature loss
(the weights are the paper's defaults; `ce_weight` and `feature_weight` change them).

Both are per token (float32, or float64 for a float64 net), averaged over each sequence's loss
mask, sum(loss * mask) / (sum(mask) + 1e-5), then over the sequences of a batch.
- soft CE: -sum_v p_target(v) log q_drafter(v), p_target = softmax of the target's logits
  (restricted to the draft vocabulary: mass outside it cannot be matched and is dropped), over
  the masked positions only (the head products dominate the cost of a step);
- feature: SmoothL1(beta=1) between the drafter's state and the target's post-norm hidden state,
  mean over dimensions; with TLI, 0.5 x final + 0.5 x (pre-TLI prediction vs the residual stream
  entering layer L-k, at non-anchor positions).

The residual stream is not normalised: on SmolLM2 the one entering layer L-1 has a per-token RMS
of about 30 (up to 450) against 1.9 for the post-norm state, so the raw pre-TLI SmoothL1 (about
11 per token after 400 steps) outweighed everything else and the TLI 1 drafter learned the
stream's large dimensions instead of the next token (validation top-1 0.24-0.27 against 0.34-0.40
without TLI). With `tli_rms_scaled` (the default) both sides of that term are divided by the
target stream's per-token RMS, which puts it on the scale of the final-state term. The reference
code uses the raw term (`tli_rms_scaled=False`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.nn import functional as F

from moaspec.nn.layers import at_least_fp32

CE_WEIGHT = 0.1
FEATURE_WEIGHT = 1.0


@dataclass(frozen=True)
class LossParts:
    total: torch.Tensor
    soft_ce: torch.Tensor
    feature: torch.Tensor
    top1: torch.Tensor  # fraction of masked positions where the drafter's argmax = the target's


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """values [..., T], mask [..., T] (weights in [0, 1]) -> scalar: each sequence's weighted mean,
    averaged over the sequences of a batch (a sequence without weight counts 0)."""
    return ((values * mask).sum(-1) / (mask.sum(-1) + 1e-5)).mean()


def drafter_loss(
    drafter_state: torch.Tensor,
    target_state: torch.Tensor,
    head_weight: torch.Tensor,
    target_logsumexp: torch.Tensor,
    mask: torch.Tensor,
    pre_tli: torch.Tensor | None = None,
    tli_target: torch.Tensor | None = None,
    tli_mask: torch.Tensor | None = None,
    tli_rms_scaled: bool = True,
    wanted_ids: torch.Tensor | None = None,
    ce_weight: float = CE_WEIGHT,
    feature_weight: float = FEATURE_WEIGHT,
) -> LossParts:
    """drafter_state, target_state [T, D]; head_weight [Vd, D] (the target's LM head rows of the
    draft vocabulary); target_logsumexp [T] (over the full vocabulary); mask [T];
    with TLI: pre_tli, tli_target [T, D] and tli_mask [T]; tli_rms_scaled: compare the pre-TLI
    state and its target divided by the target's per-token RMS (see the module docstring);
    wanted_ids [T]: the target's own next token as a draft-vocabulary row (-1 outside it) for
    `top1`, None to compare with the best of the draft vocabulary's target logits.
    total = ce_weight * soft CE + feature_weight * feature term.
    The mask may weigh positions (values in [0, 1]): every term is a weighted mean.
    A padded batch of B sequences passes [B, T, ...] and masks [B, T] (0 on the padding): every
    term, and top1, is then the mean over the sequences of each one's own value."""
    rows = mask.bool()
    with torch.autocast(device_type=target_state.device.type, enabled=False):  # the target's probabilities stay float32
        target_logits = at_least_fp32(target_state[rows].to(head_weight.dtype) @ head_weight.T)
    target_probs = torch.exp(target_logits - at_least_fp32(target_logsumexp[rows, None]))  # [M, Vd]
    draft_log_probs = torch.log_softmax(at_least_fp32(drafter_state[rows] @ head_weight.T), dim=-1)
    soft_ce = torch.zeros(mask.shape, dtype=draft_log_probs.dtype, device=mask.device)
    soft_ce[rows] = -(target_probs * draft_log_probs).sum(-1)  # [..., T], 0 off the mask
    feature = F.smooth_l1_loss(at_least_fp32(drafter_state), at_least_fp32(target_state), reduction="none", beta=1.0).mean(-1)
    feature_loss = masked_mean(feature, mask)
    if pre_tli is not None and tli_target is not None and tli_mask is not None:
        predicted, wanted = at_least_fp32(pre_tli), at_least_fp32(tli_target)
        if tli_rms_scaled:
            rms = wanted.pow(2).mean(-1, keepdim=True).sqrt().clamp_min(1e-6)  # [T, 1], a constant
            predicted, wanted = predicted / rms, wanted / rms
        pre = F.smooth_l1_loss(predicted, wanted, reduction="none", beta=1.0).mean(-1)
        feature_loss = 0.5 * feature_loss + 0.5 * masked_mean(pre, tli_mask)
    ce_loss = masked_mean(soft_ce, mask)
    wanted = target_logits.argmax(-1) if wanted_ids is None else wanted_ids[rows]
    hits = torch.zeros(mask.shape, device=mask.device)
    hits[rows] = (draft_log_probs.argmax(-1) == wanted).float()
    top1 = masked_mean(hits, rows.float())
    total = ce_weight * ce_loss + feature_weight * feature_loss
    return LossParts(total, ce_loss.detach(), feature_loss.detach(), top1.detach())
