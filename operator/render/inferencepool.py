"""The model's InferencePool, pure: the Gateway API Inference Extension's pool of model servers
(group inference.networking.k8s.io, version v1, as the extension's v1.0 API reference documents
it), selecting the model's stage-0 pods (the ones that serve) on the serving port, so that an
inference gateway routes to them through its endpoint picker, which scrapes the model-server
protocol's metrics the workers export.

The pool names its endpoint picker by convention: the Service `<model>-epp` on port 9002 (the
picker's default gRPC port), which the user deploys with the gateway (the operator does not run
one). Rendered only when the cluster serves that API (controller/inferencepool.py asks).
"""
from __future__ import annotations

from shardwise.crds import names
from shardwise.crds.models import ShardedModel
from shardwise.operator.render.renderer import model_labels, owner_reference

GROUP = "inference.networking.k8s.io"
VERSION = "v1"
KIND = "InferencePool"
PLURAL = "inferencepools"
PICKER_PORT = 9002


def picker_name(model: str) -> str:
    return f"{model}-epp"


def render(model: ShardedModel) -> dict:
    name = model.name
    return {"apiVersion": f"{GROUP}/{VERSION}", "kind": KIND,
            "metadata": {"name": name, "namespace": model.namespace, "labels": model_labels(name),
                         "ownerReferences": [owner_reference(model)]},
            "spec": {"selector": {"matchLabels": {names.LABEL_MODEL: name, names.LABEL_STAGE: "0"}},
                     "targetPorts": [{"number": model.spec.serving.port}],
                     "endpointPickerRef": {"name": picker_name(name), "port": {"number": PICKER_PORT}}}}
