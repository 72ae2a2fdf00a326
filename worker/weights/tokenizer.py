"""Tokenizer for a model source: `tokenizer.json` of an HF directory, or one built from GGUF
metadata (byte-level BPE vocabulary + merges). Chat templates render with jinja2."""
from __future__ import annotations

import os

from shardwise.worker.errors import WorkerError
from shardwise.worker.weights import json_file

# Pre-tokenizer regex of Llama-3 style BPE vocabularies (llama.cpp pre-type "llama-bpe").
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")


class Tokenizer:
    def __init__(self, tok, chat_template: str | None, bos_token: str | None, eos_token: str | None,
                 add_bos: bool, eos_ids: list[int]):
        self.tok = tok
        self.chat_template = chat_template
        self.bos_token, self.eos_token = bos_token, eos_token
        self.add_bos = add_bos
        self.eos_ids = list(eos_ids)
        self.bos_id = tok.token_to_id(bos_token) if bos_token else None

    @property
    def vocab_size(self) -> int:
        return self.tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
        ids = self.tok.encode(text, add_special_tokens=False).ids
        if (self.add_bos if add_bos is None else add_bos) and self.bos_id is not None:
            if not ids or ids[0] != self.bos_id:
                ids = [self.bos_id] + ids
        return ids

    def decode(self, ids: list[int], skip_special: bool = True) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=skip_special)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        if not self.chat_template:
            # No template shipped: a plain "role: content" transcript.
            text = "".join(f"{m['role']}: {m['content']}\n" for m in messages)
            return text + ("assistant: " if add_generation_prompt else "")
        import jinja2
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise WorkerError(f"chat template: {message}")

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = raise_exception
        try:
            template = env.from_string(self.chat_template)
            return template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                   bos_token=self.bos_token or "", eos_token=self.eos_token or "")
        except jinja2.TemplateError as e:
            raise WorkerError(f"chat template failed: {e}") from None


def _special(tok_json_or_cfg, key):
    v = tok_json_or_cfg.get(key)
    return v.get("content") if isinstance(v, dict) else v


def from_hf_dir(path: str, eos_ids: list[int]) -> Tokenizer:
    from tokenizers import Tokenizer as HFTokenizer
    tj = os.path.join(path, "tokenizer.json")
    if not os.path.isfile(tj):
        raise WorkerError(f"{path}: no tokenizer.json (only fast tokenizers are supported)")
    if os.path.getsize(tj) > json_file.MAX_BYTES:
        raise WorkerError(f"{tj} is larger than {json_file.MAX_BYTES} bytes")
    try:
        tok = HFTokenizer.from_file(tj)
    except Exception as e:   # the tokenizers library raises a bare Exception for a file it cannot read
        why = str(e).splitlines()[0] if str(e) else repr(e)
        raise WorkerError(f"{tj} is not a tokenizer this server can load: {why}") from None
    cfg = {}
    cfg_path = os.path.join(path, "tokenizer_config.json")
    if os.path.isfile(cfg_path):
        cfg = json_file.read_object(cfg_path)
    template = cfg.get("chat_template")
    tpl_path = os.path.join(path, "chat_template.jinja")
    if template is None and os.path.isfile(tpl_path):
        template = _read_text(tpl_path)
    if isinstance(template, list):   # named templates: use the default one
        named = [t for t in template if isinstance(t, dict) and isinstance(t.get("template"), str)]
        template = next((t["template"] for t in named if t.get("name") == "default"),
                        named[0]["template"] if named else None)
    if template is not None and not isinstance(template, str):
        raise WorkerError(f"{cfg_path}: chat_template is neither a string nor a list of named templates")
    bos, eos = _special(cfg, "bos_token"), _special(cfg, "eos_token")
    ids = list(eos_ids)
    if eos and tok.token_to_id(eos) is not None and tok.token_to_id(eos) not in ids:
        ids.append(tok.token_to_id(eos))
    return Tokenizer(tok, template, bos, eos, bool(cfg.get("add_bos_token", False)), ids)


def _read_text(path: str) -> str:
    """A template file of the model folder, at most json_file.MAX_BYTES, as UTF-8 text."""
    try:
        with open(path, "rb") as f:
            raw = f.read(json_file.MAX_BYTES + 1)
        if len(raw) > json_file.MAX_BYTES:
            raise WorkerError(f"{path} is larger than {json_file.MAX_BYTES} bytes")
        return raw.decode()
    except (OSError, UnicodeDecodeError) as e:
        raise WorkerError(f"{path} cannot be read: {getattr(e, 'strerror', None) or e}") from None


def from_gguf(source) -> Tokenizer:
    from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as HFTokenizer
    kind = source.field("tokenizer.ggml.model")
    if kind != "gpt2":
        raise WorkerError(f"{source.path}: GGUF tokenizer type {kind!r} is not supported (supported: gpt2 BPE)")
    tokens = source.field("tokenizer.ggml.tokens")
    types = source.field("tokenizer.ggml.token_type") or [1] * len(tokens)
    merges = [tuple(m.split(" ", 1)) for m in source.field("tokenizer.ggml.merges") or []]
    tok = HFTokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
    pre = source.field("tokenizer.ggml.pre") or "default"
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre == "smollm":
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    elif pre in ("llama-bpe", "llama3"):
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_LLAMA3_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    else:
        tok.pre_tokenizer = byte_level
    tok.decoder = decoders.ByteLevel()
    # Control (3) and user-defined (4) tokens are matched whole, before BPE.
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, ty in zip(tokens, types) if ty in (3, 4)])
    bos_id, eos_id = source.field("tokenizer.ggml.bos_token_id"), source.field("tokenizer.ggml.eos_token_id")
    bos = tokens[bos_id] if bos_id is not None else None
    eos = tokens[eos_id] if eos_id is not None else None
    add_bos = bool(source.field("tokenizer.ggml.add_bos_token"))
    return Tokenizer(tok, source.field("tokenizer.chat_template"), bos, eos, add_bos,
                     [eos_id] if eos_id is not None else [])


def load_tokenizer(source) -> Tokenizer:
    """The tokenizer that belongs to a source.ModelSource."""
    if hasattr(source, "tokenizer"):
        return source.tokenizer()
    if hasattr(source, "index"):
        return from_gguf(source)
    return from_hf_dir(source.path, source.config.eos_token_ids)
