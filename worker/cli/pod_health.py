"""/healthz, /metrics and /progress of a pod that does not serve the API (a pipeline stage after
the first, every training pod), and a remote model's final download report at
DOWNLOAD_PROGRESS_PATH (worker/cli/pod_fetch.py). The metrics go out through prometheus-client, as
the API server's do (worker/serving/http/server.py), under the same names for what both report (the
ranks' weight bytes, readiness), so one dashboard reads every pod."""
from __future__ import annotations

import json
import threading

from shardwise.crds import names


class PodMetrics:
    """A prometheus-client collector, read at each scrape: the pod's ranks' weight bytes and
    readiness, and a training job's step, loss and gradient bytes sent between replicate groups
    (by rank 0, since the pod started) from its progress.json, none before the first step."""

    def __init__(self, health: "StageHealth", progress_dir: str | None):
        self.health, self.progress_dir = health, progress_dir

    def collect(self):
        from prometheus_client.core import GaugeMetricFamily

        weights = GaugeMetricFamily("shardwise_weight_bytes", "Bytes of weights held by each rank",
                                    labels=["rank", "stage", "tp_rank"])
        for rank, s in sorted(self.health.stats.items()):
            weights.add_metric([str(rank), str(s["stage"]), str(s["tp_rank"])], s["weight_bytes"])
        yield weights
        yield GaugeMetricFamily("shardwise_ready", "1 once every rank has loaded", value=int(self.health.ready))
        yield from self._training()

    def _training(self):
        if self.progress_dir is None:
            return
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        from shardwise.worker.training.trainer import read_progress
        progress = read_progress(self.progress_dir) or {}
        if "step" not in progress:
            return
        yield GaugeMetricFamily("shardwise_train_step", "Training steps done", value=progress["step"])
        if progress.get("loss") is not None:
            yield GaugeMetricFamily("shardwise_train_loss", "Loss of the last step", value=progress["loss"])
        sent = CounterMetricFamily("shardwise_train_replicate_bytes", "Gradient bytes rank 0 sent between "
                                   "replicate groups since the pod started, by compression method",
                                   labels=["compression"])
        sent.add_metric([progress.get("compression", "none")], progress.get("replicate_bytes", 0))
        yield sent


class StageHealth:
    """/healthz (200 once every rank of the pod has loaded, or joined and resumed), /metrics,
    /progress of a training job when `progress_dir` (its checkpoint directory) is given, and
    DOWNLOAD_PROGRESS_PATH answering `download` (a remote model's final report) when given."""

    def __init__(self, ranks: int, host: str, port: int, progress_dir: str | None = None,
                 download: bytes | None = None):
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        from prometheus_client import CollectorRegistry, generate_latest
        self.expected, self.stats = ranks, {}
        registry = CollectorRegistry(auto_describe=False)
        registry.register(PodMetrics(self, progress_dir))
        health = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def do_GET(self):
                if self.path == "/healthz":
                    body = json.dumps({"status": "ok" if health.ready else "loading",
                                       "ranks": sorted(health.stats)}).encode()
                    self._send(200 if health.ready else 503, body, "application/json")
                elif self.path == "/metrics":
                    self._send(200, generate_latest(registry), "text/plain; version=0.0.4")
                elif self.path == names.DOWNLOAD_PROGRESS_PATH and download is not None:
                    self._send(200, download, "application/json")
                elif self.path == "/progress" and progress_dir is not None:
                    from shardwise.worker.training.trainer import read_progress
                    progress = read_progress(progress_dir)
                    self._send(200 if progress else 404,
                               json.dumps(progress or {"error": {"message": "no progress yet"}}).encode(),
                               "application/json")
                else:
                    self._send(404, b'{"error": {"message": "no route"}}', "application/json")

            def _send(self, code, body, ctype):
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        ThreadingHTTPServer.allow_reuse_address = True
        self.httpd = ThreadingHTTPServer((host, port), Handler)
        self.httpd.daemon_threads = True
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    @property
    def ready(self) -> bool:
        return len(self.stats) == self.expected

    def loaded(self, stats: dict) -> None:
        self.stats[stats["rank"]] = stats

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
