"""The base of every API object, and the helpers their fields share: quantities, label keys, pvc://
uris, CEL rules, and how a validation error is told in one line. Torch-free, like all of crds/.
"""
from __future__ import annotations

import re
from typing import Any

from pydantic import BaseModel, ConfigDict
from pydantic.alias_generators import to_camel

QUANTITY_PATTERN = r"^[0-9]+(\.[0-9]+)?(Ki|Mi|Gi|Ti|Pi|k|M|G|T|P)?$"
_QUANTITY_UNITS = {"": 1, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15,
                   "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50}
LABEL_KEY_PATTERN = r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$"


def parse_quantity(value: str | int) -> int:
    """A Kubernetes quantity ("40Gi", "80G", "81920Mi", 1024) in base units (bytes for memory)."""
    match = re.fullmatch(r"([0-9]+(?:\.[0-9]+)?)([KMGTP]i|[kMGTP])?", str(value).strip())
    if not match:
        raise ValueError(f"{value!r} is not a quantity such as 40Gi or 80G")
    return int(float(match.group(1)) * _QUANTITY_UNITS[match.group(2) or ""])


def cel(*rules: tuple[str, str] | tuple[str, str, str]) -> dict[str, Any]:
    """json_schema_extra carrying CEL rules: (rule, message[, fieldPath])."""
    out = []
    for rule in rules:
        item = {"rule": rule[0], "message": rule[1]}
        if len(rule) > 2:
            item["fieldPath"] = rule[2]
        out.append(item)
    return {"x-kubernetes-validations": out}


class ApiModel(BaseModel):
    """Base of every API object: camelCase JSON, unknown fields refused."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True, alias_generator=to_camel,
                              validate_default=False)

    def to_api(self) -> dict[str, Any]:
        """The JSON a user or the API server sees: camelCase, unset optional fields left out."""
        return self.model_dump(by_alias=True, exclude_none=True, mode="json")


# A pvc:// uri names a PersistentVolumeClaim and a path inside it: pvc://<claim>/<path>.
PVC_SCHEME = "pvc://"
PVC_PATTERN = r"^pvc://[a-z0-9]([-a-z0-9]*[a-z0-9])?/.+$"


def pvc_rule(field: str, message: str) -> tuple[str, str, str]:
    """The CEL rule that a string field starting with pvc:// looks like pvc://<claim>/<path>."""
    return (f"!self.{field}.startsWith('{PVC_SCHEME}') || self.{field}.matches('{PVC_PATTERN}')",
            message, f".{field}")


def malformed_pvc(uri: str) -> bool:
    """The uri starts with pvc:// but does not name a claim and a path (pvc_rule, in Python)."""
    return uri.startswith(PVC_SCHEME) and not re.match(PVC_PATTERN, uri)


def parse_pvc(uri: str) -> tuple[str, str] | None:
    """(claim, path inside the claim) of a pvc:// uri, None for any other uri."""
    if not uri.startswith(PVC_SCHEME):
        return None
    claim, _, path = uri.removeprefix(PVC_SCHEME).partition("/")
    return claim, path


def describe_validation_error(error: Any) -> str:
    """First pydantic error as one line: `spec.parallelism.tensor: Input should be ...`."""
    first = error.errors()[0]
    where = ".".join(str(p) for p in first["loc"])
    message = first["msg"].removeprefix("Value error, ")
    return f"{where}: {message}" if where else message
