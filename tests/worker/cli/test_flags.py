"""The worker's commands share one definition of each flag (worker/cli/flags.py), and the serving
numbers they leave unset take RankSpec's defaults, which their help states."""
from __future__ import annotations

import argparse
import dataclasses
import re

import pytest

from shardwise.worker.cli import flags, generate, pod, serve, train
from shardwise.worker.serving.rank import RankSpec

DEFAULTS = {f.name: f.default for f in dataclasses.fields(RankSpec)}


def _parser(module) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    module.add_arguments(parser)
    return parser


def _help(parser: argparse.ArgumentParser, flag: str) -> str:
    return next(a.help for a in parser._actions if flag in a.option_strings)


@pytest.mark.parametrize("module", [generate, serve, pod])
def test_the_help_states_rankspecs_defaults(module):
    parser = _parser(module)
    for flag, field in (("--max-batch", "max_batch"), ("--kv-block-size", "kv_block"),
                        ("--prefill-chunk", "prefill_chunk"), ("--max-step-tokens", "max_step_tokens")):
        assert re.search(rf"\(default {DEFAULTS[field]}[;)]", _help(parser, flag)), flag


def test_flags_not_given_leave_rankspecs_defaults():
    args = _parser(generate).parse_args(["--model", "m", "--prompt", "p"])
    spec = flags.spec_from_args(args)
    for field in flags.SPEC_FIELDS.values():
        assert getattr(spec, field) == DEFAULTS[field], field
    given = _parser(serve).parse_args(["--model", "m", "--max-batch", "3", "--kv-block-size", "4",
                                       "--prefill-chunk", "5", "--max-seq-len", "6", "--threads", "2",
                                       "--max-step-tokens", "7"])
    spec = flags.spec_from_args(given)
    assert (spec.max_batch, spec.kv_block, spec.prefill_chunk, spec.max_seq, spec.threads) == (3, 4, 5, 6, 2)
    assert spec.max_step_tokens == 7


def test_a_step_budget_below_one_is_refused_in_one_line():
    from shardwise.worker.errors import WorkerError
    args = _parser(serve).parse_args(["--model", "m", "--max-step-tokens", "0"])
    with pytest.raises(WorkerError, match="^--max-step-tokens must be at least 1, not 0$"):
        flags.spec_from_args(args)


def test_one_definition_of_each_shared_flag():
    """The flags generate, serve, the pod and train have in common read the same."""
    parsers = {m.__name__: _parser(m) for m in (generate, serve, pod, train)}

    def described(parser, flag):
        a = next(a for a in parser._actions if flag in a.option_strings)
        return a.option_strings, a.choices, a.help, a.metavar

    for flag in ("--max-batch", "--max-seq-len", "--decode", "--kv-cache-tokens", "--kv-block-size",
                 "--prefill-chunk", "--max-step-tokens"):
        assert len({repr(described(p, flag)) for name, p in parsers.items() if "train" not in name}) == 1, flag
    for flag in ("--tensor-parallel", "--pipeline-parallel"):
        assert len({repr(described(p, flag)) for name, p in parsers.items() if "pod" not in name}) == 1, flag
