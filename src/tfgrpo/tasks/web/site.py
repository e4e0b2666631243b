"""The offline local web: a search engine and one HTML page per document of a JSONL corpus.

    python -m tfgrpo.tasks.web.site --corpus FILE.jsonl [--port P]

prints `serving http://127.0.0.1:P` as its first line, then serves until stopped:

* `GET /search?q=...&k=5` -> `{"query": ..., "results": [{"title", "url", "snippet"}, ...]}`, ranked by SQLite
  FTS5's BM25 (titles weigh more than text);
* `GET /wiki/<Title_with_underscores>` -> the document as an HTML page (with a menu and a footer, as real pages
  have, so the page tool's text extraction does real work);
* `GET /` -> a home page with a search form.

A corpus row is `{"title": ..., "text": ...}`; titles are unique. The builtin `hotpotqa` corpus (every paragraph
of the shipped HotpotQA questions) is the default. `running_site()` serves from a thread of the caller's process.
"""

from __future__ import annotations

import argparse
import contextlib
import html
import json
import re
import sqlite3
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, quote, unquote, urlsplit

from tfgrpo.base.util import read_jsonl_rows

DATA_DIR = Path(__file__).resolve().parent / "data"
BUILTIN_CORPORA = {"hotpotqa": DATA_DIR / "hotpotqa" / "corpus.jsonl"}
MAX_K = 20  # results per search request, at most
SNIPPET_TOKENS = 40  # words of a result's snippet around the matched terms


def corpus_path(name_or_path: str | Path) -> Path:
    """A builtin corpus name or a JSONL file, as a path that exists."""
    path = BUILTIN_CORPORA.get(str(name_or_path), Path(name_or_path).expanduser())
    if not path.is_file():
        raise ValueError(f"corpus {str(name_or_path)!r}: not a builtin name ({', '.join(BUILTIN_CORPORA)}) "
                         "and no such file")
    return path


def read_corpus(path: Path) -> list[dict]:
    """The corpus rows; a row without a title or text, or a repeated title, is an error naming its line."""
    docs, seen = [], set()
    for number, row in read_jsonl_rows(Path(path)):  # the shared JSONL reader: bad JSON names its line
        title, text = (str(row.get(k) or "").strip() for k in ("title", "text"))
        if not title or not text:
            raise ValueError(f"{path}, line {number}: a document needs a non-empty 'title' and 'text'")
        if title in seen:
            raise ValueError(f"{path}, line {number}: the title {title!r} appears twice")
        seen.add(title)
        docs.append({"title": title, "text": text})
    if not docs:
        raise ValueError(f"{path}: no documents")
    return docs


def page_path(title: str) -> str:
    return "/wiki/" + quote(title.replace(" ", "_"), safe="")


class CorpusIndex:
    """An in-memory SQLite FTS5 index of the documents; safe to query from several threads."""

    def __init__(self, docs: list[dict]):
        self._db = sqlite3.connect(":memory:", check_same_thread=False)
        self._db.execute("CREATE VIRTUAL TABLE docs USING fts5(title, text, tokenize='unicode61 remove_diacritics 2')")
        self._db.executemany("INSERT INTO docs(title, text) VALUES (?, ?)", [(d["title"], d["text"]) for d in docs])
        self._by_title = {d["title"]: d for d in docs}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._by_title)

    def search(self, query: str, k: int = 5) -> list[dict]:
        """Best `k` documents for the words of `query` (any of them may match; BM25 ranks)."""
        words = re.findall(r"\w+", query.lower())
        if not words:
            return []
        match = " OR ".join(f'"{w}"' for w in dict.fromkeys(words))  # quoted: no FTS5 syntax from the query
        sql = ("SELECT title, snippet(docs, 1, '', '', ' ... ', ?) FROM docs WHERE docs MATCH ? "
               "ORDER BY bm25(docs, 5.0, 1.0) LIMIT ?")
        with self._lock:
            rows = self._db.execute(sql, (SNIPPET_TOKENS, match, max(1, min(k, MAX_K)))).fetchall()
        return [{"title": t, "url": page_path(t), "snippet": s} for t, s in rows]  # url: a path on the site

    def document(self, title: str) -> dict | None:
        return self._by_title.get(title)


_PAGE = """<!doctype html>
<html><head><meta charset="utf-8"><title>{title} - local web</title></head>
<body>
<nav><a href="/">Home</a> | <a href="/search?q=">Search</a> | <a href="/">Random page</a></nav>
<main><article><h1>{title}</h1>
<p>{text}</p>
</article></main>
<footer>Local web of tfgrpo: an offline copy of {count} documents. Text under CC BY-SA 4.0.</footer>
</body></html>
"""

_HOME = """<!doctype html>
<html><head><meta charset="utf-8"><title>local web</title></head>
<body><h1>Local web</h1><p>{count} documents.</p>
<form action="/search"><input name="q"><input type="submit" value="Search"></form></body></html>
"""


def make_server(index: CorpusIndex, host: str = "127.0.0.1", port: int = 0) -> ThreadingHTTPServer:
    """An HTTP server (not yet serving) for the index; port 0 picks a free one."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (http.server's name)
            url = urlsplit(self.path)
            if url.path == "/search":
                params = parse_qs(url.query)
                query = params.get("q", [""])[0]
                try:
                    k = int(params.get("k", ["5"])[0])
                except ValueError:
                    return self._send(400, "application/json", json.dumps({"error": "k must be an integer"}))
                results = [{**r, "url": origin(self.server) + r["url"]} for r in index.search(query, k)]
                body = {"query": query, "results": results}
                return self._send(200, "application/json", json.dumps(body, ensure_ascii=False))
            if url.path.startswith("/wiki/"):
                name = unquote(url.path[len("/wiki/"):])
                doc = index.document(name.replace("_", " ")) or index.document(name)
                if doc is None:
                    return self._send(404, "text/html; charset=utf-8", "<h1>No such page</h1>")
                page = _PAGE.format(title=html.escape(doc["title"]), text=html.escape(doc["text"]), count=len(index))
                return self._send(200, "text/html; charset=utf-8", page)
            if url.path == "/":
                return self._send(200, "text/html; charset=utf-8", _HOME.format(count=len(index)))
            return self._send(404, "text/html; charset=utf-8", "<h1>Not found</h1>")

        def _send(self, status: int, content_type: str, body: str) -> None:
            data = body.encode("utf-8")
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):  # one line per request would drown the agent's progress
            pass

    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    return server


def origin(server: ThreadingHTTPServer) -> str:
    host, port = server.server_address[:2]
    return f"http://{host}:{port}"


@contextlib.contextmanager
def running_site(corpus: str | Path = "hotpotqa", *, port: int = 0):
    """Serve `corpus` from a background thread of this process; yields the site's base URL."""
    server = make_server(CorpusIndex(read_corpus(corpus_path(corpus))), port=port)
    thread = threading.Thread(target=server.serve_forever, name="local-web", daemon=True)
    thread.start()
    try:
        yield origin(server)
    finally:
        server.shutdown()
        server.server_close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tfgrpo.tasks.web.site", description=__doc__.splitlines()[0])
    parser.add_argument("--corpus", default="hotpotqa", help="JSONL file of {title, text} rows, or 'hotpotqa'")
    parser.add_argument("--port", type=int, default=0, help="port on 127.0.0.1 (0: any free port)")
    args = parser.parse_args(argv)
    try:
        index = CorpusIndex(read_corpus(corpus_path(args.corpus)))
    except (ValueError, OSError) as exc:
        parser.exit(2, f"error: {exc}\n")
    server = make_server(index, port=args.port)
    print(f"serving {origin(server)}", flush=True)
    print(f"{len(index)} documents from {args.corpus}; Ctrl-C stops", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()


if __name__ == "__main__":
    main()
