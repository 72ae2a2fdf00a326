"""The local-node runtime's process: `python -m shardwise.e2e.localcluster.localnodes`, started by
the local control plane; it serves the local nodes until SIGTERM or SIGINT, then kills their pods."""
from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import threading
from pathlib import Path

from shardwise.e2e.localcluster import kapi
from shardwise.e2e.localcluster.localnodes.heartbeat import RENEW_EVERY
from shardwise.e2e.localcluster.localnodes.host import NodeHost

log = logging.getLogger(__name__)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m shardwise.e2e.localcluster.localnodes")
    parser.add_argument("--kubeconfig", required=True)
    parser.add_argument("--nodes-file", help="JSON list of Node objects to register at start")
    parser.add_argument("--state-dir", required=True, help="where pods' folders and logs go")
    parser.add_argument("--renew-seconds", type=float, default=RENEW_EVERY,
                        help="how often each node's Lease is renewed")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    nodes = json.loads(Path(args.nodes_file).read_text()) if args.nodes_file else []
    state = Path(args.state_dir)
    state.mkdir(parents=True, exist_ok=True)
    host = NodeHost(kapi.Client.from_kubeconfig(args.kubeconfig), state, nodes, renew_every=args.renew_seconds)

    def on_signal(signum, frame):
        host.stopping.set()
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    host.register_nodes()
    threads = [threading.Thread(target=host.node_loop, daemon=True, name="nodes"),
               threading.Thread(target=host.pod_loop, daemon=True, name="pods")]
    for t in threads:
        t.start()
    log.info("serving local nodes %s", ", ".join(n["metadata"]["name"] for n in nodes) or "(none)")
    while not host.stopping.wait(0.5):
        pass
    log.info("stopping: killing pod processes")
    host.stop()
    host.wait_runners_done(5)
    return 0


if __name__ == "__main__":
    sys.exit(main())
