"""Fetching a model from a local S3 server (MinIO) into the node cache: cold download time and rate,
a warm start from the cache, and one pipeline stage's share, in one run; then one stream against
parallel streams (files at once, large files in byte-range parts), on loopback and through a paced
relay (e2e/slowlink.py: each connection limited to --link-mib-s, as a long round trip or a store's
per-connection limit does), in alternating rounds, with the ratios.

    python benchmarks/fetch_bench.py [--layers 8] [--hidden 1024] [--rounds 3] [--streams 8]
                                     [--link-mib-s 32] [--json]

Writes a random Llama of the given shape (float32, one safetensors file per layer plus the
embedding's and the head's, with its index), uploads it in single-part objects (so each ETag is the
MD5 the cache verifies), and fetches it three times into fresh or warm cache folders. Needs the
MinIO binary (`shardwise dev build-s3`).
"""
from __future__ import annotations

import argparse
import json
import sys
import statistics
import tempfile
import time
from pathlib import Path
from urllib.parse import urlparse

from shardwise.crds.modelsource import parse_model_uri
from shardwise.e2e.s3server import running_s3_server
from shardwise.e2e.slowlink import SlowLink
from shardwise.worker.fetch.cache import CacheConfig, ModelCache
from shardwise.worker.fetch.pull import fetch_stage
from shardwise.worker.fetch.s3 import S3Config, S3Store, make_client
from shardwise.worker.weights.tiny import write_tiny_model


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds of one stream against parallel")
    ap.add_argument("--streams", type=int, default=8, help="the parallel side's streams")
    ap.add_argument("--link-mib-s", type=float, default=32.0, help="the paced relay's rate per connection")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tests.worker.fetch.conftest import shard_by_layer

    with tempfile.TemporaryDirectory() as tmp, running_s3_server(Path(tmp) / "s3") as server:
        model = shard_by_layer(write_tiny_model(Path(tmp) / "model", "a b c d e f " * 200, layers=args.layers,
                                                hidden=args.hidden, heads=8, kv_heads=8,
                                                intermediate=4 * args.hidden))
        config = S3Config(endpoint=server.endpoint, path_style=True)
        client = make_client(config, server.env())
        client.create_bucket(Bucket="models")
        for p in sorted(model.iterdir()):
            client.put_object(Bucket="models", Key=f"m/{p.name}", Body=p.read_bytes())
        whole = sum(p.stat().st_size for p in model.iterdir())

        def timed(root: Path, stage: int = 0, pipeline: int = 1, streams: int = 8,
                  store: S3Config = config) -> tuple[float, int]:
            remote = S3Store(parse_model_uri("s3://models/m"), store, server.env())
            t = time.perf_counter()
            cache = ModelCache(CacheConfig(root, 1 << 40, disk_reserve_bytes=0, streams=streams))
            report = fetch_stage(cache, remote, "s3", "models/m", stage, pipeline)
            return time.perf_counter() - t, report.fetched_bytes

        cold_s, cold_bytes = timed(Path(tmp) / "node-a")
        warm_s, warm_bytes = timed(Path(tmp) / "node-a")
        stage_s, stage_bytes = timed(Path(tmp) / "node-b", stage=1, pipeline=2)
        streams = compare_streams(Path(tmp), server, config, timed, args)
    result = {"model_bytes": whole, "cold_s": round(cold_s, 3), "cold_mib_per_s": round(cold_bytes / cold_s / 2**20, 1),
              "warm_s": round(warm_s, 3), "warm_fetched_bytes": warm_bytes, "cold_over_warm": round(cold_s / warm_s, 1),
              "stage1_of_2_fetched_bytes": stage_bytes, "stage1_share": round(stage_bytes / whole, 3),
              "stage1_s": round(stage_s, 3), **streams}
    print(json.dumps(result) if args.json else "\n".join(f"{k}: {v}" for k, v in result.items()))
    return 0


def compare_streams(tmp: Path, server, config: S3Config, timed, args) -> dict:
    """Cold fetches with one stream and with --streams, on loopback and through the paced relay, each
    into a fresh cache, in rounds whose order alternates; the median of each and the ratios."""
    u = urlparse(server.endpoint)
    link = SlowLink((u.hostname, u.port), int(args.link_mib_s * 2**20))
    paced = S3Config(endpoint=f"http://127.0.0.1:{link.port}", path_style=True)
    sides = {f"{where}_{n}": (n, store) for where, store in (("loopback", config), ("paced", paced))
             for n in (1, args.streams)}
    seconds: dict[str, list[float]] = {k: [] for k in sides}
    try:
        for r in range(args.rounds):
            order = list(sides) if r % 2 == 0 else list(reversed(sides))
            for k in order:
                n, store = sides[k]
                took, _ = timed(tmp / f"streams-{k}-{r}", streams=n, store=store)
                seconds[k].append(took)
    finally:
        link.close()
    med = {k: statistics.median(v) for k, v in seconds.items()}
    out = {f"{k}_streams_s": round(v, 3) for k, v in med.items()}
    for where in ("loopback", "paced"):
        out[f"{where}_speedup_{args.streams}_streams"] = round(med[f"{where}_1"] / med[f"{where}_{args.streams}"], 2)
    out["paced_link_mib_s_per_connection"] = args.link_mib_s
    return out


if __name__ == "__main__":
    sys.exit(main())
