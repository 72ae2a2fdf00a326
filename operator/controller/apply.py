"""Applier: the only module of the operator that talks to the API server.

Create-or-get for pods (a pod is immutable; its name carries the replica's attempt, so a create that
meets an existing pod means an earlier reconcile already made it: nothing is created twice), server-side
apply for the per-model objects whose content may change (plan ConfigMap, Services, PDB,
NetworkPolicy), delete of a whole replica group, and the ShardedModel's status. Every request is
counted in `shardwise_api_requests_total`, which the benchmark reads to report requests per reconcile.

Every write first calls `fence()` (leader.LeaseLock.check when leader election is on: a leader whose
lease ran out sends nothing), and status patches are conditional on the resourceVersion the pass read,
so a stale pass never overwrites status a newer writer stored (leader.py says why).
"""
from __future__ import annotations

import json
import logging
from typing import Any, Callable, Mapping

from kubernetes import client, config
from kubernetes.client.rest import ApiException

from shardwise.crds import names
from shardwise.crds.models import GROUP, PLURAL, VERSION
from shardwise.operator.controller import metrics
from shardwise.operator.render import inferencepool

log = logging.getLogger("shardwise.operator.controller.apply")
FIELD_MANAGER = "shardwise-operator"
# Objects of other projects' APIs the operator may make (render/inferencepool.py): kind -> plural,
# and the group/version it reads them in.
CUSTOM_KINDS = {inferencepool.KIND: inferencepool.PLURAL}
CUSTOM_VERSIONS = {inferencepool.KIND: (inferencepool.GROUP, inferencepool.VERSION)}


def load_config(kubeconfig: str | None = None) -> client.ApiClient:
    """In-cluster config when running in a pod, else the kubeconfig (explicit path or $KUBECONFIG)."""
    configuration = client.Configuration()
    if kubeconfig:
        config.load_kube_config(config_file=kubeconfig, client_configuration=configuration)
    else:
        try:
            config.load_incluster_config(client_configuration=configuration)
        except config.ConfigException:
            config.load_kube_config(client_configuration=configuration)
    # Reconciles run on several threads at once; the default pool of 4 connections would make them
    # queue (and discard connections).
    configuration.connection_pool_maxsize = 32
    return client.ApiClient(configuration)


def _json(response: Any) -> Any:
    """Responses are read as plain JSON: turning a pod list into model objects and back costs more
    CPU than the rest of a reconcile."""
    return json.loads(response.data)


class StaleStatus(Exception):
    """The ShardedModel changed since this pass read it (a spec edit, or another operator's status
    write): the status patch was refused (409) and the pass must read the model again."""


class ObjectConflict(Exception):
    """An object the model would make exists and is not the model's (no ownerReference to it): the
    operator leaves it alone rather than take it over. str(): one line naming it."""


class PodRefused(Exception):
    """The API server's admission refused a pod the model makes (Pod Security: a hostPath in a
    namespace enforcing baseline or restricted). str(): the API server's one line."""


POD_MESSAGE_MAX = 512   # what of the API server's refusal is kept (it lists every violation)


def pod_refusal(error: ApiException) -> str:
    """The one line saying why admission refused a pod ("" for any other error): a 403 whose Status
    says the pod violates PodSecurity."""
    if error.status != 403:
        return ""
    try:
        message = str(json.loads(error.body or "{}").get("message") or "")
    except (ValueError, AttributeError):
        return ""
    if "violates PodSecurity" not in message:
        return ""
    line = " ".join(message.split())
    return line if len(line) <= POD_MESSAGE_MAX else line[:POD_MESSAGE_MAX - 1] + "…"


def any_refusal(error: ApiException) -> str:
    """The one line of any refusal of a pod (400, 403, 422: Pod Security, a quota, an admission policy,
    a webhook), "" for any other error."""
    if error.status not in (400, 403, 422):
        return ""
    try:
        message = str(json.loads(error.body or "{}").get("message") or "")
    except (ValueError, AttributeError):
        message = ""
    line = " ".join((message or str(error.reason or error.status)).split())
    return line if len(line) <= POD_MESSAGE_MAX else line[:POD_MESSAGE_MAX - 1] + "…"


def owned_by(obj: Mapping[str, Any], uid: str) -> bool:
    return any(ref.get("uid") == uid for ref in (obj.get("metadata") or {}).get("ownerReferences") or [])


class Applier:
    def __init__(self, api: client.ApiClient | None = None):
        self.api = api or load_config()
        self.core = client.CoreV1Api(self.api)
        self.policy = client.PolicyV1Api(self.api)
        self.networking = client.NetworkingV1Api(self.api)
        self.apps = client.AppsV1Api(self.api)
        self.custom = client.CustomObjectsApi(self.api)
        self.requests = 0
        # Called before every write; raises to stop it (leader.LeaseLock.check). No-op without election.
        self.fence: Callable[[], None] = lambda: None

    def _count(self, verb: str, kind: str) -> None:
        self.requests += 1
        metrics.API_REQUESTS.labels(verb, kind).inc()

    # --- the ShardedModel --------------------------------------------------------------------

    def get_model(self, namespace: str, name: str) -> dict | None:
        self._count("get", "ShardedModel")
        try:
            return _json(self.custom.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name,
                                                                   _preload_content=False))
        except ApiException as e:
            if e.status == 404:
                return None
            raise

    def patch_status(self, namespace: str, name: str, status: Mapping[str, Any],
                     resource_version: str | None) -> dict | None:
        """Merge-patch the status subresource, only if the object is still at `resource_version` (the
        version this pass read or last wrote; StaleStatus otherwise). Lists (conditions, groups) are
        replaced whole. Returns the object as stored (its new resourceVersion), None when it is gone."""
        self.fence()
        self._count("patch", "ShardedModel/status")
        body: dict[str, Any] = {"status": dict(status)}
        if resource_version:
            body["metadata"] = {"resourceVersion": resource_version}
        try:
            return _json(self.custom.patch_namespaced_custom_object_status(
                GROUP, VERSION, namespace, PLURAL, name, body, _preload_content=False))
        except ApiException as e:
            if e.status == 404:
                return None  # deleted meanwhile: its dependents go with it
            if e.status == 409:
                raise StaleStatus(f"ShardedModel {namespace}/{name} changed since it was read") from None
            raise

    def scale(self, namespace: str, name: str, replicas: int) -> None:
        """Set spec.parallelism.replicas through the scale subresource (as `kubectl scale` does)."""
        self.fence()
        self._count("patch", "ShardedModel/scale")
        self.custom.patch_namespaced_custom_object_scale(GROUP, VERSION, namespace, PLURAL, name,
                                                         {"spec": {"replicas": replicas}}, _preload_content=False)

    def patch_autoscaling_status(self, namespace: str, name: str, autoscaling: Mapping[str, Any]) -> None:
        """Merge-patch status.autoscaling alone (the autoscaler's own field: no other writer's, so
        no version condition); gone meanwhile is fine."""
        self.fence()
        self._count("patch", "ShardedModel/status")
        try:
            self.custom.patch_namespaced_custom_object_status(
                GROUP, VERSION, namespace, PLURAL, name, {"status": {"autoscaling": dict(autoscaling)}},
                _preload_content=False)
        except ApiException as e:
            if e.status != 404:
                raise

    # --- reads -----------------------------------------------------------------------------------

    def list_model_pods(self, namespace: str, model: str) -> list[dict]:
        self._count("list", "Pod")
        return _json(self.core.list_namespaced_pod(namespace, label_selector=f"{names.LABEL_MODEL}={model}",
                                                   _preload_content=False))["items"]

    def list_router_pods(self, namespace: str, model: str) -> list[dict]:
        self._count("list", "Pod")
        return _json(self.core.list_namespaced_pod(namespace, label_selector=f"{names.LABEL_ROUTER}={model}",
                                                   _preload_content=False))["items"]

    def get_configmap(self, namespace: str, name: str) -> dict | None:
        self._count("get", "ConfigMap")
        try:
            return _json(self.core.read_namespaced_config_map(name, namespace, _preload_content=False))
        except ApiException as e:
            if e.status == 404:
                return None
            raise

    def serves(self, group: str, version: str, plural: str) -> bool:
        """Whether the API server serves `plural` in group/version (discovery: a CRD installed)."""
        self._count("get", "APIResourceList")
        try:
            found = _json(self.custom.get_api_resources(group, version, _preload_content=False))
        except ApiException as e:
            if e.status in (404, 503):    # not installed, or its API not served yet
                return False
            raise
        return any(r.get("name") == plural for r in found.get("resources") or [])

    def list_nodes(self) -> list[dict]:
        self._count("list", "Node")
        return _json(self.core.list_node(_preload_content=False))["items"]

    def list_all_pods(self) -> list[dict]:
        self._count("list", "Pod")
        return _json(self.core.list_pod_for_all_namespaces(
            field_selector="status.phase!=Succeeded,status.phase!=Failed", _preload_content=False))["items"]

    # --- writes ----------------------------------------------------------------------------------

    def create_pod(self, pod: Mapping[str, Any], refusals: Callable[[ApiException], str] = pod_refusal) -> bool:
        """Create-or-get: True when created now, False when it already existed; PodRefused when
        `refusals` reads the error as admission's refusal (by default Pod Security's)."""
        self.fence()
        self._count("create", "Pod")
        try:
            self.core.create_namespaced_pod(pod["metadata"]["namespace"], pod, _preload_content=False)
            return True
        except ApiException as e:
            if e.status == 409:
                return False
            refused = refusals(e)
            if refused:
                raise PodRefused(refused) from None
            raise

    def apply(self, obj: Mapping[str, Any]) -> None:
        """Server-side apply of a per-model object: creates it, or updates the fields we own. An
        object of that name that exists without the model's ownerReference is not taken over:
        ObjectConflict (a forced apply would rewrite a user's Service and make deleting the model
        delete it)."""
        kind, ns, name = obj["kind"], obj["metadata"]["namespace"], obj["metadata"]["name"]
        owner = next((ref["uid"] for ref in obj["metadata"].get("ownerReferences") or []), None)
        existing = self._read(kind, ns, name)
        if existing is not None and owner is not None and not owned_by(existing, owner):
            raise ObjectConflict(f"{kind} {ns}/{name} exists and is not this model's; rename the model "
                                 f"or remove the {kind}")
        self.fence()
        self._count("apply", kind)
        kw = dict(field_manager=FIELD_MANAGER, force=True, _content_type="application/apply-patch+yaml",
                  _preload_content=False)
        if kind == "ConfigMap":
            self.core.patch_namespaced_config_map(name, ns, obj, **kw)
        elif kind == "Service":
            self.core.patch_namespaced_service(name, ns, obj, **kw)
        elif kind == "PodDisruptionBudget":
            self.policy.patch_namespaced_pod_disruption_budget(name, ns, obj, **kw)
        elif kind == "NetworkPolicy":
            self.networking.patch_namespaced_network_policy(name, ns, obj, **kw)
        elif kind == "Deployment":
            self.apps.patch_namespaced_deployment(name, ns, obj, **kw)
        elif kind in CUSTOM_KINDS:
            group, version = obj["apiVersion"].split("/")
            self.custom.patch_namespaced_custom_object(group, version, ns, CUSTOM_KINDS[kind], name, obj, **kw)
        else:
            raise ValueError(f"apply does not handle kind {kind}")

    def _read(self, kind: str, ns: str, name: str) -> dict | None:
        self._count("get", kind)
        try:
            if kind == "ConfigMap":
                return _json(self.core.read_namespaced_config_map(name, ns, _preload_content=False))
            if kind == "Service":
                return _json(self.core.read_namespaced_service(name, ns, _preload_content=False))
            if kind == "PodDisruptionBudget":
                return _json(self.policy.read_namespaced_pod_disruption_budget(name, ns, _preload_content=False))
            if kind == "NetworkPolicy":
                return _json(self.networking.read_namespaced_network_policy(name, ns, _preload_content=False))
            if kind == "Deployment":
                return _json(self.apps.read_namespaced_deployment(name, ns, _preload_content=False))
            if kind in CUSTOM_KINDS:
                group, version = CUSTOM_VERSIONS[kind]
                return _json(self.custom.get_namespaced_custom_object(group, version, ns, CUSTOM_KINDS[kind], name,
                                                                      _preload_content=False))
        except ApiException as e:
            if e.status == 404:
                return None
            raise
        raise ValueError(f"apply does not handle kind {kind}")

    def exists_owned(self, kind: str, namespace: str, name: str, uid: str) -> bool:
        """Whether the object exists and the model (`uid`) owns it."""
        found = self._read(kind, namespace, name)
        return found is not None and owned_by(found, uid)

    def delete_owned(self, kind: str, namespace: str, name: str, uid: str) -> None:
        """Delete a per-model object (ConfigMap, NetworkPolicy, Deployment) if the model owns it; gone
        already is fine, someone else's is left alone."""
        if not self.exists_owned(kind, namespace, name, uid):
            return
        self.fence()
        self._count("delete", kind)
        kw = dict(propagation_policy="Background", _preload_content=False)
        try:
            if kind == "ConfigMap":
                self.core.delete_namespaced_config_map(name, namespace, **kw)
            elif kind == "NetworkPolicy":
                self.networking.delete_namespaced_network_policy(name, namespace, **kw)
            elif kind == "Deployment":
                self.apps.delete_namespaced_deployment(name, namespace, **kw)
            else:
                raise ValueError(f"delete_owned does not handle kind {kind}")
        except ApiException as e:
            if e.status != 404:
                raise

    def delete_pods(self, namespace: str, names: list[str], force: bool = False) -> None:
        """Delete pods by name; gone already is fine. `force` (grace 0) for pods on a lost node, whose
        kubelet will never confirm the deletion."""
        for name in names:
            self.fence()
            self._count("delete", "Pod")
            try:
                self.core.delete_namespaced_pod(name, namespace, grace_period_seconds=0 if force else None,
                                                _preload_content=False)
            except ApiException as e:
                if e.status != 404:
                    raise

    def annotate_pod(self, namespace: str, name: str, key: str, value: str) -> None:
        """Merge-patch one annotation of a pod; gone meanwhile is fine."""
        self.fence()
        self._count("patch", "Pod")
        try:
            self.core.patch_namespaced_pod(name, namespace, {"metadata": {"annotations": {key: value}}},
                                           _preload_content=False)
        except ApiException as e:
            if e.status != 404:
                raise

    def delete_group(self, namespace: str, model: str, replica: int, uid: str) -> None:
        """Tear a replica group down as one unit: the pods with its labels that the model owns
        (ownerReference to `uid`); labels alone are anyone's to write."""
        self._count("list", "Pod")
        pods = _json(self.core.list_namespaced_pod(
            namespace, label_selector=f"{names.LABEL_MODEL}={model},{names.LABEL_REPLICA}={replica}",
            _preload_content=False))["items"]
        self.delete_pods(namespace, [p["metadata"]["name"] for p in pods if owned_by(p, uid)])
