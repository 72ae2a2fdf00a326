"""spec.autoscaling and status.autoscaling: the operator sizes a serving model's replicas on what
its users feel (queue depth, KV-cache use or time to first token), read from the replicas' own
metrics (operator/decide/autoscaling.py decides, operator/controller/autoscaler.py observes and
acts). Importable from crds/models.py too.

The bounds and the rules across fields are CEL rules on the CRD and the same checks here, in the
same words, so `kubectl apply` and `shardwise plan -f` refuse the same manifests."""
from __future__ import annotations

import math
from enum import Enum
from typing import Optional

from pydantic import ConfigDict, Field, model_validator

from shardwise.crds.apimodel import ApiModel, cel
from shardwise.crds.names import MAX_REPLICAS


class AutoscalingTarget(str, Enum):
    """What the autoscaler holds at its target value, per replica."""

    QUEUE_DEPTH = "queueDepthPerReplica"       # requests waiting for a place in a replica's batch
    KV_CACHE = "kvCacheUtilization"            # KV-cache blocks in use over all blocks, 0-1
    TTFT_P90 = "ttftP90Seconds"                # time to first token, 90th percentile over the last period


# The target value when spec.autoscaling.targetValue is omitted, per target.
DEFAULT_TARGET_VALUE = {AutoscalingTarget.QUEUE_DEPTH: 4.0, AutoscalingTarget.KV_CACHE: 0.8,
                        AutoscalingTarget.TTFT_P90: 2.0}
MAX_TARGET_VALUE = 1e6
SCALE_DOWN_DELAY = 300         # seconds of sustained low load before replicas are removed
MAX_DELAY = 86400
PERIOD = 15                    # seconds between two reads of the replicas' metrics
MAX_PERIOD = 600

MIN_OVER_MAX = "autoscaling: minReplicas must not exceed maxReplicas"
KV_OVER_ONE = "autoscaling: a kvCacheUtilization targetValue is a ratio, at most 1"


class Autoscaling(ApiModel):
    """Replicas sized from the replicas' load: desired = ceil(replicas x observed / target), within
    [minReplicas, maxReplicas]; more at once when the load is above target (after
    scaleUpStabilizationSeconds), fewer only after scaleDownDelaySeconds of load below it."""

    model_config = ConfigDict(json_schema_extra=cel(
        # has(): the API server fills the defaults in before the rules run, but a rule must not fail
        # on an object written before a field had one.
        ("!has(self.minReplicas) || !has(self.maxReplicas) || self.minReplicas <= self.maxReplicas",
         MIN_OVER_MAX, ".minReplicas"),
        ("!has(self.targetValue) || !has(self.target) || self.target != 'kvCacheUtilization' || "
         "self.targetValue <= 1.0", KV_OVER_ONE, ".targetValue")))

    min_replicas: int = Field(1, ge=0, le=MAX_REPLICAS, description=(
        "Fewest replicas. 0: the model scales to zero after scaleDownDelaySeconds without a request "
        "(`kubectl scale sm/NAME --replicas=1` wakes it)."))
    max_replicas: int = Field(..., ge=1, le=MAX_REPLICAS, description="Most replicas.")
    target: AutoscalingTarget = Field(AutoscalingTarget.QUEUE_DEPTH, description=(
        "queueDepthPerReplica: requests waiting per replica; kvCacheUtilization: KV-cache use per "
        "replica, 0-1; ttftP90Seconds: the 90th percentile of time to first token over the last period."))
    target_value: Optional[float] = Field(None, gt=0, le=MAX_TARGET_VALUE, description=(
        "The value held per replica. Omitted: 4 (queueDepthPerReplica), 0.8 (kvCacheUtilization), "
        "2 (ttftP90Seconds)."))
    scale_down_delay_seconds: int = Field(SCALE_DOWN_DELAY, ge=0, le=MAX_DELAY, description=(
        "Seconds the load must stay below target before replicas are removed (to zero included)."))
    scale_up_stabilization_seconds: int = Field(0, ge=0, le=MAX_DELAY, description=(
        "Seconds the load must stay above target before replicas are added (0: at once)."))
    period_seconds: int = Field(PERIOD, ge=1, le=MAX_PERIOD, description=(
        "Seconds between two reads of the replicas' metrics."))

    @model_validator(mode="after")
    def _rules(self) -> "Autoscaling":
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"{MIN_OVER_MAX} (minReplicas {self.min_replicas}, maxReplicas {self.max_replicas})")
        if self.target == AutoscalingTarget.KV_CACHE and self.target_value is not None and self.target_value > 1:
            raise ValueError(f"{KV_OVER_ONE} (targetValue {self.target_value})")
        if self.target_value is not None and not math.isfinite(self.target_value):
            raise ValueError("autoscaling: targetValue must be a number")
        return self

    @property
    def value(self) -> float:
        """The target value in effect."""
        return self.target_value if self.target_value is not None else DEFAULT_TARGET_VALUE[self.target]


class ScaleReason(str, Enum):
    """Why the autoscaler chose the replicas it chose (status.autoscaling.reason, and the Event's
    reason when it changed them)."""

    SCALED_UP = "ScaledUp"                     # load above target
    SCALED_DOWN = "ScaledDown"                 # load below target for scaleDownDelaySeconds
    SCALED_TO_ZERO = "ScaledToZero"            # no request for scaleDownDelaySeconds, minReplicas 0
    RAISED_TO_MIN = "RaisedToMinimum"          # replicas were below minReplicas
    LOWERED_TO_MAX = "LoweredToMaximum"        # replicas were above maxReplicas
    WITHIN_TARGET = "WithinTarget"             # nothing to change
    AT_MAXIMUM = "AtMaximum"                   # load above target, but maxReplicas reached
    STABILIZING = "WaitingToScaleUp"           # load above target for less than scaleUpStabilizationSeconds
    DELAYED = "WaitingToScaleDown"             # load below target for less than scaleDownDelaySeconds
    DRAINING = "WaitingForStreams"             # a replica to remove still runs streams (up to its drain grace)
    NO_METRICS = "WaitingForMetrics"           # a replica has not reported: no replica is removed meanwhile
    IDLE = "Idle"                              # at zero replicas, nothing waiting


class AutoscalingStatus(ApiModel):
    """What the autoscaler last decided, and the times its delays count from."""

    desired_replicas: int = Field(0, ge=0, le=MAX_REPLICAS)
    reason: Optional[ScaleReason] = None
    observed_value: Optional[float] = Field(None, description=(
        "The target's value per replica as last read (no value: no replica reported)."))
    target_value: Optional[float] = None
    last_scale_time: Optional[str] = Field(None, description="When the autoscaler last changed the replicas.")
    above_since: Optional[str] = Field(None, description="Since when the load has been above target.")
    below_since: Optional[str] = Field(None, description="Since when the load has been below target.")
