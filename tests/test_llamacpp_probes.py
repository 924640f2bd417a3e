"""bench/llamacpp_probes.py. Item 5: cells prefilled in an f32 / f16 context, moved into the
runtime's q8_0 / f16 cache through llama.cpp's sequence state, continue like a direct prefill.
Guards the layout the move depends on (a quantized key cache holds Hadamard-rotated keys): with
the keys copied unrotated the next token's logits are off by ~40. Item 6: both ways of reclaiming
parked cells run, and the weights' sliding-window mark it sets is restored."""

from __future__ import annotations

from conftest import load_bench_script


def test_moved_cells_continue_like_a_direct_prefill() -> None:
    from moaspec.api import load_target
    from moaspec.targets import llamacpp
    from moaspec.targets.llamacpp_value_cache import VALUE_CACHE_TYPES

    probes = load_bench_script("llamacpp_probes")
    target = load_target("smollm2-135m", runtime="llama.cpp", threads=2)
    tokens = (probes.CONTEXT * 10)[:120]
    wide_ms, move_ms, direct_ms, difference = probes.moved_prefill(
        target.weights, (llamacpp.KEY_CACHE_TYPE, VALUE_CACHE_TYPES["f16"]), tokens  # the prompt context's values
    )
    assert min(wide_ms, move_ms, direct_ms) > 0
    assert difference < 2.0  # other numerics (f32 keys while prefilling), the same model


def test_item_6_times_both_ways_of_reclaiming_parked_cells_and_restores_the_weights() -> None:
    from moaspec.api import load_target

    probes = load_bench_script("llamacpp_probes")
    target = load_target("smollm2-135m", runtime="llama.cpp", threads=2)
    ids = probes.CONTEXT * 5
    compactions = target.compactions
    assert probes.reclaim_ms(target, ids, 60, 0) > 0 and probes.reclaim_ms(target, ids, 60, 512) > 0
    assert target.compactions == compactions + 2 and target.weights.sliding_window == 0
