"""The results.json schemas, validated with jsonschema: `RESULTS_SCHEMA` for `moaspec bench`
(version report.SCHEMA_VERSION), `CLIENT_SERVER_SCHEMA` for `moaspec bench --client-server` (its
documents say `"kind": "client_server"`; version CLIENT_SERVER_SCHEMA_VERSION). A document is
checked against the schema of its kind and version (`schema_of`): committed results of an
earlier version stay valid.

A spec is written compactly and turned into JSON Schema (`json_schema`): a type (or tuple of
types) is that JSON type, a dict is an object with those required keys, a one-element list
[spec] an array of such items, `MapOf(spec)` an object with free keys. `None` inside a tuple
allows null; a bool is never a number. Extra keys are allowed (newer writers may add fields;
readers ignore them). Errors name the first offending place: `results.summary[0]: missing key 'tau'`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from moaspec.extras import require_modules

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


def check_validation() -> None:
    """Fail before a long run when jsonschema, which validates results.json, is missing."""
    require_modules("bench", ("jsonschema",), "validating results.json")


def validate(value: Any, spec: Any = RESULTS_SCHEMA, where: str = "results") -> None:
    """Raise SchemaError naming the first place where `value` does not follow `spec`."""
    from jsonschema import Draft202012Validator

    error = next(Draft202012Validator(json_schema(spec)).iter_errors(value), None)
    if error is None:
        return
    place = where + "".join(f"[{step}]" if isinstance(step, int) else f".{step}" for step in error.absolute_path)
    if error.validator == "required":
        missing = next(key for key in error.validator_value if key not in error.instance)
        raise SchemaError(f"{place}: missing key '{missing}'")
    expected = error.validator_value if isinstance(error.validator_value, list) else [error.validator_value]
    got = "null" if error.instance is None else type(error.instance).__name__
    raise SchemaError(f"{place}: expected {' or '.join(_JSON_TYPE_NAMES[t] for t in expected)}, got {got}")


_PYTHON_TO_JSON_TYPE = {
    int: "integer", float: "number", str: "string", bool: "boolean", dict: "object", list: "array", type(None): "null",
}
_JSON_TYPE_NAMES = {
    "integer": "int", "number": "int or float", "string": "str", "boolean": "bool", "object": "an object", "array": "a list",
    "null": "null",
}


def json_schema(spec: Any) -> dict:
    """The JSON Schema (draft 2020-12) of a compact spec."""
    if isinstance(spec, dict):
        # "properties" before "required": jsonschema reports in keyword order, so a wrong value
        # present is named before a key missing later
        properties = {key: json_schema(sub) for key, sub in spec.items()}
        return {"type": "object", "properties": properties, "required": list(spec)}
    if isinstance(spec, list):
        return {"type": "array", "items": json_schema(spec[0])}
    if isinstance(spec, MapOf):
        return {"type": "object", "additionalProperties": json_schema(spec.value)}
    types = [_PYTHON_TO_JSON_TYPE[t] for t in (spec if isinstance(spec, tuple) else (spec,))]
    if "number" in types and "integer" in types:  # a JSON number is either
        types.remove("integer")
    return {"type": types[0] if len(types) == 1 else types}


# `moaspec bench --client-server` (moaspec/bench/client_server.py, moaspec/bench/client_server_runner.py)
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
# 2: the disconnection rows' first-token agreement and task F1 (DISCONNECTION_SCORES); 1 lacked them
CLIENT_SERVER_SCHEMA_VERSION = 2
DISCONNECTION_SCORES = {
    "first_token_agreement": NUMBER,
    "num_scored": int,
    "task_f1": NULLABLE_NUMBER,
    "target_task_f1": NULLABLE_NUMBER,
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
            "agreement": NULLABLE_NUMBER,  # null: nothing was drafted alone
            **DISCONNECTION_SCORES,
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
CLIENT_SERVER_SCHEMA_V1 = {
    **CLIENT_SERVER_SCHEMA,
    "disconnection": [
        {key: spec for key, spec in CLIENT_SERVER_SCHEMA["disconnection"][0].items() if key not in DISCONNECTION_SCORES}
    ],
}


def schema_of(document: dict) -> Any:
    """The spec a results.json document follows: that of its kind (`"kind": "client_server"`, else
    `moaspec bench`'s) at its `schema_version`; SchemaError for a version no writer produced."""
    from moaspec.bench.report import SCHEMA_VERSION

    client_server = document.get("kind") == "client_server"
    if client_server:
        versions = {1: CLIENT_SERVER_SCHEMA_V1, CLIENT_SERVER_SCHEMA_VERSION: CLIENT_SERVER_SCHEMA}
    else:
        versions = {SCHEMA_VERSION: RESULTS_SCHEMA}
    version = document.get("schema_version")
    if isinstance(version, bool) or version not in versions:
        raise SchemaError(f"results.schema_version: {version!r} is not one of {sorted(versions)}")
    return versions[version]
