"""Linear weight layout: row-major (PyTorch's) or column-major, whichever multiplies few rows faster.

`nn.Linear` stores W as [out, in] row-major and computes x @ W.T. Storing the same matrix
column-major (W.T contiguous, seen through a transposed view, so shapes and the module API are
unchanged) hands MKL a plain product instead. Which is faster for the few-row inputs speculative
decoding lives on depends on the CPU and MKL build:
- on the 2-core machine of the first sessions the default layout was 3-10x slower (576 -> 576:
  4 rows 334 us vs 39 us; LM head 576 -> 49,152, 8 rows 45 ms vs 13 ms);
- on the AMX Xeon of 2026-11-22 the default layout is as fast or faster for the big matrices: a
  whole SmolLM2 forward over a 300-token cache took 37 / 40 / 55 ms for 2 / 3 / 5 new tokens
  row-major and 48 / 50 / 57 ms column-major (1 new token: 33 ms both).
So the layout is chosen per weight shape by timing a few-row product on a sample of the
module's own weights (`measure_column_major_shapes`). Values are identical; only the summation
order (~1e-7) changes.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F
from torch import nn

PROBE_ROWS = 4  # rows of the timed product: a typical verified tree / drafted level
PROBE_SAMPLE = 8  # weights timed per shape
PROBE_REPEATS = 3  # best of
COLUMN_MAJOR_MARGIN = 0.9  # column-major must be at least 10 % faster: row-major needs no copy


def column_major(weight: torch.Tensor) -> torch.Tensor:
    """The same [out, in] matrix, stored column-major (contiguous [in, out] underneath)."""
    return weight.detach().t().contiguous().t()


def linear_weights_by_shape(module: nn.Module) -> dict[tuple[int, int], list[torch.Tensor]]:
    """Every distinct Linear weight of `module` (tied weights once), grouped by [out, in] shape."""
    groups: dict[tuple[int, int], list[torch.Tensor]] = {}
    seen: set[int] = set()
    for sub in module.modules():
        if isinstance(sub, nn.Linear) and id(sub.weight) not in seen:
            seen.add(id(sub.weight))
            groups.setdefault(tuple(sub.weight.shape), []).append(sub.weight)
    return groups


def _seconds_per_product(weights: list[torch.Tensor], rows: int) -> float:
    """Best-of-PROBE_REPEATS time of one `rows`-row product with each weight, per weight."""
    x = torch.randn(rows, weights[0].shape[1], dtype=weights[0].dtype)
    best = float("inf")
    for _ in range(PROBE_REPEATS):
        start = time.perf_counter()
        for weight in weights:
            F.linear(x, weight)
        best = min(best, time.perf_counter() - start)
    return best / len(weights)


@torch.no_grad()
def column_major_is_faster(sample: list[torch.Tensor], rows: int = PROBE_ROWS) -> bool:
    """Whether `rows`-row products with these [out, in] weights are clearly faster column-major."""
    sample = [w.detach() for w in sample]
    row_s = _seconds_per_product(sample, rows)
    column_s = _seconds_per_product([column_major(w) for w in sample], rows)
    return column_s < COLUMN_MAJOR_MARGIN * row_s


def measure_column_major_shapes(module: nn.Module, rows: int = PROBE_ROWS) -> set[tuple[int, int]]:
    """The weight shapes of `module` whose few-row products are clearly faster column-major here."""
    return {
        shape
        for shape, weights in linear_weights_by_shape(module).items()
        if column_major_is_faster(weights[:PROBE_SAMPLE], rows)
    }


def in_fastest_layout(weight: torch.Tensor) -> torch.Tensor:
    """`weight` [out, in] itself, or its column-major copy when that multiplies few rows faster."""
    return column_major(weight) if column_major_is_faster([weight]) else weight.detach()


@torch.no_grad()
def use_column_major(module: nn.Module, shapes: set[tuple[int, int]]) -> nn.Module:
    """Re-lay out the Linear weights of the given shapes column-major, in place; returns `module`.

    When anything was re-laid, every other parameter and buffer is copied as well: transformers
    loads safetensors through a memory map, and one tensor left on it keeps the whole map, with
    every page the re-layout touched, resident (measured on SmolLM2: 1,424 MB RSS instead of 911 MB).
    """
    relaid: set[int] = set()
    for shape, weights in linear_weights_by_shape(module).items():
        if shape in shapes:
            for weight in weights:
                relaid.add(id(weight))
                if weight.stride(0) != 1:
                    weight.data = column_major(weight)
    if relaid:
        for tensor in [*module.parameters(), *module.buffers()]:
            if id(tensor) not in relaid:
                tensor.data = tensor.data.clone()
    return module


def use_fastest_weight_layout(module: nn.Module) -> nn.Module:
    """Measure (`measure_column_major_shapes`), then re-lay out what is faster column-major."""
    return use_column_major(module, measure_column_major_shapes(module))
