"""A remote model's download as a user sees it: status.download, the Downloading condition and the
Event when a replica has the model; the reports read from a real HTTP server on 127.0.0.1."""
from __future__ import annotations

import http.server
import json
import time

import pytest

from tests.operator import fakepods

from shardwise.crds import names
from shardwise.crds.download import STALL_SECONDS, DownloadReport
from shardwise.crds.status import ShardedModelStatus
from shardwise.operator.controller import download as reader
from shardwise.operator.controller import progress
from shardwise.operator.decide import download

URI = "s3://models/smollm2"
T0, T1 = "2026-01-01T00:00:00Z", "2026-01-01T00:01:00Z"


def fetching(fetched, total, rate=0.0, **more):
    return DownloadReport(bytes_fetched=fetched, bytes_total=total, rate=rate, **more)


def test_a_replica_fetching_is_listed_and_downloading_says_how_far():
    listed, conds, events = download.decide({}, [], {0: [fetching(1 << 30, 4 << 30, 100 << 20)]}, URI, T0)
    assert listed == [{"replica": 0, "bytesFetched": 1 << 30, "bytesTotal": 4 << 30, "percent": 25,
                       "rate": 100 << 20}]
    ShardedModelStatus.model_validate({"download": listed})   # what the CRD's schema accepts
    (cond,) = conds
    assert (cond["type"], cond["status"], cond["reason"]) == ("Downloading", "True", "Fetching")
    assert cond["message"] == "replica 0: 1.0 GiB of 4.0 GiB (25%), 100.0 MiB/s"
    assert events == []


def test_a_stalled_download_says_so_in_one_line_with_the_pods_last_error():
    stuck = fetching(5, 10, stalled_seconds=STALL_SECONDS + 35, retries=3, error="connection reset by peer")
    _, conds, _ = download.decide({}, [], {1: [fetching(1, 10, 9.0), stuck]}, URI, T0)
    (cond,) = conds
    assert cond["reason"] == "Stalled"
    assert cond["message"] == (f"replica 1: no byte for {STALL_SECONDS + 35} s from {URI} "
                               f"(retry 3: connection reset by peer)")
    assert "\n" not in cond["message"]


def test_a_replica_done_leaves_status_with_an_event_and_downloading_turns_false():
    before = {"download": [{"replica": 0, "bytesFetched": 5, "bytesTotal": 10, "percent": 50, "rate": 1}]}
    _, conds, _ = download.decide({}, [], {0: [fetching(5, 10)]}, URI, T0)
    listed, conds, events = download.decide(before, conds, {0: [fetching(10, 10, done=True, bytes_cached=2048)]},
                                            URI, T1)
    assert listed == []
    (cond,) = conds
    assert (cond["status"], cond["reason"], cond["lastTransitionTime"]) == ("False", "Done", T1)
    assert [(e.type, e.reason, e.message) for e in events] == [
        ("Normal", "Downloaded", f"replica 0 has {URI} in its caches: fetched 10 B, 2.0 KiB already cached")]


def test_a_model_that_never_downloads_gets_no_condition():
    assert download.decide({}, [{"type": "Ready", "status": "True"}], {}, URI, T0)[1] == [
        {"type": "Ready", "status": "True"}]


def test_the_condition_names_a_few_replicas_and_counts_the_rest():
    reports = {r: [fetching(r, 100)] for r in range(500)}
    listed, conds, _ = download.decide({}, [], reports, URI, T0)
    assert len(listed) == 256, "status.download is bounded"
    assert conds[0]["message"].endswith("; 496 more") and conds[0]["message"].count("replica") == 4


# ---------------------------------------------------------------- the pods' reports, over HTTP

class _Pod(http.server.BaseHTTPRequestHandler):
    body = b""
    paths: list = []

    def do_GET(self) -> None:  # noqa: N802
        type(self).paths.append(self.path)
        body = type(self).body
        fakepods.send(self, body)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture(scope="module")
def pod():
    server = fakepods.serve(_Pod)
    yield {"metadata": {"name": "m-r0-s0-a0", "labels": {names.LABEL_ATTEMPT: "0"}},
           "status": {"podIP": "127.0.0.1", "phase": "Running"},
           "spec": fakepods.http_port(server)}
    server.shutdown()


def test_a_pods_report_is_read_from_its_download_path(pod):
    _Pod.body = DownloadReport(bytes_fetched=7, bytes_total=9, rate=1.5).model_dump_json().encode()
    assert reader.fetch_download(pod) == DownloadReport(bytes_fetched=7, bytes_total=9, rate=1.5)
    assert _Pod.paths[-1] == names.DOWNLOAD_PROGRESS_PATH


@pytest.mark.parametrize("body", [b'{"pad": "' + b"x" * (10 << 20) + b'"}', b'{"bytes_fetched": -5}', b"[" * 50_000])
def test_a_hostile_report_is_none_and_read_within_the_deadline(pod, body):
    _Pod.body = body
    started = time.monotonic()
    assert reader.fetch_download(pod) is None
    assert time.monotonic() - started < progress.PROGRESS_TIMEOUT + 1.5


# ---------------------------------------------------------------- a pass of the reconciler

def test_passes_over_an_s3_model_show_its_pods_fetching_then_done():
    from tests.operator.builders import k8s_node
    from tests.operator.test_decide import LLAMA_8B, Cluster
    from shardwise.operator.decide.state import parse_state

    c = Cluster({"model": {**LLAMA_8B, "uri": URI}, "parallelism": {"tensor": 8, "pipeline": 2, "replicas": 1}},
                [k8s_node("n0"), k8s_node("n1")])
    c.reconcile()
    c.reconcile()
    pods = c.replica_pods(0)
    assert len(pods) == 2
    for p in pods:   # running, fetching, not Ready
        p["spec"]["nodeName"] = p["metadata"]["annotations"][names.ANNOTATION_PLANNED_NODE]
        p["status"] = {"phase": "Running", "podIP": "10.0.0.1"}

    def pass_with(report):
        d = c.reconcile()
        state = parse_state(c.body, list(c.pods.values()), c.configmap, "img:1", c.read_model)
        new = {"conditions": c.status.get("conditions")}
        events = reader.apply(new, state, d, lambda pod: report, c.now)
        c.body["status"].update({k: v for k, v in new.items() if v is not None})
        if new["download"] is None:
            c.body["status"].pop("download", None)
        return events

    assert pass_with(fetching(1 << 30, 4 << 30, 64 << 20)) == []
    assert c.status["download"] == [{"replica": 0, "bytesFetched": 2 << 30, "bytesTotal": 8 << 30, "percent": 25,
                                     "rate": 128 << 20}]
    assert c.condition("Downloading")["reason"] == "Fetching"
    assert metric("shardwise_download_bytes_per_second", c) == 128 << 20
    assert metric("shardwise_download_bytes_total", c) == 8 << 30
    events = pass_with(fetching(4 << 30, 4 << 30, done=True))
    assert "download" not in c.status and c.condition("Downloading")["status"] == "False"
    assert [e.reason for e in events] == ["Downloaded"]
    assert metric("shardwise_download_bytes_per_second", c) == 0


def metric(name, c):
    from shardwise.operator.controller import metrics, report
    from shardwise.operator.decide.state import parse_state
    state = parse_state(c.body, list(c.pods.values()), c.configmap, "img:1", c.read_model)
    report.record_metrics(state, c.decision, c.status, c.now)
    return metrics.REGISTRY.get_sample_value(name, {"namespace": "ns", "model": "m"})


# ---------------------------------------------------------------- a pod Pod Security refuses

def test_a_pod_security_refusal_is_one_line_saying_to_cache_in_the_pod():
    from kubernetes.client.rest import ApiException

    from shardwise.operator.controller import apply, reconciler
    from shardwise.operator.decide.state import parse_state

    said = ('pods "m-r0-s0-a0" is forbidden: violates PodSecurity "restricted:latest": '
            'hostPath volumes (volume "model-cache"), runAsNonRoot != true (container "prepare-model-cache")')
    error = ApiException(status=403, reason="Forbidden")
    error.body = json.dumps({"kind": "Status", "status": "Failure", "reason": "Forbidden", "code": 403,
                             "message": said})
    assert apply.pod_refusal(error) == said
    other = ApiException(status=403, reason="Forbidden")
    other.body = json.dumps({"message": 'pods is forbidden: User "x" cannot create resource "pods"'})
    assert apply.pod_refusal(other) == "", "RBAC is not admission: that error is raised as before"
    body = {"metadata": {"name": "m", "namespace": "ns", "uid": "u", "generation": 1},
            "spec": {"model": {"uri": URI, "parameters": 10**6, "layers": 4, "heads": 8}}}
    message = reconciler.refused_message(parse_state(body, [], None, "img:1"), said)
    assert message.startswith(said) and message.endswith("needs spec.model.cache: pod") and "\n" not in message


def _fetching_model(replicas: int, pipeline: int):
    from tests.operator.builders import k8s_node
    from tests.operator.test_decide import LLAMA_8B, Cluster

    c = Cluster({"model": {**LLAMA_8B, "uri": URI},
                 "parallelism": {"tensor": 8, "pipeline": pipeline, "replicas": replicas}},
                [k8s_node(f"n{i}") for i in range(replicas * pipeline)])
    c.reconcile()
    c.reconcile()
    for p in c.replica_pods():
        p["spec"]["nodeName"] = p["metadata"]["annotations"][names.ANNOTATION_PLANNED_NODE]
        p["status"] = {"phase": "Running", "podIP": "10.0.0.1"}
    return c


def _state(c):
    from shardwise.operator.decide.state import parse_state
    return parse_state(c.body, list(c.pods.values()), c.configmap, "img:1", c.read_model)


def test_a_replica_whose_pods_did_not_all_answer_is_never_called_done():
    c = _fetching_model(1, 2)
    answers = iter([fetching(10, 10, done=True), None])   # stage 0 done, stage 1 silent
    new = {"conditions": []}
    events = reader.apply(new, _state(c), c.decision, lambda pod: next(answers), c.now)
    assert events == [] and new["download"][0]["percent"] == 99
    assert new["conditions"][0]["reason"] == "Fetching"


def test_every_replica_has_its_turn_however_many_fetch_at_once():
    from datetime import timedelta
    c = _fetching_model(40, 1)
    asked: set = set()
    for period in range(4):
        calls = []

        def fetch(pod):
            calls.append(pod)
            return fetching(1, 10)
        new = {"conditions": []}
        reader.apply(new, _state(c), c.decision, fetch,
                     c.now + timedelta(seconds=period * progress.POLL_SECONDS))
        assert len(calls) <= reader.MAX_PODS_PER_PASS
        asked |= {p["metadata"]["labels"][names.LABEL_REPLICA] for p in calls}
        c.body["status"]["download"] = new["download"]
        assert len(new["download"]) >= len(asked) - 1   # what a pass did not read keeps its last entry
    assert len(asked) == 40
