"""The state the request threads share (engine, tokenizer, readiness, metrics) and the turning of
a validated request body into engine requests."""
from __future__ import annotations

import threading
import time

from shardwise.worker.errors import WorkerError
from shardwise.worker.serving.request import Request
from shardwise.worker.serving.scheduler import QueueFull
from shardwise.worker.serving.http import protocol
from shardwise.worker.serving.http.auth import ApiKeys
from shardwise.worker.serving.http.detokenize import TokenText
from shardwise.worker.serving.http.errors import BadRequest
from shardwise.worker.serving.http.metrics import Metrics
from shardwise.worker.serving.http.responses import Job


def refusal(e: WorkerError) -> BadRequest:
    """The answer to a request the engine refused: 429 with Retry-After when its queue is full
    (the request may succeed later, here or on another replica), else 400."""
    if isinstance(e, QueueFull):
        return BadRequest(str(e), 429, code="rate_limit_exceeded", retry_after=e.retry_after)
    return BadRequest(str(e))


class App:
    """State shared by the request threads: engine, tokenizer, readiness, metrics."""

    def __init__(self, model_name: str, tokenizer, rank: int = 0, max_tokens_default: int = 16,
                 max_request_tokens: int = protocol.MAX_REQUEST_TOKENS, api_keys: ApiKeys | None = None,
                 max_waiting: int | None = None):
        self.model_name, self.tokenizer, self.rank = model_name, tokenizer, rank
        self.engine = None
        self.loaded: list[dict] = []
        self.ready = threading.Event()
        self.draining = threading.Event()      # set on SIGTERM: finish what runs, take nothing new
        self.failed: str | None = None
        self.metrics = Metrics()
        self.max_tokens_default = max_tokens_default    # /v1/completions without max_tokens
        self.max_request_tokens = max_request_tokens    # n x max_tokens, when n > 1
        self.api_keys = api_keys                        # None: /v1/* is open
        self.max_waiting = max_waiting                  # choices queued at most (None: defaults.max_waiting)
        self.created = int(time.time())
        # a pod of a remote model: its fetch's final report (JSON), answered at DOWNLOAD_PROGRESS_PATH
        self.download: bytes | None = None
        self._token_text: TokenText | None = None

    @property
    def token_text(self) -> TokenText:
        if self._token_text is None:
            self._token_text = TokenText(self.tokenizer)
        return self._token_text

    def set_ready(self, engine, loaded: list[dict]) -> None:
        for r in loaded:
            self.metrics.weight_bytes.labels(rank=str(r["rank"]), stage=str(r["stage"]),
                                             tp_rank=str(r["tp_rank"])).set(r["weight_bytes"])
        self.engine = engine
        self.metrics.model, self.metrics.engine = engine.stage.model, engine
        self.ready.set()
        self.metrics.ready.set(1)

    def set_failed(self, message: str) -> None:
        self.failed = message
        self.ready.clear()
        self.metrics.ready.set(0)

    def model_card(self) -> dict:
        # max_model_len: vLLM's name for the context length (prompt + completion tokens), which
        # routers and clients written against vLLM already read; null until the model has loaded.
        return {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "shardwise",
                "max_model_len": self.engine.max_seq if self.engine is not None else None}

    def check_model(self, model) -> None:
        """A model name given in a path (/v1/models/{id}): this server's, or 404 model_not_found."""
        protocol.validate(protocol.ModelName, {"model": model}, self.model_name, chat=False)

    # ---- request building ----
    def build_request(self, body, chat: bool) -> Job:
        head = protocol.validate(protocol.ChatHead if chat else protocol.CompletionHead, body,
                                 self.model_name, chat)
        ids = self._messages(head, body["messages"]) if chat else self._prompt(head.prompt)
        what = "messages" if chat else "prompt"
        options = protocol.validate(protocol.ChatOptions if chat else protocol.CompletionOptions, body,
                                    self.model_name, chat)
        max_tokens = self._max_tokens(ids, what, options, chat)
        top = options.top_logprobs if not chat else ((options.top_logprobs or 0) if options.logprobs else None)
        temperature = 1.0 if options.temperature is None else options.temperature
        top_p = 1.0 if options.top_p is None else options.top_p
        seed, n = options.seed, options.n or 1
        if n > 1 and n * max_tokens > self.max_request_tokens:
            raise BadRequest(f"n x {options.max_tokens_param} is {n * max_tokens} tokens ({n} x {max_tokens}); "
                             f"this server generates at most {self.max_request_tokens} tokens for one "
                             f"request of several choices (--max-request-tokens). Please reduce n or "
                             f"{options.max_tokens_param}.", param="n")
        reqs = [Request(ids, max_new_tokens=max_tokens, temperature=float(temperature), top_p=float(top_p),
                        seed=None if seed is None else seed + i, logprobs=top, ignore_eos=options.ignore_eos)
                for i in range(n)]
        try:
            self.engine.check(reqs[0], n)
        except WorkerError as e:
            raise refusal(e) from None
        return Job(reqs, options.stop, chat, options.stream, options.include_usage, top is not None,
                   options.return_token_ids)

    def _max_tokens(self, ids: list[int], what: str, options: protocol.CompletionOptions, chat: bool) -> int:
        # The context holds prompt + completion; a completion that cannot fit is refused up front
        # (OpenAI's wording), not cut short. Without max_tokens, chat generates until the context
        # ends (OpenAI's default for chat) and completions stop at max_tokens_default (16, OpenAI's
        # default for /v1/completions), or at the context's end if that comes first.
        param = options.max_tokens_param
        max_tokens = getattr(options, param)
        context = self.engine.max_seq
        if len(ids) >= context:
            raise BadRequest(f"This model's maximum context length is {context} tokens. However, the {what} "
                             f"is {len(ids)} tokens, which leaves no room for the completion. Please reduce "
                             f"the length of the {what}.", param=what, code="context_length_exceeded")
        if max_tokens is not None and len(ids) + max_tokens > context:
            raise BadRequest(f"This model's maximum context length is {context} tokens. However, you requested "
                             f"{len(ids) + max_tokens} tokens ({len(ids)} in the {what}, {max_tokens} in the "
                             f"completion). Please reduce the length of the {what} or completion.",
                             param=param, code="context_length_exceeded")
        if max_tokens is None:
            max_tokens = context - len(ids) if chat else self.max_tokens_default
        return max_tokens

    def _messages(self, head: protocol.ChatHead, raw: list[dict]) -> list[int]:
        """The messages rendered with the chat template, tokenized. Each message goes to the
        template as it came (other keys included), its content as one string."""
        rendered = [{**m, "role": "system" if msg.role == "developer" else msg.role, "content": msg.text()}
                    for m, msg in zip(raw, head.messages)]
        try:
            text = self.tokenizer.apply_chat_template(rendered, add_generation_prompt=True)
        except WorkerError as e:
            raise BadRequest(str(e), param="messages") from None
        except Exception as e:  # noqa: BLE001 - a template's own error (jinja2 runs it) is the request's
            raise BadRequest(f"chat template failed: {type(e).__name__}: {e}", param="messages") from None
        return self.tokenizer.encode(text)

    def _prompt(self, prompt: str | list) -> list[int]:
        if isinstance(prompt, list) and isinstance(prompt[0], str):      # a list of one string
            prompt = prompt[0]
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        vocab = self.engine.stage.vocab_size
        if not all(0 <= t < vocab for t in prompt):
            raise BadRequest(f"prompt token ids must be in [0, {vocab})", param="prompt")
        return list(prompt)
