"""What a pod's containers see, since there is no image and no mount namespace: the environment
(the runtime's own plus the container's env and envFrom, with HOSTNAME and POD_IP), the ConfigMaps
and Secrets they name, and paths and names rewritten: a path inside the pod to its folder here, a
cluster DNS name to a pod IP (the container waits until every such name resolves)."""
from __future__ import annotations

import base64
import os
import re
from typing import Callable

from shardwise.e2e.localcluster import kapi
from shardwise.e2e.localcluster.localnodes.dns import DNS_NAME


class Waiting(Exception):
    """The container cannot start yet: the waiting state's reason and message, as a kubelet's."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason, self.message = reason, message


def rewrite_paths(text: str, paths: dict[str, str]) -> str:
    """Each path inside the pod (a mountPath, a terminationMessagePath) -> its folder or file here.
    Only a whole path: not the tail of a longer one (/data/checkpoints) nor of a URL whose bucket and
    prefix spell it (s3://checkpoints/tiny beside a mount at /checkpoints/tiny)."""
    for mount in sorted((m for m in paths if m), key=len, reverse=True):
        text = re.sub(r"(?<![\w./-])" + re.escape(mount) + r"(?=/|$|[^\w.-])", paths[mount].replace("\\", "\\\\"),
                      text)
    return text


class PodEnvironment:
    """One pod's view of the cluster: its env, the objects it names, its paths and names rewritten."""

    def __init__(self, client: kapi.Client, resolve: Callable[[str], str | None],
                 pod: Callable[[], dict], ip: str):
        self.client = client
        self.resolve = resolve
        self.pod = pod          # the pod as last seen
        self.ns = pod()["metadata"]["namespace"]
        self.ip = ip
        self.mounts: dict[str, str] = {}            # mountPath -> folder here, once materialised
        self.container_paths: dict[str, str] = {}   # the launching container's own paths

    def env(self, spec: dict) -> dict[str, str]:
        pod = self.pod()
        env = dict(os.environ)
        env.pop("KUBECONFIG", None)
        env["HOSTNAME"] = pod["spec"].get("hostname") or pod["metadata"]["name"]
        env["POD_IP"] = self.ip
        for source in spec.get("envFrom") or []:
            prefix = source.get("prefix", "")
            if "configMapRef" in source:
                data = self.object_data("configmaps", source["configMapRef"]["name"],
                                        source["configMapRef"].get("optional"))
            else:
                data = self.object_data("secrets", source["secretRef"]["name"],
                                        source["secretRef"].get("optional"), decode=True)
            env.update({prefix + k: v for k, v in data.items()})
        declared: dict[str, str] = {}
        for item in spec.get("env") or []:
            value = self._env_value(item, declared, spec)
            if value is not None:
                declared[item["name"]] = value
        env.update(declared)
        for key in list(declared):
            env[key] = self.rewrite(env[key], env)
        return env

    def _env_value(self, item: dict, declared: dict, spec: dict) -> str | None:
        if "value" in item:
            # $(VAR) refers to variables declared before it, $$ escapes
            return re.sub(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)",
                          lambda m: "$" if m.group(0) == "$$" else
                          declared.get(m.group(1), m.group(0)), item["value"])
        source = item.get("valueFrom") or {}
        if "fieldRef" in source:
            return self._field(source["fieldRef"]["fieldPath"])
        if "configMapKeyRef" in source:
            ref = source["configMapKeyRef"]
            return self.object_data("configmaps", ref["name"], ref.get("optional")).get(ref["key"])
        if "secretKeyRef" in source:
            ref = source["secretKeyRef"]
            return self.object_data("secrets", ref["name"], ref.get("optional"),
                                    decode=True).get(ref["key"])
        if "resourceFieldRef" in source:
            ref = source["resourceFieldRef"]
            kind, _, res = ref["resource"].partition(".")
            return str((spec.get("resources") or {}).get(kind, {}).get(res, "0"))
        return None

    def _field(self, path: str) -> str:
        pod = self.pod()
        meta, spec = pod["metadata"], pod["spec"]
        m = re.fullmatch(r"metadata\.(labels|annotations)\['(.+)'\]", path)
        if m:
            return (meta.get(m.group(1)) or {}).get(m.group(2), "")
        if path in ("metadata.labels", "metadata.annotations"):
            return "\n".join(f'{k}="{v}"' for k, v in sorted((meta.get(path[9:]) or {}).items()))
        return {"metadata.name": meta["name"], "metadata.namespace": meta["namespace"],
                "metadata.uid": meta["uid"], "spec.nodeName": spec.get("nodeName", ""),
                "spec.serviceAccountName": spec.get("serviceAccountName", ""),
                "status.podIP": self.ip, "status.podIPs": self.ip, "status.hostIP": "127.0.0.1",
                "status.hostIPs": "127.0.0.1"}.get(path, "")

    def object_data(self, kind: str, name: str, optional, decode: bool = False) -> dict:
        obj = self.get_or_wait(f"/api/v1/namespaces/{self.ns}/{kind}/{name}", f"{kind[:-1]} {name!r} not found",
                               optional)
        data = dict(obj.get("data") or {})
        if decode:
            return {k: base64.b64decode(v).decode(errors="replace") for k, v in data.items()}
        for k, v in (obj.get("binaryData") or {}).items():
            data[k] = base64.b64decode(v).decode(errors="replace")
        return data

    def object_files(self, kind: str, name: str, optional) -> dict[str, bytes]:
        """A ConfigMap's or Secret's keys as the files a kubelet writes: data as UTF-8, binaryData
        and a Secret's data base64-decoded, byte for byte (a gzip-compressed pod contract)."""
        obj = self.get_or_wait(f"/api/v1/namespaces/{self.ns}/{kind}/{name}", f"{kind[:-1]} {name!r} not found",
                               optional)
        if kind == "secrets":
            return {k: base64.b64decode(v) for k, v in (obj.get("data") or {}).items()}
        files = {k: v.encode() for k, v in (obj.get("data") or {}).items()}
        files.update({k: base64.b64decode(v) for k, v in (obj.get("binaryData") or {}).items()})
        return files

    def get_or_wait(self, path: str, missing: str, optional: bool = False) -> dict:
        """The object at `path`; when it does not exist: {} if `optional`, else the container waits
        (CreateContainerConfigError, `missing`), as a kubelet's does."""
        try:
            return self.client.get(path)
        except kapi.ApiError as e:
            if e.status == 404 and optional:
                return {}
            if e.status == 404:
                raise Waiting("CreateContainerConfigError", missing) from None
            raise

    def rewrite(self, text: str, env: dict | None = None) -> str:
        text = rewrite_paths(text, {**self.mounts, **self.container_paths})

        def resolve(m: re.Match) -> str:
            ip = self.resolve(m.group(1))
            if ip is None:
                raise Waiting("ResolvingHostname", f"waiting for {m.group(1)} to resolve")
            return ip
        return DNS_NAME.sub(resolve, text)

    def rewrite_list(self, items: list[str], env: dict) -> list[str]:
        expanded = [re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)",
                           lambda m: env.get(m.group(1), m.group(0)), s) for s in items]
        return [self.rewrite(s, env) for s in expanded]
