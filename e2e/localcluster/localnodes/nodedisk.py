"""A local node's own disk: the folder of this machine where its pods' hostPath volumes are.

Node-local storage stays local to the node: pods on other nodes do not see it, a pod on the same
node later does, and deleting the Node deletes the folder (a node marked down keeps it, as a
rebooted machine would).
"""
from __future__ import annotations

import logging
import shutil
from pathlib import Path

log = logging.getLogger(__name__)


def node_folder(state_dir: Path, name: str) -> Path:
    """The node's own disk: where its pods' hostPath volumes are (next to the pods' folder)."""
    return state_dir.parent / "nodes" / name


def host_path(state_dir: Path, node: str, volume: dict) -> Path:
    """A hostPath volume of a pod on `node`: <state>/nodes/<node>/hostpath/<path>."""
    source = volume["hostPath"]
    folder = node_folder(state_dir, node) / "hostpath" / source["path"].lstrip("/")
    if source.get("type") not in ("File", "Socket", "CharDevice", "BlockDevice"):
        folder.mkdir(parents=True, exist_ok=True)
    return folder


def wipe_node(state_dir: Path, name: str) -> None:
    """A deleted node's disk is gone: its hostPath folders with it."""
    folder = node_folder(state_dir, name)
    if folder.exists():
        log.info("node %s is deleted: removing its disk %s", name, folder)
        shutil.rmtree(folder, ignore_errors=True)
