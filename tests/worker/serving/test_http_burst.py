"""A burst against a real `shardwise serve` with its default settings: 64 streamed requests sent at the
same instant all complete with their whole answer, none refused (429) or dropped. The default
waiting queue (crds/capacity.py max_waiting) holds a burst of a few hundred behind the 8 rows, the
listen backlog and the request threads (connections.py workers_for) hold every request the engine
would admit."""
from __future__ import annotations

import json
import threading
import urllib.request

from .serve_process import serve_process
from .test_drain import NEW_TOKENS, _stream
from .test_http_admission import _metrics

BURST = 64


def test_a_burst_of_64_simultaneous_streams_all_complete_with_their_whole_answer(tiny_serving_model):
    args = ["--model", str(tiny_serving_model), "--port", "0", "--threads", "1"]
    with serve_process(args) as (base, lines):
        body = json.dumps({"prompt": "the quick brown fox", "max_tokens": NEW_TOKENS, "temperature": 0}).encode()
        req = urllib.request.Request(base + "/v1/completions", data=body, headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            alone = json.loads(r.read())["choices"][0]["text"]      # greedy: every stream's answer
        outs = [{} for _ in range(BURST)]
        start = threading.Barrier(BURST)
        threads = [threading.Thread(target=lambda o=o: (start.wait(), _stream(base, o))) for o in outs]
        for t in threads:
            t.start()
        for t in threads:
            t.join(240)
        failed = [o.get("error") for o in outs if "error" in o or not o.get("done")]
        assert not failed, f"{len(failed)} of {BURST} failed: {failed[:3]}"
        for o in outs:
            assert o["usage"]["completion_tokens"] == NEW_TOKENS and o["chunks"][-1]["finish_reason"] == "length"
            assert "".join(c["text"] for c in o["chunks"]) == alone
        assert _metrics(base).get("shardwise_rejected_requests_total", 0) == 0
        assert not any("Traceback" in line for line in lines)
