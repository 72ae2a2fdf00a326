"""The kind tooling's pure parts and its one-line errors, without a cluster (tests/kind runs one):
the capabilities a host lacks, the runc wrapper that drops them, the kind config the nodes get, and
what `shardwise kind` says when Docker, the binaries or the network are not there."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from shardwise.e2e.kind import docker

from shardwise.e2e.kind import images

from shardwise.e2e.kind import cluster as kindcluster

from shardwise.e2e.kind import registry

ROOT = Path(__file__).resolve().parents[2]
FULL = "CapBnd:\t000001ffffffffff\n"
NO_SYS_RESOURCE = "CapBnd:\t000001fffeffffff\n"


def test_capabilities_missing_names_the_bits_the_bounding_set_lacks():
    assert docker.capabilities_missing(FULL, last_cap=40) == []
    assert docker.capabilities_missing(NO_SYS_RESOURCE, last_cap=40) == ["CAP_SYS_RESOURCE"]
    # Only the capabilities this kernel knows count.
    assert docker.capabilities_missing("CapBnd:\t00000000ffffffff\n", last_cap=31) == []


def test_the_runc_wrapper_drops_what_this_host_cannot_grant_and_passes_the_rest(tmp_path, monkeypatch):
    monkeypatch.setenv("SHARDWISE_CACHE", str(tmp_path / "cache"))
    fake_runc = tmp_path / "runc"
    fake_runc.write_text("#!/bin/sh\necho \"$@\" > \"$(dirname \"$0\")/called\"\n")
    fake_runc.chmod(0o755)
    wrapper = docker.install_runtime_wrapper(str(fake_runc))
    every = [f"CAP_{name}" for name in docker.CAPABILITIES[:int(Path("/proc/sys/kernel/cap_last_cap").read_text()) + 1]]
    lacking = set(docker.capabilities_missing())
    bundle = tmp_path / "bundle"
    bundle.mkdir()
    (bundle / "config.json").write_text(json.dumps(
        {"process": {"capabilities": {"bounding": every, "effective": every}}, "root": {"path": "rootfs"}}))
    process = tmp_path / "process.json"
    process.write_text(json.dumps({"capabilities": {"bounding": every}, "args": ["true"]}))

    for argv, spec, caps_of in ((["--root", "/run/x", "create", "--bundle", str(bundle), "id1"],
                                 bundle / "config.json", lambda s: s["process"]["capabilities"]),
                                (["exec", "--process", str(process), "id1"], process,
                                 lambda s: s["capabilities"])):
        subprocess.run([str(wrapper), *argv], check=True)
        assert (tmp_path / "called").read_text().split() == argv   # runc got the same arguments
        for listed in caps_of(json.loads(spec.read_text())).values():
            assert set(listed) == set(every) - lacking
    subprocess.run([str(wrapper), "state", "id1"], check=True)
    assert (tmp_path / "called").read_text().split() == ["state", "id1"]


def test_configure_daemon_keeps_other_settings_and_reports_a_change(tmp_path):
    daemon_json = tmp_path / "daemon.json"
    daemon_json.write_text(json.dumps({"log-driver": "local"}))
    wrapper = tmp_path / "runc-capped"
    assert docker.configure_daemon(wrapper, daemon_json) is True
    config = json.loads(daemon_json.read_text())
    assert config["log-driver"] == "local" and config["default-runtime"] == docker.RUNTIME_NAME
    assert config["runtimes"][docker.RUNTIME_NAME] == {"path": str(wrapper)}
    assert docker.configure_daemon(wrapper, daemon_json) is False


def test_the_kind_config_gets_the_registry_the_shared_folder_and_the_oom_score_fix_only_when_needed(tmp_path):
    shared = tmp_path / "shared"
    plain = kindcluster.effective_config(kindcluster.CONFIG, [], shared)
    restricted = kindcluster.effective_config(kindcluster.CONFIG, ["CAP_SYS_RESOURCE"], shared)
    original = yaml.safe_load(kindcluster.CONFIG.read_text())
    assert plain["containerdConfigPatches"] == [registry.containerd_patch()]
    assert "restrict_oom_score_adj = true" in restricted["containerdConfigPatches"][-1]
    for node, given in zip(plain["nodes"], original["nodes"]):
        mounts = node.get("extraMounts", [])
        assert node["labels"] == given["labels"]
        assert mounts == ([{"hostPath": str(shared), "containerPath": kindcluster.SHARED_MOUNT}]
                          if node["role"] == "worker" else [])
    assert [n["role"] for n in plain["nodes"]] == ["control-plane"] + ["worker"] * 4


def test_debian_mirror_is_read_from_apt_sources(monkeypatch):
    monkeypatch.setenv("SHARDWISE_DEBIAN_MIRROR", "http://mirror.example/debian")
    assert images.debian_mirror() == "http://mirror.example/debian"


def test_a_failed_build_step_is_one_line_naming_its_last_output_and_the_log(tmp_path, monkeypatch):
    monkeypatch.setenv("SHARDWISE_CACHE", str(tmp_path))
    with pytest.raises(docker.DockerError) as e:
        images.run_logged(["sh", "-c", "echo fetching; echo 'E: Failed getting release file' >&2; exit 1"],
                          "debootstrap", lambda _: None)
    assert str(e.value) == (f"debootstrap failed: E: Failed getting release file "
                            f"(full log: {tmp_path / 'images.log'})")


def shardwise_kind(*args: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "shardwise", "kind", *args], capture_output=True, text=True,
                          env={**os.environ, "PYTHONSAFEPATH": "1", **env}, timeout=120, cwd="/")


def test_no_docker_no_daemon_no_binaries_each_say_one_line(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    no_docker = shardwise_kind("build", env={"PATH": str(empty)})
    assert no_docker.returncode == 1
    assert no_docker.stderr.strip() == ("shardwise kind: docker: not found on PATH; install Docker "
                                        "(Debian: `apt-get install docker.io`) and start dockerd")
    if not shutil.which("docker"):
        pytest.skip("no docker CLI here for the daemon check")
    no_daemon = shardwise_kind("build", env={"DOCKER_HOST": f"unix://{tmp_path}/no.sock"})
    assert no_daemon.returncode == 1 and len(no_daemon.stderr.strip().splitlines()) == 1
    assert no_daemon.stderr.startswith("shardwise kind: the Docker daemon is not answering")
    unbuilt = shardwise_kind("up", "--name", "nothing-here", env={"SHARDWISE_CACHE": str(tmp_path / "cache")})
    assert unbuilt.returncode == 1
    assert unbuilt.stderr.strip() == "shardwise kind: kind is not built: run `shardwise kind build`"


def test_a_module_that_cannot_be_downloaded_is_one_line(tmp_path, monkeypatch):
    if not shutil.which("go"):
        pytest.skip("no go here")
    from shardwise.e2e import build
    monkeypatch.setenv("SHARDWISE_CACHE", str(tmp_path))
    monkeypatch.setenv("GOPROXY", "off")   # as without network: nothing to download from
    monkeypatch.setenv("GOMODCACHE", str(tmp_path / "mod"))
    with pytest.raises(build.BuildError) as e:
        build.download_module("example.com/not/there", "v1.0.0")
    assert str(e.value).startswith("downloading example.com/not/there@v1.0.0 failed: ")
    assert "GOPROXY=off" in str(e.value) and "\n" not in str(e.value)


def test_a_missing_node_image_and_a_taken_cluster_name_are_one_line(tmp_path):
    try:
        docker.check_daemon()
    except docker.DockerError as e:
        pytest.skip(str(e))
    # kind itself answers `get clusters`; this stand-in lists one cluster, as kind would.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "kind").write_text("#!/bin/sh\n[ \"$1 $2\" = 'get clusters' ] && echo taken\n")
    (bin_dir / "kind").chmod(0o755)
    with pytest.raises(docker.DockerError) as e:
        kindcluster.KindCluster("taken", bin_dir).create(image="shardwise/kind-node:not-built")
    assert str(e.value) == ("image shardwise/kind-node:not-built is not there: build it with "
                            "`shardwise kind build`")
    if not docker.image_exists(images.DEBIAN_IMAGE):
        pytest.skip(f"no {images.DEBIAN_IMAGE} to stand in for a node image")
    with pytest.raises(docker.DockerError) as e:
        kindcluster.KindCluster("taken", bin_dir).create(image=images.DEBIAN_IMAGE)
    assert str(e.value).startswith("a kind cluster named 'taken' already exists: use it")


def test_a_disk_too_small_for_the_cluster_is_refused_in_one_line_before_any_node_is_made():
    from shardwise.e2e.kind import space

    gpu_nodes = kindcluster.KindCluster("shardwise-space-check").gpu_node_count()
    assert gpu_nodes == 4   # e2e/kind/kind-config.yaml: four GPU workers, the control plane is not one
    sizes = [int(0.5e9), int(3.8e9)]
    need = space.needed_bytes(sizes, gpu_nodes)
    space.check_room(sizes, gpu_nodes, free=need)            # room enough: no complaint
    with pytest.raises(docker.DockerError) as e:
        space.check_room(sizes, gpu_nodes, free=int(5.1e9))
    message = str(e.value)
    assert "\n" not in message and "5.1 GB free" in message and f"{need / 1e9:.1f} GB" in message


def test_every_stage_of_the_product_images_is_kept_under_a_tag_of_its_own():
    """A stage without a tag is an untagged image once the build is done, which the next build's
    cleanup would take for a superseded one (and throw away the cache of torch's layer with it)."""
    from shardwise.e2e.kind import space

    assert space.stages(ROOT / "docker" / "worker.Dockerfile") == ["deps", "kernels", "app"]
    assert space.stages(ROOT / "docker" / "operator.Dockerfile") == ["build"]
    assert space.stage_tag("shardwise/worker:dev-cpu", "deps") == "shardwise/worker-deps:dev-cpu"
