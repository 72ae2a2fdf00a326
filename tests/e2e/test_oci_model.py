"""End to end on local nodes: a model pushed to a registry as an OCI artifact (`shardwise push`, as a
user pushes one) and a ShardedModel whose only source is `uri: oci://<registry>/models/tiny:v1` and a
Secret of the registry's credentials. The registry is the real distribution registry on loopback
(plain HTTP, as a registry on the same machine is spoken to) with htpasswd users, reached through a
paced link so that the download lasts long enough for the operator to watch it. The model is probed
from the registry (no hints), planned, downloaded (status.download, a Downloaded Event) and Ready,
and answers the same greedy completion as the same folder served from `file://` beside it.

A tiny random Llama (two layers), so the whole test takes seconds, not minutes. Skipped when torch or
the registry binary (`shardwise kind build`) is missing.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from shardwise.e2e import localregistry
from .test_operator_worker import CRD, complete, serving_ip, wait
from .test_remote_model import downloaded_events, fetch_line
from ..worker.texts import PANGRAMS

pytestmark = [pytest.mark.controlplane, pytest.mark.slow, pytest.mark.timeout(600)]

USER, PASSWORD = "puller", "registry-pull-password-4f1c"
ROLE = "shardwise.dev/test-role"
# The tiny model is about 0.4 MiB: about 7 s through the link, several of the operator's reads of the
# pod's progress (every second in these tests) even on a loaded machine
LINK_BYTES_PER_S = 64 << 10
PROMPTS = ("the quick brown fox", "pack my box with")


def test_a_model_pushed_to_a_registry_is_probed_downloaded_and_answers_as_from_its_folder(
        cluster, namespace, kubectl, node_factory, tmp_path):
    pytest.importorskip("torch")
    if localregistry.binary() is None:
        pytest.skip("the registry binary is not built (shardwise kind build)")
    from shardwise.e2e.slowlink import SlowLink
    from shardwise.worker.weights.tiny import write_tiny_model

    folder = write_tiny_model(tmp_path / "tiny", PANGRAMS, layers=2, hidden=64, heads=4, kv_heads=2)
    cluster.install_crd(CRD)
    label = {"shardwise.dev/test": namespace}
    for role in ("oci", "file"):
        node_factory(f"{namespace[-6:]}-{role}", 1, local=True, labels={**label, ROLE: role})
    with localregistry.LocalRegistry(tmp_path / "registry", users={USER: PASSWORD}) as registry:
        _push(folder, f"oci://{registry.host}/models/tiny:v1")
        link = SlowLink(("127.0.0.1", registry.port), LINK_BYTES_PER_S, shared=True)
        kubectl("create", "secret", "generic", "registry-pull",
                f"--from-literal=OCI_USERNAME={USER}", f"--from-literal=OCI_PASSWORD={PASSWORD}")
        try:
            with cluster.operator(namespace, tmp_path / "operator.log"):
                _run(cluster, kubectl, label, f"oci://127.0.0.1:{link.port}/models/tiny:v1", folder)
        finally:
            link.close()
    operator_log = (tmp_path / "operator.log").read_text(errors="replace")
    assert PASSWORD not in operator_log


def _push(folder, target: str) -> None:
    """`shardwise push` with the credentials in the environment, as docs/model-sources.md says."""
    env = {**os.environ, "OCI_USERNAME": USER, "OCI_PASSWORD": PASSWORD}
    pushed = subprocess.run([sys.executable, "-m", "shardwise", "push", str(folder), target, "--plain-http"],
                            capture_output=True, text=True, timeout=120, env=env)
    assert pushed.returncode == 0, pushed.stderr
    assert pushed.stdout.startswith("pushed 3 files") and PASSWORD not in pushed.stdout + pushed.stderr


def _model(name: str, role: str, label: dict, **source) -> str:
    return json.dumps({
        "apiVersion": "shardwise.dev/v1alpha1", "kind": "ShardedModel", "metadata": {"name": name},
        "spec": {"model": source, "parallelism": {"tensor": 1, "pipeline": 1, "replicas": 1},
                 "serving": {"maxModelLength": 1024}, "placement": {"nodeSelector": {**label, ROLE: role}},
                 "recovery": {"backoffSeconds": 1, "maxRestarts": 3}}})


def _run(cluster, kubectl, label, uri: str, folder) -> None:
    kubectl("apply", "-f", "-", input=_model("tiny-oci", "oci", label, uri=uri,
                                             credentialsRef={"name": "registry-pull"}))
    kubectl("apply", "-f", "-", input=_model("tiny-file", "file", label, uri=f"file://{folder}"))

    def status() -> dict:
        return json.loads(kubectl("get", "sm", "tiny-oci", "-o", "json")).get("status", {})

    t0 = time.monotonic()
    # about 20 s on a quiet machine; minutes where other work shares its two cores
    ip = wait(lambda: serving_ip(kubectl, "tiny-oci"), 360, "tiny-oci Ready from oci://")
    print(f"created -> Ready (probed, fetched at {LINK_BYTES_PER_S >> 10} KiB/s, loaded) in "
          f"{time.monotonic() - t0:.1f}s")
    reference = wait(lambda: serving_ip(kubectl, "tiny-file"), 120, "tiny-file Ready from file://")
    # no hints in the spec: the plan's two layers were read from the registry by the probe pod
    assert status()["plan"]["placements"][0]["layers"] == "0-1"
    # status showed the download (status.download, the Downloading condition) and says it is done
    downloading = [c for c in status()["conditions"] if c["type"] == "Downloading"]
    assert [(c["status"], c["reason"]) for c in downloading] == [("False", "Done")], downloading
    assert uri in downloading[0]["message"] and not status().get("download")
    downloaded = wait(lambda: downloaded_events(kubectl, "tiny-oci"), 30, "a Downloaded Event")
    assert f"replica 0 has {uri} in its caches: fetched" in downloaded[0], downloaded
    line = fetch_line(kubectl, cluster, "tiny-oci", uri)
    assert "from the node's cache" in line and "fetched 0.0 MiB" not in line, line
    print(f"{downloaded[0]}; {line}")
    for prompt in PROMPTS:
        text = complete(ip, prompt)
        assert text and text == complete(reference, prompt), prompt
    # the credentials reached the pods through the Secret only: never in the spec, status or pods
    assert PASSWORD not in kubectl("get", "sm,pods", "-o", "json")
