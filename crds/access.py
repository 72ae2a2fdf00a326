"""Who may call a served model: the API keys' Secret (ServingAuth) and the NetworkPolicy peers
allowed to reach the serving port (NetworkPeer), as parts of spec.serving (crds/models.py)."""
from __future__ import annotations

import re
from typing import Optional

from pydantic import ConfigDict, Field, field_validator, model_validator

from shardwise.crds.apimodel import LABEL_KEY_PATTERN, ApiModel, cel
from shardwise.crds.names import DEFAULT_API_KEYS_KEY

LABEL_VALUE_PATTERN = r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$"
DNS_SUBDOMAIN_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
PEER_NEEDS_SELECTOR = "serving.allowFrom: each peer needs namespaceSelector or podSelector"


class SecretKeyRef(ApiModel):
    name: str = Field(min_length=1, max_length=253, pattern=DNS_SUBDOMAIN_PATTERN,
                      description="A Secret in the model's namespace.")
    key: str = Field(DEFAULT_API_KEYS_KEY, min_length=1, max_length=253, pattern=r"^[-._a-zA-Z0-9]+$",
                     description="Its key holding the accepted API keys, one per line.")


class ServingAuth(ApiModel):
    secret_ref: SecretKeyRef = Field(description=(
        "The Secret holding the bearer tokens /v1/* accepts (one per line); /healthz and /metrics "
        "stay open. The pods mount it read-only; the operator never reads it."))


class LabelSelector(ApiModel):
    """Labels only (no expressions): what a NetworkPolicy peer is chosen by. Empty: every one."""

    match_labels: dict[str, str] = Field(default_factory=dict, max_length=16, json_schema_extra={
        "additionalProperties": {"type": "string", "maxLength": 63, "pattern": LABEL_VALUE_PATTERN}})

    @field_validator("match_labels")
    @classmethod
    def _label_keys(cls, labels: dict[str, str]) -> dict[str, str]:
        for key, value in labels.items():
            if len(key) > 316 or not re.match(LABEL_KEY_PATTERN, key):
                raise ValueError(f"{key!r} is not a label key")
            if len(value) > 63 or not re.match(LABEL_VALUE_PATTERN, value):
                raise ValueError(f"{value!r} is not a label value")
        return labels


class NetworkPeer(ApiModel):
    """Who may reach the serving port, as a NetworkPolicy peer: pods of podSelector in the model's
    namespace, every pod of the namespaces of namespaceSelector, or with both, those pods there."""

    model_config = ConfigDict(json_schema_extra=cel(
        ("has(self.namespaceSelector) || has(self.podSelector)", PEER_NEEDS_SELECTOR)))

    namespace_selector: Optional[LabelSelector] = None
    pod_selector: Optional[LabelSelector] = None

    @model_validator(mode="after")
    def _some_selector(self) -> "NetworkPeer":
        if self.namespace_selector is None and self.pod_selector is None:
            raise ValueError(PEER_NEEDS_SELECTOR)
        return self
