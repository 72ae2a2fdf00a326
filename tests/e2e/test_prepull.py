"""End to end on local nodes: a ShardedModel from `s3://` (a real S3 server, MinIO, on loopback) with
`model.prePull: true`. Before its group's pod exists, a pre-pull pod on the planned node runs
`shardwise fetch` into that node's cache; once it Succeeded the operator creates the group's pod
(a PrePulled Event), deletes the pre-pull pod, and that pod finds every file in the node's cache
(its fetch line says 0.0 MiB fetched). status.nodeCache names the node.

Skipped when torch, the SmolLM2 weights or the S3 server binary are missing.
"""
from __future__ import annotations

import json
import os

import pytest

from tests.e2e.test_remote_model import _smollm2_gguf, fetch_line, stage0, wait

pytestmark = [pytest.mark.controlplane, pytest.mark.timeout(600)]

URI = "s3://models/smollm2"


def test_pre_pull_fills_the_planned_node_cache_before_the_pod_starts(cluster, namespace, kubectl, node_factory,
                                                                     tmp_path):
    from shardwise.e2e import s3server
    from shardwise.worker.fetch.s3 import S3Config, make_client
    from tests.e2e.test_remote_model import CRD

    gguf = _smollm2_gguf()
    if not os.access(s3server.minio_path(), os.X_OK):
        pytest.skip("the S3 server is not built: python -m shardwise.e2e.s3server")
    cluster.install_crd(CRD)
    label = {"shardwise.dev/test": namespace}
    node_factory(f"{namespace[-6:]}-pp-0", 1, local=True, labels=label)
    with s3server.running_s3_server(tmp_path / "minio") as store:
        client = make_client(S3Config(endpoint=store.endpoint, path_style=True), store.env())
        client.create_bucket(Bucket="models")
        with open(gguf, "rb") as f:
            client.put_object(Bucket="models", Key=f"smollm2/{gguf.name}", Body=f)
        kubectl("create", "secret", "generic", "store-creds",
                f"--from-literal=AWS_ACCESS_KEY_ID={store.access_key}",
                f"--from-literal=AWS_SECRET_ACCESS_KEY={store.secret_key}")
        with cluster.operator(namespace, tmp_path / "operator.log"):
            _run(cluster, kubectl, label, store.endpoint)


def _run(cluster, kubectl, label, endpoint) -> None:
    sm = {"apiVersion": "shardwise.dev/v1alpha1", "kind": "ShardedModel", "metadata": {"name": "smol"},
          "spec": {"model": {"uri": URI, "endpoint": endpoint, "pathStyle": True, "prePull": True,
                             "credentialsRef": {"name": "store-creds"}},
                   "parallelism": {"tensor": 1, "pipeline": 1, "replicas": 1},
                   "placement": {"nodeSelector": label},
                   "recovery": {"backoffSeconds": 1, "maxRestarts": 3}}}
    kubectl("apply", "-f", "-", input=json.dumps(sm))

    def reasons() -> dict[str, str]:
        items = json.loads(kubectl("get", "events", "--field-selector", "involvedObject.name=smol",
                                   "-o", "json"))["items"]
        return {e["reason"]: e["message"] for e in items}

    # the pre-pull pod runs before any pod of the group exists
    pulled = wait(lambda: json.loads(kubectl("get", "pods", "-l", "shardwise.dev/role=model-prepull",
                                             "-o", "json"))["items"] or None, 120, "the pre-pull pod")
    assert pulled[0]["spec"]["nodeName"] and stage0(kubectl)[0] is None
    node = pulled[0]["spec"]["nodeName"]
    wait(lambda: "PrePulled" in reasons() or None, 180, "the pre-pull done and the group released")
    assert "PrePulling" in reasons() and "PrePullFailed" not in reasons(), reasons()
    # the group's pod finds its files in the node's cache
    wait(lambda: stage0(kubectl)[0], 120, "the group's pod running")
    line = wait(lambda: _fetched(kubectl, cluster), 120, "the pod's fetch line")
    assert "fetched 0.0 MiB" in line and "from the node's cache" in line, line
    status = json.loads(kubectl("get", "sm", "smol", "-o", "json"))["status"]
    assert (status["nodeCache"]["uri"], status["nodeCache"]["nodes"]) == (URI, [node])
    wait(lambda: not json.loads(kubectl("get", "pods", "-l", "shardwise.dev/role=model-prepull",
                                        "-o", "json"))["items"] or None, 60, "the pre-pull pod deleted")


def _fetched(kubectl, cluster) -> str | None:
    try:
        return fetch_line(kubectl, cluster, uri=URI)
    except (AssertionError, OSError):
        return None


def test_a_refused_pre_pull_pod_never_blocks_the_group(cluster, namespace, kubectl, node_factory, tmp_path):
    """An admission policy of the cluster refuses pre-pull pods in this namespace: the group's pods
    are created anyway, and the refusal is said in one Warning."""
    from tests.e2e.test_remote_model import CRD
    cluster.install_crd(CRD)
    node_factory(f"{namespace}-g8", gpus=8, labels={"shardwise.dev/test": namespace})   # kwok: pods only pretend
    policy = f"no-prepull-{namespace}"[:63]
    kubectl("apply", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List", "items": [
        {"apiVersion": "admissionregistration.k8s.io/v1", "kind": "ValidatingAdmissionPolicy",
         "metadata": {"name": policy},
         "spec": {"failurePolicy": "Fail", "matchConstraints": {"resourceRules": [
             {"apiGroups": [""], "apiVersions": ["v1"], "operations": ["CREATE"], "resources": ["pods"]}]},
             "validations": [{"expression": "!has(object.metadata.labels) || "
                                            "!('shardwise.dev/role' in object.metadata.labels) || "
                                            "object.metadata.labels['shardwise.dev/role'] != 'model-prepull'",
                              "message": "pre-pull pods are not allowed here"}]}},
        {"apiVersion": "admissionregistration.k8s.io/v1", "kind": "ValidatingAdmissionPolicyBinding",
         "metadata": {"name": policy},
         "spec": {"policyName": policy, "validationActions": ["Deny"], "matchResources": {
             "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": namespace}}}}}]}))
    try:
        probe = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p", "labels": {
            "shardwise.dev/role": "model-prepull"}}, "spec": {"containers": [{"name": "c", "image": "x"}]}}

        def refused():
            try:
                kubectl("create", "--dry-run=server", "-f", "-", input=json.dumps(probe))
            except AssertionError as e:
                return "not allowed here" in str(e) or None
            return None
        wait(refused, 30, "the admission policy in force")
        with cluster.operator(namespace, tmp_path / "operator.log"):
            sm = {"apiVersion": "shardwise.dev/v1alpha1", "kind": "ShardedModel", "metadata": {"name": "pp"},
                  "spec": {"model": {"uri": URI, "endpoint": "http://127.0.0.1:9", "pathStyle": True,
                                     "prePull": True, "parameters": 135_000_000, "layers": 30, "heads": 9,
                                     "kvHeads": 3, "hiddenSize": 576, "vocabSize": 49152},
                           "parallelism": {"tensor": 1, "pipeline": 1, "replicas": 1},
                           "placement": {"nodeSelector": {"shardwise.dev/test": namespace}}}}
            kubectl("apply", "-f", "-", input=json.dumps(sm))
            wait(lambda: stage0(kubectl, "pp")[0] or _pod_named(kubectl), 90, "the group's pod despite the refusal")
            events = json.loads(kubectl("get", "events", "--field-selector", "involvedObject.name=pp",
                                        "-o", "json"))["items"]
            said = [e["message"] for e in events if e["reason"] == "PodRefused"]
            assert said and "not allowed here" in said[0] and "created without a pre-pull" in said[0], said
    finally:
        kubectl("delete", "validatingadmissionpolicybinding,validatingadmissionpolicy", policy, "--ignore-not-found",
                check=False)


def _pod_named(kubectl) -> str | None:
    pods = json.loads(kubectl("get", "pods", "-l", "shardwise.dev/model=pp,shardwise.dev/stage=0",
                              "-o", "json"))["items"]
    return pods[0]["metadata"]["name"] if pods else None
