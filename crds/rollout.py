"""spec.rollout: how a serving model replaces its replicas when their layout, image or spec changes
(operator/decide/rollout.py decides). Importable from crds/models.py too.

The replicas are replaced through two budgets, as a Deployment's are:
- maxSurge: replicas of the new spec started beside the old ones before an old one is taken down.
  They run as extra replicas (numbered after the desired ones) while the roll lasts and are removed
  when every desired replica runs the new spec, so the model never serves fewer replicas than asked.
- maxUnavailable: desired replicas that may be down at once for their replacement.

Defaults maxSurge 1, maxUnavailable 0: with replicas > 1 the model keeps serving at its full size
while a roll has room for one more replica. A roll must never wait for capacity the old replicas
hold (a full cluster has no GPUs for a surge replica): when a surge replica cannot be placed and
nothing else can move, one old replica is taken down first whatever maxUnavailable says, with an
Event saying so, and the others keep serving. Both 0 would allow no step at all, and is refused.

A training job is one world over its replicas and restarts whole on a change: it ignores rollout.
Changing only spec.rollout rolls nothing (renderer.spec_hash leaves it out)."""
from __future__ import annotations

from pydantic import ConfigDict, Field, model_validator

from shardwise.crds.apimodel import ApiModel, cel
from shardwise.crds.names import MAX_REPLICAS

MAX_SURGE = 16          # surge replicas at once: each is a whole replica's GPUs
NO_STEP = "rollout: maxSurge and maxUnavailable cannot both be 0 (the roll could never take a step)"


class Rollout(ApiModel):
    """How many replicas a roll may add (maxSurge) and take down (maxUnavailable) at once."""

    model_config = ConfigDict(json_schema_extra=cel(
        ("!has(self.maxSurge) || !has(self.maxUnavailable) || self.maxSurge > 0 || self.maxUnavailable > 0",
         NO_STEP, ".maxSurge")))

    max_surge: int = Field(1, ge=0, le=MAX_SURGE, description=(
        "Replicas of the new spec started beside the old ones before an old one is taken down. When "
        "the cluster has no room for one, replicas are replaced in place, one at a time."))
    max_unavailable: int = Field(0, ge=0, le=MAX_REPLICAS, description=(
        "Desired replicas that may be down at once for their replacement (0: none, except the one a "
        "full cluster forces down)."))

    @model_validator(mode="after")
    def _some_step(self) -> "Rollout":
        if self.max_surge == 0 and self.max_unavailable == 0:
            raise ValueError(NO_STEP)
        return self
