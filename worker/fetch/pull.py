"""Fetch what one pipeline stage loads of a remote model into the node cache, inside one held entry:
the metadata (config, tokenizer, index: a few KiB to MiB), then the weight files the index says hold
the stage's tensors (select.py); or, for a GGUF model, the byte ranges of the file's header and the
stage's tensors (gguf_fill.py). A GGUF model of one stage is fetched whole, as a single download
verified by its checksum, unless the node already holds ranges of it (then only the rest)."""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

from shardwise.worker.fetch.cache import Entry, FetchReport, ModelCache, Progress
from shardwise.worker.fetch.remote import Remote
from shardwise.worker.fetch.gguf_fill import fill_gguf_ranges, partial
from shardwise.worker.fetch.select import (gguf_share, gguf_stage_ranges, metadata_files, stage_share,
                                           weight_files, whole_gguf)


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
        if gguf is not None and pipeline == 1 and not partial(entry, gguf):
            yield entry, entry.fill(remote, [gguf], progress)      # the whole file: one verified download
            return
        if gguf is not None:       # a stage's ranges of the file
            def wants(path, header):
                return gguf_stage_ranges(header, gguf.size, gguf_share(path, stage, pipeline, layers))
            yield entry, fill_gguf_ranges(entry, remote, gguf, wants, progress)
            return
        first = entry.fill(remote, metadata_files(listing), metadata_progress)
        share = stage_share(entry.files_dir, stage, pipeline, layers)
        weights = entry.fill(remote, weight_files(listing, entry.files_dir, share), progress)
        weights.fetched_bytes += first.fetched_bytes
        weights.reused_bytes += first.reused_bytes
        weights.resumed_bytes += first.resumed_bytes
        weights.files = first.files + weights.files
        yield entry, weights


def fetch_stage(cache: ModelCache, remote: Remote, scheme: str, location: str, stage: int = 0,
                pipeline: int = 1, layers: tuple[int, int] | None = None,
                progress: Progress | None = None) -> FetchReport:
    """hold_stage's report, the entry released afterwards (a later eviction may remove it)."""
    with hold_stage(cache, remote, scheme, location, stage, pipeline, layers, progress) as (_, report):
        return report
