"""spec.checkpoint's fields for the shared tier in an object store (`checkpoint.uri: s3://...`): the
uri, the S3 endpoint, region and addressing, and the Secret of credentials. Their names and types
are spec.model's for an s3:// model (endpoint, region, pathStyle, credentialsRef), so that one
S3-compatible store is described the same way in both places.
"""
from __future__ import annotations

from typing import Optional

from pydantic import Field

from shardwise.crds.access import DNS_SUBDOMAIN_PATTERN
from shardwise.crds.apimodel import ApiModel
from shardwise.crds.sourcespec import ENDPOINT_PATTERN, REGION_PATTERN, SCHEME_SHAPES

# An s3:// uri's shape (what the API server can check; crds/modelsource.parse_s3_uri checks the rest),
# the endpoint's and the region's: spec.model's own (crds/sourcespec.py).
S3_URI_PATTERN = SCHEME_SHAPES["s3"][0]

STORE_OPTIONS_NEED_URI = ("checkpoint.endpoint, checkpoint.region, checkpoint.pathStyle and "
                          "checkpoint.credentialsRef are for checkpoint.uri only")


class CredentialsRef(ApiModel):
    name: str = Field(min_length=1, max_length=253, pattern=DNS_SUBDOMAIN_PATTERN, description=(
        "A Secret in the model's namespace. Its pods get its keys AWS_ACCESS_KEY_ID, "
        "AWS_SECRET_ACCESS_KEY and AWS_SESSION_TOKEN (each optional, none other) as environment "
        "variables of the same name. The operator never reads it."))


class ObjectStoreCheckpoint(ApiModel):
    """The object-store fields of spec.checkpoint (a base of crds.models.Checkpoint)."""

    uri: Optional[str] = Field(None, max_length=4096, pattern=S3_URI_PATTERN, description=(
        "s3://<bucket>/<prefix>: keep the shared checkpoints in this S3-compatible object store (the "
        "durable tier), beside or instead of a claim; `path` then holds only the job's progress."))
    endpoint: Optional[str] = Field(None, max_length=2048, pattern=ENDPOINT_PATTERN, description=(
        "The S3-compatible endpoint of checkpoint.uri, http(s)://host[:port][/path] (no credentials "
        "in it). Omitted: AWS S3."))
    region: Optional[str] = Field(None, max_length=64, pattern=REGION_PATTERN,
                                  description="The bucket's region (omitted: us-east-1).")
    path_style: Optional[bool] = Field(None, description=(
        "Address the bucket as <endpoint>/<bucket> rather than <bucket>.<endpoint> (MinIO and most "
        "S3-compatible stores)."))
    credentials_ref: Optional[CredentialsRef] = Field(None, description=(
        "The Secret whose keys the training pods write and read checkpoint.uri with."))

    def store_options_without_uri(self) -> bool:
        return not self.uri and any(v is not None for v in (self.endpoint, self.region, self.path_style,
                                                            self.credentials_ref))


def store_rule() -> tuple[str, str, str]:
    """The CEL rule (self is spec.checkpoint): the store's options only with checkpoint.uri."""
    return ("has(self.uri) || (!has(self.endpoint) && !has(self.region) && !has(self.pathStyle) && "
            "!has(self.credentialsRef))", STORE_OPTIONS_NEED_URI, ".uri")
