"""Wire format of the client-server split (docs/protocol.md): versioned messages, tensor codecs.

Bodies are msgpack (`application/msgpack`) or JSON (`application/json`); nothing received is
unpickled or executed. Tensors travel as {"dtype", "shape", "data"} (+ "scale" for int8) with raw
little-endian bytes (base64 in JSON). Every decoder validates types, ranges and sizes and raises
`ProtocolError` (-> HTTP 400; moaspec/serving/strict_json.py) with a one-line reason: a verify
request's draft tree and drafter probabilities too (`parse_tree`).
"""

from __future__ import annotations

import base64
import json
import math
import secrets
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from moaspec.serving.strict_json import ProtocolError, parse_json
from moaspec.tree import DraftTree, leaf_groups

PROTOCOL_VERSION = 1
MSGPACK = "application/msgpack"
JSON = "application/json"

# wire dtype name -> (torch dtype, bytes per element)
WIRE_DTYPES: dict[str, tuple[torch.dtype, int]] = {
    "f16": (torch.float16, 2),
    "f32": (torch.float32, 4),
    "f64": (torch.float64, 8),
    "i8": (torch.int8, 1),
}
CONTEXT_DTYPES = ("f16", "i8", "f32")  # what a client may ask the context to be sent as
MAX_TENSOR_ELEMENTS = 1 << 24
MAX_STOP_IDS = 64  # an open request's stop_ids
DRAFT_PROB_SLACK = 1e-6  # rounding allowed above 1 in a node's drafter distribution


# -- body codecs --------------------------------------------------------------------------------
def dumps(message: dict, content_type: str) -> bytes:
    if content_type == MSGPACK:
        import msgpack

        return msgpack.packb(message, use_bin_type=True)
    return json.dumps(_to_json(message), separators=(",", ":")).encode()


def loads(body: bytes, content_type: str) -> dict:
    """Parse a body; -> a dict (anything else is a ProtocolError)."""
    if content_type == JSON:
        message = parse_json(body)
    elif content_type == MSGPACK:
        message = _parse_msgpack(body)
    else:
        raise ProtocolError(f"unsupported content type '{content_type}' (use {MSGPACK} or {JSON})")
    if not isinstance(message, dict):
        raise ProtocolError("the body must be an object")
    return message


def _parse_msgpack(body: bytes) -> Any:
    import msgpack

    try:
        return msgpack.unpackb(body, raw=False, strict_map_key=True, max_bin_len=len(body), max_str_len=len(body))
    except Exception:  # noqa: BLE001  msgpack raises many types on garbage (ValueError, TypeError, StackError, ...)
        raise ProtocolError("the body is not valid msgpack (a map with string keys, UTF-8 strings)") from None


def _to_json(value: Any) -> Any:
    if isinstance(value, bytes):
        return {"b64": base64.b64encode(value).decode()}
    if isinstance(value, dict):
        return {k: _to_json(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_to_json(v) for v in value]
    return value


def _bytes_field(value: Any, name: str) -> bytes:
    if isinstance(value, bytes):
        return value
    if isinstance(value, dict) and isinstance(value.get("b64"), str):
        try:
            return base64.b64decode(value["b64"], validate=True)
        except ValueError as exc:
            raise ProtocolError(f"{name}: invalid base64") from exc
    raise ProtocolError(f"{name}: expected bytes")


# -- field validation -----------------------------------------------------------------------------
def get_int(message: dict, name: str, low: int, high: int, default: int | None = None) -> int:
    value = message.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ProtocolError(f"'{name}' must be an integer in [{low}, {high}]")
    return value


def get_float(message: dict, name: str, low: float, high: float, default: float) -> float:
    value = message.get(name, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
        raise ProtocolError(f"'{name}' must be a number in [{low}, {high}]")
    return float(value)


def get_ids(message: dict, name: str, vocab_size: int, min_len: int, max_len: int) -> list[int]:
    value = message.get(name)
    if not isinstance(value, list) or not min_len <= len(value) <= max_len:
        raise ProtocolError(f"'{name}' must be a list of {min_len}..{max_len} token ids")
    if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab_size for t in value):
        raise ProtocolError(f"'{name}' must hold token ids in [0, {vocab_size})")
    return value


def get_choice(message: dict, name: str, choices: tuple[str, ...], default: str) -> str:
    value = message.get(name, default)
    if value not in choices:
        raise ProtocolError(f"'{name}' must be one of {', '.join(choices)}")
    return value


# -- tensors ----------------------------------------------------------------------------------------
def encode_tensor(x: torch.Tensor, wire_dtype: str) -> dict:
    """x [..., C] -> wire dict. i8: symmetric per-vector (last axis) scale, sent as float32."""
    x = x.detach().cpu()
    if wire_dtype == "i8":
        scale = (x.float().abs().amax(-1, keepdim=True) / 127.0).clamp_min(1e-12)  # [..., 1]
        quantized = torch.round(x.float() / scale).clamp(-127, 127).to(torch.int8)
        return {"dtype": "i8", "shape": list(x.shape), "data": _raw(quantized), "scale": _raw(scale.squeeze(-1))}
    dtype = WIRE_DTYPES[wire_dtype][0]
    return {"dtype": wire_dtype, "shape": list(x.shape), "data": _raw(x.to(dtype))}


def decode_tensor(value: Any, name: str, max_elements: int = MAX_TENSOR_ELEMENTS) -> torch.Tensor:
    """Wire dict -> tensor (float32 for i8, else the sent dtype); validated."""
    if not isinstance(value, dict):
        raise ProtocolError(f"{name}: expected a tensor object")
    wire_dtype = get_choice(value, "dtype", tuple(WIRE_DTYPES), "")
    shape = value.get("shape")
    if not isinstance(shape, list) or len(shape) > 4 or not all(isinstance(s, int) and not isinstance(s, bool) and 0 <= s <= max_elements for s in shape):
        raise ProtocolError(f"{name}: bad shape")
    numel = math.prod(shape)
    if numel > max_elements:
        raise ProtocolError(f"{name}: more elements than the limit {max_elements}")
    dtype, itemsize = WIRE_DTYPES[wire_dtype]
    tensor = _from_raw(_bytes_field(value.get("data"), name), dtype, numel * itemsize, name).reshape(shape)
    if wire_dtype != "i8":
        return tensor
    if not shape:
        raise ProtocolError(f"{name}: an i8 tensor needs at least one axis (its scales are per vector)")
    scale = _from_raw(_bytes_field(value.get("scale"), name), torch.float32, math.prod(shape[:-1]) * 4, name)
    return tensor.float() * scale.reshape(*shape[:-1], 1)


def _raw(x: torch.Tensor) -> bytes:
    return x.detach().cpu().contiguous().numpy().tobytes()  # a server's target may be on a GPU


def _from_raw(data: bytes, dtype: torch.dtype, num_bytes: int, name: str) -> torch.Tensor:
    if len(data) != num_bytes:
        raise ProtocolError(f"{name}: {len(data)} bytes of data where the shape needs {num_bytes}")
    if num_bytes == 0:
        return torch.zeros(0, dtype=dtype)
    return torch.frombuffer(bytearray(data), dtype=dtype)


def encode_context(context: dict[str, torch.Tensor], wire_dtype: str) -> dict:
    return {name: encode_tensor(x, wire_dtype) for name, x in context.items()}


def decode_context(value: Any, num_tokens: int) -> dict[str, torch.Tensor]:
    """Context tensors, each with one row per verified token."""
    if not isinstance(value, dict) or len(value) > 8:
        raise ProtocolError("context: expected an object of at most 8 tensors")
    context = {}
    for name, tensor in value.items():
        decoded = decode_tensor(tensor, f"context.{name}")
        if decoded.dim() == 0 or decoded.shape[0] != num_tokens:
            raise ProtocolError(f"context.{name}: expected {num_tokens} rows")
        context[str(name)] = decoded
    return context


# -- messages -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class OpenRequest:
    """Start a session: prefill prompt_ids. With root_id, resume (resynchronise) instead: the
    server rebuilds the verified context and continues from the given root without choosing one
    (prompt_len: its first tokens are prefilled as the session's prompt was, the rest decoded as
    verification decoded them: TargetSession.resume)."""

    prompt_ids: list[int]
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    max_new_tokens: int = 256
    root_id: int | None = None
    context_from: int = 0  # return context for prompt positions >= this (the client has the rest)
    prompt_len: int | None = None  # with root_id: the leading prompt_ids the session was opened with
    context_dtype: str = "f16"
    stop_ids: list[int] | None = None  # with a verify's `remaining`: the server closes a finished session itself
    version: int = PROTOCOL_VERSION
    request_id: str = field(default_factory=lambda: secrets.token_hex(12))  # makes retries idempotent

    def to_wire(self) -> dict:
        return {k: v for k, v in asdict(self).items() if v is not None}


@dataclass(frozen=True)
class VerifyRequest:
    """One draft tree. draft_probs: None for deterministic drafts, else per node (root: empty) the
    exact sparse distribution it was drawn from: (token ids, float64 probabilities)."""

    seq: int
    token_ids: list[int]
    parents: list[int]
    draft_probs: list[tuple[list[int], torch.Tensor]] | None = None
    remaining: int | None = None  # tokens the client can still emit: the server closes the session when this reply ends it

    def to_wire(self) -> dict:
        message: dict[str, Any] = {"seq": self.seq, "token_ids": self.token_ids, "parents": self.parents}
        if self.remaining is not None:
            message["remaining"] = self.remaining
        if self.draft_probs is not None:
            message["draft_ids"] = [ids for ids, _ in self.draft_probs]
            message["draft_probs"] = encode_tensor(torch.cat([p for _, p in self.draft_probs]).double(), "f64")
        return message


@dataclass
class Verification:
    """The server's answer to a verify (or open) request, as the client sees it."""

    path_node_idx: list[int]
    next_token: int
    start_pos: int
    context: dict[str, torch.Tensor]
    server_s: float
    closed: bool = False  # the server closed the session: this reply finished the generation


def parse_verification(message: dict, vocab_size: int, num_nodes: int, num_tokens: int | None = None) -> Verification:
    """Validate a verify response (open responses: num_nodes = 0, num_tokens = context rows)."""
    path = message.get("path_node_idx", [0])
    if not isinstance(path, list) or not all(isinstance(i, int) and 0 <= i < max(num_nodes, 1) for i in path):
        raise ProtocolError("path_node_idx: expected node indices of the sent tree")
    next_token = get_int(message, "next_token", 0, vocab_size - 1)
    start_pos = get_int(message, "start_pos", 0, 1 << 40, 0)
    rows = len(path) if num_tokens is None else num_tokens
    context = decode_context(message.get("context", {}), rows)
    server_s = get_float(message, "server_s", 0.0, 1e9, 0.0)
    closed = message.get("closed", False)
    if not isinstance(closed, bool):
        raise ProtocolError("'closed' must be a boolean")
    return Verification(path, next_token, start_pos, context, server_s, closed)


def parse_tree(
    message: dict, vocab_size: int, max_nodes: int, max_leaves: int | None, max_draft_prob_entries: int
) -> DraftTree:
    """A verify request's draft tree: `token_ids` [N] (at most `max_nodes`), `parents` [N] (-1 for
    the root), and, for a stochastic verifier, the drafter's sparse distributions (`draft_ids`,
    `draft_probs`: `parse_draft_probs`); at most `max_leaves` leaves (None: any). ProtocolError
    naming what is wrong."""
    token_ids = get_ids(message, "token_ids", vocab_size, 1, max_nodes)
    parents = message.get("parents")
    if not isinstance(parents, list) or len(parents) != len(token_ids) or not all(
        isinstance(p, int) and not isinstance(p, bool) and -1 <= p < len(token_ids) for p in parents
    ):
        raise ProtocolError("'parents' must hold one node index (or -1 for the root) per node")
    draft_probs = None
    if "draft_probs" in message:
        draft_probs = parse_draft_probs(message, len(token_ids), vocab_size, max_draft_prob_entries)
    try:
        tree = DraftTree(torch.tensor(token_ids), torch.tensor(parents), draft_probs)
    except ValueError as exc:
        raise ProtocolError(str(exc)) from exc
    if max_leaves is not None and len(leaf_groups(tree.parents)[0]) > max_leaves:
        raise ProtocolError(f"a tree may have at most {max_leaves} leaves on this server ('max_tree_leaves')")
    return tree


def parse_draft_probs(message: dict, num_nodes: int, vocab_size: int, max_entries: int) -> torch.Tensor:
    """Sparse per-node drafter distributions (`draft_ids`: a list of token ids per node,
    `draft_probs`: their probabilities, float64, at most `max_entries`) -> dense [N, V] float64 rows."""
    ids = message.get("draft_ids")
    if not isinstance(ids, list) or len(ids) != num_nodes or not all(isinstance(row, list) for row in ids):
        raise ProtocolError("'draft_ids' must hold one list of token ids per node")
    lengths = [len(row) for row in ids]
    if sum(lengths) > max_entries:
        raise ProtocolError(f"more than {max_entries} drafter probabilities")
    flat_ids = get_ids({"ids": [t for row in ids for t in row]}, "ids", vocab_size, 0, sum(lengths))
    values = decode_tensor(message["draft_probs"], "draft_probs", max_entries)
    if values.dtype != torch.float64 or values.shape != (len(flat_ids),):
        raise ProtocolError("'draft_probs' must be float64 with one value per draft id")
    if not bool(torch.isfinite(values).all()) or bool((values < 0).any()):
        raise ProtocolError("'draft_probs' must be finite and non-negative")
    dense = torch.zeros(num_nodes, vocab_size, dtype=torch.float64)
    rows = torch.repeat_interleave(torch.arange(num_nodes), torch.tensor(lengths, dtype=torch.long))
    dense[rows, torch.tensor(flat_ids, dtype=torch.long)] = values
    if bool((dense.sum(dim=1) > 1.0 + DRAFT_PROB_SLACK).any()):
        raise ProtocolError("each node's 'draft_probs' must be a distribution: they sum to more than 1")
    return dense
