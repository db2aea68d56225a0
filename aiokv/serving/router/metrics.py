"""Prometheus metrics of the router, on a per-app :class:`CollectorRegistry`.

Each app owns its registry, so several routers (or tests) in one process do
not collide in the global default registry.
"""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from aiokv.serving.router.registry import Instance

__all__ = ["CONTENT_TYPE_LATEST", "RouterMetrics"]

_LATENCY_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
)
_BYTES_BUCKETS = tuple(float(4**k) * 1024 for k in range(1, 12))


class RouterMetrics:
    """All metric families of one router app."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            "aiokv_router_requests",
            "Client requests handled, by endpoint and HTTP status.",
            ["endpoint", "status"],
            registry=r,
        )
        self.retries = Counter(
            "aiokv_router_retries",
            "Upstream attempts retried on another instance, by role that failed.",
            ["role"],
            registry=r,
        )
        self.errors = Counter(
            "aiokv_router_errors",
            "Errors, by kind (bad_request, unknown_model, upstream, no_instance, stream).",
            ["kind"],
            registry=r,
        )
        self.evictions = Counter(
            "aiokv_router_evictions",
            "Instances evicted for missing heartbeats, by role.",
            ["role"],
            registry=r,
        )
        self.latency = Histogram(
            "aiokv_router_request_seconds",
            "End-to-end request latency seen by the router, by endpoint.",
            ["endpoint"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.ttft = Histogram(
            "aiokv_router_ttft_seconds",
            "Time to first token: to the first streamed chunk (stream) or to the "
            "prefill's first token (non-stream).",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.prefill_seconds = Histogram(
            "aiokv_router_prefill_seconds",
            "Duration of the prefill leg (including the KV transfer it starts).",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.kv_bytes = Counter(
            "aiokv_router_kv_transfer_bytes",
            "KV-cache bytes moved prefill -> decode, as reported by prefill workers.",
            registry=r,
        )
        self.kv_seconds = Histogram(
            "aiokv_router_kv_transfer_seconds",
            "KV-cache transfer duration per request, as reported by prefill workers.",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.kv_request_bytes = Histogram(
            "aiokv_router_kv_transfer_request_bytes",
            "KV-cache bytes per request.",
            buckets=_BYTES_BUCKETS,
            registry=r,
        )
        self.instances = Gauge(
            "aiokv_router_instances",
            "Registered instances, by role.",
            ["role"],
            registry=r,
        )
        self.instance_healthy = Gauge(
            "aiokv_router_instance_healthy",
            "1 when the instance is healthy, 0 when marked unhealthy.",
            ["role", "url"],
            registry=r,
        )
        self.instance_outstanding = Gauge(
            "aiokv_router_instance_outstanding",
            "Requests in flight at the instance.",
            ["role", "url"],
            registry=r,
        )
        self._labelled: set[tuple[str, str]] = set()

    def refresh_instances(self, instances: Iterable[Instance]) -> None:
        """Set the per-instance gauges from the registry; drop evicted label sets."""
        counts = {"prefill": 0, "decode": 0}
        seen: set[tuple[str, str]] = set()
        for inst in instances:
            counts[inst.role] += 1
            key: tuple[str, str] = (str(inst.role), inst.url)
            seen.add(key)
            self.instance_healthy.labels(*key).set(1 if inst.healthy else 0)
            self.instance_outstanding.labels(*key).set(inst.outstanding)
        for role, n in counts.items():
            self.instances.labels(role).set(n)
        for key in self._labelled - seen:
            self.instance_healthy.remove(*key)
            self.instance_outstanding.remove(*key)
        self._labelled = seen

    def report_transfer(self, params: object) -> None:
        """Record the KV transfer a prefill worker reported in ``kv_transfer_params``."""
        if not isinstance(params, dict):
            return
        nbytes = params.get("transfer_bytes")
        secs = params.get("transfer_seconds")
        if isinstance(nbytes, (int, float)) and not isinstance(nbytes, bool) and nbytes >= 0:
            self.kv_bytes.inc(nbytes)
            self.kv_request_bytes.observe(nbytes)
        if isinstance(secs, (int, float)) and not isinstance(secs, bool) and secs >= 0:
            self.kv_seconds.observe(secs)

    def render(self, with_instances: bool = True) -> bytes:
        """The text exposition; without the per-instance series (labelled with worker
        URLs) unless ``with_instances``."""
        text = generate_latest(self.registry)
        if with_instances:
            return text
        hidden = (b"aiokv_router_instance_healthy", b"aiokv_router_instance_outstanding")
        return b"".join(
            line for line in text.splitlines(keepends=True) if not _name(line).startswith(hidden)
        )


def _name(line: bytes) -> bytes:
    """The metric a line of the text exposition is about (sample, HELP or TYPE line)."""
    if line.startswith((b"# HELP ", b"# TYPE ")):
        return line.split(b" ", 3)[2]
    return line
