"""Linear weight layout: PyTorch's row-major, or column-major where that multiplies few rows faster.

`nn.Linear` stores W as [out, in] row-major and computes x @ W.T. Storing the same matrix
column-major (W.T contiguous, seen through a transposed view, so shapes and the module API are
unchanged) hands MKL a plain product instead. Which is faster for the few-row inputs speculative
decoding lives on depends on the CPU and MKL build:
- on the 2-core machine of the first sessions the row-major products were 3-10x slower (576 ->
  576: 4 rows 334 us vs 39 us; LM head 576 -> 49,152, 8 rows 45 ms vs 13 ms);
- on the AMX Xeon of 2026-11-22 row-major is as fast or faster: a whole SmolLM2 forward over a
  300-token cache took 37 / 40 / 55 ms for 2 / 3 / 5 new tokens row-major and 48 / 50 / 57 ms
  column-major (1 new token: 33 ms both).
Timing a few products on a sample of weights at load did not predict the whole forward (the
samples sit in cache, the model streams from memory), so the layout is a setting:
MOASPEC_WEIGHT_LAYOUT=row (default) or column. Values are identical; only the summation order
(~1e-7) changes.
"""

from __future__ import annotations

import os

import torch
from torch import nn

from moaspec.errors import MoaspecError

LAYOUT_ENV = "MOASPEC_WEIGHT_LAYOUT"
LAYOUTS = ("row", "column")


def column_major(weight: torch.Tensor) -> torch.Tensor:
    """The same [out, in] matrix, stored column-major (contiguous [in, out] underneath)."""
    return weight.detach().t().contiguous().t()


def weight_layout() -> str:
    """The layout MOASPEC_WEIGHT_LAYOUT asks for ("row" when unset)."""
    layout = os.environ.get(LAYOUT_ENV, "row").strip().lower() or "row"
    if layout not in LAYOUTS:
        raise MoaspecError(f"{LAYOUT_ENV} must be one of {', '.join(LAYOUTS)}, not {layout!r}")
    return layout


@torch.no_grad()
def use_column_major(module: nn.Module) -> nn.Module:
    """Re-lay out every Linear weight of `module` column-major, in place (tied weights once).

    Every other parameter and buffer is copied as well: transformers loads safetensors through a
    memory map, and one tensor left on it keeps the whole map, with every page the re-layout
    touched, resident (measured on SmolLM2: 1,424 MB RSS instead of 911 MB).
    """
    relaid: set[int] = set()
    for sub in module.modules():
        if isinstance(sub, nn.Linear) and id(sub.weight) not in relaid:
            relaid.add(id(sub.weight))
            if sub.weight.stride(0) != 1:
                sub.weight.data = column_major(sub.weight)
    for tensor in [*module.parameters(), *module.buffers()]:
        if id(tensor) not in relaid:
            tensor.data = tensor.data.clone()
    return module


def use_configured_layout(module: nn.Module) -> nn.Module:
    """`module` in the layout of MOASPEC_WEIGHT_LAYOUT (untouched for "row")."""
    return use_column_major(module) if weight_layout() == "column" else module


def weight_in_configured_layout(weight: torch.Tensor) -> torch.Tensor:
    """A detached [out, in] weight in the layout of MOASPEC_WEIGHT_LAYOUT."""
    return column_major(weight) if weight_layout() == "column" else weight.detach()
