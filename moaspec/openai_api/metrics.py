"""Prometheus metrics of `moaspec serve` (prometheus_client, text exposition format 0.0.4).

One registry per server (never the process-wide default, so two servers in one process, as in
the tests, do not mix). Label values are bounded by the caller: routes are the registered ones or
"other" (no route matched, or refused before routing: malformed HTTP, header time-out), statuses
are HTTP codes, endpoints and finish reasons fixed sets. The `_created` series prometheus_client
adds are left out, so the exposition holds exactly the names docs/protocol.md lists (*Metrics*).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.metrics_core import Metric

if TYPE_CHECKING:
    from moaspec.metrics import SpecStats

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
TAU_BUCKETS = (1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0, 8.0)


class _WithoutCreated:
    """A registry view without the `*_created` samples (creation timestamps)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry

    def collect(self) -> Iterator[Metric]:
        for family in self.registry.collect():
            family.samples = [s for s in family.samples if not s.name.endswith("_created")]
            yield family


class ServerMetrics:
    """Everything /metrics exposes. τ follows the engine's convention: tokens per target forward,
    bonus/recovered token included (moaspec/metrics.py)."""

    def __init__(self, queue_waiting: Callable[[], float], queue_active: Callable[[], float], queue_capacity: float) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("moaspec_http_requests_total", "HTTP requests by route and status.", ("route", "status"), registry=r)
        self.latency = Histogram(
            "moaspec_http_request_duration_seconds", "Time from request to the end of the response (the whole stream).",
            ("route",), registry=r, buckets=LATENCY_BUCKETS,
        )
        self.generations = Counter(
            "moaspec_generations_total", "Finished generations by endpoint and finish reason (stop, length, cancelled, error).",
            ("endpoint", "finish_reason"), registry=r,
        )
        self.prompt_tokens = Counter("moaspec_prompt_tokens_total", "Prompt tokens prefilled.", registry=r)
        self.generated_tokens = Counter("moaspec_generated_tokens_total", "Tokens generated (verified), cancelled generations included.", registry=r)
        self.target_forwards = Counter("moaspec_target_forwards_total", "Target forward passes (prefill and verifications).", registry=r)
        self.forward_tokens = Counter("moaspec_forward_tokens_total", "Tokens produced by target forwards (accepted drafts + one per forward).", registry=r)
        self.verifications = Counter("moaspec_verifications_total", "Draft trees verified.", registry=r)
        self.drafted_nodes = Counter("moaspec_drafted_nodes_total", "Drafted tree nodes sent to verification (root excluded).", registry=r)
        self.accepted_drafts = Counter("moaspec_accepted_drafts_total", "Drafted tokens accepted by the verifier.", registry=r)
        self.reached_depth = Counter("moaspec_draft_depth_reached_total", "Verifications whose tree reached depth d.", ("depth",), registry=r)
        self.accepted_depth = Counter("moaspec_draft_depth_accepted_total", "Verifications accepting at least d drafted tokens.", ("depth",), registry=r)
        self._totals = {"forwards": 0.0, "forward_tokens": 0.0}  # read by the τ gauge (a gauge may not collect the registry)
        self._gauge("moaspec_mean_tokens_per_forward", "tau over all generations so far: forward_tokens_total / target_forwards_total.", self._tau)
        self.tau = Histogram("moaspec_request_tokens_per_forward", "tau (tokens per target forward, bonus included) per generation.", registry=r, buckets=TAU_BUCKETS)
        self.ttft = Histogram("moaspec_time_to_first_token_seconds", "Time from admission to the first generated text.", registry=r, buckets=LATENCY_BUCKETS)
        self.queue_wait = Histogram("moaspec_queue_wait_seconds", "Time a generation waited for the model.", registry=r, buckets=LATENCY_BUCKETS)
        self.generation_s = Histogram("moaspec_generation_seconds", "Time a generation held the model.", registry=r, buckets=LATENCY_BUCKETS)
        self._gauge("moaspec_queue_waiting", "Generations waiting for the model.", queue_waiting)
        self._gauge("moaspec_generations_active", "Generations holding the model.", queue_active)
        self._gauge("moaspec_queue_capacity", "Most generations that may wait (more get 429).", lambda: queue_capacity)

    def _gauge(self, name: str, help_text: str, read: Callable[[], float]) -> None:
        Gauge(name, help_text, registry=self.registry).set_function(read)

    def add_server_gauges(self, connections: Callable[[], float], sessions: Callable[[], float], reserved_tokens: Callable[[], float]) -> None:
        """The split server's state: open connections, open sessions and their reserved tokens."""
        self._gauge("moaspec_connections_open", "Open HTTP connections (more than --max-connections get 503).", connections)
        self._gauge("moaspec_split_sessions_open", "Open split-protocol sessions.", sessions)
        self._gauge("moaspec_split_reserved_tokens", "Cached tokens reserved by open split sessions (prompt + max_new_tokens each).", reserved_tokens)

    def count_refusal(self, status: int) -> None:
        """A request refused before routing (malformed HTTP, header time-out)."""
        self.requests.labels("other", str(status)).inc()

    def _tau(self) -> float:
        forwards = self._totals["forwards"]
        return self._totals["forward_tokens"] / forwards if forwards else 0.0

    def record_stats(self, stats: SpecStats) -> None:
        """Add one generation's SpecStats to the counters."""
        self.generated_tokens.inc(stats.new_tokens)
        self.target_forwards.inc(stats.target_forwards)
        self.forward_tokens.inc(stats.forward_tokens)
        self._totals["forwards"] += stats.target_forwards
        self._totals["forward_tokens"] += stats.forward_tokens
        self.verifications.inc(stats.num_verifications)
        self.drafted_nodes.inc(stats.drafted_nodes)
        self.accepted_drafts.inc(stats.forward_tokens - stats.target_forwards)
        for depth, count in enumerate(stats.reached_depth, start=1):
            self.reached_depth.labels(str(depth)).inc(count)
        for depth, count in enumerate(stats.accepted_depth, start=1):
            self.accepted_depth.labels(str(depth)).inc(count)
        if stats.target_forwards:
            self.tau.observe(stats.tau)

    def render(self) -> str:
        return generate_latest(_WithoutCreated(self.registry)).decode()
