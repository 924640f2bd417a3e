"""The measurements behind the README's *Target runtimes* section, in one run on an idle machine:

1. exactness of tree verification with llama.cpp's default f16 KV cache against the runtime's
   (q8_0 keys, this machine's value cache: llamacpp_value_cache.py): greedy decoding through random
   trees that hold the true continuation, against one-token decoding, over bench prompts (prompts
   whose outputs diverge);
2. one-token decode cost and prefill cost by key/value cache types (raw llama_decode loops,
   types interleaved);
3. the cost of capturing keys/values through the eval callback (0, 4 or 30 layers);
4. captured keys/values against the float32 transformers runtime's (relative error per layer);
5. prefilling 1,000 tokens in an f32 / f16 context and moving the cells into one with the
   runtime's cache types (llama.cpp's sequence state: keys Hadamard-rotated per head, as
   llama.cpp stores a quantized key cache, then quantized to q8_0), against prefilling there;
6. reclaiming parked cells (`LlamaCppTarget._reclaim_parked`) after 300, 900 and 1,800 verified
   tokens: through llama.cpp's sequence state (the runtime's way) against re-decoding the
   verified tokens (sliding-window models' way, and every model's before session 31).

    .venv/bin/python bench/llamacpp_probes.py --out bench/results/llamacpp-probes-2026-11-24.json
        [--items 1,2,3,4,5,6] [--rounds 4]

Item 2 also times pairs with an f32 side and f32 / f32, to show what the exact cache costs on
this CPU. With flash attention llama.cpp casts an f32 key or value cache to f16 before attending
(llama-graph.cpp, `build_attn_mha`), so those pairs run the f16 / f16 kernels: tiled for long
batches, not batch-invariant, hence not exact with trees (the runtime's prompt context uses f32 /
f16 for prompts only, in fixed chunks: targets/llamacpp.py).
"""

from __future__ import annotations

import json
import random
import statistics
import sys
import time

import torch

from moaspec.bench.output import write_json
from moaspec.bench.script_args import known_names, output_file, positive_int, run_script, script_parser
from moaspec.targets.llamacpp import MAX_BATCH
from moaspec.targets.llamacpp_value_cache import VALUE_CACHE_TYPES

PROBE_ITEMS = ("1", "2", "3", "4", "5", "6")  # --items: the probes of the docstring
PROBE_CELLS = 4096  # each probe context's cells: its longest decode
# ggml types: 0 f32, 1 f16, 8 q8_0. Only a quantized key cache keeps the per-query kernel (exact
# with trees); an f32 side is cast to f16, so every other pair takes the tiled and split-KV kernels.
KV_TYPES = {"q8_0/q8_0": (8, 8), "f16/f16": (1, 1), "f32/f16": (0, 1), "f16/f32": (1, 0), "f32/f32": (0, 0)}
CONTEXT = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3717, 411, 5356, 12401, 102, 2, 198, 1, 4093, 198]


def tree_exactness(target_factory, prompts: list[list[int]], new_tokens: int) -> int:
    """Prompts whose greedy output through random trees differs from one-token decoding."""
    from moaspec.tree import DraftTree
    from moaspec.verify import verify_greedy

    target, generator, diverged = target_factory(), random.Random(0), 0
    for prompt in prompts:
        token = int(target.set_context(torch.tensor(prompt)).logits[0].argmax())
        plain = [token]
        while len(plain) < new_tokens + 5:
            out = target.verify(DraftTree(torch.tensor([plain[-1]]), torch.tensor([-1])))
            target.commit([0])
            plain.append(int(out.logits[0].argmax()))
        target.reset()
        generated = [int(target.set_context(torch.tensor(prompt)).logits[0].argmax())]
        while len(generated) < new_tokens:
            position = len(generated) - 1
            ids, parents, node = [generated[-1]], [-1], 0
            for true_id in plain[position + 1 : position + 5]:
                siblings = [(true_id, True), (generator.randrange(1000, 40000), False)]
                generator.shuffle(siblings)
                for token_id, correct in siblings:
                    ids.append(token_id)
                    parents.append(node)
                    if correct:
                        next_node = len(ids) - 1
                if generator.random() < 0.3:
                    break
                node = next_node
            tree = DraftTree(torch.tensor(ids), torch.tensor(parents))
            accepted = verify_greedy(tree, target.verify(tree).logits)
            target.commit(accepted.path_node_idx)
            generated.extend(accepted.emitted_ids)
        diverged += generated[:new_tokens] != plain[:new_tokens]
        target.reset()
    return diverged


def prefill(lib, ctx, tokens: list[int]) -> None:
    """Decode `tokens` in chunks of the runtime's batch size, as the runtime prefills."""
    for start in range(0, len(tokens), MAX_BATCH):
        chunk = (lib.llama_token * len(tokens[start : start + MAX_BATCH]))(*tokens[start : start + MAX_BATCH])
        if lib.llama_decode(ctx, lib.llama_batch_get_one(chunk, len(chunk))) != 0:
            raise RuntimeError("llama_decode failed")


def _context(weights, type_k: int, type_v: int, sequences: int = 1, callback=None):
    """A flash-attention llama_context of 4,096 cells with these key/value cache types."""
    lib = weights.lib
    params = lib.llama_context_default_params()
    params.n_ctx, params.n_batch, params.n_ubatch, params.n_seq_max = PROBE_CELLS, MAX_BATCH, MAX_BATCH, sequences
    params.n_threads = params.n_threads_batch = torch.get_num_threads()
    params.flash_attn_type, params.type_k, params.type_v, params.no_perf, params.kv_unified = 1, type_k, type_v, True, True
    if callback is not None:
        params.cb_eval = callback
    return lib.llama_init_from_model(weights.model, params)


def raw_decode_ms(weights, type_k: int, type_v: int, context_len: int, steps: int, callback=None) -> tuple[float, float]:
    """(ms of the prefill of context_len tokens, mean ms of one-token llama_decode after it)."""
    import numpy as np

    lib = weights.lib
    ctx = _context(weights, type_k, type_v, callback=callback)
    try:
        started = time.perf_counter()
        prefill(lib, ctx, (CONTEXT * 100)[:context_len])
        prefill_ms = (time.perf_counter() - started) * 1000
        token, started = 5, time.perf_counter()
        for _ in range(steps):
            lib.llama_decode(ctx, lib.llama_batch_get_one((lib.llama_token * 1)(token), 1))
            token = int(np.ctypeslib.as_array(lib.llama_get_logits_ith(ctx, -1), shape=(weights.vocab_size,)).argmax())
        return prefill_ms, (time.perf_counter() - started) / steps * 1000
    finally:
        lib.llama_free(ctx)


def moved_prefill(weights, runtime_kv: tuple[int, int], tokens: list[int]) -> tuple[float, float, float, float]:
    """(ms prefilling in f32 / f16, ms moving the cells (the runtime's own conversion,
    moaspec/targets/llamacpp_cells.py), ms prefilling with runtime_kv, max |logit difference| of
    the next token between the two paths)."""
    import ctypes

    import numpy as np

    from moaspec.targets.llamacpp_cells import SequenceState

    if runtime_kv[0] != 8:
        raise RuntimeError("item 5 moves keys into a q8_0 key cache")
    lib = weights.lib
    wide, moved, direct = _context(weights, 0, 1), _context(weights, *runtime_kv, 64), _context(weights, *runtime_kv, 64)
    head_dim = weights.hidden_size // lib.llama_model_n_head(weights.model)
    try:
        started = time.perf_counter()
        prefill(lib, wide, tokens)
        wide_ms = (time.perf_counter() - started) * 1000
        started = time.perf_counter()
        size = lib.llama_state_seq_get_size(wide, 0)
        state = (ctypes.c_uint8 * size)()
        lib.llama_state_seq_get_data(wide, state, size, 0)
        blob = SequenceState.parse(memoryview(state)).to_q8_0(head_dim).to_buffer()
        if lib.llama_state_seq_set_data(moved, (ctypes.c_uint8 * len(blob)).from_buffer(blob), len(blob), 0) != len(blob):
            raise RuntimeError("llama.cpp refused the moved cells")
        move_ms = (time.perf_counter() - started) * 1000
        started = time.perf_counter()
        prefill(lib, direct, tokens)
        direct_ms = (time.perf_counter() - started) * 1000
        logits = []
        for ctx in (moved, direct):
            lib.llama_decode(ctx, lib.llama_batch_get_one((lib.llama_token * 1)(5), 1))
            logits.append(np.ctypeslib.as_array(lib.llama_get_logits_ith(ctx, -1), shape=(weights.vocab_size,)).copy())
        return wide_ms, move_ms, direct_ms, float(np.abs(logits[0] - logits[1]).max())
    finally:
        for ctx in (wide, moved, direct):
            lib.llama_free(ctx)


def reclaim_ms(target, ids: list[int], verified: int, sliding_window: int) -> float:
    """ms of one `_reclaim_parked` with `verified` tokens and 4 parked cells; `sliding_window`
    set on the weights picks the re-decoding path."""
    from moaspec.tree import DraftTree

    target.weights.sliding_window = sliding_window
    try:
        target.reset()
        target.prefill(torch.tensor(ids[: verified - 8]))
        for k in range(4):  # a wrong sibling before the true one: one cell parked per step
            start = verified - 8 + 2 * k
            target.verify(DraftTree(torch.tensor([ids[start], 7, ids[start + 1]]), torch.tensor([-1, 0, 0])))
            target.commit([0, 2])
        tick = time.perf_counter()
        target._reclaim_parked()
        return 1e3 * (time.perf_counter() - tick)
    finally:
        target.weights.sliding_window = 0


def main() -> int:
    parser = script_parser(__doc__)
    parser.add_argument("--prompts", type=positive_int, default=3, help="bench prompts per category for item 1 (default 3)")
    parser.add_argument("--new-tokens", type=positive_int, default=128)
    parser.add_argument("--rounds", type=positive_int, default=4, help="interleaved rounds for items 2-3 (default 4)")
    parser.add_argument("--items", type=lambda text: known_names(text, PROBE_ITEMS, "item"), default=",".join(PROBE_ITEMS),
                        help="comma-separated items to run (default all)")
    parser.add_argument("--out", type=output_file, default=None)
    args = parser.parse_args()
    wanted = set(args.items)

    from moaspec.api import load_target
    from moaspec.bench.prompts import CATEGORIES, load_prompts
    from moaspec.calibration.machine import cpu_description
    from moaspec.chat import encode_chat_prompt
    from moaspec.targets import llamacpp
    from moaspec.targets.llamacpp_features import CapturedKV

    target = load_target("smollm2-135m", runtime="llama.cpp")
    weights = target.weights
    def runtime_target(type_k: int, type_v: int):
        def make():
            made = llamacpp.LlamaCppTarget(weights, target.tokenizer, target.config, target.name, value_cache=type_v)
            made.key_cache_type = type_k  # before its contexts are made (on first need)
            weights.exact_nodes = llamacpp.MAX_TREE_NODES  # measure, do not refuse
            return made
        return make

    runtime_kv = (target.key_cache_type, target.value_cache_type)  # this machine's choice (llamacpp_value_cache.py)
    runtime_values = target.value_cache_name
    result = {"command": " ".join(sys.argv), "cpu": cpu_description(), "threads": torch.get_num_threads()}
    if "1" in wanted:
        prompts = [
            encode_chat_prompt(target.tokenizer, item.turns[0])
            for items in load_prompts(CATEGORIES, args.prompts).values()
            for item in items
        ]
        exactness = {name: tree_exactness(runtime_target(*kinds), prompts, args.new_tokens) for name, kinds in
                     (("f16 KV", (1, 1)), (f"q8_0 keys, {runtime_values} values (the runtime's)", runtime_kv))}
        print(f"1. prompts diverging out of {len(prompts)}: {exactness}", file=sys.stderr)
        result |= {"tree_exactness_prompts_diverged": exactness, "num_prompts": len(prompts), "new_tokens": args.new_tokens}

    if wanted & {"2", "3"}:
        kv_types = KV_TYPES | {f"q8_0/{runtime_values} (the runtime's)": runtime_kv} if "2" in wanted else {}
        captures = {f"{n} layers": CapturedKV(weights.lib, range(30 - n, 30), 3, 64) for n in (4, 30)} if "3" in wanted else {}
        decode = {f"{name} after {n}": [] for name in kv_types for n in (300, 1000)}
        decode |= {f"capture {c}": [] for c in captures}
        prefill_1000 = {name: [] for name in kv_types}
        for _ in range(args.rounds):
            for name, (k, v) in kv_types.items():
                decode[f"{name} after 300"].append(raw_decode_ms(weights, k, v, 300, 48)[1])
                prefill_ms, decode_after = raw_decode_ms(weights, k, v, 1000, 48)
                prefill_1000[name].append(prefill_ms)
                decode[f"{name} after 1000"].append(decode_after)
            for name, capture in captures.items():
                decode[f"capture {name}"].append(raw_decode_ms(weights, *runtime_kv, 300, 48, capture.callback)[1])
        decode_ms = {name: round(statistics.median(v), 2) for name, v in decode.items()}
        prefill_ms = {name: round(statistics.median(v), 1) for name, v in prefill_1000.items()}
        print(f"2-3. one-token decode ms (key/value cache types; captures after 300 tokens): {decode_ms}", file=sys.stderr)
        result["one_token_decode_ms"] = decode_ms
        if prefill_ms:
            print(f"2. prefill ms of 1000 tokens (key/value cache types): {prefill_ms}", file=sys.stderr)
            result["prefill_1000_ms"] = prefill_ms

    if "4" in wanted:
        exact = load_target("smollm2-135m", runtime="transformers")
        target.keep_layer_kv(range(30))
        ids = torch.tensor(target.tokenizer("The quick brown fox jumps over the lazy dog. " * 3)["input_ids"])
        target.set_context(ids)
        exact.set_context(ids)
        got, want = target.layer_kv(0, len(ids)), exact.layer_kv(0, len(ids))
        relative = [round(float((got[:, i] - want[:, i]).norm() / want[:, i].norm()), 4) for i in range(30)]
        print(f"4. relative error of captured keys/values, layers 0-29: {relative}", file=sys.stderr)
        result["layer_kv_relative_error"] = relative

    if "5" in wanted:
        prompt_path_kv = (target.key_cache_type, VALUE_CACHE_TYPES["f16"])  # item 5 moves keys only: f16 values
        rounds = [moved_prefill(weights, prompt_path_kv, (CONTEXT * 100)[:1000]) for _ in range(args.rounds)]
        moved = {key: round(statistics.median(r[i] for r in rounds), 1)
                 for i, key in enumerate(("f32_f16_prefill_ms", "move_ms", "runtime_prefill_ms"))}
        moved["next_token_max_logit_difference"] = round(max(r[3] for r in rounds), 3)
        print(f"5. prefill of 1000 tokens in f32 / f16, moved into the runtime's cache types: {moved}", file=sys.stderr)
        result["moved_prefill_1000"] = moved

    if "6" in wanted:
        ids = CONTEXT * 100  # 2,000 tokens
        paths = {"sequence state": 0, "re-decode": 512}
        times = {(n, path): [] for n in (308, 908, 1808) for path in paths}
        for _ in range(args.rounds):
            for (n, path) in times:
                times[n, path].append(reclaim_ms(target, ids, n, paths[path]))
        reclaim = {f"{path} after {n}": round(statistics.median(v), 1) for (n, path), v in times.items()}
        print(f"6. ms to reclaim 4 parked cells (verified tokens): {reclaim}", file=sys.stderr)
        result["reclaim_parked_ms"] = reclaim

    print(json.dumps(result, indent=1))
    if args.out is not None:
        write_json(args.out, result)
    return 0


if __name__ == "__main__":
    run_script(main)
