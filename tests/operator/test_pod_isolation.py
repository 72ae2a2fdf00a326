"""What keeps one tenant's model from another's, as rendered (pure; no cluster): API keys from a
Secret, the model's NetworkPolicy, and the local checkpoint tier's node directory (only the roots the
operator allows, handed to the non-root worker)."""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import tempfile
from datetime import datetime, timezone

import pytest

from shardwise.crds.contract import PodContract
from shardwise.crds.models import ShardedModel, ShardedModelSpec, load_manifest
from shardwise.operator.decide import decisions, status
from shardwise.operator.decide.decisions import World
from shardwise.operator.decide.state import parse_state
from shardwise.operator.render import renderer, settings
from shardwise.operator.render.settings import Settings
from shardwise.worker.cli import pod as worker_pod
from tests.operator.builders import k8s_node
from tests.operator.test_renderer import _plan

META = {"name": "llama", "namespace": "prod", "uid": "uid-1", "generation": 1}
HINTS = {"uri": "/models/m", "parameters": 1_000_000_000, "layers": 16, "heads": 16}
T0 = datetime(2026, 1, 1, tzinfo=timezone.utc)


def _spec(**spec) -> dict:
    return {"model": dict(HINTS), "parallelism": {"tensor": 2, "pipeline": 2, "replicas": 2},
            "serving": {"port": 8080}, **spec}


def _model(**spec) -> ShardedModel:
    return ShardedModel(metadata=META, spec=ShardedModelSpec.model_validate(_spec(**spec)))


def _training(**spec) -> dict:
    return _spec(workload="training", training={"data": "/d.txt", "steps": 10},
                 checkpoint={"claim": "ckpt", **spec.pop("checkpoint", {})}, **spec)


def _worker_args(pod: dict) -> argparse.Namespace:
    """The container's arguments as `shardwise worker` parses them."""
    parser = argparse.ArgumentParser()
    worker_pod.add_arguments(parser)
    container = pod["spec"]["containers"][0]
    assert container["command"] == ["shardwise", "worker"]
    return parser.parse_args(container["args"])


# --- API keys ----------------------------------------------------------------------------------------

def test_serving_pods_read_the_api_keys_from_the_secret_mounted_read_only():
    model = _model(serving={"port": 8080, "auth": {"secretRef": {"name": "llama-keys"}}})
    plan = _plan()
    for pod in renderer.render_replica_pods(model, plan, 0, 0):
        spec = pod["spec"]
        volume = next(v for v in spec["volumes"] if v["name"] == "api-keys")
        assert volume["secret"]["secretName"] == "llama-keys"
        assert volume["secret"]["items"] == [{"key": "api-keys", "path": "keys"}]
        mount = next(m for m in spec["containers"][0]["volumeMounts"] if m["name"] == "api-keys")
        assert mount["readOnly"] is True
        # the worker's own flag names the mounted file
        assert _worker_args(pod).api_key_file == f"{mount['mountPath']}/keys"
        # probes stay keyless: /healthz is not under /v1
        assert spec["containers"][0]["readinessProbe"]["httpGet"]["path"] == "/healthz"
    # the key inside the Secret can be named
    other = _model(serving={"auth": {"secretRef": {"name": "k", "key": "tokens.txt"}}})
    pod = renderer.render_pod(other, plan, plan.placement(0, 0), 0)
    assert next(v for v in pod["spec"]["volumes"] if v["name"] == "api-keys")["secret"]["items"][0]["key"] == "tokens.txt"


def test_the_pod_contract_carries_neither_the_keys_secret_nor_the_peers():
    """A worker image older than these fields reads the contract as before (its serving section
    refuses unknown fields)."""
    model = _model(serving={"port": 8080, "auth": {"secretRef": {"name": "k"}},
                            "allowFrom": [{"podSelector": {}}]})
    text = renderer.configmap_contract(renderer.render_configmap(model, _plan()))
    served = json.loads(text)["serving"]
    assert served["port"] == 8080 and not {"auth", "allow_from", "allowFrom"} & set(served)
    assert PodContract.from_json(text).serving.port == 8080


def test_without_auth_no_key_is_asked_and_existing_pods_keep_their_hash():
    plan = _plan()
    pod = renderer.render_pod(_model(), plan, plan.placement(0, 0), 0)
    assert _worker_args(pod).api_key_file is None
    assert "api-keys" not in {v["name"] for v in pod["spec"]["volumes"]}
    # allowFrom is the NetworkPolicy's: changing it rolls no pod; turning keys on does
    plain = _model().spec
    fenced = _model(serving={"port": 8080, "allowFrom": [{"podSelector": {"matchLabels": {"app": "web"}}}]}).spec
    keyed = _model(serving={"port": 8080, "auth": {"secretRef": {"name": "k"}}}).spec
    assert renderer.spec_hash(plain) == renderer.spec_hash(fenced) != renderer.spec_hash(keyed)


def test_a_training_job_serves_no_api_and_mounts_no_keys():
    model = ShardedModel(metadata=META, spec=ShardedModelSpec.model_validate(
        _training(serving={"auth": {"secretRef": {"name": "k"}}})))
    plan = _plan()
    pod = renderer.render_pod(model, plan, plan.placement(0, 0), 0)
    assert "api-keys" not in {v["name"] for v in pod["spec"]["volumes"]}
    assert _worker_args(pod).api_key_file is None


@pytest.mark.parametrize("serving, words", [
    ({"auth": {"secretRef": {"name": "Bad_Name"}}}, "spec.serving.auth.secretRef.name"),
    ({"auth": {}}, "spec.serving.auth.secretRef"),
    ({"allowFrom": [{}]}, "each peer needs namespaceSelector or podSelector"),
    ({"allowFrom": [{"podSelector": {"matchLabels": {"bad key!": "x"}}}]}, "'bad key!' is not a label key"),
    ({"allowFrom": [{"podSelector": {"matchLabels": {"app": "-x"}}}]}, "spec.serving.allowFrom"),
])
def test_bad_auth_or_peers_are_refused_in_one_line(serving, words):
    manifest = {"apiVersion": "shardwise.dev/v1alpha1", "kind": "ShardedModel", "metadata": {"name": "m"},
                "spec": _spec(serving=serving)}
    with pytest.raises(ValueError) as e:
        load_manifest(manifest)
    assert words in str(e.value) and "\n" not in str(e.value)


# --- NetworkPolicy -----------------------------------------------------------------------------------

def _policy(model: ShardedModel, **kw) -> dict:
    objects = renderer.render_shared(model, _plan(), Settings(**kw))
    (policy,) = [o for o in objects if o["kind"] == "NetworkPolicy"]
    return policy


def test_the_rendezvous_and_collectives_hear_only_the_models_own_pods_the_api_anyone():
    policy = _policy(_model())
    own = {"matchLabels": {"shardwise.dev/model": "llama"}}
    assert policy["metadata"]["name"] == "llama" and policy["metadata"]["namespace"] == "prod"
    (ref,) = policy["metadata"]["ownerReferences"]
    assert ref["uid"] == "uid-1" and ref["controller"] is True
    spec = policy["spec"]
    assert spec["podSelector"] == own and spec["policyTypes"] == ["Ingress"]
    peers, serving = spec["ingress"]
    # every port (TCPStore, gloo's and NCCL's ephemeral ones) from the model's pods only
    assert peers == {"from": [{"podSelector": own}]}
    # the serving port from anywhere: no `from`
    assert serving == {"ports": [{"protocol": "TCP", "port": 8080}]}


def test_allow_from_limits_the_serving_port_and_keeps_the_operator_in():
    model = _model(serving={"port": 9000, "allowFrom": [
        {"namespaceSelector": {"matchLabels": {"team": "web"}}},
        {"podSelector": {"matchLabels": {"app": "gateway"}}},
        {"namespaceSelector": {}, "podSelector": {"matchLabels": {"role": "client"}}}]})
    policy = _policy(model, operator_namespace="shardwise-system",
                     operator_labels={"app.kubernetes.io/name": "shardwise"})
    serving = policy["spec"]["ingress"][1]
    assert serving["ports"] == [{"protocol": "TCP", "port": 9000}]
    assert serving["from"] == [
        {"namespaceSelector": {"matchLabels": {"team": "web"}}},
        {"podSelector": {"matchLabels": {"app": "gateway"}}},
        {"namespaceSelector": {}, "podSelector": {"matchLabels": {"role": "client"}}},
        {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "shardwise-system"}},
         "podSelector": {"matchLabels": {"app.kubernetes.io/name": "shardwise"}}}]
    # an operator outside the cluster has no pods to name
    assert len(_policy(model)["spec"]["ingress"][1]["from"]) == 3


def test_a_training_job_gets_its_policy_too_and_the_operator_can_turn_it_off():
    job = ShardedModel(metadata=META, spec=ShardedModelSpec.model_validate(_training()))
    assert _policy(job)["spec"]["ingress"][0] == {"from": [{"podSelector": {"matchLabels": {"shardwise.dev/model": "llama"}}}]}
    for model in (job, _model()):
        kinds = {o["kind"] for o in renderer.render_shared(model, _plan(), Settings(network_policy=False))}
        assert "NetworkPolicy" not in kinds


# --- the local checkpoint tier -----------------------------------------------------------------------

def _pass(spec: dict, roots: tuple[str, ...]):
    """One reconcile pass over a new model with `roots` allowed: (decision, status)."""
    body = {"metadata": dict(META), "spec": spec, "status": {}}
    nodes = {n: k8s_node(n, "rack-a", 8) for n in ("n0", "n1")}
    old = settings.CURRENT
    settings.configure(Settings(local_checkpoint_roots=roots))
    try:
        state = parse_state(body, [], None, "op/worker:1")
        decision = decisions.decide(state, World(nodes), T0)
        return decision, status.build_status(state, decision, {}, T0)
    finally:
        settings.configure(old)


@pytest.mark.parametrize("host_path", ["/", "/etc", "/var/lib/shardwise/checkpoints/../../kubelet",
                                       "/var/lib/shardwise/checkpoints/sub", "/var/lib/shardwise"])
def test_a_host_path_the_operator_does_not_allow_makes_nothing_and_says_which_it_does(host_path):
    spec = _training(checkpoint={"local": {"hostPath": host_path}})
    decision, new = _pass(spec, ("/var/lib/shardwise/checkpoints", "/mnt/nvme/ckpt"))
    assert not [a for a in decision.actions if isinstance(a, (decisions.CreatePods, decisions.ApplyShared))]
    assert new["phase"] == "Failed"
    planned = next(c for c in new["conditions"] if c["type"] == "Planned")
    assert planned["status"] == "False" and planned["reason"] == "InvalidSpec"
    assert "checkpoint.local.hostPath" in planned["message"]
    if ".." not in host_path:
        assert "allowed: /var/lib/shardwise/checkpoints, /mnt/nvme/ckpt" in planned["message"]


def test_an_allowed_root_is_planned_and_mounted_per_model_whatever_its_spelling():
    decision, new = _pass(_training(checkpoint={"local": {"hostPath": "/mnt//nvme/./ckpt/"}}), ("/mnt/nvme/ckpt",))
    assert [a for a in decision.actions if isinstance(a, decisions.CreatePods)] and new["phase"] != "Failed"
    # no root allowed: no local tier for anyone
    _, new = _pass(_training(checkpoint={"local": {}}), ())
    assert new["phase"] == "Failed" and "allowed: none" in new["message"]


def test_the_local_tier_is_handed_to_the_workers_group_by_a_root_init_container_without_capabilities():
    model = ShardedModel(metadata=META, spec=ShardedModelSpec.model_validate(
        _training(image="tenant/own:1", checkpoint={"local": {"hostPath": "/mnt/nvme/ckpt/"}})))
    plan = _plan()
    pod = renderer.render_pod(model, plan, plan.placement(0, 0), 0, "op/worker:1",
                              Settings(local_checkpoint_roots=("/mnt/nvme/ckpt",)))
    spec = pod["spec"]
    volume = next(v for v in spec["volumes"] if v["name"] == "local-checkpoint")
    assert volume["hostPath"] == {"path": "/mnt/nvme/ckpt/prod/llama", "type": "DirectoryOrCreate"}
    assert spec["securityContext"]["runAsNonRoot"] is True and spec["securityContext"]["supplementalGroups"] == [10001]
    (init,) = spec["initContainers"]
    # the operator's image, never the tenant's, as root with no capability, on that directory only
    assert init["image"] == "op/worker:1" and spec["containers"][0]["image"] == "tenant/own:1"
    sc = init["securityContext"]
    assert (sc["runAsUser"], sc["runAsGroup"], sc["allowPrivilegeEscalation"]) == (0, 10001, False)
    assert sc["capabilities"] == {"drop": ["ALL"]} and sc["readOnlyRootFilesystem"] is True
    assert [m["name"] for m in init["volumeMounts"]] == ["local-checkpoint"]
    assert "chgrp 10001" in init["command"][-1] and "chmod 2770" in init["command"][-1]
    # the chart may forbid the root step: the nodes' directories are then prepared beforehand
    bare = renderer.render_pod(model, plan, plan.placement(0, 0), 0, "op/worker:1",
                               Settings(prepare_local_checkpoints=False))["spec"]
    assert "initContainers" not in bare and bare["securityContext"]["supplementalGroups"] == [10001]
    # a pod without a local tier is unchanged: no init container, no extra group
    plain = renderer.render_pod(_model(), plan, plan.placement(0, 0), 0, "op/worker:1")["spec"]
    assert "initContainers" not in plain and "supplementalGroups" not in plain["securityContext"]


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("setpriv"),
                    reason="runs the init container's command as the pods would: needs root and setpriv")
def test_the_init_containers_command_lets_a_worker_of_any_uid_write_the_kubelets_directory():
    model = ShardedModel(metadata=META, spec=ShardedModelSpec.model_validate(_training(checkpoint={"local": {}})))
    plan = _plan()
    spec = renderer.render_pod(model, plan, plan.placement(0, 0), 0, "op/worker:1")["spec"]
    (init,) = spec["initContainers"]
    groups = ",".join(str(g) for g in spec["securityContext"]["supplementalGroups"])
    base = tempfile.mkdtemp()
    try:
        os.chmod(base, 0o755)
        tier = os.path.join(base, "prod", "llama")
        os.makedirs(tier, mode=0o755)        # what the kubelet's DirectoryOrCreate makes: root, 0755
        os.chmod(tier, 0o755)

        def worker(*cmd: str) -> subprocess.CompletedProcess:   # a custom image's uid, in the pod's groups
            return subprocess.run(["setpriv", "--reuid", "12345", "--regid", "12345", "--groups", groups, *cmd],
                                  capture_output=True, text=True)
        assert worker("touch", f"{tier}/before").returncode != 0
        sc = init["securityContext"]
        command = [c.replace(renderer.LOCAL_TIER_MOUNT, tier) for c in init["command"]]
        subprocess.run(["setpriv", "--reuid", str(sc["runAsUser"]), "--regid", str(sc["runAsGroup"]),
                        "--clear-groups", "--inh-caps=-all", "--bounding-set=-all", "--no-new-privs", *command],
                       check=True, capture_output=True)
        assert worker("mkdir", f"{tier}/step-10").returncode == 0
        assert worker("touch", f"{tier}/step-10/rank-0").returncode == 0
        assert os.stat(f"{tier}/step-10").st_gid == 10001      # setgid: the group stays the worker's
    finally:
        shutil.rmtree(base)
