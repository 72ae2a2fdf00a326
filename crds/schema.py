"""The ShardedModel CRD, generated from the pydantic models in crds/models.py.

Pydantic writes JSON Schema; the API server wants an OpenAPI v3 *structural* schema: every node
typed, no $ref, no anyOf-with-null for optional fields, no titles. `structural()` turns one into the
other; `crd()` wraps it with names, subresources and printer columns.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from shardwise.crds import models

CRD_FILE = Path(__file__).with_name(f"{models.PLURAL}.{models.GROUP}.yaml")

# JSON Schema keywords a structural schema may keep; the rest (title, $defs, ...) are dropped.
_KEEP = {"type", "description", "default", "enum", "format", "minimum", "maximum", "exclusiveMinimum",
         "exclusiveMaximum", "minLength",
         "maxLength", "pattern", "minItems", "maxItems", "minProperties", "maxProperties", "items", "properties",
         "required",
         "additionalProperties", "nullable", "x-kubernetes-validations", "x-kubernetes-list-type",
         "x-kubernetes-list-map-keys", "x-kubernetes-int-or-string",
         "x-kubernetes-preserve-unknown-fields"}


def structural(schema: dict[str, Any], defs: dict[str, Any] | None = None) -> dict[str, Any]:
    """One pydantic JSON Schema node as a structural OpenAPI v3 node."""
    defs = defs if defs is not None else schema.get("$defs", {})
    node = dict(schema)
    if "$ref" in node:
        target = defs[node.pop("$ref").rsplit("/", 1)[-1]]
        node = {**target, **node}  # field-level description/default win over the model's
    if "allOf" in node and len(node["allOf"]) == 1:
        node = {**node.pop("allOf")[0], **node}
        return structural(node, defs)
    if "anyOf" in node:
        options = [o for o in node.pop("anyOf") if o.get("type") != "null"]
        if len(options) != 1:
            raise ValueError(f"cannot express anyOf {options} structurally")
        node = {**options[0], **node}
        return structural(node, defs)
    if "const" in node:
        node["enum"] = [node.pop("const")]
    if "enum" in node and "type" not in node:
        node["type"] = "string"
    if node.get("default", 0) is None:
        del node["default"]
    for bound, flag in (("minimum", "exclusiveMinimum"), ("maximum", "exclusiveMaximum")):
        # JSON Schema's `exclusiveMinimum: 0` (pydantic's gt=0) is OpenAPI v3.0's
        # `minimum: 0, exclusiveMinimum: true`
        if isinstance(node.get(flag), (int, float)) and not isinstance(node[flag], bool):
            node[bound], node[flag] = node[flag], True
    out = {k: v for k, v in node.items() if k in _KEEP}
    if "properties" in out:
        out["properties"] = {k: structural(v, defs) for k, v in out["properties"].items()}
        out.setdefault("type", "object")
    if isinstance(out.get("additionalProperties"), dict):
        out["additionalProperties"] = structural(out["additionalProperties"], defs)
    elif out.get("additionalProperties") is False:
        del out["additionalProperties"]  # structural schemas refuse unknown fields by themselves
    if isinstance(out.get("items"), dict):
        out["items"] = structural(out["items"], defs)
    if out.get("type") == "object" and "properties" not in out and "additionalProperties" not in out:
        out["x-kubernetes-preserve-unknown-fields"] = True  # only metadata-like free maps
    return out


def open_api_schema() -> dict[str, Any]:
    raw = models.ShardedModel.model_json_schema(by_alias=True, mode="validation")
    root = structural(raw)
    props = root["properties"]
    props["apiVersion"] = {"type": "string", "description": "shardwise.dev/v1alpha1"}
    props["kind"] = {"type": "string", "description": "ShardedModel"}
    props["metadata"] = {"type": "object"}
    root["required"] = ["spec"]
    root.pop("x-kubernetes-preserve-unknown-fields", None)
    # the name rules (ShardedModel's): the API server keeps metadata.name readable at the root only
    root["x-kubernetes-validations"] = raw.get("x-kubernetes-validations", [])
    return root


def crd() -> dict[str, Any]:
    """The CustomResourceDefinition manifest as a dict."""
    columns = [
        {"name": "Tensor", "type": "integer", "jsonPath": ".status.tensor",
         "description": "tensor-parallel degree in effect"},
        {"name": "Pipeline", "type": "integer", "jsonPath": ".status.pipeline",
         "description": "pipeline stages in effect"},
        {"name": "Replicas", "type": "integer", "jsonPath": ".spec.parallelism.replicas",
         "description": "replicas asked for"},
        {"name": "Ready", "type": "integer", "jsonPath": ".status.readyReplicas",
         "description": "replicas whose every stage is ready"},
        {"name": "Phase", "type": "string", "jsonPath": ".status.phase"},
        {"name": "Step", "type": "integer", "jsonPath": ".status.training.step", "priority": 1,
         "description": "training: optimizer steps done"},
        {"name": "Checkpoint", "type": "integer", "jsonPath": ".status.lastCheckpoint.step", "priority": 1,
         "description": "training: step of the newest complete checkpoint"},
        {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
    ]
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{models.PLURAL}.{models.GROUP}"},
        "spec": {
            "group": models.GROUP,
            "scope": "Namespaced",
            "names": {"kind": models.KIND, "listKind": f"{models.KIND}List", "plural": models.PLURAL,
                      "singular": models.SINGULAR, "shortNames": list(models.SHORT_NAMES),
                      "categories": ["all", "shardwise"]},
            "versions": [{
                "name": models.VERSION,
                "served": True,
                "storage": True,
                "schema": {"openAPIV3Schema": open_api_schema()},
                "subresources": {
                    "status": {},
                    "scale": {"specReplicasPath": ".spec.parallelism.replicas",
                              "statusReplicasPath": ".status.replicas",
                              "labelSelectorPath": ".status.selector"},
                },
                "additionalPrinterColumns": columns,
            }],
        },
    }


def crd_yaml() -> str:
    header = ("# Generated by `shardwise crds generate` from crds/models.py. Do not edit by hand;\n"
              "# `shardwise crds check` fails when this file and the models drift.\n")
    return header + yaml.safe_dump(crd(), sort_keys=False, width=100)
