"""Linear weight layout: PyTorch's row-major, or column-major where that multiplies few rows faster.

`nn.Linear` stores W as [out, in] row-major and computes x @ W.T. Storing the same matrix
column-major (W.T contiguous, seen through a transposed view, so shapes and the module API are
unchanged) hands MKL a plain product instead. Which is faster for the few-row inputs speculative
decoding lives on depends on the CPU and MKL build:
- on the 2-core machine of the first sessions the row-major products were 3-10x slower (576 ->
  576: 4 rows 334 us vs 39 us; LM head 576 -> 49,152, 8 rows 45 ms vs 13 ms);
- on the AMX Xeon of 2026-11-22 row-major is as fast or faster: a whole SmolLM2 forward over a
  300-token cache took 37 / 40 / 55 ms for 2 / 3 / 5 new tokens row-major and 48 / 50 / 57 ms
  column-major (1 new token: 33 ms both);
- on the AVX-512 EPYC of 2026-11-24 plain decoding ran 14.9 tok/s row-major, 18.2 column-major.
Timing a few products on a sample of weights did not predict the whole forward (the samples sit
in cache, the model streams from memory), so the machine calibration (moaspec/calibration)
times whole target forwards in both layouts and picks one; MOASPEC_WEIGHT_LAYOUT=row|column
fixes it instead. Values are identical; only the summation order (~1e-7) changes.
"""

from __future__ import annotations

import torch
from torch import nn

from moaspec.nn.layout_names import check_layout


def column_major(weight: torch.Tensor) -> torch.Tensor:
    """The same [out, in] matrix, stored column-major (contiguous [in, out] underneath)."""
    return weight.detach().t().contiguous().t()


def weight_in_layout(weight: torch.Tensor, layout: str) -> torch.Tensor:
    """A detached [out, in] weight stored in `layout` ("row" or "column"); a copy only when needed."""
    check_layout(layout)
    weight = weight.detach()
    if layout == "column":
        return weight if weight.stride(0) == 1 and weight.dim() == 2 else column_major(weight)
    return weight if weight.is_contiguous() else weight.contiguous()


@torch.no_grad()
def use_layout(module: nn.Module, layout: str) -> nn.Module:
    """Re-lay out every Linear weight of `module` in `layout`, in place (tied weights once).

    When a weight moved, every other parameter and buffer is copied as well (once): transformers
    loads safetensors through a memory map, and one tensor left on it keeps the whole map, with
    every page the re-layout touched, resident (measured on SmolLM2: 1,424 MB RSS instead of 911 MB).
    """
    check_layout(layout)
    relaid: set[int] = set()
    changed = False
    for sub in module.modules():
        if isinstance(sub, nn.Linear) and id(sub.weight) not in relaid:
            relaid.add(id(sub.weight))
            new = weight_in_layout(sub.weight, layout)
            changed |= new.data_ptr() != sub.weight.data_ptr()
            sub.weight.data = new
    if changed and not getattr(module, "_moaspec_unmapped", False):
        for tensor in [*module.parameters(), *module.buffers()]:
            if id(tensor) not in relaid:
                tensor.data = tensor.data.clone()
        module._moaspec_unmapped = True
    return module


def layout_of(module: nn.Module) -> str:
    """"column" when the module's first Linear weight is stored column-major, else "row"."""
    for sub in module.modules():
        if isinstance(sub, nn.Linear) and sub.weight.dim() == 2 and sub.weight.shape[0] > 1:
            return "column" if sub.weight.stride(0) == 1 else "row"
    return "row"
