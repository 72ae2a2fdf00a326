"""`shardwise serve`: an OpenAI-compatible HTTP API over a model split across local processes."""
from __future__ import annotations

import argparse
import sys

from shardwise.worker.cli.flags import add_model_arguments, add_waiting_argument, spec_from_args
from shardwise.worker.distributed.launch import Exit, stop_on_signals


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from shardwise.worker.serving.http.protocol import MAX_REQUEST_TOKENS
    add_model_arguments(parser)
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="port to bind (default 8000; 0 = any free port)")
    parser.add_argument("--micro-batches", type=int, default=0,
                        help="cache slots are split into this many groups in flight (default: one per stage)")
    parser.add_argument("--api-key-file", default=None, metavar="FILE",
                        help="accepted API keys, one per line: /v1/* then needs 'Authorization: Bearer <key>' "
                             "(/healthz and /metrics stay open)")
    add_waiting_argument(parser)
    parser.add_argument("--max-request-tokens", type=int, default=MAX_REQUEST_TOKENS, metavar="N",
                        help="completion tokens one request of several choices may ask for, n x max_tokens "
                             f"(default {MAX_REQUEST_TOKENS}; one choice may always fill the context)")


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def run(args) -> int:
    from shardwise.worker.errors import WorkerError
    from shardwise.worker.serving.rank import LocalRuntime, validate
    from shardwise.worker.serving.http.auth import ApiKeys
    from shardwise.worker.serving import defaults
    from shardwise.worker.serving.http.server import App, Server, run_engine, workers_for
    from shardwise.worker.weights.tokenizer import load_tokenizer

    runtime = server = None
    try:
        spec = spec_from_args(args)
        source = validate(spec)
        keys = ApiKeys.from_file(args.api_key_file) if args.api_key_file else None
        waiting = args.max_waiting or defaults.max_waiting(spec.max_batch)
        app = App(args.model, load_tokenizer(source), max_request_tokens=args.max_request_tokens, api_keys=keys,
                  max_waiting=waiting)
        try:
            server = Server(app, args.host, args.port, workers=workers_for(spec.max_batch + waiting)).start()
        except OSError as e:
            raise WorkerError(f"cannot listen on {args.host}:{args.port}: {e.strerror}") from None
        _say(f"listening on http://{args.host}:{server.port} (loading {args.model} on "
             f"{spec.tensor} x {spec.pipeline} ranks; /healthz turns 200 when every rank has loaded)")
        stop = stop_on_signals()
        runtime = LocalRuntime(spec, source)
        ctx = runtime.start()
        _say("ready; weight bytes per rank: " + ", ".join(str(r["weight_bytes"]) for r in ctx.loaded))
        run_engine(app, ctx, stop, args.micro_batches)
        _say("stopping")
        return Exit.OK
    except WorkerError as e:
        _say(f"shardwise serve: error: {e}")
        return Exit.BAD_INPUT
    finally:
        if runtime is not None:
            try:
                runtime.stop()
            except Exception:  # noqa: BLE001 - ranks already gone after a failure
                pass
        if server is not None:
            server.close()
