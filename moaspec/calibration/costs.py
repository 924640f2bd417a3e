"""Measured costs of one speculative cycle on this machine, for `moaspec tune` and the machine
calibration (costs_store.py).

- verify_s[N]: one target forward over a tree of N nodes (root included) on a context of
  `context_len` tokens, plus the cache commit, right after a forward over another number of
  nodes, as speculation alternates them. Measured on a binary-tree shape (an additive tree mask,
  as real trees use), once per target.
- plain_step_s: a one-node forward (and commit) among many, as plain decoding runs them.
- tree_penalty_s: what the plain steps after a tree cost beyond as many steady ones, in all, per
  tree node beyond the root (the median over trees of PENALTY_TREES nodes). Both are timed on
  targets that reuse compute graphs (`reuses_graphs`); elsewhere a plain step is verify_s[1] and
  the penalty 0, which saves the transformers runtime ~5 s of 50 ms steps per layout. On llama.cpp
  the first plain step after a batch of another shape rebuilds the compute graph (a plain step
  reuses the one before), and the following ones take several steps to settle back, longer after
  larger trees. On 2 cores of an Intel Xeon with SmolLM2-135M, plain steps of 7.5-9.5 ms paid
  2.4 / 6.0 / 10.2 ms in all after trees of 2 / 4 / 8 nodes (medians of 30, 12 steps after).
  Speculation pays that on top of each tree's verify (`tree_s`): a 4-node chain cost ~4 plain
  steps there, not the 2.5 of its verify among one-node forwards.
- propose_s[(depth, top_k)]: one `propose` of the drafter's dynamic tree of that shape, right
  after the `accept` of the previous proposal's root, as in an engine cycle that kept only the
  root (drafters feed the tokens of the last `accept` when they next propose). The node budget
  only changes the final selection, so it is not a dimension of the cost.
- accept_s = (fixed, per_token): the drafter's `accept` of n newly verified tokens, fitted as
  fixed + per_token * n from n = 1 and n = 4.
Every figure is the median over `repeats` rounds; the configurations are interleaved round by
round so drifting machine load hits all of them alike.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from moaspec.config import MAX_TREE_BUDGET, SamplingConfig, TreeConfig
from moaspec.drafters.base import VerifiedUpdate
from moaspec.timing import interleaved_medians
from moaspec.tree import DraftTree

if TYPE_CHECKING:
    import torch

    from moaspec.drafters.tree_drafter import TreeDrafter
    from moaspec.targets.base import Target

NODE_COUNTS = (1, 2, 3, 4, 5, 7, 9, 13, 17, 25, 33)
# progress(done, total): called after each measured job (a configuration's run in one round)
Progress = Callable[[int, int], None]


# a tree this many times as slow as a larger one (few-row products may invert costs a little, never this)
IRREGULAR_RATIO = 3.0


@dataclass(frozen=True)
class VerifyCosts:
    """What `measure_verify` measured (module docstring): seconds per node count, of a plain
    step, and the plain steps' excess after a tree per node beyond its root."""

    verify_s: dict[int, float]
    plain_step_s: float
    tree_penalty_s: float

    def irregularity(self) -> str | None:
        """A warning when a tree took over IRREGULAR_RATIO times as long as a larger one (a
        forward's cost grows with its nodes: such timings mean that something else ran on the
        machine while they were taken, and a choice resting on them is noise); else None."""
        counts = sorted(self.verify_s)
        for i, small in enumerate(counts):
            for large in counts[i + 1 :]:
                if self.verify_s[small] > IRREGULAR_RATIO * self.verify_s[large]:
                    return (
                        f"the verify timings are irregular ({small} nodes took {self.verify_s[small] * 1000:.1f} ms, "
                        f"{large} nodes {self.verify_s[large] * 1000:.1f} ms): another process was probably busy "
                        "on this machine; measure again when it is quiet"
                    )
        return None


@dataclass(frozen=True)
class CycleCosts:
    verify_s: dict[int, float]
    propose_s: dict[tuple[int, int], float]
    accept_s: tuple[float, float]
    plain_step_s: float | None = None  # None: verify_s[1]
    tree_penalty_s: float = 0.0  # per node beyond the root

    def plain_step(self) -> float:
        """Seconds of one plain decoding step among others (module docstring)."""
        return self.verify(1) if self.plain_step_s is None else self.plain_step_s

    def tree_s(self, num_nodes: float) -> float:
        """Seconds a cycle verifying num_nodes nodes costs: a plain step for one node; a tree's
        verify and its penalty on the plain steps after it otherwise (module docstring)."""
        if num_nodes <= 1:
            return self.plain_step()
        return self.verify(num_nodes) + self.tree_penalty_s * (num_nodes - 1)

    def verify(self, num_nodes: float) -> float:
        """verify_s linearly interpolated (and extrapolated from the last two points)."""
        counts = sorted(self.verify_s)
        if num_nodes in self.verify_s:
            return self.verify_s[num_nodes]
        below = [n for n in counts if n < num_nodes]
        above = [n for n in counts if n > num_nodes]
        lo, hi = (
            (below[-1], above[0])
            if below and above
            else ((counts[-2], counts[-1]) if below else (counts[0], counts[1]))
        )
        slope = (self.verify_s[hi] - self.verify_s[lo]) / (hi - lo)
        return max(0.0, self.verify_s[lo] + slope * (num_nodes - lo))

    def cycle_s(self, tree: TreeConfig, num_nodes: int, tau: float) -> float:
        """Seconds per verification cycle: draft, verify (tree_s), and the drafter taking in ~tau tokens."""
        fixed, per_token = self.accept_s
        return self.propose_s[(tree.depth, tree.top_k)] + self.tree_s(num_nodes) + fixed + per_token * tau

    def to_dict(self) -> dict:
        return {
            "verify_s": {str(n): round(s, 6) for n, s in sorted(self.verify_s.items())},
            "plain_step_s": round(self.plain_step(), 6),
            "tree_penalty_s": round(self.tree_penalty_s, 6),
            "propose_s": {f"{d}x{k}": round(s, 6) for (d, k), s in sorted(self.propose_s.items())},
            "accept_s": {"fixed": round(self.accept_s[0], 6), "per_token": round(self.accept_s[1], 6)},
        }


def binary_tree(num_nodes: int, vocab_size: int, generator: torch.Generator) -> DraftTree:
    """A tree of num_nodes nodes where node i's parent is (i - 1) // 2 (root = node 0)."""
    import torch  # measuring: the calibration's random tokens are torch's (a cached result needs none)

    parents = torch.tensor([-1] + [(i - 1) // 2 for i in range(1, num_nodes)])
    return DraftTree(torch.randint(0, vocab_size, (num_nodes,), generator=generator), parents)


def chain_tree(num_nodes: int, vocab_size: int, generator: torch.Generator) -> DraftTree:
    """A chain of num_nodes random tokens (root = node 0)."""
    import torch

    return DraftTree.chain(torch.randint(0, vocab_size, (num_nodes,), generator=generator))


SETTLED_STEPS = 10  # plain steps timed before a tree (after as many untimed) and after it
PENALTY_TREES = (2, 4, 8)  # the trees after which the penalty is timed, each once per round


def measure_verify(
    target: Target, context_len: int, repeats: int, node_counts: tuple[int, ...] = NODE_COUNTS,
    hidden_layers: tuple[int, ...] = (), progress: Progress | None = None,
) -> VerifyCosts:
    """Median seconds of target.verify + commit for each tree size the target takes, each right
    after a forward of another size; of a plain step; and the tree penalty per node (module
    docstring; chains where the target verifies only chains). Rollbacks are not timed: an engine
    cycle has none. Each penalty sample compares the SETTLED_STEPS plain steps after a tree with
    as many just before it, so that the machine's drifting speed cancels; the samples after
    trees of PENALTY_TREES nodes (those the target takes) give seconds per node beyond the root."""
    import torch

    generator = torch.Generator().manual_seed(0)
    max_nodes = min(getattr(target, "max_tree_nodes", None) or max(node_counts), max(node_counts))
    penalty_sizes = [n for n in PENALTY_TREES if n <= max_nodes]
    room = 3 * SETTLED_STEPS + max(penalty_sizes, default=0)
    if target.reuses_graphs and context_len + room > target.max_positions:
        raise ValueError(f"a context of {context_len} tokens leaves no room for {room} timed positions")
    sizes = sorted({1, max_nodes, *(n for n in node_counts if n <= max_nodes)})  # the largest tree taken, measured
    counts = [n for n in sizes if context_len + 1 + n <= target.max_positions]  # after another forward's token
    shape = chain_tree if getattr(target, "max_tree_leaves", None) == 1 else binary_tree
    trees = {n: shape(n, target.vocab_size, generator) for n in {1, *counts, *penalty_sizes}}
    larger = trees[next((n for n in counts if n > 1), 1)]
    other = {n: larger if n == 1 else trees[1] for n in counts}  # the forward of another size before each
    target.reset()
    target.prefill(torch.randint(0, target.vocab_size, (context_len,), generator=generator).numpy())

    def forward(tree: DraftTree) -> float:
        begin = time.perf_counter()
        target.verify(tree, hidden_layers)
        target.commit([0])
        return time.perf_counter() - begin

    def tree_job(n: int) -> float:
        forward(other[n])
        seconds = forward(trees[n])
        target.rollback(context_len)
        return seconds

    plain_steps: list[float] = []
    penalties: list[tuple[int, float]] = []  # (tree nodes, seconds)

    def plain_job(size: int | None) -> None:
        settled = [forward(trees[1]) for _ in range(2 * SETTLED_STEPS)][SETTLED_STEPS:]
        plain_steps.append(statistics.median(settled))
        if size is not None:
            forward(trees[size])
            penalties.append((size, sum(forward(trees[1]) for _ in range(SETTLED_STEPS)) - sum(settled)))
        target.rollback(context_len)

    jobs: dict = {n: (lambda n=n: tree_job(n)) for n in counts}
    plain_jobs = len(penalty_sizes or [None]) if target.reuses_graphs else 0
    for size in (penalty_sizes or [None])[:plain_jobs]:
        jobs[("plain", size)] = lambda size=size: plain_job(size)
    measured = interleaved_medians(jobs, repeats, progress=progress)
    for key in list(measured):
        if isinstance(key, tuple):
            del measured[key]
    if not plain_jobs:
        return VerifyCosts(measured, measured[1], 0.0)
    timed = slice(plain_jobs, None)  # the warm-up round's left out
    return VerifyCosts(measured, statistics.median(plain_steps[timed]), penalty_per_node(penalties[timed]))


def penalty_per_node(samples: list[tuple[int, float]]) -> float:
    """The median of the (tree nodes, penalty seconds) samples' seconds per node beyond the root
    (robust to the odd sample a busy machine inflates); 0 without samples, never below 0."""
    ratios = [seconds / (nodes - 1) for nodes, seconds in samples if nodes > 1]
    return max(0.0, statistics.median(ratios)) if ratios else 0.0


def measure_drafter(
    drafter: TreeDrafter, target: Target, context_len: int, repeats: int, shapes: list[tuple[int, int]],
    progress: Progress | None = None,
) -> tuple[dict, tuple[float, float]]:
    """-> (propose_s per (depth, top_k), accept_s (fixed, per_token)); restores the drafter's tree."""
    import torch

    generator = torch.Generator().manual_seed(1)
    hidden = drafter.hidden_layers
    target.reset()
    context = torch.randint(0, target.vocab_size, (context_len,), generator=generator).numpy()
    out = target.prefill(context, hidden)
    drafter.reset()
    drafter.accept(VerifiedUpdate(context, 0, out.hidden, target))

    def accept(n: int) -> None:
        ids = torch.randint(0, target.vocab_size, (n,), generator=generator).numpy()
        start = target.num_cached
        update = target.prefill(ids, hidden)
        begin = time.perf_counter()
        drafter.accept(VerifiedUpdate(ids, start, update.hidden, target))
        times[n].append(time.perf_counter() - begin)  # prefill excluded: only the drafter's share

    times: dict[int, list[float]] = {1: [], 4: []}
    room = (target.max_positions - context_len - 8 - len(shapes)) // (5 + len(shapes))
    rounds = max(1, min(repeats, room))
    for _ in range(rounds):
        accept(1)
        accept(4)
    one, four = statistics.median(times[1]), statistics.median(times[4])
    per_token = max(0.0, (four - one) / 3)
    saved = drafter.tree_config
    sampling = SamplingConfig()
    # Every cycle's root is verified in one prefill up front (the cycles below feed it to the
    # drafter one token at a time, as the engine would): one forward instead of one per cycle.
    roots = torch.randint(0, target.vocab_size, ((rounds + 1) * len(shapes) + 1,), generator=generator).numpy()
    start = target.num_cached
    verified = target.prefill(roots[:-1], hidden)
    drafter.propose(int(roots[0]), sampling, generator)  # the first cycle starts by accepting this root
    cycle = [0]

    def propose(depth: int, top_k: int) -> float:
        """One engine cycle that accepted only the root: the previous proposal's root is accepted
        (untimed), then the timed proposal from the next root."""
        i = cycle[0]
        cycle[0] += 1
        rows = None if verified.hidden is None else verified.hidden[i : i + 1]
        drafter.accept(VerifiedUpdate(roots[i : i + 1], start + i, rows, target))
        drafter.tree_config = TreeConfig(depth=depth, top_k=top_k, budget=min(depth * top_k, MAX_TREE_BUDGET))
        begin = time.perf_counter()
        drafter.propose(int(roots[i + 1]), sampling, generator)
        return time.perf_counter() - begin

    try:
        propose_s = interleaved_medians(
            {shape: (lambda shape=shape: propose(*shape)) for shape in shapes}, rounds, progress=progress
        )
    finally:
        drafter.tree_config = saved
    return propose_s, (max(0.0, one - per_token), per_token)
