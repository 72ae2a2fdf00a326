"""A pod's volumes as folders of this machine: ConfigMaps and Secrets written into the pod's folder,
hostPath volumes on its node's disk, claims at their bound PersistentVolume's path; the files of
ConfigMap volumes (inside gzip too) get the pod's paths rewritten to those folders."""
from __future__ import annotations

import os
import shutil
from pathlib import Path

from shardwise.crds import compressed
from shardwise.e2e.localcluster.localnodes import nodedisk
from shardwise.e2e.localcluster.localnodes.containers import TERMINATION_LOG, ContainerProc
from shardwise.e2e.localcluster.localnodes.podenv import PodEnvironment, Waiting, rewrite_paths

# A gzip-compressed ConfigMap file is inflated to at most this to rewrite its paths (a ConfigMap holds
# 1 MiB); one that inflates to more is left as it is, for its reader to refuse.
REWRITE_MAX_BYTES = 64 << 20


def materialise(environment: PodEnvironment, pod: dict, folder: Path, state_dir: Path,
                containers: list[ContainerProc]) -> dict[str, str]:
    """Write each volume to <pod folder>/volumes/<name>; return mountPath -> host path."""
    folders: dict[str, Path] = {}
    texts: list[Path] = []     # ConfigMap files: they may name paths inside the pod
    for vol in pod["spec"].get("volumes") or []:
        target = folder / "volumes" / vol["name"]
        if "hostPath" in vol:
            folders[vol["name"]] = nodedisk.host_path(state_dir, pod["spec"]["nodeName"], vol)
            continue
        if "persistentVolumeClaim" in vol:
            folders[vol["name"]] = claim_folder(environment, vol["persistentVolumeClaim"]["claimName"])
            continue
        if target.exists():
            shutil.rmtree(target)
        target.mkdir(parents=True)
        folders[vol["name"]] = target
        texts += _write_objects(environment, vol, target)
        # emptyDir and anything else (projected service-account tokens...) stay empty folders
    mounts: dict[str, str] = {}
    for c in pod["spec"]["containers"] + (pod["spec"].get("initContainers") or []):
        for m in c.get("volumeMounts") or []:
            if m["name"] in folders:
                host = folders[m["name"]] / m.get("subPath", "")
                mounts[m["mountPath"].rstrip("/") or "/"] = str(host).rstrip("/")
    paths = {**termination_paths(containers), **mounts}
    for text in texts:
        _rewrite_file(text, paths)
    return mounts or {"": ""}


def refresh(environment: PodEnvironment, pod: dict, folder: Path, containers: list[ContainerProc],
            mounts: dict[str, str]) -> None:
    """Write the pod's ConfigMap and Secret volumes again from the objects as they are now (a kubelet
    does so when the pod is updated), each file replaced whole so that a reader never sees half of
    it; a volume whose object is missing keeps what it had."""
    paths = {**termination_paths(containers), **{k: v for k, v in mounts.items() if k}}
    for vol in pod["spec"].get("volumes") or []:
        if "configMap" not in vol and "secret" not in vol:
            continue
        target, staging = folder / "volumes" / vol["name"], folder / "volumes" / f".{vol['name']}.new"
        if staging.exists():
            shutil.rmtree(staging)
        staging.mkdir(parents=True)
        try:
            for text in _write_objects(environment, vol, staging):
                _rewrite_file(text, paths)
            for path in sorted(p for p in staging.rglob("*") if p.is_file()):
                dest = target / path.relative_to(staging)
                dest.parent.mkdir(parents=True, exist_ok=True)
                os.replace(path, dest)
        except Waiting:
            pass
        finally:
            shutil.rmtree(staging, ignore_errors=True)


def _rewrite_file(path: Path, paths: dict[str, str]) -> None:
    """A ConfigMap file with the pod's paths rewritten; a gzip-compressed one (the pod contract) is
    rewritten inside, and stays compressed. A file that is not text, or not gzip it can read, is left
    as it is (the container reads it as a kubelet would have written it)."""
    raw = path.read_bytes()
    gzipped = compressed.is_gzip(raw)
    try:
        text = (compressed.decompress(raw, REWRITE_MAX_BYTES) if gzipped else raw).decode()
    except (compressed.Unreadable, UnicodeDecodeError):
        return
    out = rewrite_paths(text, paths).encode()
    path.write_bytes(compressed.compress(out) if gzipped else out)


def _write_objects(environment: PodEnvironment, vol: dict, target: Path) -> list[Path]:
    """A ConfigMap or Secret volume's keys as files in `target`; the ConfigMap files written."""
    texts = []
    for kind, key in (("configMap", "configmaps"), ("secret", "secrets")):
        if kind in vol:
            ref = vol[kind]
            data = environment.object_files(key, ref.get("name") or ref.get("secretName"), ref.get("optional"))
            items = ref.get("items")
            pairs = [(i["key"], i["path"]) for i in items] if items else [(k, k) for k in data]
            for k, rel in pairs:
                if k in data:
                    (target / rel).parent.mkdir(parents=True, exist_ok=True)
                    (target / rel).write_bytes(data[k])
                    if kind == "configMap":
                        texts.append(target / rel)
    return texts


def termination_paths(containers: list[ContainerProc]) -> dict[str, str]:
    """terminationMessagePath -> the file of the first container that declares it."""
    paths: dict[str, str] = {}
    for c in containers:
        paths.setdefault(c.spec.get("terminationMessagePath") or TERMINATION_LOG, str(c.message_file))
    return paths


def claim_folder(environment: PodEnvironment, claim: str) -> Path:
    """The folder of this machine behind a claim: its bound PersistentVolume's hostPath or local
    path (what the persistent-volume controller bound it to)."""
    pvc = environment.get_or_wait(f"/api/v1/namespaces/{environment.ns}/persistentvolumeclaims/{claim}",
                                  f"persistentvolumeclaim {claim!r} not found")
    volume = (pvc.get("spec") or {}).get("volumeName")
    if (pvc.get("status") or {}).get("phase") != "Bound" or not volume:
        raise Waiting("ContainerCreating", f"waiting for claim {claim!r} to be bound")
    pv = environment.get_or_wait(f"/api/v1/persistentvolumes/{volume}",
                                 f"persistentvolume {volume!r} not found")
    source = (pv.get("spec") or {}).get("hostPath") or (pv.get("spec") or {}).get("local")
    if not source or not source.get("path"):
        raise Waiting("CreateContainerConfigError", f"claim {claim!r} is bound to {volume!r}, which is "
                                                    "not a hostPath or local volume (local nodes mount only those)")
    folder = Path(source["path"])
    folder.mkdir(parents=True, exist_ok=True)
    return folder
