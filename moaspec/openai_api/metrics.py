"""A minimal Prometheus registry (text exposition format 0.0.4) for the OpenAI-compatible server.

No client library: counters, gauges and histograms with fixed label names, updated only from the
server's event loop (so no locks), rendered by `Registry.render()`. Label values are bounded by
the caller (routes are the registered ones or "other", statuses are HTTP codes).
"""

from __future__ import annotations

import math
from collections.abc import Callable

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
TAU_BUCKETS = (1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0, 8.0)


def _labels(names: tuple[str, ...], values: tuple[str, ...], extra: str = "") -> str:
    pairs = [f'{name}="{_escape(value)}"' for name, value in zip(names, values, strict=True)]
    if extra:
        pairs.append(extra)
    return "{" + ",".join(pairs) + "}" if pairs else ""


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _number(value: float) -> str:
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value)) if not float(value).is_integer() else str(int(value))


class Counter:
    def __init__(self, name: str, help_text: str, labelnames: tuple[str, ...] = ()) -> None:
        self.name, self.help, self.labelnames = name, help_text, labelnames
        self.values: dict[tuple[str, ...], float] = {} if labelnames else {(): 0.0}

    def inc(self, amount: float = 1.0, *labels: str) -> None:
        self.values[labels] = self.values.get(labels, 0.0) + amount

    def lines(self) -> list[str]:
        return [f"{self.name}{_labels(self.labelnames, k)} {_number(v)}" for k, v in sorted(self.values.items())]

    kind = "counter"


class Gauge:
    """A value read from `read()` at render time."""

    kind = "gauge"

    def __init__(self, name: str, help_text: str, read: Callable[[], float]) -> None:
        self.name, self.help, self.read = name, help_text, read

    def lines(self) -> list[str]:
        return [f"{self.name} {_number(self.read())}"]


class Histogram:
    kind = "histogram"

    def __init__(self, name: str, help_text: str, buckets: tuple[float, ...], labelnames: tuple[str, ...] = ()) -> None:
        self.name, self.help, self.labelnames = name, help_text, labelnames
        self.buckets = tuple(sorted(buckets))
        self.series: dict[tuple[str, ...], list[float]] = {}  # labels -> [bucket counts..., +Inf, sum]

    def observe(self, value: float, *labels: str) -> None:
        row = self.series.setdefault(labels, [0.0] * (len(self.buckets) + 2))
        for i, bound in enumerate(self.buckets):
            if value <= bound:
                row[i] += 1
        row[-2] += 1
        row[-1] += value

    def lines(self) -> list[str]:
        out = []
        for labels, row in sorted(self.series.items()):
            for bound, count in zip((*self.buckets, math.inf), row[:-1], strict=True):
                le = 'le="' + _number(bound) + '"'
                out.append(f"{self.name}_bucket{_labels(self.labelnames, labels, le)} {_number(count)}")
            out.append(f"{self.name}_sum{_labels(self.labelnames, labels)} {_number(row[-1])}")
            out.append(f"{self.name}_count{_labels(self.labelnames, labels)} {_number(row[-2])}")
        return out


class Registry:
    def __init__(self) -> None:
        self.metrics: list[Counter | Gauge | Histogram] = []

    def add(self, metric):
        self.metrics.append(metric)
        return metric

    def render(self) -> str:
        out = []
        for metric in self.metrics:
            out.append(f"# HELP {metric.name} {metric.help}")
            out.append(f"# TYPE {metric.name} {metric.kind}")
            out.extend(metric.lines())
        return "\n".join(out) + "\n"


class ServerMetrics:
    """Everything /metrics exposes. τ follows the engine's convention: tokens per target forward,
    bonus/recovered token included (moaspec/metrics.py)."""

    def __init__(self, queue_waiting: Callable[[], float], queue_active: Callable[[], float], queue_capacity: float) -> None:
        r = self.registry = Registry()
        self.requests = r.add(Counter("moaspec_http_requests_total", "HTTP requests by route and status.", ("route", "status")))
        self.latency = r.add(Histogram("moaspec_http_request_duration_seconds", "Time from request to the end of the response (the whole stream).", LATENCY_BUCKETS, ("route",)))
        self.generations = r.add(Counter("moaspec_generations_total", "Finished generations by endpoint and finish reason (stop, length, cancelled, error).", ("endpoint", "finish_reason")))
        self.prompt_tokens = r.add(Counter("moaspec_prompt_tokens_total", "Prompt tokens prefilled."))
        self.generated_tokens = r.add(Counter("moaspec_generated_tokens_total", "Tokens generated (verified), cancelled generations included."))
        self.target_forwards = r.add(Counter("moaspec_target_forwards_total", "Target forward passes (prefill and verifications)."))
        self.forward_tokens = r.add(Counter("moaspec_forward_tokens_total", "Tokens produced by target forwards (accepted drafts + one per forward)."))
        self.verifications = r.add(Counter("moaspec_verifications_total", "Draft trees verified."))
        self.drafted_nodes = r.add(Counter("moaspec_drafted_nodes_total", "Drafted tree nodes sent to verification (root excluded)."))
        self.accepted_drafts = r.add(Counter("moaspec_accepted_drafts_total", "Drafted tokens accepted by the verifier."))
        self.reached_depth = r.add(Counter("moaspec_draft_depth_reached_total", "Verifications whose tree reached depth d.", ("depth",)))
        self.accepted_depth = r.add(Counter("moaspec_draft_depth_accepted_total", "Verifications accepting at least d drafted tokens.", ("depth",)))
        r.add(Gauge("moaspec_mean_tokens_per_forward", "tau over all generations so far: forward_tokens_total / target_forwards_total.", self._tau))
        self.tau = r.add(Histogram("moaspec_request_tokens_per_forward", "tau (tokens per target forward, bonus included) per generation.", TAU_BUCKETS))
        self.ttft = r.add(Histogram("moaspec_time_to_first_token_seconds", "Time from admission to the first generated text.", LATENCY_BUCKETS))
        self.queue_wait = r.add(Histogram("moaspec_queue_wait_seconds", "Time a generation waited for the model.", LATENCY_BUCKETS))
        self.generation_s = r.add(Histogram("moaspec_generation_seconds", "Time a generation held the model.", LATENCY_BUCKETS))
        r.add(Gauge("moaspec_queue_waiting", "Generations waiting for the model.", queue_waiting))
        r.add(Gauge("moaspec_generations_active", "Generations holding the model.", queue_active))
        r.add(Gauge("moaspec_queue_capacity", "Most generations that may wait (more get 429).", lambda: queue_capacity))

    def _tau(self) -> float:
        forwards = self.target_forwards.values[()]
        return self.forward_tokens.values[()] / forwards if forwards else 0.0

    def record_stats(self, stats) -> None:
        """Add one generation's SpecStats to the counters."""
        self.generated_tokens.inc(stats.new_tokens)
        self.target_forwards.inc(stats.target_forwards)
        self.forward_tokens.inc(stats.forward_tokens)
        self.verifications.inc(stats.num_verifications)
        self.drafted_nodes.inc(stats.drafted_nodes)
        self.accepted_drafts.inc(stats.forward_tokens - stats.target_forwards)
        for depth, count in enumerate(stats.reached_depth, start=1):
            self.reached_depth.inc(count, str(depth))
        for depth, count in enumerate(stats.accepted_depth, start=1):
            self.accepted_depth.inc(count, str(depth))
        if stats.target_forwards:
            self.tau.observe(stats.tau)

    def render(self) -> str:
        return self.registry.render()
