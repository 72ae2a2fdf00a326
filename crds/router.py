"""spec.serving.router: the model's router (`shardwise router`, operator/router/), rendered by the
operator as a Deployment in front of the replicas' stage-0 pods when `enabled`; the serving Service
then selects the router pods. Importable from crds/models.py too.

The rate limit is the router's own --rate-limit syntax, checked here by a pattern (the CRD's) and
by the router's parser (the same words as `shardwise router` would say)."""
from __future__ import annotations

from typing import Optional

from pydantic import Field, field_validator

from shardwise.crds.apimodel import ApiModel
from shardwise.crds.autoscaling import Autoscaling

MAX_ROUTER_REPLICAS = 16
MAX_HOLD_SECONDS = 600
HOLD_SECONDS = 30.0     # the router's default hold: a replica's restart
# What a request waits by default in front of a model that scales to zero: its first request wakes
# it, and a replica starts within this on most clusters (a pod scheduled, its image pulled, the
# model fetched and loaded).
HOLD_FROM_ZERO_SECONDS = 300
# RATE/s[:BURST][:requests|tokens] (operator/router/limits.py parses it; the pattern bounds its shape)
RATE_LIMIT_PATTERN = r"^[0-9]+(\.[0-9]+)?/s(:[0-9]+(\.[0-9]+)?)?(:(requests|tokens))?$"
ROUTER_SERVING_ONLY = "spec.serving.router is only for workload: inference"
# On ShardedModelSpec (a training job serves nothing to route)
ROUTER_RULE = ("!has(self.serving) || !has(self.serving.router) || !has(self.serving.router.enabled) || "
               "!self.serving.router.enabled || self.workload != 'training'", ROUTER_SERVING_ONLY, ".serving.router")


class Router(ApiModel):
    """The model's front door: routes each request to the replica with the longest cached prefix
    against load, moves a stream whose replica fails to another one, holds requests while no
    replica is Ready, checks the model's API keys (spec.serving.auth) and an optional per-key rate."""

    enabled: bool = Field(False, description=(
        "Run the router and point the serving Service at it (false: the Service selects the replicas' "
        "stage-0 pods directly)."))
    replicas: int = Field(2, ge=1, le=MAX_ROUTER_REPLICAS, description=(
        "Router pods (stateless apart from caches: any number serves the same)."))
    rate_limit: Optional[str] = Field(None, max_length=64, pattern=RATE_LIMIT_PATTERN, description=(
        "Per API key: RATE/s[:BURST][:requests|tokens], e.g. 5/s or 200/s:1000:tokens (tokens: generated "
        "tokens); over it, 429 with Retry-After. Omitted: no limit."))
    hold_seconds: Optional[float] = Field(None, ge=0, le=MAX_HOLD_SECONDS, description=(
        "How long a request waits while no replica is Ready before 503 with Retry-After. Omitted: the "
        f"router's default ({HOLD_SECONDS:g} s), or {HOLD_FROM_ZERO_SECONDS} s with autoscaling.minReplicas 0."))

    @field_validator("rate_limit")
    @classmethod
    def _rate_limit(cls, value: Optional[str]) -> Optional[str]:
        # the pattern has checked the shape; the bounds are the router's (operator/router/limits.py)
        if value is not None:
            parts = value.split(":")
            rate = float(parts[0][:-2])
            burst = float(parts[1]) if len(parts) > 1 and parts[1] not in ("requests", "tokens") else 1.0
            if not (0 < rate <= 1e6 and 1 <= burst <= 1e9):
                raise ValueError(f"rateLimit {value!r}: RATE must be in (0, 1e6] and BURST in [1, 1e9]")
        return value


def hold_seconds(router: Router, autoscaling: Optional[Autoscaling]) -> Optional[float]:
    """The hold the router runs with: the spec's, else a cold start's when the model may scale to
    zero, else None (the router's own default)."""
    if router.hold_seconds is not None:
        return router.hold_seconds
    if autoscaling is not None and autoscaling.min_replicas == 0:
        return float(HOLD_FROM_ZERO_SECONDS)
    return None


def check_workload(router: Optional[Router], training: bool) -> None:
    """ROUTER_RULE in Python."""
    if router is not None and router.enabled and training:
        raise ValueError(ROUTER_SERVING_ONLY)
