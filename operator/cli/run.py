"""`shardwise operator run`: the operator process (kopf), with leader election, /metrics and /healthz."""
from __future__ import annotations

import argparse
import http.server
import logging
import os
import sys
import threading
from typing import Callable

from shardwise.crds.apimodel import parse_quantity
from shardwise.crds.names import LOCAL_CHECKPOINT_ROOT, MODEL_CACHE_BUDGET, MODEL_CACHE_ROOT
from shardwise.operator.render.settings import DEFAULT_ROUTER_IMAGE


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", required=True)
    run = sub.add_parser("run", help="watch ShardedModels and reconcile them")
    run.add_argument("--kubeconfig", help="kubeconfig file (default: in-cluster, else $KUBECONFIG or ~/.kube/config)")
    scope = run.add_mutually_exclusive_group()
    scope.add_argument("--namespace", "-n", action="append", default=[],
                       help="watch only this namespace (repeatable)")
    scope.add_argument("--all-namespaces", "-A", action="store_true", help="watch every namespace (the default)")
    run.add_argument("--metrics-port", type=int, default=9090, help="Prometheus /metrics port; 0 turns it off")
    run.add_argument("--health-port", type=int, default=8080, help="/healthz port; 0 turns it off")
    run.add_argument("--bind-address", default="0.0.0.0", help="address of the /metrics and /healthz servers")
    run.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    run.add_argument("--worker-image", default=None,
                     help="worker image for ShardedModels that set no spec.image")
    run.add_argument("--router-image", default=DEFAULT_ROUTER_IMAGE,
                     help="image of the models' router pods (spec.serving.router): the operator's own "
                          "(default %s)" % DEFAULT_ROUTER_IMAGE)
    run.add_argument("--lease-namespace", default=None,
                     help="namespace of the leader-election Lease (default: $POD_NAMESPACE, else 'default')")
    run.add_argument("--lease-name", default="shardwise-operator")
    run.add_argument("--lease-duration", type=int, default=15,
                     help="seconds without renewal after which a standby takes over (renewed every third)")
    run.add_argument("--progress-seconds", type=float, default=10.0,
                     help="how often a running training job's progress is read from its pods")
    run.add_argument("--grow-after-seconds", type=float, default=30.0,
                     help="how long an elastic training job runs short before it may grow back (no restart loops)")
    run.add_argument("--model-root", default=os.environ.get("SHARDWISE_MODEL_ROOT", ""),
                     help="folder of the operator's own file system it may read models from (spec.model.uri "
                          "inside it); default $SHARDWISE_MODEL_ROOT, else none: the probe pod reads them")
    run.add_argument("--network-policy", action=argparse.BooleanOptionalAction, default=True,
                     help="make a NetworkPolicy per model (--no-network-policy: for clusters whose network "
                          "plugin enforces none)")
    run.add_argument("--operator-pod-labels", default="", metavar="K=V,...",
                     help="labels of the operator's own pods (in $POD_NAMESPACE), which every model's "
                          "NetworkPolicy admits to the serving port (a training pod's /progress)")
    run.add_argument("--local-checkpoint-root", action="append", default=None, metavar="DIR",
                     help="a node directory spec.checkpoint.local.hostPath may name (repeatable; default "
                          "%s; an empty value: none, no model gets a local tier)" % LOCAL_CHECKPOINT_ROOT)
    run.add_argument("--prepare-local-checkpoints", action=argparse.BooleanOptionalAction, default=True,
                     help="give a local tier's new node directory to the worker's group with a root init "
                          "container (--no-prepare-local-checkpoints: the nodes' directories are prepared "
                          "beforehand; see docs/security.md)")
    run.add_argument("--model-cache-host-path", default=MODEL_CACHE_ROOT, metavar="DIR",
                     help="node directory of the cache remote models (hf://, s3://, oci://) are fetched into, "
                          "<DIR>/<namespace> per namespace (default %s; empty: none, every pod fetches into "
                          "an emptyDir of its own)" % MODEL_CACHE_ROOT)
    run.add_argument("--model-cache-budget", default=str(MODEL_CACHE_BUDGET), metavar="QUANTITY",
                     help="bytes the node cache keeps, least recently used out (a quantity: 500Gi)")
    run.add_argument("--prepare-model-cache", action=argparse.BooleanOptionalAction, default=True,
                     help="give a namespace's new cache directory to the worker's group with a root init "
                          "container (--no-prepare-model-cache: the nodes' directories are prepared beforehand)")
    run.add_argument("--plain-http-registry", action="append", default=[], metavar="HOST[:PORT]",
                     help="an OCI registry the pods and the probe of oci:// models may speak plain HTTP to "
                          "(repeatable; registry credentials then cross the network in clear): a registry "
                          "inside the cluster without TLS. Others: HTTPS only, but a loopback one")
    run.add_argument("--no-leader-election", action="store_true",
                     help="run without a Lease (only when exactly one operator runs)")


class _Health(http.server.BaseHTTPRequestHandler):
    alive = threading.Event()
    # the reconcile loops that have not completed a pass in time (controller/liveness.py)
    stalled: Callable[[], list[str]] = staticmethod(lambda: [])

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        stalled = self.stalled() if self.alive.is_set() else []
        ok = self.path.startswith("/healthz") and self.alive.is_set() and not stalled
        self.send_response(200 if ok else 503)
        self.send_header("Content-Type", "text/plain")
        self.end_headers()
        body = "ok\n" if ok else f"reconcile stalled: {', '.join(stalled)}\n" if stalled else "not ready\n"
        self.wfile.write(body.encode())

    def log_message(self, *args: object) -> None:
        pass


class _Refused(Exception):
    """A one-line reason the operator cannot start (printed, exit status 2)."""


def run(args: argparse.Namespace) -> int:
    import kopf

    from shardwise.operator.controller import apply as applier_mod

    from shardwise.operator.controller import handlers

    try:
        _check_arguments(args)
        _configure_logging(args.log_level)
        api = _connect(args.kubeconfig)
        _serve_health_and_metrics(args)
    except _Refused as e:
        print(f"shardwise operator: {e}", file=sys.stderr)
        return 2
    handlers.WIRING.applier = applier_mod.Applier(api)
    _Health.stalled = staticmethod(handlers.WIRING.liveness.stalled)
    if args.worker_image:
        handlers.WIRING.default_image = args.worker_image
    lock = None if args.no_leader_election else _become_leader(api, args)
    if lock is not None:
        handlers.WIRING.applier.fence = lock.check   # no write once the lease has run out
    scope = dict(clusterwide=True) if not args.namespace else dict(namespaces=args.namespace)
    try:
        kopf.run(standalone=True, **scope)
    finally:
        if lock is not None:
            lock.release()
    return 0


def _check_arguments(args: argparse.Namespace) -> None:
    from shardwise.operator.decide import elastic
    from shardwise.operator.controller import modelroot
    from shardwise.operator.controller import progress as training
    from shardwise.operator.render import settings

    if args.progress_seconds <= 0:
        raise _Refused("--progress-seconds must be more than 0")
    if args.grow_after_seconds < 0:
        raise _Refused("--grow-after-seconds must be 0 or more")
    if not args.no_leader_election and args.lease_duration < 3:
        raise _Refused("--lease-duration must be at least 3 seconds")
    if args.kubeconfig and not os.path.exists(args.kubeconfig):
        raise _Refused(f"kubeconfig {args.kubeconfig} does not exist")
    if args.model_root and not os.path.isdir(args.model_root):
        raise _Refused(f"--model-root {args.model_root} is not a directory")
    render_settings = _render_settings(args)
    training.POLL_SECONDS = args.progress_seconds
    modelroot.ROOT = args.model_root
    elastic.GROW_AFTER_SECONDS = args.grow_after_seconds
    settings.configure(render_settings)


def _render_settings(args: argparse.Namespace):
    """What shapes the objects rendered (operator/render/settings.py), checked: one line if wrong."""
    from shardwise.crds.modelsource import is_registry, registry_key
    from shardwise.operator.render import localtier, settings

    labels = {}
    for item in filter(None, (p.strip() for p in args.operator_pod_labels.split(","))):
        key, eq, value = item.partition("=")
        if not eq or not key:
            raise _Refused(f"--operator-pod-labels: {item!r} is not KEY=VALUE")
        labels[key] = value
    roots = [r for r in (args.local_checkpoint_root or [LOCAL_CHECKPOINT_ROOT]) if r]
    for root in roots:
        if not root.startswith("/") or ".." in root.split("/"):
            raise _Refused(f"--local-checkpoint-root {root} must be an absolute path without '..'")
    roots = list(dict.fromkeys(localtier.normalised(r) for r in roots))
    for a in roots:
        for b in roots:
            if a != b and (b + "/").startswith(a.rstrip("/") + "/"):
                raise _Refused(f"--local-checkpoint-root {b} is inside {a}: a model's directory under "
                               f"{a} could lead into {b}; give roots apart")
    cache = args.model_cache_host_path
    if cache and (not cache.startswith("/") or ".." in cache.split("/")):
        raise _Refused(f"--model-cache-host-path {cache} must be an absolute path without '..'")
    for root in roots if cache else []:
        a, b = localtier.normalised(cache).rstrip("/") + "/", root.rstrip("/") + "/"
        if a.startswith(b) or b.startswith(a):
            raise _Refused(f"--model-cache-host-path {cache} overlaps --local-checkpoint-root {root}: a "
                           f"namespace's cache directory could be another model's checkpoints; give them apart")
    try:
        budget = parse_quantity(args.model_cache_budget)
    except ValueError as e:
        raise _Refused(f"--model-cache-budget: {e}") from None
    plain = args.plain_http_registry or []
    for host in plain:
        if not is_registry(host):
            raise _Refused(f"--plain-http-registry {host[:200]!r} is not a registry's HOST[:PORT]")
    return settings.Settings(network_policy=args.network_policy,
                             plain_http_registries=tuple(dict.fromkeys(map(registry_key, plain))),
                             model_cache_host_path=localtier.normalised(cache) if cache else "",
                             model_cache_budget=budget, prepare_model_cache=args.prepare_model_cache,
                             operator_namespace=os.environ.get("POD_NAMESPACE", ""), operator_labels=labels,
                             local_checkpoint_roots=tuple(roots),
                             prepare_local_checkpoints=args.prepare_local_checkpoints,
                             router_image=args.router_image)


def _configure_logging(level: str) -> None:
    logging.basicConfig(level=getattr(logging, level.upper()),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # kopf logs every successful event handler at INFO: one line per pod or node update is noise.
    if level != "debug":
        logging.getLogger("kopf.objects").setLevel(logging.WARNING)
    for noisy in ("kubernetes", "aiohttp"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    logging.getLogger("urllib3").setLevel(logging.ERROR)  # its retry warnings repeat what we say once


def _connect(kubeconfig: str | None):
    from kubernetes.config import ConfigException

    from shardwise.operator.controller import apply as applier_mod

    if kubeconfig:
        os.environ["KUBECONFIG"] = kubeconfig  # kopf's own login reads it too
        # ...through the kubernetes client, which read $KUBECONFIG once, when it was imported.
        from kubernetes.config import kube_config
        kube_config.KUBE_CONFIG_DEFAULT_LOCATION = kubeconfig
    try:
        return applier_mod.load_config(kubeconfig)
    except (ConfigException, OSError) as e:
        raise _Refused(f"no cluster to talk to ({e}); pass --kubeconfig") from None


def _serve_health_and_metrics(args: argparse.Namespace) -> None:
    from shardwise.operator.controller import metrics

    try:
        if args.health_port:
            _Health.alive.set()  # a standby is healthy too: it is waiting, as it should
            server = http.server.ThreadingHTTPServer((args.bind_address, args.health_port), _Health)
            threading.Thread(target=server.serve_forever, daemon=True, name="healthz").start()
        if args.metrics_port:
            metrics.serve(args.metrics_port, args.bind_address)
    except OSError as e:
        raise _Refused(f"cannot listen on {args.bind_address} for /healthz (port {args.health_port}) "
                       f"or /metrics (port {args.metrics_port}): {e.strerror}") from None


def _become_leader(api, args: argparse.Namespace):
    """Block until this replica holds the Lease; exit at once if it is ever lost. The Lease has a
    client of its own (`api` is the applier's)."""
    from shardwise.operator.controller.leader import LeaseLock, lease_client

    lease_ns = args.lease_namespace or os.environ.get("POD_NAMESPACE") or "default"
    lock = LeaseLock(lease_client(api.configuration), lease_ns, args.lease_name,
                     lease_seconds=args.lease_duration, renew_seconds=args.lease_duration / 3)
    lock.wait_until_leader()

    def lost() -> None:
        # Another replica may be reconciling now: stop at once rather than act twice.
        logging.getLogger("shardwise.operator").error("leadership lost; exiting")
        os._exit(3)
    lock.keep_renewing(lost)
    return lock
