"""A remote model's files for one pod: before any rank loads, `shardwise worker` fetches what its
stage loads (config, tokenizer, and the weight files holding its layers: worker/fetch/select.py by the
plan's layer split; of a GGUF model, the byte ranges of its header and its tensors) into the contract's cache folder (the node's cache under its byte budget, or the
pod's own emptyDir), serving the download's progress at DOWNLOAD_PROGRESS_PATH on the pod's port
meanwhile; its final report goes on to the servers that take the port next (worker/cli/pod.py), which
answer it there for the pod's life. The entry stays in use (never evicted) for the pod's life, and
the ranks load its folder exactly as a model in a path.
"""
from __future__ import annotations

import sys
import time
from contextlib import ExitStack
from pathlib import Path

from shardwise.crds.sourcespec import ModelCache as SourceCache

# A pod's own cache (an emptyDir) is bounded by its disk only, which the cache checks before a byte
# is fetched.
POD_CACHE_BUDGET = 1 << 60
# What keeps the fetched entry in use until the pod process exits (its lock is then released).
_HELD: list[ExitStack] = []


def fetch_model(contract, placement, host: str) -> tuple[str, bytes]:
    """(the folder of the pod's stage files, fetched or found in the cache; the fetch's final
    DownloadReport as JSON, which the pod's servers answer at DOWNLOAD_PROGRESS_PATH from then on).
    One line says what was fetched and what was found."""
    from shardwise.crds.modelsource import parse_model_uri
    from shardwise.worker.fetch.cache import ModelCache, reused_words
    from shardwise.worker.fetch.progress import DownloadTracker, ProgressServer
    from shardwise.worker.fetch.pull import hold_stage
    from shardwise.worker.fetch.stores import open_remote, options_of

    source = contract.source
    parsed = parse_model_uri(source.uri)
    remote = open_remote(parsed, options_of(source))
    tracker = DownloadTracker()
    cache = ModelCache(cache_config(source), on_retry=tracker.retried)
    server = ProgressServer(tracker, host, contract.serving.port)
    began, held = time.monotonic(), ExitStack()
    try:
        _, report = held.enter_context(hold_stage(
            cache, remote, parsed.scheme.value, parsed.location, placement.stage, contract.plan.pipeline,
            (placement.layer_start, placement.layer_end), progress=tracker.phase(),
            metadata_progress=tracker.phase()))
        tracker.finished()
    except BaseException as e:
        tracker.failed(str(e))
        held.close()
        raise
    finally:
        server.close()
    _HELD.append(held)
    mib = 1 << 20
    where = "the node's cache" if source.cache is SourceCache.NODE else "the pod's cache"
    print(f"shardwise worker: {parsed}: fetched {report.fetched_bytes / mib:.1f} MiB, "
          f"{reused_words(report)} from {where} ({_files(len(report.files))} of stage "
          f"{placement.stage}) in {time.monotonic() - began:.1f}s over {cache.config.streams} streams",
          file=sys.stderr, flush=True)
    return str(report.files_dir), tracker.final_body()


def cache_config(source):
    """The cache a pod fills, as its contract's `source` block says: where, its byte budget, and the
    reads in flight (spec.model.fetchStreams; the fetcher's default when unset)."""
    from shardwise.worker.fetch.cache import CacheConfig
    streams = {"streams": source.streams} if source.streams is not None else {}
    return CacheConfig(Path(source.cache_dir), source.cache_budget or POD_CACHE_BUDGET, **streams)


def _files(n: int) -> str:
    return f"{n} file" + ("" if n == 1 else "s")
