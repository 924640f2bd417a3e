"""The header of a safetensors file written tensor by tensor (gguf_conversion.py,
targets/float_weights.py): what goes before the tensors' bytes, so neither writer holds them all."""

from __future__ import annotations

import json
import struct


def safetensors_header(tensors: list[tuple[str, str, list[int], int]], metadata: dict[str, str]) -> bytes:
    """The 8-byte length and the JSON header of a safetensors file whose tensors (name, dtype as
    safetensors names it, shape, bytes) follow it back to back in this order; the JSON padded with
    spaces to a multiple of 8 bytes, as safetensors pads it."""
    header: dict[str, object] = {"__metadata__": metadata}
    offset = 0
    for name, dtype, shape, size in tensors:
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    return struct.pack("<Q", len(encoded)) + encoded
