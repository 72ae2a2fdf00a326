"""Incremental detokenization and stop strings (worker/serving/http/detokenize.py, streaming.py)
with the built-in SmolLM2 tokenizer, no ranks: the text given out token by token is exactly the
decoding of the whole sequence, UTF-8 characters split across tokens included; stop strings cut
the text where decoding the whole text at every token did (the way the server worked before),
piece for piece; and the engine thread's callback only queues tokens."""
from __future__ import annotations

import random
import threading

import pytest

from shardwise.worker.errors import WorkerError
from shardwise.worker.serving.request import Request
from shardwise.worker.serving.http.detokenize import REPLACEMENT, IncrementalDetokenizer
from shardwise.worker.serving.http.metrics import Metrics
from shardwise.worker.serving.http.streaming import ChoiceStream, TokenFeed
from shardwise.worker.weights.loader import open_model
from shardwise.worker.weights.tokenizer import load_tokenizer

try:
    TOKENIZER = load_tokenizer(open_model("smollm2"))
except WorkerError as e:  # the demo model is an optional download
    pytest.skip(str(e), allow_module_level=True)

# Accents, CJK, emoji (4-byte, joined by U+200D), math letters: byte-level BPE splits many of
# these characters across two or more tokens.
TEXTS = ["héllo wörld, naïve café — “quotes” ‘too’", "日本語のテキストと中文文本", "🎉 👨‍👩‍👧 🤖🦀 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 ∑∫√",
         "def f(x):\n    return x ** 2  # the quick brown fox", "Ελληνικά и русский текст"]
POOL = sorted({t for text in TEXTS for t in TOKENIZER.encode(text)})


def _sequences(n: int, seed: int = 0):
    """Random token sequences: mostly tokens of TEXTS (partial characters among them), some
    anywhere in the vocabulary (special tokens included), so that pieces of characters meet in
    every order."""
    rng = random.Random(seed)
    for _ in range(n):
        yield [rng.choice(POOL) if rng.random() < 0.8 else rng.randrange(TOKENIZER.vocab_size)
               for _ in range(rng.randrange(1, 80))]


def test_incremental_text_is_the_whole_decoding():
    split = 0
    for seq in _sequences(400):
        detokenizer, stable, pending = IncrementalDetokenizer(TOKENIZER), "", ""
        for i, token in enumerate(seq):
            fresh, done = detokenizer.push(token)
            stable, pending = (stable + fresh, "") if done else (stable, fresh)
            assert stable + pending == TOKENIZER.decode(seq[:i + 1])
            split += pending.endswith(REPLACEMENT)
    assert split > 50          # characters split across tokens were met, and held back


def test_a_character_split_across_tokens_comes_out_whole():
    ids = TOKENIZER.encode("🎉")
    assert len(ids) > 1        # the emoji's four bytes are more than one token
    detokenizer = IncrementalDetokenizer(TOKENIZER)
    out = [detokenizer.push(t) for t in ids]
    assert all(not done for _, done in out[:-1]) and out[-1] == ("🎉", True)


class _Before:
    """How the server made pieces before: decode the whole text at every token, look for stop
    strings in all of it, hold back a tail that could grow into one (the reference)."""

    def __init__(self, stop: list[str]):
        self.stop, self.sent, self.finished, self.reason = stop, "", False, None

    def on_token(self, req: Request) -> tuple[str, bool] | None:
        if self.finished:
            return None
        text = TOKENIZER.decode(req.token_ids)
        hit = min((i for i in (text.find(s) for s in self.stop) if i >= 0), default=-1)
        if hit >= 0:
            text, self.finished, self.reason = text[:hit], True, "stop"
        elif req.finish_reason:
            self.finished, self.reason = True, req.finish_reason
        elif text.endswith(REPLACEMENT):
            return None
        else:
            hold = max((len(s) - 1 for s in self.stop), default=0)
            text = text[:max(0, len(text) - hold)]
        piece = text[len(self.sent):] if len(text) > len(self.sent) else ""
        self.sent = text if len(text) > len(self.sent) else self.sent
        return (piece, self.finished) if piece or self.finished else None


def _run(seq: list[int], stop: list[str]):
    """The pieces, finish reason and usage count of both ways, fed the same tokens."""
    new_req, old_req = Request([1], max_new_tokens=len(seq)), Request([1], max_new_tokens=len(seq))
    new, old = ChoiceStream(0, new_req, TOKENIZER, stop), _Before(stop)
    got, want, used = [], [], 0
    for i, token in enumerate(seq):
        reason = "length" if i == len(seq) - 1 else None
        for req in (new_req, old_req):
            req.token_ids.append(token)
            req.finish_reason = req.finish_reason or reason
        piece = new.push(token, reason)
        got.append(None if piece is None else (piece.text, piece.finished))
        if not old.finished:
            used = i + 1
        want.append(old.on_token(old_req))
    return got, want, (new.finish_reason, new.tokens, new_req.cancelled), (old.reason, used, old.reason == "stop")


def test_stop_strings_cut_where_decoding_the_whole_text_did():
    rng = random.Random(1)
    stopped = 0
    for seq in _sequences(300, seed=2):
        text = TOKENIZER.decode(seq)
        # stop strings taken from the text itself (so that they occur), and one that never does
        stop = []
        for _ in range(rng.randrange(0, 3)):
            start = rng.randrange(len(text)) if text else 0
            stop.append(text[start:start + rng.randrange(1, 6)] or "x")
        stop.append("<never>") if rng.random() < 0.3 else None
        got, want, new_end, old_end = _run(seq, stop)
        assert got == want, (seq, stop)
        assert new_end == old_end
        stopped += new_end[0] == "stop"
    assert stopped > 100


def _text(seq: list[int], stop: list[str]) -> tuple[str, str, int]:
    got, _, (reason, used, _), _ = _run(seq, stop)
    return "".join(p[0] for p in got if p), reason, used


def test_a_stop_string_that_spans_tokens():
    seq = TOKENIZER.encode("the quick brown fox jumps")
    assert _text(seq, ["k bro"]) == ("the quic", "stop", len(TOKENIZER.encode("the quick brown")))


def test_the_first_of_two_stop_strings_wins():
    seq = TOKENIZER.encode("one, two; three")
    assert _text(seq, [";", ","])[:2] == ("one", "stop")
    assert _text(seq, ["three", "two"])[:2] == ("one, ", "stop")


def test_a_stop_string_at_the_very_start():
    seq = TOKENIZER.encode("Hello there")
    assert _text(seq, ["Hel"]) == ("", "stop", 1)


def test_a_stop_string_inside_a_split_character():
    seq = TOKENIZER.encode("a 🎉 b")
    assert _text(seq, ["🎉"])[:2] == ("a ", "stop")


class _Recording:
    """A tokenizer that records the threads it decodes on."""

    def __init__(self):
        self.threads: set[str] = set()

    def decode(self, ids, skip_special: bool = True) -> str:
        self.threads.add(threading.current_thread().name)
        return TOKENIZER.decode(ids, skip_special)


def test_the_engine_thread_only_queues_tokens():
    tokenizer = _Recording()
    seq = TOKENIZER.encode("the quick brown fox")
    req = Request([1], max_new_tokens=len(seq))
    feed = TokenFeed([ChoiceStream(0, req, tokenizer, ["zzz"])], Metrics())

    def engine():
        for i, token in enumerate(seq):
            req.token_ids.append(token)
            req.finish_reason = "length" if i == len(seq) - 1 else None
            req.on_token(req, token)
    thread = threading.Thread(target=engine, name="engine")
    thread.start()
    thread.join()
    assert tokenizer.threads == set()           # nothing decoded on the engine thread
    text = "".join(p.text for p in feed.pieces())
    assert text == "the quick brown fox" and tokenizer.threads == {threading.current_thread().name}


def test_a_text_shorter_than_the_held_back_tail_is_all_held():
    # "Yes, the" is 8 characters, less than the 11 a 12-character stop string holds back: none of
    # it goes out before the stop string is found (the text ends before it, at "Yes")
    seq = TOKENIZER.encode("Yes, the answer is")
    assert _text(seq, [", the answer"]) == ("Yes", "stop", 4)
