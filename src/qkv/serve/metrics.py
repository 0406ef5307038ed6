"""What ``qkv serve`` counts, for ``GET /metrics`` in the Prometheus text format (``prometheus-client``).

Each application holds a :class:`ServerMetrics` with a registry of its own (never the library's
global one, so that a process may build many applications, as the tests do):

* ``qkv_requests_total{method, route, status}`` and ``qkv_request_duration_seconds{route}``: every
  request, by its route's template (``/v1/translate``; ``unmatched`` for a path no route takes, so
  that the paths clients make up never become labels), a streamed answer timed to its last byte;
* ``qkv_batch_rows{kind}``: the rows (sentences, sequences) of each batch the model decodes,
  ``kind`` ``translate`` or ``generate``;
* ``qkv_queue_depth{model}``: the requests each model (and the explorer) holds, read at each scrape;
* ``qkv_generated_tokens_total{model}``: tokens generated (tokens per second is its ``rate()``);
* ``qkv_time_to_first_token_seconds{model}``: from a generation's arrival to its first token.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

__all__ = ["CONTENT_TYPE", "BATCH_KINDS", "ServerMetrics"]

CONTENT_TYPE = CONTENT_TYPE_LATEST  # text/plain; version=0.0.4; charset=utf-8
BATCH_KINDS = ("translate", "generate")
UNMATCHED = "unmatched"  # the route label of a path that no route takes
METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})  # others: "other"

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
FIRST_TOKEN_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


class _QueueCollector(Collector):
    """The queue depth of each model, read from ``depths()`` whenever the registry is scraped."""

    def __init__(self, depths: Callable[[], Mapping[str, int]]) -> None:
        self.depths = depths

    @staticmethod
    def _family() -> GaugeMetricFamily:
        return GaugeMetricFamily(
            "qkv_queue_depth", "Requests waiting or running, per model (and the explorer)", labels=["model"]
        )

    def describe(self) -> Iterator[GaugeMetricFamily]:
        """The family's name and help, without reading the queues (what the registry checks names with)."""
        yield self._family()

    def collect(self) -> Iterator[GaugeMetricFamily]:
        """One gauge family: ``qkv_queue_depth{model}``, each model's requests waiting or running now."""
        gauge = self._family()
        for name, depth in sorted(self.depths().items()):
            gauge.add_metric([name], float(depth))
        yield gauge


class ServerMetrics:
    """The server's counters and histograms, in a registry of their own.

    Args:
        queue_depths: returns each model's requests waiting or running, read at every scrape (none: no
            queue gauge).
        generators: the names of the models that generate, whose token counter and first-token
            histogram exist (at zero) from the start, so that ``rate()`` has a first sample.
    """

    def __init__(
        self, queue_depths: Callable[[], Mapping[str, int]] | None = None, generators: Iterable[str] = ()
    ) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter(
            "qkv_requests",
            "HTTP requests answered, by method, route template and status",
            ["method", "route", "status"],
            registry=self.registry,
        )
        self.latency = Histogram(
            "qkv_request_duration_seconds",
            "Time from a request's arrival to its answer's last byte, by route template",
            ["route"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.batch_rows = Histogram(
            "qkv_batch_rows",
            "Rows (sentences or sequences) in each batch the model decodes, by kind",
            ["kind"],
            buckets=ROW_BUCKETS,
            registry=self.registry,
        )
        self.tokens = Counter(
            "qkv_generated_tokens",
            "Tokens generated, by model (tokens/s: rate() of it)",
            ["model"],
            registry=self.registry,
        )
        self.first_token = Histogram(
            "qkv_time_to_first_token_seconds",
            "Time from a generation request's arrival to its first token, by model",
            ["model"],
            buckets=FIRST_TOKEN_BUCKETS,
            registry=self.registry,
        )
        for kind in BATCH_KINDS:
            self.batch_rows.labels(kind)
        for name in generators:
            self.tokens.labels(name)
            self.first_token.labels(name)
        if queue_depths is not None:
            self.registry.register(_QueueCollector(queue_depths))

    def observe_batch(self, kind: str, rows: int) -> None:
        """Record one batch the model decoded: ``rows`` sentences or sequences.

        Args:
            kind: ``"translate"`` or ``"generate"``.
            rows: the rows decoded together in it.

        Raises:
            ValueError: another ``kind``, or fewer than one row.
        """
        if kind not in BATCH_KINDS:
            raise ValueError(f"batch kind must be one of {', '.join(BATCH_KINDS)}, got {kind!r}")
        if rows < 1:
            raise ValueError(f"a batch has at least one row, got {rows}")
        self.batch_rows.labels(kind).observe(rows)

    def add_tokens(self, model: str, n: int) -> None:
        """Count ``n`` tokens generated by ``model`` (``n`` >= 0; 0 records nothing new)."""
        if n < 0:
            raise ValueError(f"tokens generated cannot be negative, got {n}")
        self.tokens.labels(model).inc(n)

    def time_to_first_token(self, model: str, seconds: float) -> None:
        """Record that a request to ``model`` waited ``seconds`` from its arrival to its first token."""
        self.first_token.labels(model).observe(max(0.0, seconds))

    def observe_request(self, method: str, route: str | None, status: int, seconds: float) -> None:
        """Count one answered request and its duration (what the access middleware calls).

        Args:
            method: the HTTP method (one that HTTP does not define is counted as ``other``).
            route: the route's template (``/v1/translate``), or None for a path no route takes.
            status: the status answered.
            seconds: from the request's arrival to the answer's last byte.
        """
        label = route or UNMATCHED
        self.requests.labels(method if method in METHODS else "other", label, str(status)).inc()
        self.latency.labels(label).observe(seconds)

    def exposition(self) -> bytes:
        """Every metric in the Prometheus text format (sent with :data:`CONTENT_TYPE`)."""
        return generate_latest(self.registry)
