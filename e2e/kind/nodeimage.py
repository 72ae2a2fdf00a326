"""The kind node image, built here from the Debian mirror and Go modules alone.

kind's published node image is pulled from a registry, and `kind build node-image` pulls the images
kubeadm runs; neither works without one. This builds the same thing from parts:

    shardwise/kind-base    Debian + systemd, containerd, runc and the CNI plugins (Debian's packages),
                           kind's own node files (entrypoint, systemd units, containerd config) from the
                           `sigs.k8s.io/kind` Go module at the pinned version, kubelet/kubeadm/kubectl
    component images       kube-apiserver, -controller-manager, -scheduler, -proxy, etcd, CoreDNS,
                           pause and flannel (the pod network), tagged as kubeadm asks for them
    shardwise/kind-node    the base with those images imported into its containerd, the pod network's
                           manifest at /kind/manifests/default-cni.yaml and /kind/version: what the
                           real `kind create cluster --image` expects of a node image

The pod network is flannel with its host-gw backend (kind's nodes share one Docker bridge, so routes
to each node's pod CIDR are enough) and the standard bridge/host-local/portmap CNI plugins; kind's
kindnetd is not published as a Go module. Everything is cached as Docker images and reused while the
pins are unchanged.
"""
from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from shardwise.e2e import build
from shardwise.e2e.kind.docker import DockerError, docker, image_exists
from shardwise.e2e.kind.images import DEBIAN_IMAGE, build_debian, docker_build, run_logged

FLANNEL_IMAGE = f"shardwise/flannel:{build.FLANNEL}"
# Debian's packages a kind node runs on (kind's base image list, less rootless and storage extras).
NODE_PACKAGES = ("systemd conntrack iptables nftables iproute2 ethtool util-linux mount kmod "
                 "libseccomp2 pigz bash ca-certificates curl jq procps containerd runc "
                 "containernetworking-plugins")

_BASE_DOCKERFILE = f"""\
ARG DEBIAN_IMAGE={DEBIAN_IMAGE}
FROM ${{DEBIAN_IMAGE}}
ARG PAUSE_IMAGE
RUN apt-get update \\
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends {NODE_PACKAGES} \\
 && rm -rf /var/lib/apt/lists/* \\
 && find /lib/systemd/system/sysinit.target.wants/ -name systemd-tmpfiles-setup.service -delete \\
 && rm -f /lib/systemd/system/multi-user.target.wants/* /etc/systemd/system/*.wants/* \\
          /lib/systemd/system/local-fs.target.wants/* /lib/systemd/system/sockets.target.wants/*udev* \\
          /lib/systemd/system/sockets.target.wants/*initctl* /lib/systemd/system/basic.target.wants/* \\
 && echo "ReadKMsg=no" >> /etc/systemd/journald.conf \\
 && ln -sf /usr/lib/systemd/systemd /sbin/init
COPY files/ /
COPY bin/ /usr/bin/
# kind's units start /usr/local/bin/containerd and its containerd config looks for CNI plugins in
# /opt/cni/bin; Debian installs them under /usr.
RUN chmod 0755 /usr/local/bin/* /kind/bin/* /usr/bin/kubelet /usr/bin/kubeadm /usr/bin/kubectl \\
 && ln -sf /usr/bin/containerd /usr/local/bin/containerd \\
 && sed -i "s#^\\( *sandbox_image = \\).*#\\1\\"$PAUSE_IMAGE\\"#" /etc/containerd/config.toml \\
 && mkdir -p /opt/cni/bin /etc/kubernetes/manifests && ln -sf /usr/lib/cni/* /opt/cni/bin/ \\
 && ctr oci spec \\
      | jq '.hooks.createContainer[.hooks.createContainer | length] |= . + {{"path": "/kind/bin/mount-product-files.sh"}}' \\
      | jq 'del(.process.rlimits)' > /etc/containerd/cri-base.json \\
 && systemctl enable kubelet.service containerd.service undo-mount-hacks.service \\
 && systemctl mask systemd-binfmt.service
ENV container=docker
STOPSIGNAL SIGRTMIN+3
ENTRYPOINT ["/usr/local/bin/entrypoint", "/sbin/init"]
"""

# The pod network: flanneld routes each node's pod CIDR (host-gw); a second container writes the CNI
# config from the subnet flanneld leased (what flannel's own CNI plugin would compute at each call).
# kind fills in {{ .PodSubnet }} when the file carries its "template" marker.
_FLANNEL_MANIFEST = """\
# would you kindly template this file
apiVersion: v1
kind: ServiceAccount
metadata: {name: flannel, namespace: kube-system}
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRole
metadata: {name: flannel}
rules:
  - {apiGroups: [""], resources: [pods], verbs: [get]}
  - {apiGroups: [""], resources: [nodes], verbs: [get, list, watch]}
  - {apiGroups: [""], resources: [nodes/status], verbs: [patch]}
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRoleBinding
metadata: {name: flannel}
roleRef: {apiGroup: rbac.authorization.k8s.io, kind: ClusterRole, name: flannel}
subjects: [{kind: ServiceAccount, name: flannel, namespace: kube-system}]
---
apiVersion: v1
kind: ConfigMap
metadata: {name: kube-flannel-cfg, namespace: kube-system}
data:
  net-conf.json: |
    {"Network": "{{ .PodSubnet }}", "Backend": {"Type": "host-gw"}}
---
apiVersion: apps/v1
kind: DaemonSet
metadata: {name: kube-flannel, namespace: kube-system, labels: {app: flannel}}
spec:
  selector: {matchLabels: {app: flannel}}
  template:
    metadata: {labels: {app: flannel}}
    spec:
      hostNetwork: true
      priorityClassName: system-node-critical
      serviceAccountName: flannel
      tolerations: [{operator: Exists}]
      containers:
        - name: flanneld
          image: @FLANNEL_IMAGE@
          imagePullPolicy: Never
          command: [/opt/bin/flanneld, --ip-masq, --kube-subnet-mgr]
          env:
            - {name: POD_NAME, valueFrom: {fieldRef: {fieldPath: metadata.name}}}
            - {name: POD_NAMESPACE, valueFrom: {fieldRef: {fieldPath: metadata.namespace}}}
          securityContext: {privileged: true}
          volumeMounts:
            - {name: run, mountPath: /run/flannel}
            - {name: cfg, mountPath: /etc/kube-flannel/}
            - {name: xtables-lock, mountPath: /run/xtables.lock}
        - name: cni-config
          image: @FLANNEL_IMAGE@
          imagePullPolicy: Never
          command:
            - /bin/sh
            - -ec
            - |
              until [ -f /run/flannel/subnet.env ]; do sleep 1; done
              . /run/flannel/subnet.env
              # FLANNEL_SUBNET is the gateway's address (10.244.3.1/24); host-local wants the network
              # (node pod CIDRs are /24 here: kube-controller-manager's default mask).
              gateway=${FLANNEL_SUBNET%/*}
              network=${gateway%.*}.0/${FLANNEL_SUBNET#*/}
              cat > /etc/cni/net.d/.10-flannel.conflist <<EOF
              {"cniVersion": "0.4.0", "name": "flannel", "plugins": [
                {"type": "bridge", "bridge": "cni0", "isGateway": true, "isDefaultGateway": true,
                 "ipMasq": false, "hairpinMode": true, "mtu": $FLANNEL_MTU,
                 "ipam": {"type": "host-local",
                          "ranges": [[{"subnet": "$network", "gateway": "$gateway"}]]}},
                {"type": "portmap", "capabilities": {"portMappings": true}}]}
              EOF
              mv /etc/cni/net.d/.10-flannel.conflist /etc/cni/net.d/10-flannel.conflist
              exec sleep infinity
          volumeMounts:
            - {name: run, mountPath: /run/flannel}
            - {name: cni, mountPath: /etc/cni/net.d}
      volumes:
        - {name: run, hostPath: {path: /run/flannel}}
        - {name: cni, hostPath: {path: /etc/cni/net.d}}
        - {name: cfg, configMap: {name: kube-flannel-cfg}}
        - {name: xtables-lock, hostPath: {path: /run/xtables.lock, type: FileOrCreate}}
"""

# kind applies this after the cluster is up; the suite's claims are hostPath volumes it makes itself.
_STORAGE_MANIFEST = """\
apiVersion: storage.k8s.io/v1
kind: StorageClass
metadata:
  name: standard
  annotations: {storageclass.kubernetes.io/is-default-class: "true"}
provisioner: kubernetes.io/no-provisioner
volumeBindingMode: WaitForFirstConsumer
"""


def _recipe_tag() -> str:
    """The pinned Kubernetes version and a hash of everything this module puts in the node image, so
    that a changed recipe or pin makes a new image rather than reusing a stale one."""
    recipe = json.dumps([build.pins(), NODE_PACKAGES, _BASE_DOCKERFILE, _FLANNEL_MANIFEST,
                         _STORAGE_MANIFEST], sort_keys=True)
    return f"{build.KUBERNETES}-{hashlib.sha256(recipe.encode()).hexdigest()[:8]}"


NODE_IMAGE = f"shardwise/kind-node:{_recipe_tag()}"
BASE_IMAGE = f"shardwise/kind-base:{_recipe_tag()}"


def kubeadm_images(bin_dir: Path) -> dict[str, str]:
    """What kubeadm will ask containerd for, by component: {"kube-apiserver": "registry.k8s.io/…", …}."""
    out = subprocess.run([str(bin_dir / "kubeadm"), "config", "images", "list",
                          "--kubernetes-version", build.KUBERNETES],
                         capture_output=True, text=True, check=True).stdout.split()
    return {ref.rsplit("/", 1)[-1].split(":")[0]: ref for ref in out}


def pause_binary(work: Path, say) -> Path:
    """Kubernetes' pause container, compiled statically from the C file in the k8s.io/kubernetes module."""
    module = build.download_module("k8s.io/kubernetes", build.KUBERNETES)
    source = Path(module["Dir"]) / "build" / "pause" / "linux" / "pause.c"
    out = work / "pause"
    if not shutil.which("cc"):
        raise DockerError("cc: not found; the pause image needs a C compiler "
                          "(Debian: `apt-get install gcc libc6-dev`)")
    run_logged(["cc", "-Os", "-static", "-o", str(out), str(source),
                f'-DVERSION="{build.KUBERNETES}-shardwise"'], "compile pause", say)
    return out


def _component_image(tag: str, binary: Path, dest: str, say, base: str = "scratch",
                     entrypoint: bool = False, packages: str = "") -> None:
    """A one-binary image: FROM scratch for static Go binaries, Debian where iptables is needed."""
    if image_exists(tag):
        return
    with tempfile.TemporaryDirectory(prefix="shardwise-img-") as ctx:
        shutil.copy2(binary, Path(ctx) / binary.name)
        lines = [f"FROM {base}"]
        if packages:
            lines.append("RUN apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y "
                         f"--no-install-recommends {packages} && rm -rf /var/lib/apt/lists/*")
        lines += [f"COPY {binary.name} {dest}",
                  "ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"]
        if entrypoint:
            lines.append(f'ENTRYPOINT ["{dest}"]')
        (Path(ctx) / "Dockerfile").write_text("\n".join(lines) + "\n")
        docker_build(Path(ctx) / "Dockerfile", tag, Path(ctx), say)


def component_images(bin_dir: Path, work: Path, say) -> list[str]:
    """Build every image the node must hold; returns their names."""
    wanted = kubeadm_images(bin_dir)
    for name in ("kube-apiserver", "kube-controller-manager", "kube-scheduler"):
        _component_image(wanted[name], bin_dir / name, f"/usr/local/bin/{name}", say)
    _component_image(wanted["kube-proxy"], bin_dir / "kube-proxy", "/usr/local/bin/kube-proxy", say,
                     base=DEBIAN_IMAGE, packages="iptables nftables conntrack ipset kmod")
    _component_image(wanted["etcd"], bin_dir / "etcd", "/usr/local/bin/etcd", say)
    _component_image(wanted["coredns"], bin_dir / "coredns", "/coredns", say, entrypoint=True)
    if not image_exists(wanted["pause"]):
        _component_image(wanted["pause"], pause_binary(work, say), "/pause", say, entrypoint=True)
    _component_image(FLANNEL_IMAGE, bin_dir / "flanneld", "/opt/bin/flanneld", say,
                     base=DEBIAN_IMAGE, packages="iptables nftables")
    return [*wanted.values(), FLANNEL_IMAGE]


def build_base(bin_dir: Path, say) -> str:
    if image_exists(BASE_IMAGE):
        return BASE_IMAGE
    # kind's own node files, from the sigs.k8s.io/kind module at the pinned version.
    kind_dir = Path(build.download_module("sigs.k8s.io/kind", build.KIND)["Dir"])
    with tempfile.TemporaryDirectory(prefix="shardwise-kindbase-") as ctx:
        shutil.copytree(kind_dir / "images" / "base" / "files", Path(ctx) / "files")
        (Path(ctx) / "bin").mkdir()
        for name in ("kubelet", "kubeadm", "kubectl"):
            shutil.copy2(bin_dir / name, Path(ctx) / "bin" / name)
        (Path(ctx) / "Dockerfile").write_text(_BASE_DOCKERFILE)
        subprocess.run(["chmod", "-R", "u+w", ctx], check=True)   # the module cache is read-only
        # containerd starts every pod's sandbox from the pause image kubeadm asks for.
        docker_build(Path(ctx) / "Dockerfile", BASE_IMAGE, Path(ctx), say,
                     {"PAUSE_IMAGE": kubeadm_images(bin_dir)["pause"]})
    return BASE_IMAGE


def build_node_image(say=print, force: bool = False) -> str:
    """Everything above, in order; each part is reused while its image exists."""
    if image_exists(NODE_IMAGE) and not force:
        say(f"{NODE_IMAGE}: present")
        return NODE_IMAGE
    started = time.monotonic()
    build_debian(say)
    bin_dir = build.build(say=say, wanted=(*build.ALL_BINARIES, *build.KIND_BINARIES))
    work = build.cache_root() / "src"
    work.mkdir(parents=True, exist_ok=True)
    base = build_base(bin_dir, say)
    images = component_images(bin_dir, work, say)
    say(f"assembling {NODE_IMAGE}: importing {len(images)} images into the node's containerd")
    container = docker("run", "-d", "--entrypoint=sleep", "--security-opt", "seccomp=unconfined",
                       base, "infinity").stdout.decode().strip()
    try:
        _exec(container, "sh", "-c", "nohup containerd >/tmp/containerd.log 2>&1 &")
        _exec(container, "sh", "-c", "for i in $(seq 30); do ctr version >/dev/null 2>&1 && exit 0; "
                                     "sleep 1; done; exit 1")
        save = subprocess.Popen(["docker", "save", *images], stdout=subprocess.PIPE)
        try:
            run_logged(["docker", "exec", "-i", container, "ctr", "--namespace=k8s.io", "images",
                        "import", "--all-platforms", "--no-unpack", "--digests", "-"],
                       "import images", say, stdin=save.stdout)
        finally:
            save.stdout.close()
            save.wait()
        _exec(container, "pkill", "containerd")
        _write(container, "/kind/version", build.KUBERNETES)
        _write(container, "/kind/manifests/default-cni.yaml",
               _FLANNEL_MANIFEST.replace("@FLANNEL_IMAGE@", FLANNEL_IMAGE))
        _write(container, "/kind/manifests/default-storage.yaml", _STORAGE_MANIFEST)
        docker("commit", "--change", 'ENTRYPOINT [ "/usr/local/bin/entrypoint", "/sbin/init" ]',
               container, NODE_IMAGE)
    finally:
        docker("rm", "-f", "-v", container, check=False)
    say(f"{NODE_IMAGE}: built in {time.monotonic() - started:.0f}s")
    return NODE_IMAGE


def _exec(container: str, *cmd: str) -> None:
    docker("exec", container, *cmd)


def _write(container: str, path: str, text: str) -> None:
    docker("exec", "-i", container, "sh", "-c", f"mkdir -p $(dirname {path}) && cat > {path}",
           input=text.encode())
