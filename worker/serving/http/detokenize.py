"""From token ids to text: TokenText spells single tokens (bytes and display string, for
logprobs), and IncrementalDetokenizer turns a growing sequence of generated tokens into the text
each new token adds, decoding only the last few tokens.

Decoding the whole generated sequence again for every new token costs O(L) per token, O(L^2) per
request. IncrementalDetokenizer keeps two offsets into the tokens (as vLLM and Hugging Face TGI
do): `read`, where the text given out so far ends, and `prefix`, a few tokens before it. Each new
token decodes only tokens[prefix:] and tokens[prefix:read]; the difference is the new text. The
prefix gives the decoder the context a token's spelling can depend on (a SentencePiece decoder
drops the leading space of a sequence's first token, for one). Text that ends in U+FFFD is a UTF-8
character whose bytes are split across tokens: it is held back until the next token completes it.
"""
from __future__ import annotations

import re

REPLACEMENT = "\ufffd"      # what a decoder writes for bytes that are not (yet) a whole UTF-8 character


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table, which byte-level BPE vocabularies are spelled in."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


class TokenText:
    """The bytes and the display string of single tokens, for logprobs. A token can be part of a
    UTF-8 character: its string is then OpenAI's "bytes:\\xNN" form and `bytes` has the truth."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.tok = getattr(tokenizer, "tok", None)
        self.byte_level = self.tok is not None and type(self.tok.decoder).__name__ == "ByteLevel"
        added = self.tok.get_added_tokens_decoder() if self.tok is not None else {}
        self.added = {i: t.content for i, t in added.items()}
        self.special = {i for i, t in added.items() if t.special}
        self.unbyte = {c: b for b, c in _bytes_to_unicode().items()}
        self._cache: dict[int, bytes] = {}

    def bytes(self, tid: int) -> bytes:
        b = self._cache.get(tid)
        if b is None:
            b = self._cache[tid] = self._bytes(tid)
        return b

    def _bytes(self, tid: int) -> bytes:
        if self.tok is None:
            return self.tokenizer.decode([tid], skip_special=False).encode()
        piece = self.tok.id_to_token(tid)
        if piece is None:                       # a padded vocabulary row with no token
            return b""
        if tid in self.added:
            return self.added[tid].encode()
        if self.byte_level and all(c in self.unbyte for c in piece):
            return bytes(self.unbyte[c] for c in piece)
        m = re.fullmatch(r"<0x([0-9A-Fa-f]{2})>", piece)       # SentencePiece byte fallback
        if m:
            return bytes([int(m.group(1), 16)])
        return piece.replace("\u2581", " ").encode()

    def visible(self, tid: int) -> bytes:
        """What the token adds to the decoded text (special tokens are skipped when decoding)."""
        return b"" if tid in self.special else self.bytes(tid)

    def text(self, tid: int) -> str:
        b = self.bytes(tid)
        try:
            return b.decode("utf-8")
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{x:02x}" for x in b)


class IncrementalDetokenizer:
    """The text of one sequence of generated tokens, a token at a time: the concatenation of what
    `push` returns as stable equals `tokenizer.decode(tokens)` once that no longer ends in an
    incomplete character."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.tokens: list[int] = []
        self.prefix = 0         # first token of the decoding window (context for the tokens after `read`)
        self.read = 0           # tokens whose text has been given out as stable
        self._before = ""       # the text of tokens[prefix:read], decoded once per window

    def push(self, token: int) -> tuple[str, bool]:
        """Adds a token; returns the text of the tokens after `read` and whether it is stable. Not
        stable: the text ends in U+FFFD (a character still incomplete), or the tokens add no text
        yet (special tokens, which decoding skips); the same tokens are decoded again, with the
        next one, until their text is stable."""
        self.tokens.append(token)
        before = self._before
        text = self.tokenizer.decode(self.tokens[self.prefix:])
        if len(text) <= len(before) or text.endswith(REPLACEMENT):
            return text[len(before):], False
        self.prefix, self.read = self.read, len(self.tokens)
        self._before = self.tokenizer.decode(self.tokens[self.prefix:self.read])
        return text[len(before):], True
