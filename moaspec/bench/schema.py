"""The results.json schemas (version report.SCHEMA_VERSION) and a small validator:
`RESULTS_SCHEMA` for `moaspec bench`, `CLIENT_SERVER_SCHEMA` for `moaspec bench --client-server`
(its documents say `"kind": "client_server"`).

A spec is a type (or tuple of types), a dict of required keys -> spec, a one-element list
[spec] for a list of items, or `{str: spec}`-style `MapOf(spec)` for free keys. `None` inside a
tuple allows null. Extra keys are allowed (newer writers may add fields; readers ignore them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

NUMBER = (int, float)
NULLABLE_NUMBER = (int, float, type(None))


class SchemaError(ValueError):
    """results.json does not follow the schema (a ValueError, so callers may catch either)."""


@dataclass(frozen=True)
class MapOf:
    value: Any


ROW = {
    "method": str,
    "num_generations": int,
    "new_tokens": int,
    "wall_s": NUMBER,
    "tokens_per_s": NUMBER,
    "speedup": NUMBER,
    "tau": NUMBER,
    "target_forwards": int,
    "acceptance_per_depth": [NUMBER],
    "time_s": (dict, type(None)),
    "peak_rss_mb": NUMBER,
    "rss_growth_mb": NUMBER,
}
HEADER = {"schema_version": int, "created": str, "command": str, "machine": {"description": str}}
RUN_CONFIG = {  # the config fields both results kinds share
    "target": str,
    "categories": [str],
    "limit": (int, type(None)),
    "methods": [str],
    "temperature": NUMBER,
    "max_new_tokens": int,
    "seed": int,
}
RESULTS_SCHEMA = {
    **HEADER,
    "config": RUN_CONFIG,
    "summary": [
        {
            "method": str,
            "speedup": NUMBER,
            "tau": NUMBER,
            "tokens_per_s": NUMBER,
            "acceptance_per_depth": [NUMBER],
            "num_mismatches": int,
            "per_category": MapOf({"speedup": NUMBER, "tau": NUMBER, "tokens_per_s": NUMBER}),
        }
    ],
    "categories": [{"category": str, "num_prompts": int, "num_generations": int, "rows": [ROW]}],
    "mismatches": [
        {
            "category": str,
            "prompt_id": str,
            "turn": int,
            "method": str,
            "first_divergence": int,
            "baseline_tokens": int,
            "method_tokens": int,
        }
    ],
    "skipped": [str],
    "runs": [
        {
            "category": str,
            "prompt_id": str,
            "turn": int,
            "method": str,
            "new_tokens": int,
            "wall_s": NUMBER,
            "tau": NUMBER,
        }
    ],
}


def validate(value: Any, spec: Any = RESULTS_SCHEMA, where: str = "results") -> None:
    """Raise SchemaError naming the first place where `value` does not follow `spec`."""
    if isinstance(spec, dict):
        if not isinstance(value, dict):
            raise SchemaError(f"{where}: expected an object, got {type(value).__name__}")
        for key, sub in spec.items():
            if key not in value:
                raise SchemaError(f"{where}: missing key '{key}'")
            validate(value[key], sub, f"{where}.{key}")
    elif isinstance(spec, list):
        if not isinstance(value, list):
            raise SchemaError(f"{where}: expected a list, got {type(value).__name__}")
        for index, item in enumerate(value):
            validate(item, spec[0], f"{where}[{index}]")
    elif isinstance(spec, MapOf):
        if not isinstance(value, dict):
            raise SchemaError(f"{where}: expected an object, got {type(value).__name__}")
        for key, item in value.items():
            validate(item, spec.value, f"{where}.{key}")
    else:
        allowed = spec if isinstance(spec, tuple) else (spec,)
        if isinstance(value, bool) and bool not in allowed:  # bool is an int subclass
            raise SchemaError(f"{where}: expected {_names(allowed)}, got bool")
        if not isinstance(value, allowed):
            raise SchemaError(f"{where}: expected {_names(allowed)}, got {type(value).__name__}")


def _names(types: tuple) -> str:
    return " or ".join("null" if t is type(None) else t.__name__ for t in types)


# `moaspec bench --client-server` (moaspec/bench/client_server.py, moaspec/split/bench.py)
CLIENT_SERVER_ROW = {
    "profile": str,
    "method": str,
    "mode": str,
    "num_generations": int,
    "new_tokens": int,
    "wall_s": NUMBER,
    "tokens_per_s": NUMBER,
    "speedup": NUMBER,
    "tau": NUMBER,
    "server_calls_per_100_tokens": NUMBER,
    "bytes_per_token": NUMBER,
    "time_to_first_token_s": NUMBER,
}
CLIENT_SERVER_SCHEMA = {
    **HEADER,
    "kind": str,
    "config": {
        **RUN_CONFIG,
        "networks": MapOf({"rtt_s": NUMBER, "jitter_s": NUMBER, "bandwidth_bps": NULLABLE_NUMBER}),
        "disconnect_after": (int, type(None)),
        "offline_tokens": (int, type(None)),
    },
    "client_server": [CLIENT_SERVER_ROW],
    "disconnection": [
        {
            "drafter": str,
            "cut_after": int,
            "offline_tokens": int,
            "num_generations": int,
            "num_offline": int,
            "num_agreeing": int,
            "agreement": NUMBER,
            "first_token_agreement": NUMBER,
            "num_scored": int,
            "task_f1": NULLABLE_NUMBER,
            "target_task_f1": NULLABLE_NUMBER,
        }
    ],
    "mismatches": [{"profile": str, "prompt": str, "method": str, "mode": str, "first_divergence": int}],
    "skipped": [str],
    "runs": [
        {
            "profile": str,
            "prompt": str,
            "method": str,
            "mode": str,
            "new_tokens": int,
            "wall_s": NUMBER,
            "time_to_first_token_s": NUMBER,
            "num_calls": int,
            "num_bytes": int,
        }
    ],
}
