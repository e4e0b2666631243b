"""`BillingServer`: a plain OpenAI-compatible chat server in the standard library only. It answers each request with
`respond(body)` (a reply's text, or a whole response body as a dict: a provider's odd reply), counts every request
by model, reports usage (one token per word) and bills it at `prices` (USD per million tokens, by the model name
the request carries).

It knows nothing of what sends to it: what a compile reports it spent is checked against what this server billed.
"""

from __future__ import annotations

import json
import threading
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable

import dspy

from tfgrpo.testing import prompts


def words(messages: list[dict]) -> int:
    return sum(len(str(m.get("content") or "").split()) for m in messages)


class BillingServer:
    def __init__(self, respond: Callable[[dict], "str | dict"], prices: dict[str, dict] | None = None):
        self.respond, self.prices = respond, prices or {}
        self.requests: list[dict] = []
        self.calls: Counter = Counter()  # by model
        self.bill: Counter = Counter()  # USD by model
        self.lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def api_base(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}/v1"

    def lm(self, model: str, **kwargs) -> dspy.LM:
        return dspy.LM(f"openai/{model}", api_base=self.api_base, api_key="test", num_retries=0, **kwargs)

    def __enter__(self) -> BillingServer:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()

    def total(self) -> float:
        with self.lock:
            return sum(self.bill.values())

    def _answer(self, body: dict) -> dict:
        reply = self.respond(body)
        model = body.get("model", "")
        if isinstance(reply, dict):  # a whole body: a provider's odd reply (no choices, say); billed as it says
            usage = reply.get("usage") or {}
        else:
            usage = {"prompt_tokens": words(body["messages"]), "completion_tokens": len(reply.split())}
            usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
            reply = {"id": f"c{len(self.requests)}", "object": "chat.completion", "created": 0, "model": model,
                     "choices": [{"index": 0, "message": {"role": "assistant", "content": reply},
                                  "finish_reason": "stop"}], "usage": usage}
        price = self.prices.get(model, {})
        with self.lock:
            self.requests.append(body)
            self.calls[model] += 1
            self.bill[model] += (usage.get("prompt_tokens", 0) * price.get("input", 0)
                                 + usage.get("completion_tokens", 0) * price.get("output", 0)) / 1e6
        return reply

    def _handler(self):
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
                payload = json.dumps(server._answer(body)).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

        return Handler


def chat_reply(fields: dict) -> str:
    """A reply in DSPy's chat format for the output `fields`."""
    return "\n\n".join(f"[[ ## {k} ## ]]\n{v}" for k, v in fields.items()) + "\n\n[[ ## completed ## ]]"


def asked_fields(body: dict) -> list[str]:
    """The output fields DSPy's chat adapter asks for, from the request's system message."""
    system = body["messages"][0]["content"] if body["messages"][0]["role"] == "system" else ""
    return prompts.output_fields(system)
