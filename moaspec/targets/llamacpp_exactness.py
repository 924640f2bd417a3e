"""How large a verified tree stays exact on this machine's llama.cpp kernels (llamacpp.py's module
docstring: a tree's logits must equal one-token decoding's bit for bit), and the answer saved per
machine, llama.cpp build, GGUF content and thread count (`saved_or_measured`): every process that
verifies trees needs it, and measuring takes ~6 s.

The answer is saved as `<cache root>/calibration/<target name>/exactness-<key>.json` (cache root
as in model_store.py); a change of the CPU, llama-cpp-python's version or compiled features, the
GGUF's content (the same file installed at another path, as in another virtual environment,
shares the record), the layers offloaded to a GPU, the thread count, a q8_0 value cache
(llamacpp_value_cache.py) or the check itself (EXACTNESS_VERSION) is a new key, hence a new
measurement. An unreadable record is measured again. The value cache's own choice is saved the
same way (`saved_or_measured_record`, `machine_record_path`).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from moaspec.atomic_files import write_file_atomically
from moaspec.calibration.machine import cpu_description, key_of
from moaspec.model_store import cache_root, gguf_digest
from moaspec.targets.base import Target
from moaspec.targets.llamacpp_model import build_features
from moaspec.tree import DraftTree

if TYPE_CHECKING:
    from moaspec.targets.llamacpp import LlamaCppTarget

EXACTNESS_VERSION = 3  # 3: the largest tree is filled up to max_nodes (2: up to 120 nodes; 1: 64)
EXACTNESS_CONTEXT = 300  # tokens before the check's decodes: past 256 cells, where kernels change
EXACTNESS_STEPS = 8
# the branching trees checked: (wrong branches per depth, their length) -> 15, 64 and 120 nodes;
# the last is filled up to the largest tree allowed by one more wrong branch below the root
# (128 nodes, 58 leaves: llama.cpp's sequences bound a tree's leaves to 62)
DECOYS = ((1, 1), (8, 1), (8, 2))


def saved_or_measured(target: LlamaCppTarget, measure: Callable[[], int]) -> int:
    """The exact tree size saved for `target` (a LlamaCppTarget: its name, `weights`, `threads`
    and value cache) on this machine, else `measure()`'s answer, saved."""
    return saved_or_measured_record(_record_path(target), "exact_tree_nodes", target, measure)


def saved_exact_tree_nodes(target: LlamaCppTarget) -> int | None:
    """The exact tree size saved for `target` on this machine, None where none is (or the
    record is unreadable)."""
    return _read_saved(_record_path(target), "exact_tree_nodes")


def saved_or_measured_record(
    path: Path,
    field: str,
    target: LlamaCppTarget,
    measure: Callable[[], Any],
    valid: Callable[[Any], bool] | None = None,
) -> Any:
    """The `field` of the record at `path` where `valid` (default: a positive int), else
    `measure()`'s answer, saved there (a cache that cannot be written costs a measurement next
    time, not an error)."""
    saved = _read_saved(path, field, valid)
    if saved is not None:
        return saved
    answer = measure()
    record = {"cpu": cpu_description(), "target": target.name, "threads": target.threads, field: answer}
    try:
        write_file_atomically(path, json.dumps(record, indent=1) + "\n")
    except OSError:
        pass
    return answer


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _read_saved(path: Path, field: str, valid: Callable[[Any], bool] | None = None) -> Any:
    try:
        saved = json.loads(path.read_text()).get(field)
    except (OSError, ValueError, AttributeError):
        return None
    return saved if (valid or _positive_int)(saved) else None


def machine_record_path(target: LlamaCppTarget, kind: str, *parts: str) -> Path:
    """`<cache root>/calibration/<target>/<kind>-<key>.json`, the key naming this CPU, llama.cpp's
    version and compiled features, the GGUF's content (gguf_digest: the same file at another path
    shares the record), the layers offloaded, the thread count and `parts`."""
    import llama_cpp

    weights = target.weights
    key = key_of(
        *parts, cpu_description(), f"llama-cpp-python {llama_cpp.__version__}", build_features(llama_cpp),
        gguf_digest(weights.path), f"ngl {weights.gpu_layers}", f"{target.threads} threads",
    )
    return cache_root() / "calibration" / target.name / f"{kind}-{key}.json"


def _record_path(target) -> Path:
    # a q8_0 value cache is another configuration; the default's records keep their keys
    values = [f"values {target.value_cache_name}"] if target.value_cache_name != "f16" else []
    return machine_record_path(target, "exactness", str(EXACTNESS_VERSION), *values)


def exact_tree_nodes(probe: Target, max_nodes: int) -> int:
    """The most nodes a tree verified in `probe` (a fresh context of its own) may have and still
    give one-token decoding's logits bit for bit: `max_nodes` where branching trees of 15, 64
    and 120 nodes, the last filled up to `max_nodes`, are exact and a prompt's start kept by
    `set_context` gives a fresh prefill's logits (kernels that do not change with the batch
    size), else the longest chain k such that chains
    of 2..k tokens all are (up to EXACTNESS_STEPS; 1: none). Every tree is verified after a fresh
    prefill of EXACTNESS_CONTEXT tokens (fewer where the model's context is smaller), as a
    generation's are. Kernels chosen by batch size fail a tree or the kept start:
    llama.cpp's repacked K-quant products from 4 rows on (AVX-512 EPYC), K-quant mixes whose
    300-row prompt batch rounds otherwise than one row, an AMX or ARM matrix path, say."""
    context_len = min(EXACTNESS_CONTEXT, probe.max_positions - EXACTNESS_STEPS - 2)  # a small model's context
    if context_len < 1:
        return 1  # too small a context to check anything: plain decoding
    context = (np.arange(context_len) % 1000 + 1000) % probe.vocab_size
    first, tokens, logits = _one_token_decoding(probe, context)
    kept_start_exact = np.array_equal(probe.set_context(context).logits[0], first)  # holding context + steps
    largest = len(DECOYS) - 1
    trees_exact = all(
        _branching_tree_exact(probe, context, tokens, logits, *decoys, max_nodes if k == largest else 0)
        for k, decoys in enumerate(DECOYS)
    )
    if kept_start_exact and trees_exact:
        return max_nodes
    for length in range(2, EXACTNESS_STEPS + 1):
        if not _chain_exact(probe, context, tokens, logits, length):
            return length - 1
    return EXACTNESS_STEPS


def _one_token_decoding(
    probe: Target, context: np.ndarray
) -> tuple[np.ndarray, list[int], list[np.ndarray]]:
    """The prefill's logits after `context`, then EXACTNESS_STEPS + 1 greedy tokens decoded one
    at a time, and their logits (logits[k]: after tokens[k])."""
    tokens, logits = [], []
    first = probe.set_context(context).logits[0]
    token = int(first.argmax())
    for _ in range(EXACTNESS_STEPS + 1):
        tokens.append(token)
        out = probe.verify(DraftTree.root_only(token))
        probe.commit([0])
        logits.append(out.logits[0])
        token = int(out.logits[0].argmax())
    return first, tokens, logits


def _fresh_prefill(probe: Target, context: np.ndarray) -> None:
    """`context` prefilled in an emptied context, as a generation's prompt is the first time."""
    probe.reset()
    probe.set_context(context)


def _branching_tree_exact(
    probe: Target, context: np.ndarray, tokens: list[int], logits: list[np.ndarray], decoys: int, length: int,
    fill_to: int,
) -> bool:
    """The steps verified as the path of a branching tree (`decoys` wrong branches of `length`
    nodes before each true token: parked cells; then one more wrong branch below the root up to
    `fill_to` nodes, where that is more), then one more token after the commit, equal to
    one-token decoding."""
    _fresh_prefill(probe, context)
    ids, parents, path = [tokens[0]], [-1], [0]
    for depth in range(1, EXACTNESS_STEPS):  # the wrong branches first, then the true token
        for k in range(1, decoys + 1):
            wrong = (tokens[depth] + k) % probe.vocab_size
            ids += [wrong] * length
            parents += [path[-1]] + list(range(len(ids) - length, len(ids) - 1))
        ids.append(tokens[depth])
        parents.append(path[-1])
        path.append(len(ids) - 1)
    fill = fill_to - len(ids)
    if fill > 0:
        ids += [(tokens[1] + decoys + 1) % probe.vocab_size] * fill
        parents += [0] + list(range(len(ids) - fill, len(ids) - 1))
    return _verified_as_decoded(probe, DraftTree(ids, parents), path, tokens, logits)


def _chain_exact(
    probe: Target, context: np.ndarray, tokens: list[int], logits: list[np.ndarray], length: int
) -> bool:
    """The first `length` steps verified as one chain, then one more token after the commit."""
    _fresh_prefill(probe, context)
    chain = DraftTree.chain(tokens[:length])
    return _verified_as_decoded(probe, chain, list(range(length)), tokens, logits)


def _verified_as_decoded(
    probe: Target, tree: DraftTree, path: list[int], tokens: list[int], logits: list[np.ndarray]
) -> bool:
    """Verify `tree`, commit `path` (one-token decoding's first tokens), verify the next token:
    every logit on the path and after it equal to one-token decoding's."""
    out = probe.verify(tree)
    exact = all(np.array_equal(out.logits[node], logits[k]) for k, node in enumerate(path))
    probe.commit(path)
    after = probe.verify(DraftTree.root_only(tokens[len(path)]))
    return exact and np.array_equal(after.logits[0], logits[len(path)])
