"""Column-major Linear weights: the cheapest big speed-up on this CPU.

`nn.Linear` stores W as [out, in] row-major and computes x @ W.T. On the 2-core MKL build here
that transposed product is pathologically slow for the few-row inputs speculative decoding lives
on (measured, 576 -> 576: 4 rows 334 us vs 39 us; 8 rows 342 vs 49; LM head 576 -> 49,152 with
8 rows 45 ms vs 13 ms). Storing the same matrix column-major (W.T contiguous, seen through a
transposed view, so shapes and the module API are unchanged) gives MKL a plain product.
Values are identical; only the memory layout (and hence summation order, ~1e-7) changes.
"""

from __future__ import annotations

import torch
from torch import nn


def column_major(weight: torch.Tensor) -> torch.Tensor:
    """The same [out, in] matrix, stored column-major (contiguous [in, out] underneath)."""
    return weight.detach().t().contiguous().t()


@torch.no_grad()
def use_column_major_weights(module: nn.Module) -> nn.Module:
    """Re-lay out every Linear weight of `module` in place (tied weights once); returns it.

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
