"""Which target layers a MoA drafter reads, from its config's numbers alone (no torch): the memory
reads the last `memory_layers` layers (0: all, the paper's form), TLI runs the last `tli_layers`;
both sit at the top of the target, so the context encoder reads one contiguous range of layers."""

from __future__ import annotations


def memory_layer_ids(num_target_layers: int, memory_layers: int) -> tuple[int, ...]:
    """The target layers whose keys/values feed the memory, in order."""
    first = num_target_layers - memory_layers if memory_layers else 0
    return tuple(range(first, num_target_layers))


def context_layers(num_target_layers: int, memory_layers: int, tli_layers: int) -> range:
    """The target layers whose keys/values the context encoder reads: the memory's and the TLI's."""
    first = min(memory_layer_ids(num_target_layers, memory_layers)[0], num_target_layers - tli_layers)
    return range(first, num_target_layers)
