"""Operator metrics (prometheus-client), served on the `/metrics` port of `shardwise operator run`."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

REGISTRY = CollectorRegistry()

RECONCILE_SECONDS = Histogram(
    "shardwise_reconcile_duration_seconds", "Time of one reconcile of a ShardedModel",
    ["namespace", "model"], registry=REGISTRY,
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10))
RECONCILE_ERRORS = Counter(
    "shardwise_reconcile_errors_total", "Reconciles that raised an error", ["namespace", "model"],
    registry=REGISTRY)
SHARDS_DESIRED = Gauge(
    "shardwise_shards_desired", "Pods (replica x stage) the plan asks for", ["namespace", "model"],
    registry=REGISTRY)
SHARDS_READY = Gauge(
    "shardwise_shards_ready", "Pods (replica x stage) Ready", ["namespace", "model"], registry=REGISTRY)
REPLICAS_READY = Gauge(
    "shardwise_replicas_ready", "Replica groups with every stage Ready", ["namespace", "model"],
    registry=REGISTRY)
RECOVERIES = Counter(
    "shardwise_recoveries_total", "Replica groups torn down and recreated after a failure",
    ["namespace", "model", "cause"], registry=REGISTRY)
RECOVERY_SECONDS = Histogram(
    "shardwise_time_to_recover_seconds", "From a group's failure being seen to the group Ready again",
    ["namespace", "model"], registry=REGISTRY, buckets=(1, 2, 5, 10, 20, 30, 60, 120, 300, 600))
PLAN_COST = Gauge(
    "shardwise_plan_cost", "Topology boundaries crossed by the current plan (lower is better)",
    ["namespace", "model"], registry=REGISTRY)
PLAN_SECONDS = Histogram(
    "shardwise_plan_duration_seconds", "Time the planner took", registry=REGISTRY,
    buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5))
TRAINING_STEP = Gauge(
    "shardwise_training_step", "Optimizer steps a training job has done, as last read from it",
    ["namespace", "model"], registry=REGISTRY)
CHECKPOINT_STEP = Gauge(
    "shardwise_last_checkpoint_step", "Step of a training job's newest complete checkpoint",
    ["namespace", "model"], registry=REGISTRY)
CHECKPOINT_TIME = Gauge(
    "shardwise_last_checkpoint_timestamp_seconds",
    "Unix time of a training job's newest complete checkpoint (alert on time() minus this: work at risk)",
    ["namespace", "model"], registry=REGISTRY)
CHECKPOINT_AGE = Gauge(
    "shardwise_checkpoint_age_seconds",
    "Age of a training job's newest complete checkpoint per tier (shared: checkpoint.claim, local: "
    "checkpoint.local), as of the operator's last pass: the work a failure would lose now",
    ["namespace", "model", "tier"], registry=REGISTRY)
REPLICAS_ASKED = Gauge(
    "shardwise_training_replicas_asked", "Replicas a training job asks for (spec.parallelism.replicas)",
    ["namespace", "model"], registry=REGISTRY)
REPLICAS_RUNNING = Gauge(
    "shardwise_training_replicas_running",
    "Replicas a training job runs with now (fewer than asked while it runs shrunk; 0 while it is not Running)",
    ["namespace", "model"], registry=REGISTRY)
DOWNLOAD_RATE = Gauge(
    "shardwise_download_bytes_per_second",
    "Bytes per second a remote model's pods fetch, all replicas still fetching together (0 when none is)",
    ["namespace", "model"], registry=REGISTRY)
DOWNLOAD_FETCHED = Gauge(
    "shardwise_download_bytes_fetched", "Bytes a remote model's replicas still fetching have fetched so far",
    ["namespace", "model"], registry=REGISTRY)
DOWNLOAD_TOTAL = Gauge(
    "shardwise_download_bytes_total", "Bytes a remote model's replicas still fetching fetch in all",
    ["namespace", "model"], registry=REGISTRY)
API_REQUESTS = Counter(
    "shardwise_api_requests_total", "Requests the operator made to the API server", ["verb", "kind"],
    registry=REGISTRY)


def serve(port: int, addr: str = "0.0.0.0") -> None:
    """Start the /metrics HTTP server in a background thread."""
    start_http_server(port, addr=addr, registry=REGISTRY)


def forget(namespace: str, model: str) -> None:
    """Drop a deleted model's series so that dashboards don't show it forever."""
    for gauge in (SHARDS_DESIRED, SHARDS_READY, REPLICAS_READY, PLAN_COST, TRAINING_STEP, CHECKPOINT_STEP,
                  CHECKPOINT_TIME, REPLICAS_ASKED, REPLICAS_RUNNING, DOWNLOAD_RATE, DOWNLOAD_FETCHED, DOWNLOAD_TOTAL):
        try:
            gauge.remove(namespace, model)
        except KeyError:
            pass
    for tier in ("shared", "local"):
        try:
            CHECKPOINT_AGE.remove(namespace, model, tier)
        except KeyError:
            pass
