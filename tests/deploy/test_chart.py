"""The Helm chart: lint, render with default and non-default values, refuse bad values, least privilege.

Runs the real `helm` built by e2e/build.py; no cluster needed.
"""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import yaml

from shardwise.e2e.build import KUBERNETES, bin_dir

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "shardwise"
# Render for the Kubernetes version the rest of the project runs against (a helm cached before
# e2e/build.py stamped its default version would otherwise assume 1.20).
KUBE_VERSION = KUBERNETES.removeprefix("v")


def _helm() -> str:
    helm = bin_dir() / "helm"
    if not os.access(helm, os.X_OK):
        if os.environ.get("SHARDWISE_REQUIRE_CLUSTER"):
            pytest.fail(f"helm is not built at {helm}; run `shardwise dev build`")
        pytest.skip(f"helm is not built at {helm}; run `shardwise dev build`")
    return str(helm)


def helm(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run([_helm(), *args], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "HELM_CACHE_HOME": "/tmp/shardwise-helm-cache"})
    if check and proc.returncode != 0:
        raise AssertionError(f"helm {' '.join(args)} failed:\n{proc.stderr}")
    return proc


def render(values: dict | None = None, namespace: str = "shardwise-system",
           tmp_path: Path | None = None, include_crds: bool = False) -> list[dict]:
    args = ["template", "sw", str(CHART), "--namespace", namespace, "--kube-version", KUBE_VERSION]
    if include_crds:
        args.append("--include-crds")
    if values is not None:
        assert tmp_path is not None
        f = tmp_path / "values.yaml"
        f.write_text(yaml.safe_dump(values))
        args += ["--values", str(f)]
    return [d for d in yaml.safe_load_all(helm(*args).stdout) if d]


def find(docs: list[dict], kind: str, name: str | None = None) -> list[dict]:
    return [d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]


def one(docs: list[dict], kind: str, name: str | None = None) -> dict:
    found = find(docs, kind, name)
    assert len(found) == 1, f"expected one {kind} {name or ''}, got {[d['metadata']['name'] for d in found]}"
    return found[0]


# ---------------------------------------------------------------------------------------------- lint

def test_lint_strict_with_default_and_non_default_values(tmp_path):
    helm("lint", "--strict", str(CHART), "--kube-version", KUBE_VERSION)
    other = tmp_path / "other.yaml"
    other.write_text(yaml.safe_dump(NON_DEFAULT))
    helm("lint", "--strict", str(CHART), "--kube-version", KUBE_VERSION, "--values", str(other))


# ------------------------------------------------------------------------------------ default values

def test_default_deployment_is_hardened_and_runs_two_replicas():
    docs = render()
    dep = one(docs, "Deployment")
    spec = dep["spec"]
    assert spec["replicas"] == 2
    # Upgrades never take away a ready operator.
    assert spec["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
    pod = spec["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] != 0
    assert pod["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault"
    (c,) = pod["containers"]
    sc = c["securityContext"]
    assert sc["readOnlyRootFilesystem"] is True
    assert sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"]["drop"] == ["ALL"]
    assert sc["seccompProfile"]["type"] == "RuntimeDefault"
    assert c["resources"]["requests"]["cpu"] and c["resources"]["requests"]["memory"]
    assert c["resources"]["limits"]["memory"]
    # Probes hit the operator's health endpoint on the port the operator is told to serve it on.
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    for probe in ("livenessProbe", "readinessProbe"):
        assert c[probe]["httpGet"]["path"] == "/healthz"
        assert ports[c[probe]["httpGet"]["port"]] == 8080
    assert f"--health-port={ports['health']}" in c["args"]
    assert f"--metrics-port={ports['metrics']}" in c["args"]
    assert c["args"][:2] == ["operator", "run"] and "--all-namespaces" in c["args"]
    # Leader election on a Lease of this release, in the release namespace (where the Role allows it).
    assert "--lease-namespace=shardwise-system" in c["args"] and f"--lease-name={dep['metadata']['name']}" in c["args"]
    # The image follows the chart's appVersion unless told otherwise.
    app_version = yaml.safe_load((CHART / "Chart.yaml").read_text())["appVersion"]
    assert c["image"].endswith(f":{app_version}")
    # A writable /tmp is the only writable path.
    assert [m["mountPath"] for m in c["volumeMounts"]] == ["/tmp"]
    # The replicas prefer different nodes, and a PDB keeps one through a drain.
    anti = pod["affinity"]["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
    assert anti[0]["podAffinityTerm"]["topologyKey"] == "kubernetes.io/hostname"
    assert one(docs, "PodDisruptionBudget")["spec"]["minAvailable"] == 1
    assert pod["serviceAccountName"] == one(docs, "ServiceAccount")["metadata"]["name"]


def test_default_render_has_no_prometheus_operator_objects():
    docs = render()
    kinds = {d["kind"] for d in docs}
    assert "ServiceMonitor" not in kinds and "PodMonitor" not in kinds
    assert "ConfigMap" not in kinds  # no dashboard unless asked
    assert {"Deployment", "ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding",
            "Service", "PodDisruptionBudget"} <= kinds


# -------------------------------------------------------------------------------- non-default values

NON_DEFAULT = {
    "replicaCount": 1,
    "image": {"repository": "registry.example.com/shardwise/operator",
              "digest": "sha256:" + "a" * 64},
    "operator": {"watchNamespaces": ["team-a", "team-b"], "logLevel": "debug", "healthPort": 18080,
                 "metricsPort": 19090, "workerImage": "registry.example.com/shardwise/worker:1-cpu",
                 "extraArgs": ["--some-flag"]},
    "serviceAccount": {"name": "llm-operator", "annotations": {"example.com/role": "x"}},
    "rbac": {"aggregateToDefaultRoles": False},
    "metrics": {"service": {"port": 19090},
                "serviceMonitor": {"enabled": True, "interval": "15s", "labels": {"release": "prom"}},
                "podMonitor": {"enabled": True, "namespaces": ["team-a"]}},
    "dashboard": {"enabled": True, "namespace": "monitoring"},
    "tolerations": [{"key": "dedicated", "operator": "Exists", "effect": "NoSchedule"}],
    "nodeSelector": {"kubernetes.io/os": "linux"},
}


def test_non_default_values_render_namespaced_rbac_monitors_and_dashboard(tmp_path):
    docs = render(values=NON_DEFAULT, tmp_path=tmp_path)
    dep = one(docs, "Deployment")
    pod = dep["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    assert dep["spec"]["replicas"] == 1
    assert c["image"] == "registry.example.com/shardwise/operator@sha256:" + "a" * 64
    assert "--namespace=team-a" in c["args"] and "--namespace=team-b" in c["args"]
    assert "--all-namespaces" not in c["args"]
    assert "--log-level=debug" in c["args"] and "--some-flag" in c["args"]
    assert "--worker-image=registry.example.com/shardwise/worker:1-cpu" in c["args"]
    assert f"--router-image={c['image']}" in c["args"]     # a model's router runs the operator's image
    assert c["livenessProbe"]["httpGet"]["port"] == "health"
    assert {p["name"]: p["containerPort"] for p in c["ports"]} == {"health": 18080, "metrics": 19090}
    assert pod["serviceAccountName"] == "llm-operator"
    assert pod["tolerations"][0]["key"] == "dedicated"
    # One operator pod: no PDB (it would block every drain).
    assert not find(docs, "PodDisruptionBudget")

    # RBAC: the workload rules only in the watched namespaces, nodes cluster-wide.
    bindings = find(docs, "RoleBinding")
    workload_bindings = {b["metadata"]["namespace"] for b in bindings
                         if b["roleRef"]["kind"] == "ClusterRole"}
    assert workload_bindings == {"team-a", "team-b"}
    crb = one(docs, "ClusterRoleBinding")
    cluster_role = one(docs, "ClusterRole", crb["roleRef"]["name"])
    # Cluster-wide, only reads: the inventory, and what kopf scans to follow CRDs and namespaces.
    assert {r for rule in cluster_role["rules"] for r in rule["resources"]} == {
        "nodes", "customresourcedefinitions", "namespaces"}
    assert {v for rule in cluster_role["rules"] for v in rule["verbs"]} == {"list", "watch"}
    assert not [d for d in find(docs, "ClusterRole") if "aggregate" in json.dumps(d["metadata"])]

    sm = one(docs, "ServiceMonitor")
    assert sm["metadata"]["labels"]["release"] == "prom"
    assert sm["spec"]["endpoints"][0]["interval"] == "15s"
    svc = one(docs, "Service")
    assert sm["spec"]["endpoints"][0]["port"] in {p["name"] for p in svc["spec"]["ports"]}
    assert svc["spec"]["ports"][0]["port"] == 19090
    pm = one(docs, "PodMonitor")
    assert pm["spec"]["namespaceSelector"] == {"matchNames": ["team-a"]}

    cm = one(docs, "ConfigMap")
    assert cm["metadata"]["namespace"] == "monitoring"
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    dashboard = json.loads(cm["data"]["shardwise.json"])
    assert dashboard["panels"], "the dashboard has no panels"


def test_service_monitor_without_service_is_refused():
    proc = helm("template", "sw", str(CHART), "--kube-version", KUBE_VERSION,
                "--set", "metrics.serviceMonitor.enabled=true", "--set", "metrics.service.enabled=false",
                check=False)
    assert proc.returncode != 0
    assert "metrics.service.enabled" in proc.stderr


def _operator_settings(docs: list[dict]):
    """What the operator would run with: the Deployment's args through `shardwise operator run`'s parser."""
    import argparse

    from shardwise.operator.cli import run

    dep = one(docs, "Deployment")
    parser = argparse.ArgumentParser()
    run.add_arguments(parser)
    args = parser.parse_args(dep["spec"]["template"]["spec"]["containers"][0]["args"][1:])
    return dep, run._render_settings(args)


def test_network_policy_and_local_checkpoint_roots_reach_the_operator(tmp_path, monkeypatch):
    monkeypatch.setenv("POD_NAMESPACE", "shardwise-system")   # what the Deployment's env gives it
    dep, settings = _operator_settings(render())
    # on by default, admitting the operator's own pods: the labels its pod template carries
    pod_labels = dep["spec"]["template"]["metadata"]["labels"]
    assert settings.network_policy is True and settings.operator_namespace == "shardwise-system"
    assert settings.operator_labels and settings.operator_labels.items() <= pod_labels.items()
    assert settings.local_checkpoint_roots == ("/var/lib/shardwise/checkpoints",)
    assert settings.prepare_local_checkpoints is True
    values = {"operator": {"networkPolicy": False,
                           "localCheckpoints": {"roots": ["/mnt/nvme/ckpt", "/data/ckpt/"], "prepareAsRoot": False}}}
    _, settings = _operator_settings(render(values=values, tmp_path=tmp_path))
    assert settings.network_policy is False and settings.prepare_local_checkpoints is False
    assert settings.local_checkpoint_roots == ("/mnt/nvme/ckpt", "/data/ckpt")
    values["operator"]["localCheckpoints"]["roots"] = []
    _, settings = _operator_settings(render(values=values, tmp_path=tmp_path))
    assert settings.local_checkpoint_roots == ()


def test_the_model_cache_values_reach_the_operator(tmp_path):
    _, settings = _operator_settings(render())
    assert (settings.model_cache_host_path, settings.model_cache_budget, settings.prepare_model_cache) == (
        "/var/lib/shardwise/model-cache", 200 << 30, True)
    values = {"operator": {"modelCache": {"hostPath": "/mnt/nvme/cache/", "budget": "1500G", "prepareAsRoot": False}}}
    _, settings = _operator_settings(render(values=values, tmp_path=tmp_path))
    assert (settings.model_cache_host_path, settings.model_cache_budget, settings.prepare_model_cache) == (
        "/mnt/nvme/cache", 1500 * 10**9, False)
    values["operator"]["modelCache"]["hostPath"] = ""   # off: every pod fetches into its own emptyDir
    _, settings = _operator_settings(render(values=values, tmp_path=tmp_path))
    assert settings.model_cache_host_path == ""


def test_plain_http_registries_reach_the_operator(tmp_path):
    """None by default: every registry off the node is spoken to in HTTPS
    (tests/operator/test_remote_source_pods.py: what a listed one's pods get)."""
    _, settings = _operator_settings(render())
    assert settings.plain_http_registries == ()
    values = {"operator": {"plainHttpRegistries": ["Models.Registry.svc:5000", "10.0.0.7"]}}
    _, settings = _operator_settings(render(values=values, tmp_path=tmp_path))
    assert settings.plain_http_registries == ("models.registry.svc:5000", "10.0.0.7")


# ------------------------------------------------------------------------------------ values schema

@pytest.mark.parametrize("setting, named", [
    ("replicaCount=two", "replicaCount"),
    ("replicaCount=-1", "replicaCount"),
    ("replicas=2", "replicas"),                                   # a typo of replicaCount
    ("operator.logLevel=verbose", "logLevel"),
    ("operator.healthPort=70000", "healthPort"),
    ("operator.watchNamespaces[0]=Team_A", "watchNamespaces"),
    ("image.pullPolicy=Sometimes", "pullPolicy"),
    ("image.digest=latest", "digest"),
    ("securityContext.runAsNonRoot=false", "runAsNonRoot"),
    ("securityContext.readOnlyRootFilesystem=false", "readOnlyRootFilesystem"),
    ("metrics.serviceMonitor.interval=30", "interval"),
    ("resources.limits.memory=lots", "memory"),
    ("operator.localCheckpoints.roots[0]=var/lib", "roots"),
    ("operator.networkPolicy=maybe", "networkPolicy"),
    ("operator.modelCache.hostPath=var/cache", "hostPath"),
    ("operator.modelCache.budget=lots", "budget"),
    ("operator.plainHttpRegistries[0]=http://registry:5000", "plainHttpRegistries"),
])
def test_schema_rejects_bad_values_naming_the_key(setting, named):
    proc = helm("template", "sw", str(CHART), "--kube-version", KUBE_VERSION, "--set", setting, check=False)
    assert proc.returncode != 0, f"--set {setting} was accepted"
    assert "values don't meet the specifications of the schema" in proc.stderr
    assert named in proc.stderr


# ------------------------------------------------------------------------------------------- CRDs

def test_chart_crd_is_the_generated_crd():
    source = ROOT / "crds" / "shardedmodels.shardwise.dev.yaml"
    copy = CHART / "crds" / "shardedmodels.shardwise.dev.yaml"
    assert source.exists(), f"{source} is missing"
    assert copy.exists(), f"{copy} is missing; cp {source.relative_to(ROOT)} {copy.relative_to(ROOT)}"
    assert copy.read_text() == source.read_text(), (
        f"the chart's CRD drifted from the generated one; cp {source.relative_to(ROOT)} "
        f"{copy.relative_to(ROOT)}")
    crds = [d for d in render(include_crds=True) if d["kind"] == "CustomResourceDefinition"]
    assert "shardedmodels.shardwise.dev" in {d["metadata"]["name"] for d in crds}


# --------------------------------------------------------------------------------- least privilege

OPERATOR = ROOT / "operator"
API_GROUPS = {"pods": "", "services": "", "configmaps": "", "events": "", "nodes": "", "namespaces": "",
              "poddisruptionbudgets": "policy", "leases": "coordination.k8s.io",
              "networkpolicies": "networking.k8s.io", "deployments": "apps",
              "shardedmodels": "shardwise.dev", "shardedmodels/status": "shardwise.dev",
              "shardedmodels/scale": "shardwise.dev",
              "customresourcedefinitions": "apiextensions.k8s.io"}
CLIENT_VERBS = [("delete_collection", "deletecollection"), ("create", "create"), ("read", "get"),
                ("get", "get"), ("list", "list"), ("patch", "patch"), ("replace", "update"),
                ("delete", "delete")]
# What kopf itself asks of the API server for the handlers the operator registers.
KOPF_OWN = {
    # It finds the watched resources, and follows CRD changes, by watching CRDs.
    ("apiextensions.k8s.io", "customresourcedefinitions", "list"),
    ("apiextensions.k8s.io", "customresourcedefinitions", "watch"),
}


def _plural(snake: str) -> str:
    if snake in ("custom_object", "custom_object_status", "custom_object_scale"):
        return "shardedmodels" + snake.removeprefix("custom_object").replace("_", "/")
    if snake == "network_policy":
        return "networkpolicies"
    return snake.replace("_", "") + "s"


def operator_api_calls() -> set[tuple[str, str, str]]:
    """(apiGroup, resource, verb) for every API call in operator/: kubernetes-client calls, kopf
    watches and events, and server-side apply (a patch the API server also authorizes as create)."""
    import ast
    import re

    calls: set[tuple[str, str, str]] = set(KOPF_OWN)
    method = re.compile(r"^(%s)_(?:namespaced_)?(\w+?)(?:_for_all_namespaces)?$"
                        % "|".join(p for p, _ in CLIENT_VERBS))
    for path in sorted(OPERATOR.rglob("*.py")):
        tree = ast.parse(path.read_text())
        for func in ast.walk(tree):
            if not isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            server_side_apply = "apply-patch" in ast.unparse(func)
            other_apis = "CUSTOM_KINDS" in ast.unparse(func)     # counted below
            for node in ast.walk(func):
                if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                        and isinstance(node.func.value, ast.Attribute) \
                        and node.func.value.attr in ("core", "policy", "custom", "coord", "networking", "apps"):
                    if node.func.attr == "get_api_resources" or (other_apis and node.func.value.attr == "custom"):
                        continue     # discovery: a non-resource URL every authenticated client may read
                    m = method.match(node.func.attr)
                    assert m, f"{path.name}: unrecognised API call {node.func.attr}"
                    verb = dict(CLIENT_VERBS)[m.group(1)]
                    resource = _plural(m.group(2))
                    calls.add((API_GROUPS[resource], resource, verb))
                    if verb == "patch" and server_side_apply:
                        calls.add((API_GROUPS[resource], resource, "create"))
            for deco in func.decorator_list:
                if not (isinstance(deco, ast.Call) and ast.unparse(deco.func).startswith("kopf.")):
                    continue
                name = ast.unparse(deco.func)
                if name in ("kopf.on.startup", "kopf.on.cleanup", "kopf.on.login", "kopf.on.probe"):
                    continue
                args = [ast.unparse(a).strip("'\"") for a in deco.args]
                resource = "shardedmodels" if args[-1] == "PLURAL" else args[-1]
                calls |= {(API_GROUPS[resource], resource, "list"), (API_GROUPS[resource], resource, "watch")}
                if name not in ("kopf.on.event", "kopf.index"):
                    # Change handlers and daemons keep a finalizer and progress annotations: a patch.
                    calls.add((API_GROUPS[resource], resource, "patch"))
        if "kopf.event(" in path.read_text():
            calls.add(("", "events", "create"))
    # Objects of other projects' APIs, applied and read back through the custom objects API
    # (apply.CUSTOM_KINDS): the calls above count them as ShardedModels.
    from shardwise.operator.controller.apply import CUSTOM_KINDS, CUSTOM_VERSIONS
    for kind, plural in CUSTOM_KINDS.items():
        calls |= {(CUSTOM_VERSIONS[kind][0], plural, verb) for verb in ("get", "create", "patch")}
    return calls


def granted(docs: list[dict]) -> set[tuple[str, str, str]]:
    out = set()
    for d in docs:
        if d["kind"] in ("ClusterRole", "Role") and "aggregate" not in json.dumps(d["metadata"]):
            for rule in d["rules"]:
                for verb in rule["verbs"]:
                    for group in rule["apiGroups"]:
                        for resource in rule["resources"]:
                            out.add((group, resource, verb))
    return out


def test_rbac_grants_exactly_the_calls_the_operator_makes():
    used = operator_api_calls()
    have = granted(render())
    assert not used - have, f"the operator calls what the chart does not grant: {sorted(used - have)}"
    assert not have - used, f"the chart grants what the operator never calls: {sorted(have - used)}"


def test_rbac_has_no_wildcards_secrets_or_escalation(tmp_path):
    for docs in (render(), render(values=NON_DEFAULT, tmp_path=tmp_path)):
        for d in docs:
            if d["kind"] not in ("ClusterRole", "Role"):
                continue
            for rule in d["rules"]:
                assert "*" not in rule["verbs"] + rule["resources"] + rule["apiGroups"], d["metadata"]["name"]
                assert not {"secrets", "serviceaccounts/token", "roles", "clusterroles"} & set(rule["resources"])
                assert not {"escalate", "bind", "impersonate"} & set(rule["verbs"])
    # Leader election is confined to the release namespace.
    docs = render(namespace="ops")
    roles = {(d["kind"], d["metadata"].get("namespace")) for d in docs
             if d["kind"] in ("Role", "ClusterRole") and any("leases" in r["resources"] for r in d["rules"])}
    assert roles == {("Role", "ops")}


# ---------------------------------------------------------------------------------------- dashboard

def exported_metrics() -> set[str]:
    """Names the operator and the worker register with prometheus-client, wherever they do."""
    import re
    names = set()
    for path in sorted([*(ROOT / "operator").rglob("*.py"), *(ROOT / "worker").rglob("*.py")]):
        for kind, name in re.findall(r"\b(Counter|Gauge|Histogram|Summary)\(\s*\"(shardwise_\w+)\"", path.read_text()):
            names.add(name)
            if kind in ("Histogram", "Summary"):
                names |= {f"{name}_bucket", f"{name}_sum", f"{name}_count"}
    return names


def test_dashboard_queries_only_metrics_the_code_exports():
    import re
    dashboard = json.loads((CHART / "dashboards" / "shardwise.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    exprs += [v["definition"] for v in dashboard["templating"]["list"] if v.get("definition")]
    used = {m for e in exprs for m in re.findall(r"\bshardwise_\w+", e)}
    exported = exported_metrics()
    assert used, "the dashboard queries no shardwise metrics"
    assert not used - exported, f"the dashboard queries metrics nobody exports: {sorted(used - exported)}"
    # Every operator and worker metric has a panel (histograms through their _bucket series).
    bases = {m for m in exported if not m.endswith(("_bucket", "_sum", "_count"))}
    shown = {m.removesuffix("_bucket") for m in used}
    assert not bases - shown, f"metrics with no panel: {sorted(bases - shown)}"
