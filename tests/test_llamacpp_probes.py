"""bench/llamacpp_probes.py. Item 5: cells prefilled in an f32 / f16 context, moved into the
runtime's q8_0 / f16 cache through llama.cpp's sequence state, continue like a direct prefill.
Guards the layout the move depends on (a quantized key cache holds Hadamard-rotated keys): with
the keys copied unrotated the next token's logits are off by ~40. Item 6: both ways of reclaiming
parked cells run, and the weights' sliding-window mark it sets is restored."""

from __future__ import annotations

from conftest import load_bench_script


def test_moved_cells_continue_like_a_direct_prefill() -> None:
    from moaspec.api import load_target
    from moaspec.targets.llamacpp_value_cache import VALUE_CACHE_TYPES

    probes = load_bench_script("llamacpp_probes")
    target = load_target("smollm2-135m", runtime="llama.cpp", threads=2)
    tokens = (probes.CONTEXT * 10)[:120]
    wide_ms, move_ms, direct_ms, difference = probes.moved_prefill(
        target.weights, (target.key_cache_type, VALUE_CACHE_TYPES["f16"]), tokens  # the prompt context's values
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


def test_a_probe_target_holds_the_key_cache_it_was_given() -> None:
    """Bug (session 50): the probe swapped a module constant around the target's constructor to
    compare f16 with q8_0 key caches, but the context is made on first need, after the swap was
    undone, so every probe target held q8_0 keys. The key cache type is the target's own now,
    set before its context is made."""
    import numpy as np

    from moaspec.api import load_target
    from moaspec.targets.llamacpp_cells import SequenceState
    from moaspec.targets.llamacpp_contexts import KEY_CACHE_TYPE

    target = load_target("smollm2-135m", runtime="llama.cpp", threads=2)
    probe = target.new_session()
    probe.key_cache_type = 1  # f16
    sibling = probe.new_session()  # carried by its sessions (a mutation audit's: untested)
    assert sibling.key_cache_type == 1
    for made, key_type in ((target, KEY_CACHE_TYPE), (probe, 1), (sibling, 1)):
        made.prefill(np.arange(100, 120))
        state = SequenceState.parse(memoryview(made._sequence_state(made.ctx)))
        assert {kind for kind, _ in state.keys} == {key_type}
