"""The model's router as the operator renders it (render/router.py): opt-in, the objects it makes,
what it changes of the serving Service and the NetworkPolicy, and what it leaves alone."""
from __future__ import annotations

import pytest

from shardwise.crds import names
from shardwise.crds.models import ShardedModel, ShardedModelSpec, load_manifest
from shardwise.operator.render import renderer, router
from shardwise.operator.render.settings import Settings

METADATA = {"name": "llama", "namespace": "prod", "uid": "uid-1"}
OPERATOR = Settings(operator_namespace="shardwise-system", operator_labels={"app": "op"},
                    router_image="ghcr.io/shardwise/operator:1")


def _model(**serving) -> ShardedModel:
    spec = {"model": {"uri": "pvc://models/llama", "layers": 8, "heads": 8}, "serving": serving}
    return ShardedModel(metadata=METADATA, spec=ShardedModelSpec.model_validate(spec))


def _pod(replica: int, stage: int, ip: str, ready: bool = True, deleting: bool = False) -> dict:
    meta = {"name": f"llama-r{replica}-s{stage}-a0",
            "labels": {names.LABEL_MODEL: "llama", names.LABEL_STAGE: str(stage)}}
    if deleting:
        meta["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    return {"metadata": meta, "status": {"podIP": ip, "conditions": [
        {"type": "Ready", "status": "True" if ready else "False"}]}}


def _kinds(objs: list[dict]) -> dict[str, dict]:
    return {o["kind"]: o for o in objs}


def test_no_router_unless_enabled_and_nothing_else_changes():
    plain, off = _model(), _model(router={"enabled": False, "replicas": 3})
    assert router.render(plain, [], settings=OPERATOR) == [] == router.render(off, [], settings=OPERATOR)
    service = renderer.render_serving_service(plain)
    assert service["spec"]["selector"] == {names.LABEL_MODEL: "llama", names.LABEL_STAGE: "0"}
    assert renderer.render_serving_service(off) == service
    assert renderer.render_network_policy(off, OPERATOR) == renderer.render_network_policy(plain, OPERATOR)


def test_router_settings_never_roll_the_workers():
    base = renderer.spec_hash(_model().spec)
    for router_spec in ({"enabled": True}, {"enabled": True, "replicas": 5, "rateLimit": "5/s:20:tokens",
                                            "holdSeconds": 10}, {"enabled": False}):
        model = _model(router=router_spec)
        assert renderer.spec_hash(model.spec) == base
        assert renderer.pod_contract(model, _plan()).serving == renderer.pod_contract(_model(), _plan()).serving


def _plan():
    from shardwise.crds.plan import ReplicaPlan, ShardPlan, StagePlacement
    return ShardPlan(tensor=1, pipeline=1, num_layers=8, replicas=1, groups=[ReplicaPlan(replica=0)],
                     placements=[StagePlacement(replica=0, stage=0, node="n1", gpus=1, layer_start=0, layer_end=8,
                                                embedding=True, head=True)])


def test_enabled_router_is_a_restricted_deployment_of_the_operators_image():
    model = _model(router={"enabled": True, "replicas": 3, "rateLimit": "200/s:1000:tokens", "holdSeconds": 20},
                   auth={"secretRef": {"name": "llama-keys"}}, port=8080)
    objs = _kinds(router.render(model, [], settings=OPERATOR))
    deploy = objs["Deployment"]
    assert deploy["metadata"]["name"] == "llama-router"
    assert deploy["metadata"]["ownerReferences"][0]["uid"] == "uid-1"
    assert deploy["spec"]["replicas"] == 3
    pod = deploy["spec"]["template"]["spec"]
    assert deploy["spec"]["template"]["metadata"]["labels"][names.LABEL_ROUTER] == "llama"
    assert names.LABEL_MODEL not in deploy["spec"]["template"]["metadata"]["labels"]   # not a worker
    (c,) = pod["containers"]
    assert c["image"] == "ghcr.io/shardwise/operator:1"
    assert c["command"] == ["shardwise", "router"]
    args = c["args"]
    assert args[:4] == ["--replicas-file", "/etc/shardwise/router/replicas", "--port", "8080"]
    assert args[args.index("--api-key-file") + 1] == names.API_KEYS_PATH
    assert args[args.index("--rate-limit") + 1] == "200/s:1000:tokens"
    assert args[args.index("--hold-seconds") + 1] == "20"
    assert c["readinessProbe"]["httpGet"] == {"path": "/healthz", "port": 8080}
    assert pod["securityContext"] == renderer.WORKER_POD_SECURITY
    assert c["securityContext"]["allowPrivilegeEscalation"] is False and c["securityContext"]["readOnlyRootFilesystem"]
    assert pod["automountServiceAccountToken"] is False
    assert c["resources"]["limits"]["memory"] and "nvidia.com/gpu" not in c["resources"]["limits"]
    # the same Secret key mounted where the workers have it
    worker = renderer.render_pod(model, _plan(), _plan().placements[0], 0)
    worker_keys = next(v for v in worker["spec"]["volumes"] if v["name"] == "api-keys")
    assert next(v for v in pod["volumes"] if v["name"] == "api-keys") == worker_keys
    assert {"name": "api-keys", "mountPath": names.API_KEYS_MOUNT, "readOnly": True} in c["volumeMounts"]


def test_the_router_runs_the_operators_image_never_the_models():
    model = _model(router={"enabled": True})
    model.spec.image = "someone/custom-worker:1"
    deploy = router.render_deployment(model, Settings())
    assert deploy["spec"]["template"]["spec"]["containers"][0]["image"] == "ghcr.io/shardwise/operator:0.1.0"
    assert "--api-key-file" not in deploy["spec"]["template"]["spec"]["containers"][0]["args"]


def test_replicas_file_lists_each_ready_stage0_pod_once():
    model = _model(router={"enabled": True})
    pods = [_pod(1, 0, "10.0.0.7"), _pod(0, 0, "10.0.0.5"), _pod(0, 1, "10.0.0.6"),
            _pod(2, 0, "10.0.0.8", ready=False), _pod(3, 0, "10.0.0.9", deleting=True), _pod(4, 0, "fd00::1")]
    cm = _kinds(router.render(model, pods, settings=OPERATOR))["ConfigMap"]
    assert cm["metadata"]["name"] == "llama-router"
    assert cm["data"]["replicas"] == "http://10.0.0.5:8000\nhttp://10.0.0.7:8000\nhttp://[fd00::1]:8000\n"
    from shardwise.operator.router.replicas import parse_addresses
    assert len(parse_addresses(cm["data"]["replicas"])) == 3      # the router reads what the operator writes


def test_serving_service_selects_the_router_and_workers_hear_only_router_and_operator():
    peer = {"namespaceSelector": {"matchLabels": {"team": "a"}}}
    model = _model(router={"enabled": True}, allowFrom=[peer])
    assert renderer.render_serving_service(model)["spec"]["selector"] == {names.LABEL_ROUTER: "llama"}
    workers = renderer.render_network_policy(model, OPERATOR)["spec"]["ingress"]
    own, serving = workers
    assert own == {"from": [{"podSelector": {"matchLabels": {names.LABEL_MODEL: "llama"}}}]}  # rendezvous: workers only
    assert serving["ports"] == [{"protocol": "TCP", "port": 8000}]
    assert serving["from"][0] == {"podSelector": {"matchLabels": {names.LABEL_ROUTER: "llama"}}}
    assert serving["from"][1]["namespaceSelector"]["matchLabels"] == {"kubernetes.io/metadata.name": "shardwise-system"}
    assert peer not in serving["from"]
    front = _kinds(router.render(model, [], settings=OPERATOR))["NetworkPolicy"]["spec"]
    assert front["podSelector"] == {"matchLabels": {names.LABEL_ROUTER: "llama"}}
    # the peers allowed, and the operator (it reads the router's held requests to wake a model at zero)
    assert front["ingress"] == [{"ports": [{"protocol": "TCP", "port": 8000}], "from": [peer, serving["from"][1]]}]
    # open model: the router hears anyone on its port, and nothing else
    open_front = router.render_network_policy(_model(router={"enabled": True}))["spec"]["ingress"]
    assert open_front == [{"ports": [{"protocol": "TCP", "port": 8000}]}]


def test_a_model_that_scales_to_zero_holds_requests_for_a_cold_start():
    def hold(router_spec: dict, autoscaling: dict | None) -> str | None:
        model = _model(router=router_spec)
        if autoscaling:
            model.spec.autoscaling = ShardedModelSpec.model_validate(
                {"model": {"uri": "pvc://m/x"}, "autoscaling": autoscaling}).autoscaling
        args = router.render_deployment(model, OPERATOR)["spec"]["template"]["spec"]["containers"][0]["args"]
        return args[args.index("--hold-seconds") + 1] if "--hold-seconds" in args else None
    assert hold({"enabled": True}, None) is None                                  # the router's own 30 s
    assert hold({"enabled": True}, {"minReplicas": 1, "maxReplicas": 3}) is None
    assert hold({"enabled": True}, {"minReplicas": 0, "maxReplicas": 3}) == "300"
    assert hold({"enabled": True, "holdSeconds": 45}, {"minReplicas": 0, "maxReplicas": 3}) == "45"


def test_the_replicas_digest_follows_the_replicas_file():
    model = _model(router={"enabled": True})
    one = router.replicas_digest(router.render(model, [_pod(0, 0, "10.0.0.5")], settings=OPERATOR))
    same = router.replicas_digest(router.render(model, [_pod(0, 0, "10.0.0.5"), _pod(0, 1, "10.0.0.6")],
                                                settings=OPERATOR))
    two = router.replicas_digest(router.render(model, [_pod(0, 0, "10.0.0.5"), _pod(1, 0, "10.0.0.7")],
                                               settings=OPERATOR))
    assert one == same != two and len(one) == 16


def test_no_router_network_policy_when_the_operator_makes_none():
    objs = router.render(_model(router={"enabled": True}), [], settings=Settings(network_policy=False))
    assert [o["kind"] for o in objs] == ["ConfigMap", "Deployment"]


@pytest.mark.parametrize("router_spec, words", [
    ({"enabled": True, "replicas": 0}, "replicas"),
    ({"enabled": True, "replicas": 17}, "replicas"),
    ({"enabled": True, "rateLimit": "fast"}, "rateLimit"),
    ({"enabled": True, "rateLimit": "5/s:0"}, "BURST"),
    ({"enabled": True, "holdSeconds": 601}, "holdSeconds"),
])
def test_bad_router_settings_are_refused_in_one_line(router_spec, words):
    with pytest.raises(ValueError) as e:
        load_manifest({"metadata": {"name": "a"}, "spec": {"model": {"uri": "/m"}, "serving": {"router": router_spec}}})
    assert words in str(e.value) and "\n" not in str(e.value)


def test_a_training_job_has_no_router():
    with pytest.raises(ValueError, match="only for workload: inference"):
        load_manifest({"metadata": {"name": "a"}, "spec": {
            "model": {"uri": "/m"}, "workload": "training", "serving": {"router": {"enabled": True}},
            "training": {"data": "pvc://d/x", "steps": 1}, "checkpoint": {"claim": "ck"}}})
