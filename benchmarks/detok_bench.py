"""What turning generated tokens into text costs the server per token, as completions grow.

    python3 benchmarks/detok_bench.py [--lengths 100 500 1000 2000 4000] [--runs 3]

For each completion length L, the server-side work per token (detokenization, stop-string
matching, holding back a tail that could grow into a stop string) is timed for
- re-decoding, the baseline (implemented here): decode the whole generated text and look for
  the stop strings in all of it at every token, O(L) per token, O(L^2) per completion;
- incremental (worker/serving/http/streaming.py ChoiceStream): decode the last few tokens, look
  for stop strings in the text not given out yet, O(1) per token;
and printed in microseconds of the thread's CPU time per token (time.thread_time, so that other
processes on a busy machine do not count; the best of --runs), with the ratio. The tokens are the
built-in SmolLM2 tokenizer's encoding of English prose with some multi-byte characters, and two
stop strings that never occur (so every token pays the search, and the completion runs to L).
"""
from __future__ import annotations

import argparse
import time

from shardwise.worker.serving.request import Request
from shardwise.worker.serving.http.detokenize import REPLACEMENT
from shardwise.worker.serving.http.streaming import ChoiceStream
from shardwise.worker.weights.loader import open_model
from shardwise.worker.weights.tokenizer import load_tokenizer

PROSE = ("The quick brown fox jumps over the lazy dog, and the café's naïve owner — who speaks 日本語 — "
         "counts 🎉 emoji while the server streams its answer token by token. ")
STOP = ["\n\nUser:", "<|im_end|>x"]


class OldStream:
    """Decode everything at every token (how the server did it before)."""

    def __init__(self, tokenizer, stop: list[str]):
        self.tokenizer, self.stop, self.sent, self.finished = tokenizer, stop, "", False

    def on_token(self, token_ids: list[int], finish_reason: str | None) -> str | None:
        if self.finished:
            return None
        text = self.tokenizer.decode(token_ids)
        hit = min((i for i in (text.find(s) for s in self.stop) if i >= 0), default=-1)
        if hit >= 0:
            text, self.finished = text[:hit], True
        elif finish_reason:
            self.finished = True
        elif text.endswith(REPLACEMENT):
            return None
        else:
            hold = max((len(s) - 1 for s in self.stop), default=0)
            text = text[:max(0, len(text) - hold)]
        piece = text[len(self.sent):] if len(text) > len(self.sent) else ""
        if len(text) > len(self.sent):
            self.sent = text
        return piece


def tokens_of(tokenizer, n: int) -> list[int]:
    ids: list[int] = []
    while len(ids) < n:
        ids += tokenizer.encode(PROSE)
    return ids[:n]


def redecode_method(tokenizer, ids: list[int]) -> tuple[float, str]:
    stream, generated, out = OldStream(tokenizer, STOP), [], []
    t0 = time.thread_time()
    for i, token in enumerate(ids):
        generated.append(token)
        out.append(stream.on_token(generated, "length" if i == len(ids) - 1 else None) or "")
    return time.thread_time() - t0, "".join(out)


def incremental_method(tokenizer, ids: list[int]) -> tuple[float, str]:
    stream, out = ChoiceStream(0, Request([0], max_new_tokens=len(ids)), tokenizer, STOP), []
    t0 = time.thread_time()
    for i, token in enumerate(ids):
        piece = stream.push(token, "length" if i == len(ids) - 1 else None)
        out.append(piece.text if piece else "")
    return time.thread_time() - t0, "".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[100, 500, 1000, 2000, 4000])
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    tokenizer = load_tokenizer(open_model("smollm2"))
    print(f"{'tokens':>7} {'re-decode us/token':>18} {'incremental us/token':>20} {'ratio':>8}")
    for n in args.lengths:
        ids = tokens_of(tokenizer, n)
        full = min(redecode_method(tokenizer, ids)[0] for _ in range(args.runs))
        incr = min(incremental_method(tokenizer, ids)[0] for _ in range(args.runs))
        assert redecode_method(tokenizer, ids)[1] == incremental_method(tokenizer, ids)[1] == tokenizer.decode(ids)
        print(f"{n:>7} {full / n * 1e6:>18.1f} {incr / n * 1e6:>20.1f} {full / incr:>8.1f}")


if __name__ == "__main__":
    main()
