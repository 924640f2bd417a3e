"""Distribution preservation of `verify_stochastic` (house style 7.6 item 4).

Toy model: a vocabulary of V tokens, a random bigram target table P[prev] and a different bigram
drafter table Q[prev]. Node i of a draft tree is followed, under the target, by P[token of i].
The drafter draws each node's siblings without replacement from Q[token of parent] and stores the
conditional row it drew from, as the `DraftTree` contract requires.

Three kinds of evidence:
- *Exact*: `Enumerator` is a `RandomSource` that walks every branch of every random decision, the
  drafter's included, and re-runs the real verifier once per branch sequence ("script"). Summing
  path weight x outcome gives the emitted-token distribution exactly (float64, atol 1e-9).
- *Monte Carlo*: fixed-seed `torch.Generator` runs with chi-square tests at alpha = 1e-4 per case.
- *Power*: the same checks reject a verifier with a broken residual.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Hashable

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

import moaspec.verify
from moaspec.config import SamplingConfig
from moaspec.sampling import target_probs
from moaspec.tree import DraftTree
from moaspec.verify import Accepted, RandomSource, TorchRandom, verify_stochastic

V = 6
ALPHA = 1e-4
EXACT_ATOL = 1e-9

CHAIN1 = [-1, 0]
CHAIN2 = [-1, 0, 1]
CHAIN3 = [-1, 0, 1, 2]
SIBLINGS2 = [-1, 0, 0]
SIBLINGS3 = [-1, 0, 0, 0]
TREE_DEPTH2 = [-1, 0, 0, 1, 1]  # root: 2 children; first child: 2 children
TREE_DEPTH3 = [-1, 0, 0, 1, 3]  # root: 2 children; first child -> grandchild -> great-grandchild
TREE_SMALL = [-1, 0, 0, 1]  # root: 2 children; first child: 1 child


# ----------------------------------------------------------------------------- toy model


def dirichlet_table(seed: int, vocab: int = V, alpha: float = 2.0) -> torch.Tensor:
    """[V, V] float64 bigram table, each row drawn from Dirichlet(alpha)."""
    rows = np.random.default_rng(seed).dirichlet(np.full(vocab, alpha), size=vocab)
    return torch.from_numpy(rows)


def sparse_table(seed: int, support: int, vocab: int = V, alpha: float = 2.0) -> torch.Tensor:
    """[V, V] bigram table whose rows are Dirichlet(alpha) on `support` random tokens, 0 elsewhere.

    Small supports keep the enumeration of deep trees cheap, and a drafter with a different
    support from the target's exercises the residual on tokens q cannot propose.
    """
    rng = np.random.default_rng(seed)
    rows = np.zeros((vocab, vocab))
    for row in rows:
        row[rng.choice(vocab, size=support, replace=False)] = rng.dirichlet(np.full(support, alpha))
    return torch.from_numpy(rows)


def draft_tree(root: int, parents: list[int], q_table: torch.Tensor, source: RandomSource) -> DraftTree:
    """Sample a tree of the given shape: siblings without replacement from Q[token of parent].

    draft_probs[i] is the renormalised row node i was drawn from (earlier siblings removed).
    """
    tokens = [root]
    rows = [torch.zeros(q_table.shape[-1], dtype=q_table.dtype)]
    drawn_under: dict[int, list[int]] = defaultdict(list)
    for parent in parents[1:]:
        q = q_table[tokens[parent]]
        if drawn_under[parent]:
            q = q.clone()
            q[drawn_under[parent]] = 0.0
            q = q / q.sum()
        token = source.draw(q)
        drawn_under[parent].append(token)
        tokens.append(token)
        rows.append(q)
    return DraftTree(torch.tensor(tokens), torch.tensor(parents), torch.stack(rows))


def deterministic_tree(root: int, parents: list[int], q_table: torch.Tensor) -> DraftTree:
    """Top-m drafts by Q: the j-th child of a node is its j-th most likely token (draft_probs None)."""
    tokens = [root]
    rank_under: dict[int, int] = defaultdict(int)
    for parent in parents[1:]:
        ranked = torch.argsort(q_table[tokens[parent]], descending=True, stable=True)
        tokens.append(int(ranked[rank_under[parent]]))
        rank_under[parent] += 1
    return DraftTree(torch.tensor(tokens), torch.tensor(parents), None)


def target_rows(tree: DraftTree, p_table: torch.Tensor) -> torch.Tensor:
    """p_target [N, V]: the target after node i's root path; under a bigram, P[token of i]."""
    return p_table[tree.token_ids]


def verify_sampled(
    root: int, parents: list[int], p_table: torch.Tensor, q_table: torch.Tensor, source: RandomSource
) -> Accepted:
    tree = draft_tree(root, parents, q_table, source)
    return verify_stochastic(tree, target_rows(tree, p_table), source)


def decode(
    root: int, parents: list[int], p_table: torch.Tensor, q_table: torch.Tensor, source: RandomSource, n: int
) -> tuple[int, ...]:
    """Mini decode loop: draft from the last token, verify, append, until >= n tokens."""
    emitted: list[int] = []
    last = root
    while len(emitted) < n:
        emitted += verify_sampled(last, parents, p_table, q_table, source).emitted_ids
        last = emitted[-1]
    return tuple(emitted[:n])


# ----------------------------------------------------------------------------- exact enumeration


class Enumerator:
    """RandomSource that replays a script of recorded choices, then takes branch 0 of new decisions.

    Every decision records its kind and its branches (choice, weight); branches of weight 0 are
    left out. `weight` is the probability of the branch sequence taken.
    """

    def __init__(self, script: list[Hashable]) -> None:
        self.script = script
        self.choices: list[Hashable] = []
        self.branches: list[list[tuple[Hashable, float]]] = []
        self.kinds: list[str] = []
        self.weight = 1.0

    def _decide(self, kind: str, branches: list[tuple[Hashable, float]]) -> Hashable:
        step = len(self.choices)
        if step < len(self.script):
            choice = self.script[step]
            weights = dict(branches)
            assert choice in weights, "replay diverged: the run is not a function of its choices"
            weight = weights[choice]
        else:
            choice, weight = branches[0]
        self.choices.append(choice)
        self.branches.append(branches)
        self.kinds.append(kind)
        self.weight *= weight
        return choice

    def coin(self, prob: float) -> bool:
        assert 0.0 <= prob <= 1.0
        branches = [(outcome, w) for outcome, w in ((True, prob), (False, 1.0 - prob)) if w > 0.0]
        return bool(self._decide("coin", branches))

    def draw(self, probs: torch.Tensor) -> int:
        row = probs.to(torch.float64)
        assert bool((row >= 0).all()) and float(row.sum()) > 0
        row = row / row.sum()  # as torch.multinomial, which TorchRandom uses
        return int(self._decide("draw", [(i, w) for i, w in enumerate(row.tolist()) if w > 0.0]))


def enumerate_exact(run: Callable[[RandomSource], Hashable]) -> dict[Hashable, float]:
    """Outcome -> probability, by depth-first search over all scripts of `run`'s decisions."""
    distribution: dict[Hashable, float] = defaultdict(float)
    pending: list[list[Hashable]] = [[]]
    seen: dict[tuple[Hashable, ...], tuple[str, list[tuple[Hashable, float]]]] = {}
    while pending:
        script = pending.pop()
        source = Enumerator(script)
        outcome = run(source)
        assert len(source.choices) >= len(script), "replay ended early"
        for step, decision in enumerate(zip(source.kinds, source.branches)):
            assert seen.setdefault(tuple(source.choices[:step]), decision) == decision, "run is not replayable"
        distribution[outcome] += source.weight
        for step in range(len(script), len(source.choices)):
            for alternative, _ in source.branches[step][1:]:
                pending.append([*source.choices[:step], alternative])
    assert abs(sum(distribution.values()) - 1.0) < 1e-12, "enumeration is incomplete"
    return dict(distribution)


def as_vector(distribution: dict[Hashable, float], vocab: int = V) -> torch.Tensor:
    vector = torch.zeros(vocab, dtype=torch.float64)
    for token, prob in distribution.items():
        vector[token] += prob
    return vector


def exact_first_token(root: int, parents: list[int], p_table: torch.Tensor, q_table: torch.Tensor) -> torch.Tensor:
    dist = enumerate_exact(lambda source: verify_sampled(root, parents, p_table, q_table, source).emitted_ids[0])
    return as_vector(dist, p_table.shape[-1])


def assert_exact(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.shape == expected.shape
    gap = float((actual - expected).abs().max())
    assert gap <= EXACT_ATOL, f"max |emitted - p_target| = {gap:.3e}\nemitted  {actual}\np_target {expected}"


# ----------------------------------------------------------------------------- special tables


def disjoint_tables() -> tuple[torch.Tensor, torch.Tensor]:
    """P[r] lives on tokens {0, 1, 2} and Q[r] on {3, 4, 5} for every r."""
    p_table = dirichlet_table(20)
    q_table = dirichlet_table(21)
    p_table[:, 3:] = 0.0
    q_table[:, :3] = 0.0
    return p_table / p_table.sum(-1, keepdim=True), q_table / q_table.sum(-1, keepdim=True)


def one_hot_tables() -> tuple[torch.Tensor, torch.Tensor]:
    """Every P row is one-hot (on a row-dependent token); Q is dense."""
    p_table = torch.nn.functional.one_hot(torch.tensor([2, 4, 0, 1, 5, 3]), V).to(torch.float64)
    return p_table, dirichlet_table(31)


def warped_tables() -> tuple[torch.Tensor, torch.Tensor]:
    """P = target_probs(logits) with temperature, top-k and top-p; Q is the unwarped softmax."""
    gen = torch.Generator().manual_seed(40)
    logits = 2.0 * torch.randn(V, V, generator=gen, dtype=torch.float64)
    p_table = target_probs(logits, SamplingConfig(temperature=0.8, top_k=4, top_p=0.85))
    return p_table, torch.softmax(logits, -1)


def exposing_tables() -> tuple[torch.Tensor, torch.Tensor]:
    """q piles onto one token where p is moderate: without a residual it is emitted far too often."""
    p = torch.tensor([0.5, 0.2, 0.1, 0.1, 0.05, 0.05], dtype=torch.float64)
    q = torch.tensor([0.9, 0.02, 0.02, 0.02, 0.02, 0.02], dtype=torch.float64)
    return p.expand(V, V).clone(), q.expand(V, V).clone()


TABLES: dict[str, Callable[[], tuple[torch.Tensor, torch.Tensor]]] = {
    "dirichlet": lambda: (dirichlet_table(0), dirichlet_table(1)),
    "sparse_q": lambda: (dirichlet_table(0), sparse_table(2, support=3)),
    "sparse_q2": lambda: (dirichlet_table(0), sparse_table(3, support=2)),
    "disjoint": disjoint_tables,
    "p_equals_q": lambda: (sparse_table(10, support=4), sparse_table(10, support=4)),
    "one_hot_p": one_hot_tables,
    "warped_p": warped_tables,
    "exposing": exposing_tables,
}


def test_special_tables_are_what_they_claim() -> None:
    p_table, q_table = TABLES["sparse_q"]()
    assert bool((p_table > 0).all()) and torch.equal((q_table > 0).sum(-1), torch.full((V,), 3))
    p_table, q_table = TABLES["sparse_q2"]()
    assert bool((p_table > 0).all()) and torch.equal((q_table > 0).sum(-1), torch.full((V,), 2))
    p_table, q_table = TABLES["p_equals_q"]()
    assert torch.equal(p_table, q_table) and torch.equal((p_table > 0).sum(-1), torch.full((V,), 4))
    p_table, q_table = disjoint_tables()
    assert bool(((p_table > 0) & (q_table > 0)).sum() == 0)
    p_table, q_table = one_hot_tables()
    assert torch.equal(p_table.max(-1).values, torch.ones(V, dtype=torch.float64))
    p_table, q_table = warped_tables()
    assert bool(((p_table == 0).sum(-1) >= 2).all()) and bool((q_table > 0).all())
    assert torch.allclose(p_table.sum(-1), torch.ones(V, dtype=torch.float64), atol=1e-12)


# ----------------------------------------------------------------------------- exact tests


@pytest.mark.parametrize(
    ("tables", "shape"),
    [
        ("dirichlet", CHAIN1),
        ("dirichlet", CHAIN2),
        ("dirichlet", CHAIN3),
        ("dirichlet", SIBLINGS2),
        ("dirichlet", SIBLINGS3),
        ("sparse_q", CHAIN3),
        ("sparse_q", SIBLINGS3),
        ("sparse_q", TREE_DEPTH2),
        ("sparse_q", TREE_DEPTH3),
    ],
)
def test_exact_first_token(tables: str, shape: list[int]) -> None:
    p_table, q_table = TABLES[tables]()
    assert_exact(exact_first_token(1, shape, p_table, q_table), p_table[1])


@pytest.mark.parametrize("tables", ["disjoint", "p_equals_q", "one_hot_p", "warped_p"])
@pytest.mark.parametrize("shape", [CHAIN2, SIBLINGS3])
def test_exact_first_token_special_cases(tables: str, shape: list[int]) -> None:
    p_table, q_table = TABLES[tables]()
    assert_exact(exact_first_token(3, shape, p_table, q_table), p_table[3])


@pytest.mark.parametrize("tables", ["dirichlet", "disjoint", "p_equals_q", "one_hot_p", "warped_p"])
@pytest.mark.parametrize("shape", [CHAIN1, CHAIN3, SIBLINGS3, TREE_DEPTH3])
def test_exact_first_token_deterministic_drafts(tables: str, shape: list[int]) -> None:
    p_table, q_table = TABLES[tables]()
    tree = deterministic_tree(2, shape, q_table)
    assert tree.draft_probs is None
    dist = enumerate_exact(lambda source: verify_stochastic(tree, target_rows(tree, p_table), source).emitted_ids[0])
    assert_exact(as_vector(dist), p_table[2])


def test_exact_first_token_deterministic_duplicate_siblings() -> None:
    p_table, _ = TABLES["dirichlet"]()
    tree = DraftTree(torch.tensor([0, 4, 4, 1]), torch.tensor([-1, 0, 0, 0]), None)
    dist = enumerate_exact(lambda source: verify_stochastic(tree, target_rows(tree, p_table), source).emitted_ids[0])
    assert_exact(as_vector(dist), p_table[0])


@pytest.mark.parametrize(
    ("tables", "shape"),
    [
        ("dirichlet", CHAIN1),
        ("sparse_q2", CHAIN2),
        ("sparse_q2", TREE_SMALL),
        ("sparse_q", SIBLINGS2),
        ("warped_p", CHAIN1),
        ("warped_p", SIBLINGS2),
    ],
)
def test_exact_joint_of_first_two_tokens(tables: str, shape: list[int]) -> None:
    p_table, q_table = TABLES[tables]()
    root = 5
    dist = enumerate_exact(lambda source: decode(root, shape, p_table, q_table, source, 2))
    joint = torch.zeros(V, V, dtype=torch.float64)
    for (x1, x2), prob in dist.items():
        joint[x1, x2] += prob
    assert_exact(joint, p_table[root][:, None] * p_table)


def test_exact_acceptance_of_a_single_draft_is_sum_of_min() -> None:
    p_table, q_table = TABLES["dirichlet"]()
    dist = enumerate_exact(lambda source: verify_sampled(4, CHAIN1, p_table, q_table, source).num_accepted)
    expected = float(torch.minimum(p_table[4], q_table[4]).sum())
    assert abs(dist.get(1, 0.0) - expected) <= EXACT_ATOL
    assert 0.2 < expected < 0.9, "the case must have both outcomes"


def test_exact_p_equals_q_accepts_the_whole_chain() -> None:
    p_table, q_table = dirichlet_table(10), dirichlet_table(10)
    dist = enumerate_exact(lambda source: verify_sampled(0, CHAIN3, p_table, q_table, source).num_accepted)
    assert dist == {3: pytest.approx(1.0, abs=EXACT_ATOL)}



def test_a_node_its_drafter_could_not_have_drawn_is_ignored_exactly() -> None:
    """A mutation audit (session 50): a node whose own row gives its token probability 0 (the
    split server takes rows from a client, which may send one) must be skipped, not divided by:
    with `q_token <= 0` made `< 0` the verifier raised ZeroDivisionError. Placed first among the
    root's children, before two properly drawn siblings, it leaves the first token's law exact."""
    p_table, q_table = TABLES["dirichlet"]()
    impossible = q_table[1].clone()
    impossible[0] = 0.0
    impossible /= impossible.sum()

    def run(source: RandomSource) -> int:
        drawn = draft_tree(1, SIBLINGS2, q_table, source)
        tree = DraftTree(
            torch.tensor([int(drawn.token_ids[0]), 0, *drawn.token_ids[1:].tolist()]),
            torch.tensor([-1, 0, 0, 0]),
            torch.cat([drawn.draft_probs[:1], impossible[None], drawn.draft_probs[1:]]),
        )
        return verify_stochastic(tree, target_rows(tree, p_table), source).emitted_ids[0]

    assert_exact(as_vector(enumerate_exact(run)), p_table[1])


def test_the_residual_of_equal_laws_is_a_law() -> None:
    """p == q leaves no residual mass (rejection has probability 0 there, but rounding can reach
    it): the residual is then p itself, never a division by zero (a mutation audit, session 50)."""
    p = dirichlet_table(0)[2]
    for q in (p, p * (1 + 1e-12)):
        residual = moaspec.verify._residual(p, q)
        assert bool(torch.isfinite(residual).all()) and abs(float(residual.sum()) - 1.0) <= EXACT_ATOL
    torch.testing.assert_close(moaspec.verify._residual(p, p), p, rtol=0, atol=0)

def test_enumerator_sums_a_known_distribution() -> None:
    """The enumerator itself: two coins and a draw, probabilities by hand."""

    def run(source: RandomSource) -> tuple[bool, bool, int]:
        first = source.coin(0.25)
        second = source.coin(0.5) if first else False
        return first, second, source.draw(torch.tensor([0.0, 0.6, 0.4]))

    dist = enumerate_exact(run)
    assert dist == {
        (True, True, 1): pytest.approx(0.075),
        (True, True, 2): pytest.approx(0.05),
        (True, False, 1): pytest.approx(0.075),
        (True, False, 2): pytest.approx(0.05),
        (False, False, 1): pytest.approx(0.45),
        (False, False, 2): pytest.approx(0.3),
    }


# ----------------------------------------------------------------------------- Monte Carlo


def draft_batch(
    root: int, parents: list[int], q_table: torch.Tensor, n: int, generator: torch.Generator
) -> list[DraftTree]:
    """n trees from the same drafter as `draft_tree`, with the sampling vectorised over the batch."""
    tokens = torch.full((n, len(parents)), root, dtype=torch.long)
    rows = torch.zeros(n, len(parents), q_table.shape[-1], dtype=q_table.dtype)
    for node, parent in enumerate(parents[1:], start=1):
        q = q_table[tokens[:, parent]]
        earlier = [sibling for sibling in range(1, node) if parents[sibling] == parent]
        if earlier:
            q = q.scatter(1, tokens[:, earlier], 0.0)
            q = q / q.sum(-1, keepdim=True)
        tokens[:, node] = torch.multinomial(q, 1, generator=generator).squeeze(1)
        rows[:, node] = q
    parent_ids = torch.tensor(parents)
    return [DraftTree(tokens[i], parent_ids, rows[i]) for i in range(n)]


class Replay:
    """RandomSource that hands out given draws in order (no coins)."""

    def __init__(self, draws: list[int]) -> None:
        self.draws = iter(draws)

    def coin(self, prob: float) -> bool:
        raise AssertionError("the drafter flips no coins")

    def draw(self, probs: torch.Tensor) -> int:
        token = next(self.draws)
        assert float(probs[token]) > 0
        return token


@pytest.mark.parametrize("shape", [SIBLINGS3, TREE_DEPTH2])
def test_batched_drafter_is_the_enumerated_drafter(shape: list[int]) -> None:
    _, q_table = TABLES["dirichlet"]()
    for tree in draft_batch(3, shape, q_table, 50, torch.Generator().manual_seed(0)):
        replayed = draft_tree(3, shape, q_table, Replay(tree.token_ids[1:].tolist()))
        assert np.array_equal(replayed.token_ids, tree.token_ids)
        assert np.array_equal(replayed.parents, tree.parents)
        assert torch.allclose(replayed.draft_probs, tree.draft_probs, rtol=0.0, atol=1e-15)


def sample_verified(
    root: int, parents: list[int], p_table: torch.Tensor, q_table: torch.Tensor, n: int, seed: int
) -> tuple[np.ndarray, list[Accepted]]:
    """n draft+verify runs on one seeded generator: counts [V] of the first emitted token, results."""
    generator = torch.Generator().manual_seed(seed)
    trees = draft_batch(root, parents, q_table, n, generator)
    results = [verify_stochastic(tree, target_rows(tree, p_table), generator) for tree in trees]
    counts = np.bincount([r.emitted_ids[0] for r in results], minlength=p_table.shape[-1])
    return counts, results


def chi_square_pvalue(counts: np.ndarray, p: torch.Tensor) -> float:
    """Chi-square goodness of fit on p's support; tokens outside it must never appear."""
    probs = p.numpy()
    support = probs > 0
    assert counts[~support].sum() == 0, f"tokens outside p's support were emitted: {counts}"
    if support.sum() == 1:
        return 1.0
    expected = counts.sum() * probs[support] / probs[support].sum()
    assert expected.min() >= 5, "too few samples per cell for a chi-square test"
    return float(chisquare(counts[support], expected).pvalue)


@pytest.mark.statistical
def test_monte_carlo_first_token_multi_child_tree() -> None:
    p_table, q_table = TABLES["dirichlet"]()
    counts, results = sample_verified(1, TREE_DEPTH2, p_table, q_table, 20_000, seed=100)
    assert chi_square_pvalue(counts, p_table[1]) > ALPHA
    assert {r.path_node_idx[1] for r in results if r.num_accepted} == {1, 2}, "both root children accepted"


@pytest.mark.statistical
def test_monte_carlo_chain_draft_acceptance_rate_and_first_token() -> None:
    p_table, q_table = TABLES["dirichlet"]()
    n = 20_000
    counts, results = sample_verified(4, CHAIN1, p_table, q_table, n, seed=110)
    rate = sum(r.num_accepted for r in results) / n
    expected = float(torch.minimum(p_table[4], q_table[4]).sum())
    sigma = (expected * (1 - expected) / n) ** 0.5
    assert abs(rate - expected) <= 4 * sigma, f"acceptance {rate:.4f}, expected {expected:.4f} +- {4 * sigma:.4f}"
    assert chi_square_pvalue(counts, p_table[4]) > ALPHA


@pytest.mark.statistical
def test_monte_carlo_p_equals_q_always_accepts_the_first_child() -> None:
    p_table, q_table = dirichlet_table(10), dirichlet_table(10)
    counts, results = sample_verified(2, SIBLINGS3, p_table, q_table, 10_000, seed=120)
    assert all(r.path_node_idx == [0, 1] for r in results)
    assert chi_square_pvalue(counts, p_table[2]) > ALPHA


@pytest.mark.statistical
def test_monte_carlo_one_hot_p_always_emits_its_token() -> None:
    p_table, q_table = TABLES["one_hot_p"]()
    counts, _ = sample_verified(0, TREE_DEPTH2, p_table, q_table, 2_000, seed=130)
    assert counts.tolist() == (2_000 * p_table[0]).long().tolist()


# ----------------------------------------------------------------------------- power


def residual_unchanged(p_target: torch.Tensor, q_draft: torch.Tensor) -> torch.Tensor:
    """Broken: after a rejection, keep drawing from p (no residual)."""
    return p_target


def residual_unnormalised(p_target: torch.Tensor, q_draft: torch.Tensor) -> torch.Tensor:
    """Broken: max(p - q, 0) without renormalisation (the next sibling is accepted too rarely)."""
    return (p_target - q_draft).clamp_min(0.0)


@pytest.mark.parametrize(
    ("broken", "tables", "shape"),
    [
        (residual_unchanged, "exposing", CHAIN1),
        (residual_unchanged, "dirichlet", CHAIN1),
        (residual_unchanged, "sparse_q", TREE_DEPTH2),
        (residual_unnormalised, "dirichlet", SIBLINGS2),
        (residual_unnormalised, "sparse_q", SIBLINGS3),
    ],
)
def test_power_exact_enumeration_rejects_a_broken_residual(
    monkeypatch: pytest.MonkeyPatch,
    broken: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    tables: str,
    shape: list[int],
) -> None:
    p_table, q_table = TABLES[tables]()
    assert_exact(exact_first_token(1, shape, p_table, q_table), p_table[1])
    monkeypatch.setattr(moaspec.verify, "_residual", broken)
    gap = float((exact_first_token(1, shape, p_table, q_table) - p_table[1]).abs().max())
    assert gap > 1e-3


@pytest.mark.statistical
def test_power_monte_carlo_rejects_a_missing_residual(monkeypatch: pytest.MonkeyPatch) -> None:
    p_table, q_table = TABLES["exposing"]()
    counts, _ = sample_verified(0, CHAIN1, p_table, q_table, 2_000, seed=140)
    assert chi_square_pvalue(counts, p_table[0]) > ALPHA
    monkeypatch.setattr(moaspec.verify, "_residual", residual_unchanged)
    counts, _ = sample_verified(0, CHAIN1, p_table, q_table, 2_000, seed=140)
    assert chi_square_pvalue(counts, p_table[0]) < ALPHA


# ----------------------------------------------------------------------------- determinism


def run_seeded(seed: int, steps: int = 200) -> list[Accepted]:
    p_table, q_table = TABLES["dirichlet"]()
    generator = torch.Generator().manual_seed(seed)
    drafter_source = TorchRandom(generator)
    results, last = [], 0
    for _ in range(steps):
        tree = draft_tree(last, TREE_DEPTH2, q_table, drafter_source)
        results.append(verify_stochastic(tree, target_rows(tree, p_table), generator))
        last = results[-1].next_token
    return results


def test_same_seed_gives_the_same_accepted_bit_for_bit() -> None:
    first, second = run_seeded(7), run_seeded(7)
    assert first == second
    assert first != run_seeded(8), "a different seed must change something, or the check is empty"


def test_verifier_leaves_the_global_rng_alone() -> None:
    p_table, q_table = TABLES["dirichlet"]()
    tree = draft_tree(0, TREE_DEPTH2, q_table, TorchRandom(torch.Generator().manual_seed(0)))
    state = torch.get_rng_state()
    verify_stochastic(tree, target_rows(tree, p_table), torch.Generator().manual_seed(1))
    assert torch.equal(torch.get_rng_state(), state)
