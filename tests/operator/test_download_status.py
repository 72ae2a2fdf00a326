"""A remote model's download as a user sees it: status.download, the Downloading condition and one
Downloaded Event per replica attempt, however short its download (a pod Ready before any pass read
it, a start from a warm cache); the reports read from a real HTTP server on 127.0.0.1."""
from __future__ import annotations

import http.server
import json
import time
from datetime import datetime, timezone

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
NOW = datetime(2026, 1, 1, tzinfo=timezone.utc)


def fetching(fetched, total, rate=0.0, **more):
    return DownloadReport(bytes_fetched=fetched, bytes_total=total, rate=rate, **more)


def test_a_replica_fetching_is_listed_and_downloading_says_how_far():
    listed, conds, events, _ = download.decide([], {0: [fetching(1 << 30, 4 << 30, 100 << 20)]}, URI, T0)
    assert listed == [{"replica": 0, "bytesFetched": 1 << 30, "bytesTotal": 4 << 30, "percent": 25,
                       "rate": 100 << 20}]
    ShardedModelStatus.model_validate({"download": listed})   # what the CRD's schema accepts
    (cond,) = conds
    assert (cond["type"], cond["status"], cond["reason"]) == ("Downloading", "True", "Fetching")
    assert cond["message"] == "replica 0: 1.0 GiB of 4.0 GiB (25%), 100.0 MiB/s"
    assert events == []


def test_a_stalled_download_says_so_in_one_line_with_the_pods_last_error():
    stuck = fetching(5, 10, stalled_seconds=STALL_SECONDS + 35, retries=3, error="connection reset by peer")
    _, conds, _, _ = download.decide([], {1: [fetching(1, 10, 9.0), stuck]}, URI, T0)
    (cond,) = conds
    assert cond["reason"] == "Stalled"
    assert cond["message"] == (f"replica 1: no byte for {STALL_SECONDS + 35} s from {URI} "
                               f"(retry 3: connection reset by peer)")
    assert "\n" not in cond["message"]


def test_a_replica_done_leaves_status_with_an_event_and_downloading_turns_false():
    _, conds, _, _ = download.decide([], {0: [fetching(5, 10)]}, URI, T0)
    listed, conds, events, downloaded = download.decide(conds, {0: [fetching(10, 10, done=True, bytes_cached=2048)]},
                                                        URI, T1)
    assert listed == [] and downloaded == {0}
    (cond,) = conds
    assert (cond["status"], cond["reason"], cond["lastTransitionTime"]) == ("False", "Done", T1)
    assert [(e.type, e.reason, e.message) for e in events] == [
        ("Normal", "Downloaded", f"replica 0 has {URI} in its caches: fetched 10 B, 2.0 KiB already cached")]


def test_a_model_that_never_downloads_gets_no_condition():
    assert download.decide([{"type": "Ready", "status": "True"}], {}, URI, T0).conditions == [
        {"type": "Ready", "status": "True"}]


def test_the_condition_names_a_few_replicas_and_counts_the_rest():
    reports = {r: [fetching(r, 100)] for r in range(500)}
    listed, conds, _, _ = download.decide([], reports, URI, T0)
    assert len(listed) == 256, "status.download is bounded"
    assert conds[0]["message"].endswith("; 496 more") and conds[0]["message"].count("replica") == 4


# ---------------------------------------------------------------- one Downloaded Event per replica attempt

def _group(attempt=0, ready_for=10.0, downloaded=None):
    from datetime import timedelta
    from shardwise.crds.status import GroupPhase, ReplicaGroupStatus
    from shardwise.operator.decide.recovery import iso
    return ReplicaGroupStatus(replica=0, attempt=attempt, phase=GroupPhase.READY, downloaded=downloaded,
                              ready_since=iso(NOW - timedelta(seconds=ready_for)))


def _ready_pod(attempt=0, stage=0):
    return {"metadata": {"name": f"m-r0-s{stage}-a{attempt}", "labels": {names.LABEL_ATTEMPT: str(attempt)}},
            "status": {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]}}


def test_a_replica_ready_before_any_read_gets_one_downloaded_event_saying_what_it_fetched_and_reused():
    groups = {0: _group(attempt=1)}
    pods = {0: [_ready_pod(1, 0), _ready_pod(1, 1), _ready_pod(0, 0)]}    # the last: an older attempt's
    (asked,) = download.pods_to_ask(groups, pods, NOW)
    assert [p["metadata"]["name"] for p in asked.pods] == ["m-r0-s0-a1", "m-r0-s1-a1"] and not asked.starting
    final = [fetching(0, 0, done=True, bytes_cached=3 << 20), fetching(1 << 20, 1 << 20, done=True, bytes_cached=0)]
    out = download.decide([], {0: final}, URI, T0)
    assert [(e.type, e.reason, e.message) for e in out.events] == [
        ("Normal", "Downloaded", f"replica 0 has {URI} in its caches: fetched 1.0 MiB, 3.0 MiB already cached")]
    assert out.downloaded == {0} and out.listed == [] and out.conditions == []
    groups[0].downloaded = groups[0].attempt          # what the pass writes to the group's record
    assert download.pods_to_ask(groups, pods, NOW) == [], "its Event is posted: never asked again"
    assert len(download.pods_to_ask({0: _group(attempt=2, downloaded=1)}, {0: [_ready_pod(2)]}, NOW)) == 1, \
        "a new attempt fetches again and has its own Event"


def test_a_ready_replica_is_asked_for_its_final_report_for_a_bounded_time():
    pods = {0: [_ready_pod()]}
    assert download.pods_to_ask({0: _group(ready_for=download.READY_ASK_SECONDS - 1)}, pods, NOW)
    assert download.pods_to_ask({0: _group(ready_for=download.READY_ASK_SECONDS + 1)}, pods, NOW) == [], \
        "a pod that never answers (an older worker image) costs no pass once its group has been Ready a while"
    starting = {0: [{**_ready_pod(), "status": {"phase": "Running"}}]}
    from shardwise.crds.status import ReplicaGroupStatus
    assert download.pods_to_ask({0: ReplicaGroupStatus(replica=0)}, starting, NOW)[0].starting


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

def _s3_model(pipeline: int = 2):
    from tests.operator.builders import k8s_node
    from tests.operator.test_decide import LLAMA_8B, Cluster
    c = Cluster({"model": {**LLAMA_8B, "uri": URI}, "parallelism": {"tensor": 8, "pipeline": pipeline, "replicas": 1},
                 "recovery": {"backoffSeconds": 1}}, [k8s_node(f"n{i}") for i in range(2 * pipeline)])
    c.reconcile()
    c.reconcile()
    return c


def _pass(c, fetch):
    """One reconciler pass whose download part reads the pods with `fetch`; its Downloaded Events."""
    d = c.reconcile()
    new = {"conditions": c.status.get("conditions")}
    events = reader.apply(new, _state(c), d, fetch, c.now)
    c.body["status"].update({k: v for k, v in new.items() if v is not None})
    if new["download"] is None:
        c.body["status"].pop("download", None)
    return events


def test_passes_over_an_s3_model_show_its_pods_fetching_then_done():
    c = _s3_model()
    pods = c.replica_pods(0)
    assert len(pods) == 2
    for p in pods:   # running, fetching, not Ready
        p["spec"]["nodeName"] = p["metadata"]["annotations"][names.ANNOTATION_PLANNED_NODE]
        p["status"] = {"phase": "Running", "podIP": "10.0.0.1"}

    def pass_with(report):
        return _pass(c, lambda pod: report)

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
    assert pass_with(fetching(4 << 30, 4 << 30, done=True)) == [], "one Event: its pods still answer once done"


def test_a_download_over_before_any_read_gets_its_event_once_per_attempt():
    c = _s3_model()
    c.run_all()       # fetched from a warm cache and loaded between two passes: Ready at the first read
    asked = []

    def warm(pod):
        asked.append(pod["metadata"]["name"])
        return fetching(0, 0, done=True, bytes_cached=5 << 20)
    events = _pass(c, warm)
    assert c.group(0)["phase"] == "Ready" and len(asked) == 2
    assert [e.message for e in events] == [f"replica 0 has {URI} in its caches: fetched 0 B, 10.0 MiB already cached"]
    first = c.group(0)["attempt"]
    assert c.group(0)["downloaded"] == first
    assert "download" not in c.status and all(x["type"] != "Downloading" for x in c.status["conditions"])
    for _ in range(3):
        assert _pass(c, warm) == [] and len(asked) == 2, "posted once, then its pods are not asked again"
    c.fail(c.replica_pods(0)[0]["metadata"]["name"])     # the group is re-planned: attempt 1 fetches again
    events = []
    for _ in range(6):
        events += _pass(c, lambda pod: fetching(7 << 20, 7 << 20, done=True))
        c.run_all()
    assert c.group(0)["attempt"] == c.group(0)["downloaded"] == first + 1
    assert [e.message for e in events] == [f"replica 0 has {URI} in its caches: fetched 14.0 MiB, 0 B already cached"]


def test_a_downloaded_event_is_posted_once_the_status_recording_it_is_written():
    from shardwise.operator.controller import apply, reconciler
    c = _s3_model(pipeline=1)
    c.run_all()
    done = fetching(0, 0, done=True, bytes_cached=1)

    class Writer:
        def __init__(self, fails):
            self.fails, self.written = fails, []

        def patch(self, new):
            if self.fails:
                raise apply.StaleStatus("changed since it was read")
            self.written.append(new)

    refused, out = Writer(fails=True), reconciler.Outcome()
    with pytest.raises(apply.StaleStatus):
        reconciler._report(refused, _state(c), c.reconcile(), (lambda p: None, lambda p: done), c.now, out)
    assert "Downloaded" not in [e.reason for e in out.events], "not written: the next pass posts it"
    written, out = Writer(fails=False), reconciler.Outcome()
    reconciler._report(written, _state(c), c.reconcile(), (lambda p: None, lambda p: done), c.now, out)
    assert [e.reason for e in out.events].count("Downloaded") == 1
    record = written.written[-1]["groups"][0]
    assert record["downloaded"] == record["attempt"]


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
