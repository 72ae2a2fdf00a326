"""Fetching a model from a local S3 server (MinIO) into the node cache: cold download time and rate,
a warm start from the cache, and one pipeline stage's share, in one run.

    python benchmarks/fetch_bench.py [--layers 8] [--hidden 1024] [--json]

Writes a random Llama of the given shape (float32, one safetensors file per layer plus the
embedding's and the head's, with its index), uploads it in single-part objects (so each ETag is the
MD5 the cache verifies), and fetches it three times into fresh or warm cache folders. Needs the
MinIO binary (`shardwise dev build-s3`).
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from shardwise.crds.modelsource import parse_model_uri
from shardwise.e2e.s3server import running_s3_server
from shardwise.worker.fetch.cache import CacheConfig, ModelCache
from shardwise.worker.fetch.pull import fetch_stage
from shardwise.worker.fetch.s3 import S3Config, S3Store, make_client
from shardwise.worker.weights.tiny import write_tiny_model


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=1024)
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

        def timed(root: Path, stage: int = 0, pipeline: int = 1) -> tuple[float, int]:
            remote = S3Store(parse_model_uri("s3://models/m"), config, server.env())
            t = time.perf_counter()
            report = fetch_stage(ModelCache(CacheConfig(root, 1 << 40, disk_reserve_bytes=0)), remote,
                                 "s3", "models/m", stage, pipeline)
            return time.perf_counter() - t, report.fetched_bytes

        cold_s, cold_bytes = timed(Path(tmp) / "node-a")
        warm_s, warm_bytes = timed(Path(tmp) / "node-a")
        stage_s, stage_bytes = timed(Path(tmp) / "node-b", stage=1, pipeline=2)
    result = {"model_bytes": whole, "cold_s": round(cold_s, 3), "cold_mib_per_s": round(cold_bytes / cold_s / 2**20, 1),
              "warm_s": round(warm_s, 3), "warm_fetched_bytes": warm_bytes, "cold_over_warm": round(cold_s / warm_s, 1),
              "stage1_of_2_fetched_bytes": stage_bytes, "stage1_share": round(stage_bytes / whole, 3),
              "stage1_s": round(stage_s, 3)}
    print(json.dumps(result) if args.json else "\n".join(f"{k}: {v}" for k, v in result.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
