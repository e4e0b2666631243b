"""Search backends behind the web agent's `search(query)` tool.

A backend turns a query into a few `SearchResult`s (title, URL, snippet); `format_results` renders them as the
numbered text the model reads.  Serper (the paper's Google search API), Tavily and Brave are paid APIs whose key
is read from an environment variable at search time, never stored on the backend nor put into a message,
exception or repr.  `LocalSiteSearch` queries the project's offline web over HTTP.

A timeout, a network error, HTTP 429 or a 5xx gets one more try after a short pause; any other failure raises
`SearchError`.  A JSON object without the service's result keys means "no results" (`[]`); a body that is not
JSON, not an object, or whose result keys have the wrong type raises `SearchError`.
"""

from __future__ import annotations

import os
import time
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import httpx
import lxml.html

from tfgrpo.base.util import clip

_RETRYABLE = frozenset({429, *range(500, 600)})  # HTTP statuses worth one more try


@dataclass(frozen=True)
class SearchResult:
    title: str
    url: str
    snippet: str


class SearchError(RuntimeError):
    """A search that failed (missing key, HTTP error, bad JSON, ...); the message is short and never holds a key."""


class SearchBackend:
    """Query checks, the key, one retry, HTTP and JSON errors; subclasses give `_request` and `_parse`."""

    service = ""
    max_k = 20  # the most results the service hands out per request

    def __init__(self, api_key_env: str | None, endpoint: str, timeout_s: float, client: httpx.Client | None,
                 backoff_s: float) -> None:  # subclasses take these as keyword-only knobs
        self.api_key_env = api_key_env
        self.endpoint = endpoint
        self.timeout_s = timeout_s
        self.backoff_s = backoff_s
        self._client = client

    def __repr__(self) -> str:
        return f"{type(self).__name__}(endpoint={self.endpoint!r}, api_key_env={self.api_key_env!r})"

    def search(self, query: str, k: int = 5) -> list[SearchResult]:
        """At most `k` results; direct answers (answer box, knowledge graph, Tavily answer) come first and count."""
        if not isinstance(query, str) or not query.strip():
            raise SearchError("empty search query")
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise SearchError(f"k must be a positive integer, got {k!r}")
        key = self._key()
        method, url, options = self._request(query.strip(), min(k, self.max_k), key)
        try:
            response = self._send(method, url, options)
        except SearchError as exc:  # defence in depth: no key in any message
            raise SearchError(str(exc).replace(key, "***") if key else str(exc)) from None
        return self._parse(self._json(response))[:k]

    def _key(self) -> str:
        if self.api_key_env is None:
            return ""
        key = os.environ.get(self.api_key_env, "").strip()
        if not key:
            raise SearchError(f"{self.service} search needs an API key in ${self.api_key_env}")
        return key

    def _send(self, method: str, url: str, options: dict[str, Any]) -> httpx.Response:
        with nullcontext(self._client) if self._client is not None else httpx.Client() as client:
            outcome = self._attempt(client, method, url, options)
            if isinstance(outcome, httpx.TransportError) or outcome.status_code in _RETRYABLE:
                time.sleep(self.backoff_s)
                outcome = self._attempt(client, method, url, options)
        if isinstance(outcome, httpx.TimeoutException):
            raise SearchError(f"{self.service} search timed out after {self.timeout_s:g}s (tried twice)")
        if isinstance(outcome, httpx.TransportError):
            raise SearchError(f"{self.service} search failed (tried twice): {type(outcome).__name__}: {outcome}")
        return self._checked(outcome)

    def _attempt(self, client: httpx.Client, method: str, url: str,
                 options: dict[str, Any]) -> httpx.Response | httpx.TransportError:
        try:
            return client.request(method, url, timeout=self.timeout_s, **options)
        except httpx.TransportError as exc:
            return exc

    def _checked(self, response: httpx.Response) -> httpx.Response:
        status = response.status_code
        if status in (401, 403) and self.api_key_env is not None:
            raise SearchError(f"key rejected by {self.service} (check ${self.api_key_env})")
        if status == 429:
            raise SearchError(f"{self.service} rate limit (HTTP 429), still there after a retry")
        if status >= 400:
            raise SearchError(f"{self.service} search failed: HTTP {status}")
        return response

    def _json(self, response: httpx.Response) -> dict[str, Any]:
        try:
            data = response.json()
        except ValueError:
            raise SearchError(f"{self.service} returned malformed JSON") from None
        if not isinstance(data, dict):
            raise SearchError(f"{self.service} returned JSON of an unexpected shape (not an object)")
        return data

    def _objects(self, data: dict[str, Any], key: str) -> list[dict[str, Any]]:
        """The objects in the list under `key` ([] when the key is missing)."""
        items = data.get(key, [])
        if not isinstance(items, list):
            raise SearchError(f"{self.service} returned JSON of an unexpected shape ({key!r} is not a list)")
        return [item for item in items if isinstance(item, dict)]


class SerperSearch(SearchBackend):
    """Google results through serper.dev: answer box, knowledge graph, then the organic results."""

    service = "Serper"
    max_k = 100

    def __init__(self, *, api_key_env: str = "SERPER_API_KEY", endpoint: str = "https://google.serper.dev/search",
                 timeout_s: float = 20.0, client: httpx.Client | None = None, backoff_s: float = 1.0) -> None:
        super().__init__(api_key_env, endpoint, timeout_s, client, backoff_s)

    def _request(self, query: str, k: int, key: str) -> tuple[str, str, dict[str, Any]]:
        return "POST", self.endpoint, {"headers": {"X-API-KEY": key}, "json": {"q": query, "num": k}}

    def _parse(self, data: dict[str, Any]) -> list[SearchResult]:
        box, graph = data.get("answerBox"), data.get("knowledgeGraph")
        found = []
        if isinstance(box, dict):
            text = box.get("answer") or box.get("snippet")
            found.append(_result(box.get("title") or "Answer box", box.get("link"), text, need_url=False))
        if isinstance(graph, dict):
            url = graph.get("website") or graph.get("descriptionLink")
            found.append(_result(graph.get("title"), url, graph.get("description"), need_url=False))
        found += [_result(item.get("title"), item.get("link"), item.get("snippet"))
                  for item in self._objects(data, "organic")]
        return _kept(found)


class TavilySearch(SearchBackend):
    """Tavily's search API; its generated answer (asked for by default) comes first when it is given."""

    service = "Tavily"

    def __init__(self, *, api_key_env: str = "TAVILY_API_KEY", endpoint: str = "https://api.tavily.com/search",
                 timeout_s: float = 20.0, client: httpx.Client | None = None, backoff_s: float = 1.0,
                 include_answer: bool = True) -> None:
        super().__init__(api_key_env, endpoint, timeout_s, client, backoff_s)
        self.include_answer = include_answer

    def _request(self, query: str, k: int, key: str) -> tuple[str, str, dict[str, Any]]:
        body = {"query": query, "max_results": k, "search_depth": "basic", "include_answer": self.include_answer}
        return "POST", self.endpoint, {"headers": {"Authorization": f"Bearer {key}"}, "json": body}

    def _parse(self, data: dict[str, Any]) -> list[SearchResult]:
        found = [_result("Tavily answer", "", data.get("answer"), need_url=False)]
        found += [_result(item.get("title"), item.get("url"), item.get("content"))
                  for item in self._objects(data, "results")]
        return _kept(found)


class BraveSearch(SearchBackend):
    """Brave's web search API; its `<strong>` highlights and HTML entities become plain text."""

    service = "Brave"

    def __init__(self, *, api_key_env: str = "BRAVE_API_KEY",
                 endpoint: str = "https://api.search.brave.com/res/v1/web/search", timeout_s: float = 20.0,
                 client: httpx.Client | None = None, backoff_s: float = 1.0) -> None:
        super().__init__(api_key_env, endpoint, timeout_s, client, backoff_s)

    def _request(self, query: str, k: int, key: str) -> tuple[str, str, dict[str, Any]]:
        headers = {"X-Subscription-Token": key, "Accept": "application/json"}
        return "GET", self.endpoint, {"headers": headers, "params": {"q": query, "count": k}}

    def _parse(self, data: dict[str, Any]) -> list[SearchResult]:
        web = data.get("web", {})
        if not isinstance(web, dict):
            raise SearchError("Brave returned JSON of an unexpected shape ('web' is not an object)")
        return _kept([_result(_plain(item.get("title")), item.get("url"), _plain(item.get("description")))
                      for item in self._objects(web, "results")])


class LocalSiteSearch(SearchBackend):
    """The offline local web: GET {base_url}/search?q=...&k=... -> {"results": [{title, url, snippet}]}."""

    service = "local site"
    max_k = 100

    def __init__(self, base_url: str, *, timeout_s: float = 20.0, client: httpx.Client | None = None,
                 backoff_s: float = 1.0) -> None:
        super().__init__(None, f"{base_url.rstrip('/')}/search", timeout_s, client, backoff_s)

    def _request(self, query: str, k: int, key: str) -> tuple[str, str, dict[str, Any]]:
        return "GET", self.endpoint, {"params": {"q": query, "k": k}}

    def _parse(self, data: dict[str, Any]) -> list[SearchResult]:
        return _kept([_result(item.get("title"), item.get("url"), item.get("snippet"))
                      for item in self._objects(data, "results")])


_API_BACKENDS = {"serper": SerperSearch, "tavily": TavilySearch, "brave": BraveSearch}
BACKENDS = (*_API_BACKENDS, "local")


def make_backend(name: str, *, api_key_env: str | None = None, base_url: str | None = None) -> SearchBackend:
    """The backend called `name`: serper, tavily, brave, or local (which needs `base_url` and takes no key)."""
    choice = name.strip().lower()
    if choice == "local":
        if not base_url or api_key_env is not None:
            raise ValueError("the local search backend needs base_url and takes no api_key_env")
        return LocalSiteSearch(base_url)
    if choice not in _API_BACKENDS:
        raise ValueError(f"unknown search backend {name!r}; choose one of: {', '.join(BACKENDS)}")
    if base_url is not None:
        raise ValueError(f"base_url is for the local search backend only, not {choice}")
    cls = _API_BACKENDS[choice]
    return cls() if api_key_env is None else cls(api_key_env=api_key_env)


def format_results(results: list[SearchResult], *, snippet_chars: int = 300) -> str:
    """The numbered list the model reads ("1. Title\\n   URL\\n   snippet" each), or "No results."."""
    if not results:
        return "No results."
    blocks = []
    for number, result in enumerate(results, start=1):
        lines = [f"{number}. {result.title or '(untitled)'}"]
        if result.url:
            lines.append(f"   {result.url}")
        if result.snippet:
            lines.append(f"   {clip(result.snippet, snippet_chars, keep_tail=False)}")
        blocks.append("\n".join(lines))
    return "\n".join(blocks)


def _result(title: Any, url: Any, snippet: Any, *, need_url: bool = True) -> SearchResult | None:
    """A result from raw JSON fields (non-strings count as empty); None if it lacks a needed URL or any text."""
    title, url, snippet = (" ".join(v.split()) if isinstance(v, str) else "" for v in (title, url, snippet))
    if (need_url and not url) or not (snippet or (title and url)):
        return None
    return SearchResult(title=title, url=url, snippet=snippet)


def _kept(found: list[SearchResult | None]) -> list[SearchResult]:
    return [result for result in found if result is not None]


def _plain(html: Any) -> Any:
    """The text of an HTML fragment (tags dropped, entities decoded); non-strings and blanks pass through."""
    if not isinstance(html, str) or not html.strip():
        return html
    return lxml.html.fragment_fromstring(html, create_parent="div").text_content()

