"""The router's Prometheus metrics, in a registry of its own (several routers in one process, as
the tests run them, do not collide)."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from shardwise.crds import names


class Metrics:
    def __init__(self):
        r = self.registry = CollectorRegistry()
        self.requests = Counter("shardwise_router_requests_total", "requests answered, by endpoint and status code",
                                ["endpoint", "code"], registry=r)
        self.routed = Counter("shardwise_router_routed_total", "requests sent to each replica", ["replica"], registry=r)
        self.prefix_blocks = Counter("shardwise_router_prefix_blocks_total",
                                     "prompt blocks found in the chosen replica's prefix index", registry=r)
        self.migrations = Counter("shardwise_router_migrations_total",
                                  "streams moved to another replica after theirs failed", registry=r)
        self.retries = Counter("shardwise_router_retries_total",
                               "requests sent again to another replica before any byte was answered", registry=r)
        self.upstream_errors = Counter("shardwise_router_upstream_errors_total",
                                       "failed exchanges with a replica, by kind", ["kind"], registry=r)
        self.holds = Counter("shardwise_router_holds_total", "requests held while no replica was Ready", registry=r)
        self.hold_timeouts = Counter("shardwise_router_hold_timeouts_total",
                                     "held requests answered 503 when the hold bound passed", registry=r)
        self.rate_limited = Counter("shardwise_router_rate_limited_total", "requests answered 429 by a key's limit",
                                    registry=r)
        # the operator's autoscaler reads this one to wake a model scaled to zero
        self.held = Gauge(names.METRIC_ROUTER_HELD, "requests waiting now for a Ready replica", registry=r)
        self.ready = Gauge("shardwise_router_ready_replicas", "replicas whose health check passes", registry=r)
        self.added = Histogram("shardwise_router_added_seconds",
                               "time from a request's arrival to its forwarding to a replica",
                               buckets=(1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, .01, .05, .1, .5, 1, 5, 30),
                               registry=r)
