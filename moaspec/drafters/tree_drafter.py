"""Shared machinery of the model drafters (MoA, EAGLE-2) driven by the dynamic tree builder.

A subclass provides `start(root_id) -> [1, Vd]` and `expand(token_ids, parent, depth) -> [k, Vd]`
(draft-vocabulary log-probabilities, see dynamic_tree.py) plus `reset`, `accept_context`, a
`context_encoder` (the target-side part, see base.py) and `_keep_provisional_root`. This base
holds the borrowed target modules, the (reduced) LM head, checkpoint loading, and the tree
bookkeeping: the entries a proposal drafted (entry 0 = the root) and, for each, which drafted
entries it may attend to (its ancestors and itself).

Devices: the net, its caches and the target modules it borrows sit on the target's device (a
GPU with `--device cuda`); the tree bookkeeping, the tree builders and the lookup stay on the
CPU, so token ids, positions and masks move to the device at each net call and log-probs come
back once per tree level.

Prompt lookup (`--drafter moa+ngram`): with `enable_lookup()`, a proposal first asks the n-gram
drafter for continuations of the context; when it has some, they alone are the tree (the model
does not run: its caches catch up at its next proposal), otherwise the model drafts its tree.
Measured on MT-bench (20 + 20 questions, both turns, interleaved): this made `moa+ngram` 1.22x /
1.26x where merging the continuations into the model's tree made 1.19x / 1.22x; a matched
continuation is right more often than the model's guess (depth-1 acceptance 0.61 vs 0.47), and
skipping the model saves its proposal and two tree nodes. Drafting alone (split deployment, link
down) follows the same rule one token at a time: the lookup's first token where it has a
continuation, else the model's top choice. The lookup reads the subclass's `history` (verified
tokens, then provisional roots: append-only between resets, and a reset makes a new list),
catching up on the new tokens at each proposal.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from moaspec.config import NgramConfig, SamplingConfig, TreeConfig
from moaspec.drafters.base import AloneDraft, Context, ContextEncoder, VerifiedUpdate, pick_alone
from moaspec.drafters.dynamic_tree import build_dynamic_tree, build_sampled_tree
from moaspec.drafters.ngram import LOOKUP_PRECISION_AGREED, LOOKUP_PRECISION_DISPUTED, NgramDrafter
from moaspec.drafters.vocab import target_token_ids
from moaspec.errors import MoaspecError
from moaspec.nn.drafter_net import DrafterNet
from moaspec.nn.fast_linear import use_layout, weight_in_layout
from moaspec.nn.layers import at_least_fp32
from moaspec.nn.target_layers import check_tli_layers
from moaspec.tree import DraftTree

if TYPE_CHECKING:
    from moaspec.targets.base import Target


class TreeDrafter:
    """Base class; see the module docstring."""

    net_class: type[DrafterNet]
    tree_source: str = "checkpoint"  # where tree_config came from: "checkpoint", "tuned", "explicit" (tuned.py)
    context_encoder: ContextEncoder
    history: list[int]  # verified tokens (+ provisional roots while drafting alone); set by reset()
    lookup: NgramDrafter | None = None  # prompt lookup tried before the model (module docstring)

    def __init__(self, net: DrafterNet, target: Target, tree: TreeConfig | None = None, tli_layers: int = 0) -> None:
        self.target = target
        self.device = target.device  # the net, its caches and the target's borrowed modules
        self.net = use_layout(net.eval().to(self.device), target.weight_layout)
        self.tree_config = tree or TreeConfig()
        self.parts = target.parts(tli_layers)
        check_tli_layers(self.parts.tli_layers, self.parts.rotary_emb)
        self.dtype = next(net.parameters()).dtype
        self.head = weight_in_layout(self.net.head_weight(self.parts).to(self.dtype), target.weight_layout)  # [Vd, D]
        # the tree builders map draft-vocabulary rows on the CPU (log-probs come back there)
        self.draft_vocab_ids = self.net.draft_vocab_ids.cpu() if net.config.draft_vocab_size else None
        self.reset()

    @classmethod
    def from_pretrained(cls, directory: str | Path, target: Target) -> TreeDrafter:
        """Load a checkpoint directory (refused for another target); its tree config is the default."""
        net, record = cls.net_class.from_pretrained(directory, target)
        try:
            tree = TreeConfig(**record.get("tree", {}))
        except (TypeError, ValueError) as exc:
            raise MoaspecError(f"{Path(directory) / 'config.json'}: its default tree is not valid ({exc})") from None
        return cls(net, target, tree)

    def reset(self) -> None:
        raise NotImplementedError

    def use_layout(self, layout: str) -> None:
        """Store the drafter's own weights in `layout` (the target's, after a calibration changed it)."""
        use_layout(self.net, layout)
        self.head = weight_in_layout(self.head, layout)

    def enable_lookup(self, config: NgramConfig | None = None) -> None:
        """Try prompt lookup before the model at every proposal from now on."""
        self.lookup = NgramDrafter(config)
        self.lookup_history: list[int] | None = None  # the `history` list the lookup has read

    def accept(self, update: VerifiedUpdate) -> None:
        """In-process: encode the context here, then accept it (exactly what a split client does)."""
        self.accept_context(update.token_ids, update.start_pos, self.context_encoder.encode(update))

    def accept_context(self, token_ids: np.ndarray, start_pos: int, context: Context) -> None:
        raise NotImplementedError

    @torch.inference_mode()
    def draft_alone(self, root_id: int, sampling: SamplingConfig, generator: torch.Generator) -> AloneDraft:
        """The next token without the target: the first token of the lookup's trie when it has
        one (as `propose`), with the copy's measured precision where the model's own first choice
        is the same token or is not (ngram.py), else the model's own choice (with the model's
        probability of it). The root becomes provisional context (base.py) either way, so the
        model runs even when the lookup answers (EAGLE keeps its predicted feature of the root)."""
        trie = self._lookup_proposal(root_id, sampling, generator)
        log_probs = self.start(root_id)[0]
        self._keep_provisional_root(root_id)
        if trie is not None:  # the first child: the longest n-gram's most recent match
            copy = int(trie.token_ids[1])
            if int(target_token_ids(int(log_probs.argmax()), self.draft_vocab_ids)) == copy:
                return AloneDraft(copy, LOOKUP_PRECISION_AGREED, "lookup+model")
            return AloneDraft(copy, LOOKUP_PRECISION_DISPUTED, "lookup")
        token = pick_alone(log_probs, sampling, generator)
        return AloneDraft(int(target_token_ids(token, self.draft_vocab_ids)), float(log_probs[token].exp()), "model")

    def _keep_provisional_root(self, root_id: int) -> None:
        """After `start(root_id)`: keep the root as context, with predicted activations."""
        raise NotImplementedError

    def start(self, root_id: int) -> torch.Tensor:
        raise NotImplementedError

    def expand(self, token_ids: torch.Tensor, parent: torch.Tensor, depth: int) -> torch.Tensor:
        raise NotImplementedError

    @torch.inference_mode()
    def propose(self, root_id: int, sampling: SamplingConfig, generator: torch.Generator) -> DraftTree:
        trie = self._lookup_proposal(root_id, sampling, generator)
        if trie is not None:  # deterministic drafts (no draft_probs): the point-mass case of verify.py
            return trie
        start = lambda: self.start(root_id)[0]  # noqa: E731
        if self.tree_config.sampled and not sampling.greedy:
            return build_sampled_tree(
                root_id, start, self.expand, self.tree_config, self.target.vocab_size,
                sampling.temperature, generator, self.draft_vocab_ids,
            )
        return build_dynamic_tree(root_id, start, self.expand, self.tree_config, self.draft_vocab_ids)

    def _lookup_proposal(self, root_id: int, sampling: SamplingConfig, generator: torch.Generator) -> DraftTree | None:
        """The lookup's trie after catching up on `history` (restarted after a reset); None
        when prompt lookup is off or the context has no match."""
        lookup = self.lookup
        if lookup is None:
            return None
        if self.lookup_history is not self.history:
            lookup.reset()
            self.lookup_history = self.history
        known = len(lookup.history)
        lookup.accept_context(torch.tensor(self.history[known:], dtype=torch.long), known, {})
        trie = lookup.propose(root_id, sampling, generator)
        return trie if trie.num_nodes > 1 else None

    # -- tree bookkeeping ----------------------------------------------------------------------
    def _begin_tree(self) -> None:
        """A new proposal: the only drafted entry is the root."""
        self.tree_rows = torch.ones(1, 1, dtype=torch.bool)  # [n, n]: entry i sees entry j
        self.level_slots = torch.zeros(1, dtype=torch.long)  # drafted-entry index of each last beam

    def _add_level(self, parent: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Register k new beams whose parents index the previous level (-1 = the root).

        -> (rows [k, n + k]: which drafted entries each new beam sees, parent_slots [k]).
        """
        num_drafted, count = self.tree_rows.shape[0], parent.numel()
        parent_slots = torch.where(parent >= 0, self.level_slots[parent.clamp_min(0)], 0)
        rows = torch.cat([self.tree_rows[parent_slots], torch.eye(count, dtype=torch.bool)], dim=1)
        self.tree_rows = torch.cat([torch.nn.functional.pad(self.tree_rows, (0, count)), rows], 0)
        self.level_slots = torch.arange(num_drafted, num_drafted + count)
        return rows, parent_slots

    def _log_probs(self, final: torch.Tensor) -> torch.Tensor:
        """The (reduced) LM head on the drafter's final states [n, D] -> log-probs [n, Vd], on the
        CPU, where the tree is built (a copy only when the drafter runs on a GPU)."""
        return torch.log_softmax(at_least_fp32(final @ self.head.T), dim=-1).cpu()
