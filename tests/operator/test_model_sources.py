"""Where the operator gets a model's shape: the spec's hints, the model root the chart configures
(controller/modelroot.py), or the probe pod. It never opens what a tenant names anywhere else."""
from __future__ import annotations

import functools
import json
import os
import threading

from shardwise.crds.models import MODEL_FACT_LIMITS, ShardedModel
from shardwise.crds.modelshape import from_hints
from shardwise.operator.controller import modelroot
from shardwise.operator.decide import probe
from shardwise.operator.decide.state import parse_state

CONFIG = {"num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 8, "hidden_size": 256,
          "vocab_size": 1000, "intermediate_size": 512}


def state_of(uri: str, root: str = "", **model):
    body = {"metadata": {"name": "m", "namespace": "ns", "uid": "u", "generation": 1},
            "spec": {"model": {"uri": uri, **model}}}
    return parse_state(body, [], None, "op/worker:1", functools.partial(modelroot.read, root=root))


def within(seconds: float, fn):
    """fn's result, failing (not hanging the suite) when it takes longer than `seconds`."""
    out: list = []
    thread = threading.Thread(target=lambda: out.append(fn()), daemon=True)
    thread.start()
    thread.join(seconds)
    assert out, f"still running after {seconds} s: the operator read what it must not"
    return out[0]


def test_dev_zero_is_never_read_it_needs_the_probe():
    state = within(5, lambda: state_of("/dev/zero"))
    assert state.local_facts is None and state.facts_error == "", "needs probe, nothing read"
    # even under a root that holds it, a device is not a file the operator opens
    state = within(5, lambda: state_of("/dev/zero", root="/"))
    assert state.local_facts is None and "not a regular file" in state.facts_error


def test_a_fifo_is_never_opened_it_needs_the_probe(tmp_path):
    fifo = tmp_path / "model"
    os.mkfifo(fifo)
    state = within(5, lambda: state_of(str(fifo)))
    assert state.local_facts is None and state.facts_error == ""
    state = within(5, lambda: state_of(str(fifo), root=str(tmp_path)))
    assert "not a regular file" in state.facts_error
    # a FIFO where config.json should be: opened without blocking, refused
    (tmp_path / "hf").mkdir()
    os.mkfifo(tmp_path / "hf" / "config.json")
    state = within(5, lambda: state_of(str(tmp_path / "hf"), root=str(tmp_path)))
    assert "not a regular file" in state.facts_error


def test_a_readable_model_outside_the_root_is_probed_and_inside_it_is_read(tmp_path):
    (tmp_path / "inside").mkdir()
    (tmp_path / "inside" / "config.json").write_text(json.dumps(CONFIG))
    assert state_of(str(tmp_path / "inside")).local_facts is None, "no root: nothing is read"
    assert state_of(str(tmp_path / "inside"), root=str(tmp_path / "other")).local_facts is None
    facts = state_of(str(tmp_path / "inside"), root=str(tmp_path)).local_facts
    assert facts is not None and facts.layers == 4
    assert state_of("inside", root=str(tmp_path)).local_facts == facts, "a relative uri is under the root"
    # a symlink inside the root that leads out of it is not followed out
    (tmp_path / "root").mkdir()
    (tmp_path / "root" / "link").symlink_to(tmp_path / "inside")
    state = state_of(str(tmp_path / "root" / "link"), root=str(tmp_path / "root"))
    assert state.local_facts is None and state.facts_error == ""
    # a config.json over the cap is refused, not read whole
    (tmp_path / "big").mkdir()
    (tmp_path / "big" / "config.json").write_text(" " * (modelroot.CONFIG_MAX_BYTES + 10) + "{}")
    assert "larger than" in state_of(str(tmp_path / "big"), root=str(tmp_path)).facts_error


def test_the_probe_runs_the_operators_image_not_the_tenants():
    model = ShardedModel.model_validate({"metadata": {"name": "m", "namespace": "ns", "uid": "u"},
                                         "spec": {"model": {"uri": "/models/x"}, "image": "evil/image:1"}})
    pod = probe.render(model, "op/worker:1")
    assert [c["image"] for c in pod["spec"]["containers"]] == ["op/worker:1"]


def _probe_pod(facts: dict) -> dict:
    return {"metadata": {"name": "m-probe-0"}, "status": {"phase": "Succeeded", "containerStatuses": [
        {"state": {"terminated": {"exitCode": 0, "message": json.dumps(facts)}}}]}}


def test_a_probe_reporting_absurd_facts_is_refused_in_one_line():
    from shardwise.crds.models import ModelSource
    sane = from_hints(ModelSource.model_validate({"uri": "/m", "parameters": 8_000_000_000, "layers": 32,
                                                  "heads": 32})).to_dict()
    assert probe.result(_probe_pod(sane)).layers == 32
    for field, value in (("layers", 10**6), ("params", 9 * 10**18), ("heads", 10**5), ("hidden", 2**40)):
        reason = probe.result(_probe_pod({**sane, field: value}))
        assert isinstance(reason, probe.Unread) and not reason.transient and "\n" not in reason.reason, reason
        assert field in reason.reason and str(MODEL_FACT_LIMITS[field]) in reason.reason, reason
