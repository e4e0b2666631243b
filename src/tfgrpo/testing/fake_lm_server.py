"""A fake OpenAI-compatible chat server that answers DSPy programs and tfgrpo's learning calls.

It speaks just enough of the OpenAI chat API (`POST /v1/chat/completions`, `GET /v1/models`) for
`dspy.LM("openai/fake", api_base=server.api_base, api_key="x")`, and replies in DSPy's chat format (or JSON
when the JSON adapter asks for it). Replies are pure functions of the request and a seed, so runs are
reproducible under any thread schedule:

* student calls ("What is A + B?"): right or wrong by a hash of the request. Identical requests (G rollouts
  of one query differ only in their `rollout_id`, which never reaches the wire) are told apart by how often
  the server has seen that request (`vary_identical=True`); turn it off when every request is unique.
  ReAct-style calls use `tool_turns` tool calls before `finish`.
* learning calls, told apart by the output field they ask for (`tfgrpo.testing.prompts`, the rules the
  tests' scripted LM uses too): see `responder.py`.

Faults are injected by name at a rate, decided by hashes: reply faults (`malformed`, `truncated`, `empty`,
`invented_ids`) by the request alone, transient ones (`http429`, `http500`, `hang`) also by the request's
repeat count, so a retry can succeed. Every call is counted per kind with its tokens (`stats()`), and the
usage goes back in the response. `process=True` runs the server in a child process (benchmarks: the
orchestrator's GIL and memory then stay its own); stats travel over `GET /_stats`.

Opt-in, it behaves like a paid API (`provider.py`): prefix caching reported and billed as DeepSeek and OpenAI do,
a bill from per-token prices, reasoning models (and OpenAI's 400 for their unsupported parameters), a
requests-per-minute limit, and a log of every request's parameters and usage.
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import json
import math
import multiprocessing
import re
import socket
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from statistics import NormalDist

from tfgrpo.testing.prompts import KINDS, kind_of, output_fields
from tfgrpo.testing.provider import Provider, count_tokens
from tfgrpo.testing.provider import message_text as _text
from tfgrpo.testing.responder import Responder, hash_unit

REPLY_FAULTS = ("malformed", "truncated", "empty", "invented_ids")
TRANSIENT_FAULTS = ("http429", "http500", "hang")
FAULTS = REPLY_FAULTS + TRANSIENT_FAULTS


class _Server(ThreadingHTTPServer):
    daemon_threads, block_on_close, allow_reuse_address = True, False, True
    request_queue_size = 1024  # many clients connect at once; a short backlog drops SYNs (1 s retransmits)

    def handle_error(self, request, client_address):
        if not isinstance(sys.exc_info()[1], OSError):  # a client that went away (killed, timed out) is normal
            super().handle_error(request, client_address)


class FakeLMServer:
    """Start/stop with `with FakeLMServer(...) as server:`; point an LM at `server.api_base` (or `server.lm()`).

    latency: seconds per call, or `latency(kind) -> seconds` (a module-level function with `process=True`).
    latency_dist: "fixed" (every call takes `latency`) or "lognormal" (heavy-tailed, as real endpoints are: median
    `latency`, sigma `latency_sigma`; 1.0 puts p99 at ~10x the median); a call's draw is fixed by the request and the
    seed, so a run is reproducible under any thread schedule. Every call's (kind, question, turn, latency) is logged in
    `stats()["log"]`, from which a benchmark can rebuild the step's critical path.
    faults: {fault name: rate in [0, 1]}; fault_kinds: which kinds of call may get them.
    hang_seconds: how long a `hang` holds the reply (set it above the client's timeout); retry_after: the
    Retry-After hint sent with 429/500, in seconds (DSPy honors it instead of its 1-2-4 s backoff). The `http429`
    fault stands for a provider's rate limit at a rate; `rate_limit_rpm` is one by the clock instead.

    As a paid API (each off by default; see `tfgrpo.testing.provider`):
    prefix_cache: count as cached the longest prefix a prompt shares with an earlier one to the same model, in whole
    `cache_block`s and nothing below `cache_min` tokens (DeepSeek: 64 and 64, the default; OpenAI: 128 and 1024),
    reported as `usage.prompt_tokens_details.cached_tokens` (OpenAI; what DSPy reads) and
    `usage.prompt_cache_hit_tokens` / `prompt_cache_miss_tokens` (DeepSeek). The cache outlives `reset_stats()`.
    prices: {model: {"input", "cached_input", "output"}} in USD per token ("*": any other model; `dspy_prices(model)`
    gives DSPy's own); each served call is billed in `stats()["billed_usd"]`.
    reasoning: True (o-series, gpt-5 but -chat, deepseek-reasoner) or {model or prefix: tokens per reply}: the
    completion then counts that many reasoning tokens (`usage.completion_tokens_details.reasoning_tokens`, scaled by
    `reasoning_effort`), shown as `reasoning_content` except for OpenAI's models, which hide it and answer 400 to a
    temperature other than 1 or to `max_tokens`, as OpenAI does.
    rate_limit_rpm: at most this many requests per sliding minute; the rest get 429 with the wait as Retry-After.
    token_chars: count a token per this many characters (a real tokenizer: about 4) instead of one per word.
    log_requests: True (or the number of latest requests to keep) lists each request's model, kind, HTTP status,
    fault, temperature, max_tokens, max_completion_tokens, other body keys (`extra`) and usage in
    `stats()["requests"]`.
    `stats()` also totals prompt_tokens, cached_tokens, completion_tokens, reasoning_tokens and billed_usd (and per
    kind, and per model in `models`), and counts replies per HTTP status (`statuses`).
    """

    def __init__(self, *, latency: float | Callable[[str], float] = 0.0, latency_dist: str = "fixed",
                 latency_sigma: float = 1.0, seed: int = 0, correct_rate: float = 0.5,
                 tool_turns: int = 0, vary_identical: bool = True, merge_at: int = 6, faults: dict | None = None,
                 fault_kinds=KINDS, hang_seconds: float = 2.0, retry_after: float = 0.01, process: bool = False,
                 prefix_cache: bool = False, cache_block: int = 64, cache_min: int = 64, prices: dict | None = None,
                 reasoning: bool | dict | None = None, rate_limit_rpm: int | None = None,
                 log_requests: bool | int = False, token_chars: int | None = None):
        if set(faults or {}) - set(FAULTS):
            raise ValueError(f"unknown faults {sorted(set(faults) - set(FAULTS))}; known: {FAULTS}")
        if latency_dist not in ("fixed", "lognormal"):
            raise ValueError(f"latency_dist must be 'fixed' or 'lognormal', got {latency_dist!r}")
        self.config = dict(latency=latency, latency_dist=latency_dist, latency_sigma=latency_sigma, seed=seed, correct_rate=correct_rate, tool_turns=tool_turns,
                           vary_identical=vary_identical, merge_at=merge_at, faults=dict(faults or {}),
                           fault_kinds=tuple(fault_kinds), hang_seconds=hang_seconds, retry_after=retry_after)
        paid = dict(prefix_cache=prefix_cache, cache_block=cache_block, cache_min=cache_min, prices=prices,
                    reasoning=reasoning, rate_limit_rpm=rate_limit_rpm, token_chars=token_chars)
        self.provider = Provider(**paid)
        self.config.update(paid, log_requests=log_requests)
        self.process, self.port = process, None
        self.responder = Responder(seed, correct_rate, tool_turns, vary_identical, merge_at)
        self._lock, self._stop, self._hooks, self._conns = threading.Lock(), threading.Event(), [], set()
        self._httpd = self._thread = self._child = self._pipe = None
        self.reset_stats()

    @property
    def api_base(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()

    def start(self) -> FakeLMServer:
        if self.process:
            ctx = multiprocessing.get_context("spawn")
            self._pipe, child_end = ctx.Pipe()
            self._child = ctx.Process(target=_child_main, args=(self.config, child_end), daemon=True)
            self._child.start()
            if not self._pipe.poll(60):
                raise RuntimeError("the fake LM server process did not start")
            self.port = self._pipe.recv()
            return self
        self._httpd = _Server(("127.0.0.1", 0), _make_handler(self))
        self.port = self._httpd.server_address[1]
        self._thread = threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.05},
                                        name="fake-lm-server", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._child is not None:
            self._pipe.send("stop")
            self._child.join(10)
            self._child.kill()  # (a no-op once it has exited)
            self._child = None
            return
        if self._httpd is None:
            return
        self._stop.set()  # wakes sleeping latencies and hangs
        self._httpd.shutdown()
        self._httpd.server_close()
        with self._lock:
            conns = list(self._conns)
        for conn in conns:  # end idle keep-alive connections so their threads exit
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
        self._thread.join(5)
        self._httpd = None

    def reset_stats(self) -> None:  # (in this process; a server in its own process starts afresh)
        per_kind = dict(calls=0, ok=0, errors=0, prompt_tokens=0, completion_tokens=0, cached_tokens=0,
                        reasoning_tokens=0, billed_usd=0.0, first_at=None, last_at=None)
        keep = self.config["log_requests"]
        with self._lock:
            self._stats = {"calls": 0, "in_flight": 0, "max_in_flight": 0, "kinds": {k: dict(per_kind) for k in KINDS},
                           "faults": {f: 0 for f in FAULTS}, "faults_by_kind": {k: {} for k in KINDS}, "log": [],
                           "statuses": {}, "models": {},
                           "requests": collections.deque(maxlen=None if keep is True else int(keep))}
            self._seen: dict[str, int] = {}  # request digest -> times seen

    def stats(self) -> dict:
        """Calls, tokens and injected faults so far, per kind of call (a copy)."""
        if self.process and self._child is not None:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/_stats", timeout=10) as r:
                return json.loads(r.read())
        with self._lock:
            stats = json.loads(json.dumps(self._stats, default=list))
        for name in _SPENT:
            stats[name] = sum(k[name] for k in stats["kinds"].values())
        return stats

    def on_call(self, n: int, fn: Callable[[], None], kind: str | None = None) -> None:
        """Run `fn()` when the n-th call (of `kind`, or of any kind) arrives, before it is answered."""
        with self._lock:
            self._hooks.append([n, fn, kind])

    def lm(self, model: str = "openai/fake", **overrides):
        """A `dspy.LM` for this server: no cache, short timeout, a few retries (overridable)."""
        import dspy

        return dspy.LM(model, **{"api_base": self.api_base, "api_key": "x", "num_retries": 3, "timeout": 10,
                                 "cache": False, **overrides})

    def _answer(self, body: dict) -> tuple[int, dict, dict]:
        """(status, extra headers, JSON body) for one chat completion request."""
        cfg, messages = self.config, body.get("messages") or []
        system = _text(next((m.get("content") for m in messages if m.get("role") == "system"), ""))
        user = _text(messages[-1].get("content")) if messages else ""
        fields = output_fields(system)
        kind = kind_of(fields)
        digest = hashlib.sha256(json.dumps([messages, body.get("temperature")], sort_keys=True).encode()).hexdigest()
        with self._lock:
            seen = self._seen.get(digest, 0)
            self._seen[digest] = seen + 1
            s, k = self._stats, self._stats["kinds"][kind]
            s["calls"], k["calls"], s["in_flight"] = s["calls"] + 1, k["calls"] + 1, s["in_flight"] + 1
            s["max_in_flight"] = max(s["max_in_flight"], s["in_flight"])
            k["first_at"], k["last_at"] = k["first_at"] or time.time(), time.time()  # how fast a stage's calls go out
            due = [h for h in self._hooks if h[0] == (s["calls"] if h[2] is None else s["kinds"][h[2]]["calls"])
                   and (h[2] is None or h[2] == kind)]
        for hook in due:
            hook[1]()
        try:
            refused = self.provider.refusal(body)
            if refused is not None:
                self._count(kind, "errors")
                self._record(body, kind, refused[0], None)
                return refused
            fault = self._fault(kind, digest, seen)
            latency = cfg["latency"](kind) if callable(cfg["latency"]) else cfg["latency"]
            if cfg["latency_dist"] == "lognormal":
                z = NormalDist().inv_cdf(min(max(hash_unit(cfg["seed"], "latency", digest, seen), 1e-9), 1 - 1e-9))
                latency *= math.exp(cfg["latency_sigma"] * z)
            question = re.findall(r"What is -?\d+ \+ -?\d+\?", user)
            turn = len(re.findall(r"\[\[ ## tool_name_\d+ ## \]\]", user)) + (0 if "next_tool_name" in fields else 1000)
            with self._lock:  # (ReAct: `turn` counts the trajectory's tool calls; 1000+ is the final extract call)
                self._stats["log"].append([kind, question[-1] if question else "", turn, latency])
            self._stop.wait(cfg["hang_seconds"] if fault == "hang" else latency)
            if fault in ("http429", "http500"):
                code, kind_name = (429, "rate_limit_error") if fault == "http429" else (500, "server_error")
                self._count(kind, "errors")
                self._record(body, kind, code, fault)
                return code, {"Retry-After": str(cfg["retry_after"])}, {"error": {
                    "message": f"fake {fault}", "type": kind_name, "param": None, "code": fault}}
            values = self.responder.values(kind, fields, system, user, digest, seen, invent=fault == "invented_ids")
            text, finish = _render(values, json_mode="response_format" in body or "Respond with a JSON object" in user), "stop"
            if fault == "malformed":
                text = "Sure! Here is what I think about it: " + text.replace("[[ ## ", "[ ").replace("{", "(")[:80]
            elif fault == "truncated":
                text, finish = text[: max(1, int(len(text) * 0.4))], "length"
            elif fault == "empty":
                text = ""
            reasoning, thought = self.provider.reasoning(body)  # (words stand in for tokens)
            completion = count_tokens(text, self.provider.token_chars) + reasoning
            usage, spent = self.provider.usage(body, messages, completion, reasoning)
            self._count(kind, "ok", **spent)
            self._record(body, kind, 200, fault, spent)
            message = {"role": "assistant", "content": text, **({"reasoning_content": thought} if thought else {})}
            return 200, {}, {"id": f"chatcmpl-{digest[:12]}-{seen}", "object": "chat.completion",
                             "created": int(time.time()), "model": body.get("model", "fake"),
                             "choices": [{"index": 0, "message": message, "finish_reason": finish}], "usage": usage}
        finally:
            with self._lock:
                self._stats["in_flight"] -= 1

    def _fault(self, kind: str, digest: str, seen: int) -> str | None:
        cfg = self.config
        if kind not in cfg["fault_kinds"]:
            return None
        for name in FAULTS:
            rate = cfg["faults"].get(name, 0.0)
            if not rate or (name == "invented_ids" and kind not in ("advantage", "consolidation")):
                continue
            parts = (cfg["seed"], name, digest) + ((seen,) if name in TRANSIENT_FAULTS else ())
            if hash_unit(*parts) < rate:
                with self._lock:
                    self._stats["faults"][name] += 1
                    self._stats["faults_by_kind"][kind][name] = self._stats["faults_by_kind"][kind].get(name, 0) + 1
                return name
        return None

    def _count(self, kind, outcome, **tokens):
        with self._lock:
            for name, n in {outcome: 1, **tokens}.items():
                self._stats["kinds"][kind][name] += n

    def _record(self, body: dict, kind: str, status: int, fault: str | None, spent: dict | None = None) -> None:
        """Count a reply by HTTP status and by model, and log the request when asked to."""
        spent, model = spent or dict.fromkeys(_SPENT, 0), str(body.get("model", ""))
        with self._lock:
            s = self._stats
            s["statuses"][str(status)] = s["statuses"].get(str(status), 0) + 1
            m = s["models"].setdefault(model, {"calls": 0, **dict.fromkeys(_SPENT, 0)})
            for name, n in {"calls": 1, **spent}.items():
                m[name] += n
            if self.config["log_requests"]:
                extra = {k: v for k, v in body.items() if k not in _PARAMS + ("messages", "model")}
                s["requests"].append({"model": model, "kind": kind, "status": status, "fault": fault,
                                      **{k: body.get(k) for k in _PARAMS}, "extra": extra, **spent})


_SPENT = ("prompt_tokens", "cached_tokens", "completion_tokens", "reasoning_tokens", "billed_usd")
_PARAMS = ("temperature", "max_tokens", "max_completion_tokens")


def _render(values: dict, json_mode: bool) -> str:
    if json_mode:
        return json.dumps(values)
    parts = [f"[[ ## {k} ## ]]\n{v if isinstance(v, str) else json.dumps(v)}" for k, v in values.items()]
    return "\n\n".join(parts + ["[[ ## completed ## ]]"])


def _make_handler(server: FakeLMServer):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        disable_nagle_algorithm = True
        wbufsize = 1 << 16  # head and body leave in one write: split small writes meet delayed ACKs (~40 ms)

        def setup(self):
            super().setup()
            with server._lock:
                server._conns.add(self.connection)

        def finish(self):
            with server._lock:
                server._conns.discard(self.connection)
            with contextlib.suppress(OSError):
                super().finish()

        def log_message(self, *args):  # quiet
            return

        def _send(self, code: int, payload: dict, headers: dict | None = None):
            data = json.dumps(payload).encode()
            try:
                self.send_response(code)
                for k, v in {"Content-Type": "application/json", "Content-Length": str(len(data)), **(headers or {})}.items():
                    self.send_header(k, v)
                self.end_headers()
                self.wfile.write(data)
                self.wfile.flush()
            except OSError:  # the client gave up (timeout) or went away (killed)
                self.close_connection = True

        def do_GET(self):
            if self.path.rstrip("/") == "/v1/models":
                self._send(200, {"object": "list", "data": [{"id": "fake", "object": "model", "owned_by": "tfgrpo"}]})
            elif self.path == "/_stats":
                self._send(200, server.stats())
            else:
                self._send(404, {"error": {"message": f"no route {self.path}", "type": "not_found"}})

        def do_POST(self):
            try:
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
            except ValueError as exc:
                return self._send(400, {"error": {"message": f"bad JSON: {exc}", "type": "invalid_request_error"}})
            if self.path.rstrip("/") != "/v1/chat/completions" or not isinstance(body, dict):
                return self._send(404, {"error": {"message": f"no route {self.path}", "type": "not_found"}})
            code, headers, payload = server._answer(body)
            self._send(code, payload, headers)

    return Handler


def _child_main(config: dict, pipe) -> None:
    server = FakeLMServer(**config).start()
    pipe.send(server.port)
    with contextlib.suppress(EOFError):
        pipe.recv()  # blocks until the parent says stop (or goes away)
    server.stop()
