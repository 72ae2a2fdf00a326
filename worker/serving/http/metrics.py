"""The server's Prometheus collectors: request latency and time to first token, token counts and
rate, the ranks' weight bytes and communication time, the engine's queue, and, read at scrape
time, the KV cache's blocks (KVCacheUse), the queue's bound and refusals (Admission), speculative
decoding's drafts and acceptance (Speculation), a mixture-of-experts model's load (ExpertLoad),
and the same engine's queue, running requests and KV-cache use again under the names of the
Gateway API Inference Extension's model-server protocol (ModelServerProtocol), which gateways and
endpoint pickers scrape."""
from __future__ import annotations

import threading
import time
from collections import deque

from shardwise.crds import names

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class ExpertLoad:
    """Prometheus collector of a mixture-of-experts model's load balance, read at scrape time from
    the layers rank 0 holds (with pipeline stages: the first stage's layers):
    shardwise_expert_tokens_total{layer,expert} and shardwise_expert_imbalance{layer} (max/mean)."""

    def __init__(self, model):
        self.model = model

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        from shardwise.worker.model.moe import expert_load, imbalance
        tokens = CounterMetricFamily("shardwise_expert_tokens", "Tokens routed to each expert",
                                     labels=["layer", "expert"])
        ratio = GaugeMetricFamily("shardwise_expert_imbalance",
                                  "Most tokens any expert got over the mean per expert (1: balanced)",
                                  labels=["layer"])
        model = self.model()
        for layer, counts in (expert_load(model) if model is not None else {}).items():
            for e, n in enumerate(counts):
                tokens.add_metric([layer, str(e)], n)
            ratio.add_metric([layer], imbalance(counts))
        return [tokens, ratio]


class _EngineCollector:
    """A collector read from the engine at scrape time; `engine` is a weak reference (None before the
    engine starts and after it stops: nothing to report)."""

    def __init__(self, engine):
        self.engine = engine

    def collect(self):
        engine = self.engine()
        return [] if engine is None else self.families(engine)

    def families(self, engine) -> list:
        raise NotImplementedError


class KVCacheUse(_EngineCollector):
    """Prometheus collector of the paged KV cache (engine.py, kv_blocks.py), read at scrape time:
    shardwise_kv_cache_blocks{state} (used: held by requests; cached: kept for prefix reuse,
    reclaimable; free), shardwise_kv_cache_block_tokens, and counters of prompt tokens reused
    from the cache and of preempted requests."""

    def families(self, engine) -> list:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
        pool = engine.pool
        blocks = GaugeMetricFamily("shardwise_kv_cache_blocks", "KV-cache blocks by state", labels=["state"])
        blocks.add_metric(["used"], pool.used)
        blocks.add_metric(["cached"], len(pool.evictable))
        blocks.add_metric(["free"], len(pool.free))
        size = GaugeMetricFamily("shardwise_kv_cache_block_tokens", "Token positions per KV-cache block",
                                 value=pool.block_size)
        reused = CounterMetricFamily("shardwise_prefix_reused_tokens", "Prompt tokens found in the KV "
                                     "cache instead of prefilled", value=engine.stats.reused_tokens)
        preempted = CounterMetricFamily("shardwise_preempted_requests", "Requests preempted when the "
                                        "KV cache ran out of blocks", value=engine.stats.preempted)
        return [blocks, size, reused, preempted]


class Admission(_EngineCollector):
    """Prometheus collector of the engine's waiting queue, read at scrape time: its bound,
    shardwise_max_waiting_requests (choices), and shardwise_rejected_requests_total, the requests
    refused with 429 because it was full."""

    def families(self, engine) -> list:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
        bound = engine.scheduler.max_waiting
        out = [CounterMetricFamily("shardwise_rejected_requests", "Requests refused (429) because the "
                                   "waiting queue was full", value=engine.stats.rejected)]
        if bound is not None:
            out.append(GaugeMetricFamily("shardwise_max_waiting_requests", "Choices the waiting queue "
                                         "holds at most (--max-waiting)", value=bound))
        return out


class Speculation(_EngineCollector):
    """Prometheus collector of speculative decoding (speculative.py), read at scrape time when the
    engine speculates: shardwise_speculative_draft_tokens_total (drafts fed to be verified),
    shardwise_speculative_accepted_tokens_total (of them, accepted), their ratio
    shardwise_speculative_acceptance_rate, and shardwise_speculative_steps_total."""

    def families(self, engine) -> list:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
        if engine.speculator is None:
            return []
        stats = engine.speculator.stats
        return [
            CounterMetricFamily("shardwise_speculative_draft_tokens", "Draft tokens fed to be verified",
                                value=stats.proposed),
            CounterMetricFamily("shardwise_speculative_accepted_tokens", "Draft tokens accepted (equal "
                                "to the model's greedy token)", value=stats.accepted),
            GaugeMetricFamily("shardwise_speculative_acceptance_rate", "Accepted over fed draft tokens "
                              "since the start (0 before any)", value=stats.acceptance),
            CounterMetricFamily("shardwise_speculative_steps", "Decode steps that verified drafts",
                                value=stats.steps),
        ]


# The model-server protocol's names: crds/names.py (the operator's autoscaler reads them too).
PROTOCOL_QUEUED, PROTOCOL_RUNNING = names.METRIC_QUEUED, names.METRIC_RUNNING
PROTOCOL_KV_CACHE, PROTOCOL_LORA = names.METRIC_KV_CACHE, names.METRIC_LORA
LORA_LABELS = ("max_lora", "running_lora_adapters", "waiting_lora_adapters")


def kv_cache_utilization(pool) -> float:
    """Blocks held by requests over all blocks, 0-1 (cached reusable blocks count as free: a new
    request may take them)."""
    return min(1.0, max(0.0, pool.used / pool.num_blocks)) if pool.num_blocks else 0.0


class ModelServerProtocol(_EngineCollector):
    """The engine's queue, running requests and KV-cache use under the protocol's names, read at
    scrape time from the same engine state as shardwise_waiting_requests, shardwise_running_requests
    and shardwise_kv_cache_blocks. No LoRA adapters are served: the LoRA info gauge says so (max_lora
    0, empty adapter lists), its value the time the server started, as the protocol asks."""

    def __init__(self, engine):
        super().__init__(engine)
        self.started = time.time()

    def families(self, engine) -> list:
        from prometheus_client.core import GaugeMetricFamily
        out = [GaugeMetricFamily(PROTOCOL_QUEUED, "Requests waiting in the queue (TotalQueuedRequests)",
                                 value=len(engine.waiting)),
               GaugeMetricFamily(PROTOCOL_RUNNING, "Requests being decoded (TotalRunningRequests)",
                                 value=engine.running)]
        use = kv_cache_utilization(engine.pool)
        out += [GaugeMetricFamily(name, "KV-cache blocks in use over all blocks, 0-1 (KVCacheUtilization)",
                                  value=use) for name in PROTOCOL_KV_CACHE]
        lora = GaugeMetricFamily(PROTOCOL_LORA, "LoRA adapters (none served); value: when last updated",
                                 labels=list(LORA_LABELS))
        lora.add_metric(["0", "", ""], self.started)
        return out + [lora]


class Metrics:
    """The registry /metrics renders; `token()` is called once per generated token."""

    def __init__(self):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
        r = self.registry = CollectorRegistry()
        self.latency = Histogram("shardwise_request_latency_seconds", "Time from request to last token",
                                 ["endpoint"], buckets=LATENCY_BUCKETS, registry=r)
        self.ttft = Histogram("shardwise_time_to_first_token_seconds",   # names.METRIC_TTFT
                              "Time from request to first token",
                              ["endpoint"], buckets=LATENCY_BUCKETS, registry=r)
        self.requests = Counter("shardwise_requests_total", "HTTP requests by endpoint and status code",
                                ["endpoint", "code"], registry=r)
        self.generated = Counter("shardwise_generated_tokens_total", "Tokens generated", registry=r)
        self.prompt = Counter("shardwise_prompt_tokens_total", "Prompt tokens processed", registry=r)
        self.tps = Gauge("shardwise_tokens_per_second", "Generated tokens per second over the last 10 s",
                         registry=r)
        self.weight_bytes = Gauge("shardwise_weight_bytes", "Bytes of weights held by each rank",
                                  ["rank", "stage", "tp_rank"], registry=r)
        self.comm = Gauge("shardwise_communication_seconds_total",
                          "Seconds this rank spent in collectives and send/recv", ["rank"], registry=r)
        self.running = Gauge("shardwise_running_requests", "Requests being decoded", registry=r)
        self.waiting = Gauge("shardwise_waiting_requests", "Requests waiting for a cache slot", registry=r)
        self.ready = Gauge("shardwise_ready", "1 once every rank has loaded", registry=r)
        self.model = None          # rank 0's stage, for the mixture-of-experts load (ExpertLoad)
        r.register(ExpertLoad(lambda: self.model))
        self.engine = None         # for the KV cache's use (KVCacheUse)
        r.register(KVCacheUse(lambda: self.engine))
        r.register(Admission(lambda: self.engine))
        r.register(Speculation(lambda: self.engine))
        r.register(ModelServerProtocol(lambda: self.engine))
        self._window: deque = deque()
        self._lock = threading.Lock()

    def token(self, n: int = 1) -> None:
        self.generated.inc(n)
        now = time.monotonic()
        with self._lock:
            self._window.append((now, n))

    def render(self, engine, rank: int) -> bytes:
        from prometheus_client import generate_latest

        from shardwise.worker.distributed.tensor_parallel import COMM
        now = time.monotonic()
        with self._lock:
            while self._window and self._window[0][0] < now - 10:
                self._window.popleft()
            self.tps.set(sum(n for _, n in self._window) / 10.0)
        self.comm.labels(rank=str(rank)).set(COMM.seconds)
        if engine is not None:
            self.running.set(engine.running)
            self.waiting.set(len(engine.waiting))
        return generate_latest(self.registry)
