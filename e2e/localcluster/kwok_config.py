"""kwok's --config file: its options and the Stage objects that are the local control plane's
simulated kubelet, kept as YAML files next to this module (package data, so an installed package
has them too).

The kwok binary loads stages only from its --config files, and `kwok` (unlike kwokctl) has no
built-in defaults, so the stages are the defaults kwokctl ships (sigs.k8s.io/kwok v0.8.0,
kustomize/stage/{node/fast,node/heartbeat-with-lease,pod/fast}, Apache-2.0), copied unchanged:
nodes become Ready, their Lease is renewed (kwok --node-lease-duration-seconds), pods on them become
Running and Ready, Job pods complete, deleted pods go away.
"""
from __future__ import annotations

from importlib import resources

CONFIGURATION_FILE = "kwok-configuration.yaml"
STAGE_FILES = ("kwok-stages-node-fast.yaml", "kwok-stages-node-heartbeat-with-lease.yaml",
               "kwok-stages-pod-fast.yaml")


def config_text() -> str:
    """The whole --config file: the KwokConfiguration, then every Stage, as one YAML stream."""
    folder = resources.files(__package__)
    return "".join(folder.joinpath(name).read_text() for name in (CONFIGURATION_FILE, *STAGE_FILES))
