"""A training job's progress report -> status (both checkpoint tiers)."""
from __future__ import annotations

from datetime import datetime, timezone

from shardwise.crds.models import Checkpoint
from shardwise.operator.controller import progress as training

T = datetime(2026, 1, 1, 12, 0, 0, tzinfo=timezone.utc).timestamp()


def test_both_tiers_of_checkpoints_reach_status_with_their_paths_inside_the_pods():
    progress = {"step": 57, "steps": 100, "loss": 2.5, "time": T,
                "last_checkpoint": {"step": 40, "time": T - 60, "name": "step-00000040"},
                "last_local_checkpoint": {"step": 50, "time": T - 10, "path": "/x/step-00000050"}}
    out = training.status_fields(progress, Checkpoint(claim="c", local={}))
    assert out["lastCheckpoint"] == {"step": 40, "time": "2026-01-01T11:59:00.000Z", "path": "/checkpoints/step-00000040"}
    assert out["lastLocalCheckpoint"] == {"step": 50, "time": "2026-01-01T11:59:50.000Z",
                                          "path": "/local-checkpoints/step-00000050"}
    assert "lastLocalCheckpoint" not in training.status_fields(progress, Checkpoint(claim="c"))

