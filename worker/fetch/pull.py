"""Fetch what one pipeline stage loads of a remote model into the node cache, in two steps inside one
held entry: the metadata (config, tokenizer, index: a few KiB to MiB), then the weight files the
index says hold the stage's tensors (select.py)."""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

from shardwise.worker.fetch.cache import Entry, FetchReport, ModelCache, Progress
from shardwise.worker.fetch.remote import Remote
from shardwise.worker.fetch.select import metadata_files, stage_share, weight_files, whole_gguf


@contextmanager
def hold_stage(cache: ModelCache, remote: Remote, scheme: str, location: str, stage: int = 0,
               pipeline: int = 1, layers: tuple[int, int] | None = None,
               progress: Progress | None = None,
               metadata_progress: Progress | None = None) -> Iterator[tuple[Entry, FetchReport]]:
    """The stage's files in the cache, held in use (never evicted) for the block: (entry, report).
    `progress` follows the weights' fill, `metadata_progress` the metadata's before it."""
    listing = remote.list_files()
    gguf = whole_gguf(listing)
    with cache.open(scheme, location, remote.revision()) as entry:
        if gguf is not None:       # a GGUF model: one file, whole (see select.py)
            yield entry, entry.fill(remote, [gguf], progress)
            return
        first = entry.fill(remote, metadata_files(listing), metadata_progress)
        share = stage_share(entry.files_dir, stage, pipeline, layers)
        weights = entry.fill(remote, weight_files(listing, entry.files_dir, share), progress)
        weights.fetched_bytes += first.fetched_bytes
        weights.reused_bytes += first.reused_bytes
        weights.files = first.files + weights.files
        yield entry, weights


def fetch_stage(cache: ModelCache, remote: Remote, scheme: str, location: str, stage: int = 0,
                pipeline: int = 1, layers: tuple[int, int] | None = None,
                progress: Progress | None = None) -> FetchReport:
    """hold_stage's report, the entry released afterwards (a later eviction may remove it)."""
    with hold_stage(cache, remote, scheme, location, stage, pipeline, layers, progress) as (_, report):
        return report
