"""How fast speculation could make each benchmark category on this machine, at best.

    MOASPEC_NO_CALIBRATION=1 .venv/bin/python bench/lookup_ceiling.py --limit 10 \\
        --max-new-tokens 96 --out bench/results/lookup-ceiling.json

Plain greedy decoding runs through the engine on every prompt (first turns, with the set's
fixed history such as QA's document; on the runtime's default, llama.cpp for the built-in
target), timing its prefill, and the target's verify costs for 1-16 nodes and of a plain step
are measured as the machine calibration measures them. From the target's own greedy tokens
(lossless speculation emits exactly these) each category's time is then predicted, prefill as
measured plus one forward's cost per cycle:

- `plain`: one plain step per token (the model; the JSON holds it beside the measured decode
  time); a cycle of n nodes below costs a tree's verify and its penalty on the plain steps
  after it (costs.py's tree_s);
- `lookup`: every trie the calibration weighs (calibration/predict.py's `lookup_configs`, with
  and without the gate built from these costs), replayed exactly (profile.simulate_lookup); the
  best one per category in hindsight;
- `lookup oracle`: each cycle drafts, as one chain, the longest continuation that any earlier
  occurrence of the root token would have got right (as long as the target agrees, at most 15),
  or nothing, with the draft lengths chosen by dynamic programming to minimise the total cost:
  no prompt-lookup policy can beat it;
- `perfect drafter`: every draft right, chains chosen the same way: no drafter of any kind can
  beat it on this verify curve.

Speedups are against `plain`; against llama-cpp-python's own generation multiply by the bench's
`none` / `llama.cpp` ratio (about 1.0 in every category, README *Target runtimes*).
"""

from __future__ import annotations

import sys

from tqdm import tqdm

from moaspec.api import load_target
from moaspec.bench.output import write_json
from moaspec.bench.prompts import CATEGORIES, load_prompts
from moaspec.bench.script_args import category_list, int_at_least, output_file, positive_int, run_script, script_parser
from moaspec.calibration.costs import CycleCosts
from moaspec.calibration.costs_store import measure_verify_costs
from moaspec.calibration.machine import cpu_description, runtime_description
from moaspec.calibration.predict import lookup_configs
from moaspec.calibration.profile import LookupSequence, simulate_lookup
from moaspec.chat import encode_chat_messages
from moaspec.config import GenerationConfig
from moaspec.drafters import make_drafter
from moaspec.drafters.lookup_gate import LookupGate
from moaspec.engine import Engine
from moaspec.errors import MoaspecError

MAX_CHAIN = 15  # drafted tokens per cycle at most: 16 verified nodes, the largest tree measured


def longest_copies(sequence: LookupSequence) -> list[int]:
    """[i]: with generated token i as the root, the most following tokens that the continuation of
    some earlier occurrence of that root spells right, at most MAX_CHAIN (0 when none does). A
    continuation is read from the verified tokens only (prompt + generated[:i + 1], the root
    included), as the n-gram drafter reads it."""
    tokens = [*sequence.prompt_ids, *sequence.generated_ids]
    start = len(sequence.prompt_ids)
    found = []
    for i in range(len(sequence.generated_ids)):
        root = start + i
        future = tokens[root + 1 : root + 1 + MAX_CHAIN]
        best = 0
        for earlier in range(root):
            if tokens[earlier] != tokens[root]:
                continue
            length = 0
            while length < len(future) and earlier + 1 + length <= root and tokens[earlier + 1 + length] == future[length]:
                length += 1
            best = max(best, length)
        found.append(best)
    return found


def cheapest_decode_s(num_tokens: int, longest: list[int], costs: CycleCosts) -> float:
    """Least seconds to emit generated tokens 1..num_tokens-1 (token 0 comes from the prefill)
    when the cycle rooted at token i may draft any 0..longest[i] tokens as a chain, all accepted
    (a cycle of n nodes costs costs.tree_s(n): a chain's penalty on the plain steps after it included)."""
    best = [0.0] * num_tokens
    for i in range(num_tokens - 2, -1, -1):
        reach = min(longest[i], num_tokens - 2 - i)
        best[i] = min(costs.tree_s(1 + drafted) + best[i + 1 + drafted] for drafted in range(reach + 1))
    return best[0] if num_tokens > 1 else 0.0


def replayed_decode_s(sequences: list[LookupSequence], config, gate, costs: CycleCosts) -> tuple[float, float]:
    """(seconds, tau) of greedy decoding with lookup `config` (and `gate`) over the sequences."""
    seconds = 0.0

    def add(num_nodes: int, emitted: int) -> None:
        nonlocal seconds
        seconds += costs.tree_s(num_nodes)

    stats = simulate_lookup(sequences, config, gate, on_cycle=add)
    return seconds, (stats.tokens / stats.cycles if stats.cycles else 1.0)


def describe(config, gated: bool) -> str:
    shape = f"{config.min_ngram}+-grams {config.max_depth}x{config.max_branches}"
    return f"{shape} gated" if gated else shape


def main() -> int:
    parser = script_parser(__doc__)
    parser.add_argument("--target", default="smollm2-135m")
    parser.add_argument("--runtime", default=None, help="llama.cpp or transformers (default: the target's)")
    parser.add_argument("--categories", type=category_list, default=",".join(CATEGORIES))
    parser.add_argument("--limit", type=positive_int, default=10, help="prompts per category, drawn as the bench draws them")
    parser.add_argument("--max-new-tokens", type=int_at_least(2), default=96, help="at least 2: one leaves nothing to look up")
    parser.add_argument("--out", type=output_file, default=None, help="write the results here as JSON")
    args = parser.parse_args()

    target = load_target(args.target, runtime=args.runtime)
    verify_costs = measure_verify_costs(target, ("row",), lambda text: print(f"measuring {text}", file=sys.stderr))["row"]
    costs = CycleCosts(verify_costs.verify_s, {}, (0.0, 0.0), verify_costs.plain_step_s, verify_costs.tree_penalty_s)
    gate = LookupGate.from_cycle_costs(costs.tree_s, max(c.max_nodes for c in lookup_configs()))
    engine = Engine(target, make_drafter("none", target))
    generation = GenerationConfig(max_new_tokens=args.max_new_tokens)

    categories = {}
    prompts = load_prompts(args.categories, args.limit)
    for category, items in prompts.items():
        sequences, prefill_s, decode_s = [], 0.0, 0.0
        for prompt in tqdm(items, desc=category, unit="prompt", file=sys.stderr):
            messages = [*prompt.history, {"role": "user", "content": prompt.turns[0]}]
            prompt_ids = encode_chat_messages(target.tokenizer, messages)
            if len(prompt_ids) + args.max_new_tokens > target.max_positions:
                continue  # does not fit with its answer
            result = engine.generate(prompt_ids, generation=generation, stop_ids=target.stop_ids)
            sequences.append(LookupSequence(prompt_ids, result.token_ids))
            prefill_s += result.stats.prefill_s
            decode_s += result.stats.wall_s - result.stats.prefill_s
        if not sequences:
            raise MoaspecError(
                f"no {category} prompt fits the context ({target.max_positions}) with --max-new-tokens {args.max_new_tokens}"
            )
        plain_s = prefill_s + sum(max(0, len(s.generated_ids) - 1) for s in sequences) * costs.plain_step()
        lookups = []
        for config in lookup_configs():
            for gated in (False, True):
                seconds, tau = replayed_decode_s(sequences, config, gate if gated else None, costs)
                lookups.append((prefill_s + seconds, tau, describe(config, gated)))
        best_s, best_tau, best_name = min(lookups)
        oracle_s = prefill_s + sum(
            cheapest_decode_s(len(s.generated_ids), longest_copies(s), costs) for s in sequences
        )
        perfect_s = prefill_s + sum(
            cheapest_decode_s(len(s.generated_ids), [MAX_CHAIN] * len(s.generated_ids), costs)
            for s in sequences
        )
        categories[category] = {
            "prompts": len(sequences),
            "new_tokens": sum(len(s.generated_ids) for s in sequences),
            "prefill_s": round(prefill_s, 4),
            "measured_decode_s": round(decode_s, 4),
            "modelled_decode_s": round(plain_s - prefill_s, 4),
            "prefill_share": round(prefill_s / plain_s, 4),
            "best_lookup": {"config": best_name, "speedup": round(plain_s / best_s, 4), "tau": round(best_tau, 4)},
            "lookup_oracle_speedup": round(plain_s / oracle_s, 4),
            "perfect_drafter_speedup": round(plain_s / perfect_s, 4),
        }
    record = {
        "command": " ".join(["bench/lookup_ceiling.py", *sys.argv[1:]]),
        "cpu": cpu_description(),
        "runtime": runtime_description(target),
        "verify_s": {str(n): round(s, 6) for n, s in sorted(verify_costs.verify_s.items())},
        "plain_step_s": round(verify_costs.plain_step_s, 6),
        "tree_penalty_s": round(verify_costs.tree_penalty_s, 6),
        "categories": categories,
    }
    print(f"{record['cpu']}, {record['runtime']}")
    print("| category | prefill share | best lookup (hindsight) | its speedup | lookup oracle | perfect drafter |")
    print("|---|---:|---|---:|---:|---:|")
    for category, row in categories.items():
        print(
            f"| {category} | {row['prefill_share']:.0%} | {row['best_lookup']['config']} | "
            f"{row['best_lookup']['speedup']:.2f}× | {row['lookup_oracle_speedup']:.2f}× | {row['perfect_drafter_speedup']:.2f}× |"
        )
    if args.out is not None:
        write_json(args.out, record, indent=1)
    return 0


if __name__ == "__main__":
    run_script(main)
