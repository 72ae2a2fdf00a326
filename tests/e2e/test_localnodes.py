"""Local nodes run a pod's containers as processes: command, env, mounted ConfigMaps, readiness
from the pod's own probe, restarts reported, processes killed with the pod or the node."""
from __future__ import annotations

import gzip
import json
import os
import signal
import textwrap
import time

import pytest

from shardwise.e2e.pytest_plugin import wait_until

pytestmark = [pytest.mark.controlplane, pytest.mark.timeout(240)]

# The container: records what it sees, then serves HTTP on its pod IP once the test allows it.
SERVER = textwrap.dedent("""
    import gzip, http.server, json, os, pathlib, sys, time
    out, gate = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
    seen = {k: os.environ.get(k) for k in ("MY_NAME", "MY_NAMESPACE", "MY_ROLE", "GREETING",
                                            "POD_IP", "PEER", "PLAN")}
    seen["plan_file"] = open(os.environ["PLAN"]).read()
    seen["gzip_file"] = gzip.decompress(open(os.environ["PLAN"] + ".gz", "rb").read()).decode()
    seen["pid"] = os.getpid()
    (out / f"seen-{os.getpid()}.json").write_text(json.dumps(seen))
    while not gate.exists():
        time.sleep(0.1)
    http.server.HTTPServer((os.environ["POD_IP"], 8080),
                           http.server.SimpleHTTPRequestHandler).serve_forever()
""")


def pod_manifest(name: str, node: str, script: str, out_dir: str, gate: str,
                 namespace: str) -> dict:
    return {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "labels": {"role": "server"}},
        "spec": {
            "nodeName": node, "hostname": "rank-0", "subdomain": "group",
            "terminationGracePeriodSeconds": 2,
            "volumes": [{"name": "plan", "configMap": {"name": "plan"}}],
            "containers": [{
                "name": "server", "image": "not-pulled",
                "command": ["python3", script], "args": [out_dir, gate],
                "env": [
                    {"name": "MY_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
                    {"name": "MY_NAMESPACE",
                     "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
                    {"name": "MY_ROLE",
                     "valueFrom": {"fieldRef": {"fieldPath": "metadata.labels['role']"}}},
                    {"name": "GREETING",
                     "valueFrom": {"configMapKeyRef": {"name": "plan", "key": "greeting"}}},
                    {"name": "PEER", "value": f"rank-0.group.{namespace}.svc.cluster.local:29500"},
                    {"name": "PLAN", "value": "/etc/shardwise/plan.json"},
                ],
                "volumeMounts": [{"name": "plan", "mountPath": "/etc/shardwise"}],
                "readinessProbe": {"httpGet": {"path": "/", "port": 8080}, "periodSeconds": 1},
            }],
        },
    }


def pod(kubectl, name: str) -> dict:
    return json.loads(kubectl("get", "pod", name, "-o", "json"))


def ready(p: dict) -> bool:
    return any(c["type"] == "Ready" and c["status"] == "True"
               for c in p["status"].get("conditions") or [])


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"


@pytest.fixture
def server(kubectl, namespace, tmp_path):
    script = tmp_path / "server.py"
    script.write_text(SERVER)
    # plan.json.gz is not UTF-8: kubectl stores it in binaryData, as the operator stores the contract
    (tmp_path / "plan.json.gz").write_bytes(gzip.compress(b'{"self": "/etc/shardwise/plan.json.gz", '
                                                          b'"log": "/dev/termination-log"}'))
    kubectl("create", "configmap", "plan", "--from-literal=greeting=hello",
            '--from-literal=plan.json={"stages": 2, "self": "/etc/shardwise/plan.json", "log": "/dev/termination-log"}',
            f"--from-file=plan.json.gz={tmp_path / 'plan.json.gz'}")
    return script, tmp_path


def seen_files(out_dir) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(out_dir.glob("seen-*.json"),
                                                      key=os.path.getmtime)]


def test_pod_runs_its_command_and_is_ready_only_when_its_probe_answers(kubectl, namespace,
                                                                       server):
    script, out = server
    gate = out / "gate"
    kubectl("apply", "-f", "-", input=json.dumps(
        pod_manifest("rank-0", "local-node-0", str(script), str(out), str(gate), namespace)))
    seen = wait_until(lambda: seen_files(out), 30, "the container to start")[0]
    p = pod(kubectl, "rank-0")
    ip = p["status"]["podIP"]
    assert ip.startswith("127.") and ip != "127.0.0.1"
    assert seen == {"MY_NAME": "rank-0", "MY_NAMESPACE": namespace, "MY_ROLE": "server",
                    "GREETING": "hello", "POD_IP": ip, "PEER": f"{ip}:29500",
                    "PLAN": seen["PLAN"], "plan_file": seen["plan_file"], "gzip_file": seen["gzip_file"],
                    "pid": seen["pid"]}
    assert seen["PLAN"] != "/etc/shardwise/plan.json" and seen["PLAN"].endswith("/plan.json")
    # Paths inside the pod named in a ConfigMap's file (the worker's pod contract) are this machine's.
    plan_file = json.loads(seen["plan_file"])
    assert plan_file["stages"] == 2 and plan_file["self"] == seen["PLAN"]
    assert plan_file["log"].endswith(f"{namespace}_rank-0/server.termination-log")
    # ...a gzip-compressed one's too (binaryData, written byte for byte, rewritten inside)
    assert json.loads(seen["gzip_file"]) == {"self": seen["PLAN"] + ".gz", "log": plan_file["log"]}

    # Running, but its probe does not answer yet: not Ready for a few probe periods.
    for _ in range(3):
        p = pod(kubectl, "rank-0")
        assert p["status"]["phase"] == "Running" and not ready(p)
        time.sleep(1)
    gate.touch()
    wait_until(lambda: ready(pod(kubectl, "rank-0")), 15, "the pod to become Ready")

    # A Service name resolves to a Ready pod behind it; a pod that exits 0 with
    # restartPolicy Never has Succeeded.
    kubectl("apply", "-f", "-", input=json.dumps({
        "apiVersion": "v1", "kind": "Service", "metadata": {"name": "server"},
        "spec": {"selector": {"role": "server"}, "ports": [{"port": 8080}]}}))
    answer = out / "client.txt"
    kubectl("apply", "-f", "-", input=json.dumps({
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": "client"},
        "spec": {"nodeName": "local-node-0", "restartPolicy": "Never", "containers": [{
            "name": "client", "image": "not-pulled",
            "command": ["sh", "-c", f'echo "$TARGET" > {answer}'],
            "env": [{"name": "TARGET",
                     "value": f"http://server.{namespace}.svc.cluster.local:8080/"}]}]}}))
    wait_until(lambda: pod(kubectl, "client")["status"].get("phase") == "Succeeded", 20,
               "the client pod to succeed")
    assert answer.read_text().strip() == f"http://{ip}:8080/"

    kubectl("delete", "pod", "rank-0", "--wait=false")
    wait_until(lambda: not alive(seen["pid"]), 15, "the process of the deleted pod to end")
    wait_until(lambda: "rank-0" not in kubectl("get", "pods", "-o", "name"), 15,
               "the pod object to go")


def test_killing_the_process_shows_up_as_a_restart(kubectl, namespace, server):
    script, out = server
    gate = out / "gate"
    gate.touch()
    kubectl("apply", "-f", "-", input=json.dumps(
        pod_manifest("rank-0", "local-node-0", str(script), str(out), str(gate), namespace)))
    wait_until(lambda: ready(pod(kubectl, "rank-0")), 30, "the pod to become Ready")
    first = seen_files(out)[0]["pid"]
    os.kill(first, signal.SIGKILL)

    def restarted():
        status = pod(kubectl, "rank-0")["status"]["containerStatuses"][0]
        return status["restartCount"] == 1 and status
    status = wait_until(restarted, 20, "the restart to be reported")
    assert status["lastState"]["terminated"]["exitCode"] == 137
    wait_until(lambda: ready(pod(kubectl, "rank-0")), 20, "the restarted pod to be Ready again")
    second = seen_files(out)[-1]["pid"]
    assert second != first and alive(second)
    kubectl("delete", "pod", "rank-0", "--wait=false")
    wait_until(lambda: not alive(second), 15, "the process to end")


def test_a_node_going_down_kills_its_processes(kubectl, namespace, server, cluster):
    script, out = server
    gate = out / "gate"
    gate.touch()
    node = cluster.add_local_node(f"{namespace}-local", gpus=2)
    try:
        kubectl("apply", "-f", "-", input=json.dumps(
            pod_manifest("rank-0", node, str(script), str(out), str(gate), namespace)))
        wait_until(lambda: ready(pod(kubectl, "rank-0")), 30, "the pod to become Ready")
        pid = seen_files(out)[0]["pid"]
        cluster.node_down(node)
        wait_until(lambda: not alive(pid), 10, "the processes of the downed node to end")
        cluster.wait_node_ready(node, ready=False, timeout=40)
    finally:
        cluster.delete_node(node)


def test_a_claim_is_its_bound_volume_folder_and_exits_leave_termination_messages(kubectl, namespace, cluster,
                                                                                 tmp_path):
    """Two pods mount one claim (bound by the volume controller to a hostPath volume) and see one
    folder; what a container writes to its terminationMessagePath, or the tail of its log when it
    failed with FallbackToLogsOnError, is its termination message."""
    with cluster.hostpath_claim(namespace, "shared", tmp_path / "volume"):
        def job(name: str, script: str) -> dict:
            return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
                    "spec": {"nodeName": "local-node-0", "restartPolicy": "Never",
                             "volumes": [{"name": "data", "persistentVolumeClaim": {"claimName": "shared"}}],
                             "containers": [{"name": "main", "image": "not-pulled", "command": ["sh", "-c", script],
                                             "env": [{"name": "OUT", "value": "/mnt/data"}],
                                             "volumeMounts": [{"name": "data", "mountPath": "/mnt/data"}],
                                             "terminationMessagePolicy": "FallbackToLogsOnError"}]}}
        kubectl("apply", "-f", "-", input=json.dumps(job(
            "writer", 'echo written > "$OUT/note" && echo "42 steps" > /dev/termination-log')))
        wait_until(lambda: pod(kubectl, "writer")["status"].get("phase") == "Succeeded", 60, "the writer to finish")
        kubectl("apply", "-f", "-", input=json.dumps(job(
            "reader", 'cat "$OUT/note"; echo "error: nothing to do" >&2; exit 3')))
        wait_until(lambda: pod(kubectl, "reader")["status"].get("phase") == "Failed", 60, "the reader to fail")

    assert (tmp_path / "volume" / "note").read_text() == "written\n"
    done = pod(kubectl, "writer")["status"]["containerStatuses"][0]["state"]["terminated"]
    assert done["exitCode"] == 0 and done["message"] == "42 steps\n"
    failed = pod(kubectl, "reader")["status"]["containerStatuses"][0]["state"]["terminated"]
    assert failed["exitCode"] == 3
    # the log's tail: what the reader found in the shared folder, then its error
    assert failed["message"].splitlines()[-2:] == ["written", "error: nothing to do"]


def test_a_hostpath_volume_is_a_folder_of_its_node_gone_with_the_node(kubectl, namespace, cluster, tmp_path):
    """A pod's own hostPath volume is node-local: a later pod on the same node reads what the first
    wrote, a pod on another node sees an empty folder, and a deleted node's folder is gone."""
    nodes = [cluster.add_local_node(f"{namespace[-6:]}-disk-{i}", gpus=1) for i in range(2)]
    try:
        def job(name: str, node: str, script: str) -> dict:
            return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
                    "spec": {"nodeName": node, "restartPolicy": "Never",
                             "volumes": [{"name": "disk", "hostPath": {"path": "/var/lib/shardwise-test",
                                                                       "type": "DirectoryOrCreate"}}],
                             "containers": [{"name": "main", "image": "not-pulled", "command": ["sh", "-c", script],
                                             "volumeMounts": [{"name": "disk", "mountPath": "/disk"}]}]}}

        def run(name: str, node: str, script: str) -> str:
            kubectl("apply", "-f", "-", input=json.dumps(job(name, node, script)))
            wait_until(lambda: pod(kubectl, name)["status"].get("phase") == "Succeeded", 60, f"{name} to finish")
            return name
        run("writer", nodes[0], 'echo on-node-0 > /disk/note')
        run("same-node", nodes[0], 'cp /disk/note /disk/read-back')
        run("other-node", nodes[1], 'test ! -e /disk/note && touch /disk/empty')
        disks = [cluster.state_dir / "nodes" / n / "hostpath" / "var/lib/shardwise-test" for n in nodes]
        assert (disks[0] / "read-back").read_text() == "on-node-0\n"
        assert (disks[1] / "empty").exists() and not (disks[1] / "note").exists()
        assert not (tmp_path / "var").exists()
        cluster.delete_node(nodes[0])
        wait_until(lambda: not disks[0].exists(), 30, "the deleted node's disk to be gone")
        assert (disks[1] / "empty").exists()
    finally:
        for n in nodes:
            cluster.delete_node(n)
