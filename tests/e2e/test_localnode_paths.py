"""How a local node shows a pod its mounts (no mount namespace): a path inside the pod is rewritten to
its folder here wherever it appears in the command, env and contract, and only a whole path is."""
from __future__ import annotations

from shardwise.e2e.localcluster.localnodes.podenv import rewrite_paths

MOUNTS = {"/checkpoints/tiny": "/state/pods/ns_p/volumes/checkpoint", "/models": "/state/pods/ns_p/volumes/model"}


def test_a_mount_path_and_the_paths_under_it_are_rewritten():
    text = '{"path": "/checkpoints/tiny", "model": "/models/tiny"} --data=/models x:/checkpoints/tiny/step-1'
    assert rewrite_paths(text, MOUNTS) == (
        '{"path": "/state/pods/ns_p/volumes/checkpoint", "model": "/state/pods/ns_p/volumes/model/tiny"} '
        '--data=/state/pods/ns_p/volumes/model x:/state/pods/ns_p/volumes/checkpoint/step-1')


def test_a_url_or_a_longer_path_that_contains_a_mount_path_is_left_alone():
    # An object-store checkpoint beside its progress folder of the same name: the uri is the pod's
    # to reach the store, not a path of its filesystem.
    text = '{"uri": "s3://checkpoints/tiny", "path": "/checkpoints/tiny", "other": "/data/models/x", "m": "/models2"}'
    assert rewrite_paths(text, MOUNTS) == (
        '{"uri": "s3://checkpoints/tiny", "path": "/state/pods/ns_p/volumes/checkpoint", '
        '"other": "/data/models/x", "m": "/models2"}')
