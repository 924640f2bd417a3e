"""bench/llamacpp_probes.py item 5: cells prefilled in an f32 / f16 context, moved into the
runtime's q8_0 / f16 cache through llama.cpp's sequence state, continue like a direct prefill.
Guards the layout the move depends on (a quantized key cache holds Hadamard-rotated keys): with
the keys copied unrotated the next token's logits are off by ~40."""

from __future__ import annotations

from conftest import load_bench_script


def test_moved_cells_continue_like_a_direct_prefill() -> None:
    from moaspec.api import load_target
    from moaspec.targets import llamacpp

    probes = load_bench_script("llamacpp_probes")
    target = load_target("smollm2-135m", runtime="llama.cpp", threads=2)
    tokens = (probes.CONTEXT * 10)[:120]
    wide_ms, move_ms, direct_ms, difference = probes.moved_prefill(
        target.weights, (llamacpp.KEY_CACHE_TYPE, llamacpp.VALUE_CACHE_TYPE), tokens
    )
    assert min(wide_ms, move_ms, direct_ms) > 0
    assert difference < 2.0  # other numerics (f32 keys while prefilling), the same model
