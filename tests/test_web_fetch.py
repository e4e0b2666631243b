"""The page tool's fetcher: SSRF refusals, redirects, limits, decoding and text extraction.

Real sockets on 127.0.0.1 only: a bare listener that counts connections (refusals must make none)
and a small HTTP server that the fetcher may reach because its origin is allowed."""

from __future__ import annotations

import contextlib
import http.server
import itertools
import socket
import threading
import time

import pytest
import trafilatura

from tfgrpo.tasks.web.fetch import Page, PageFetcher, Refused, page_text

ARTICLE = """<!DOCTYPE html><html><head><title>Otters</title><script>var tracking = 1;</script></head><body>
<nav><a href="/">Home</a> | <a href="/news">News</a> | <a href="/contact">Contact</a></nav>
<article><h1>The Great Otter Migration</h1>
<p>Every spring, thousands of otters travel down the river to reach the coastal estuaries, where food is plentiful.</p>
<h2>Why they move</h2>
<p>Scientists believe the migration follows the seasonal abundance of crabs in the estuary, which peaks in late April.</p>
</article>
<footer>Copyright 2024 Otter News. All rights reserved. Privacy policy.</footer></body></html>"""


def reply(status=200, body=b"", content_type="text/html; charset=utf-8", **headers) -> bytes:
    """A raw HTTP response; header names are given with underscores for dashes."""
    lines = [f"HTTP/1.1 {status} {http.HTTPStatus(status).phrase}"] + [f"{k.replace('_', '-')}: {v}" for k, v in headers.items()]
    if content_type:
        lines.append(f"Content-Type: {content_type}")
    if not {"Content_Length", "Transfer_Encoding"} & headers.keys():
        lines.append(f"Content-Length: {len(body)}")
    return "\r\n".join(lines).encode() + b"\r\n\r\n" + body


def routes(listener_port: int) -> dict[str, list[bytes]]:
    """Each path's response, as the pieces the server writes (those in DRIPPING, 0.2 s apart)."""
    slow = reply(body=b"x" * 100)
    chunk = b"<p>" + b"spam " * 200 + b"</p>"
    return {
        "/article": [reply(body=ARTICLE.encode())],
        "/untyped": [reply(body=ARTICLE.encode(), content_type=None)],
        "/plain": [reply(body=b"line one\n  line two\n", content_type="text/plain")],
        "/latin1": [reply(body="<html><body><p>Un café à Paris, s'il vous plaît.</p></body></html>".encode("latin-1"),
                          content_type="text/html; charset=ISO-8859-1")],
        "/utf8": [reply(body="<html><body><p>Naïve café in 東京 — 5 €.</p></body></html>".encode())],
        "/pdf": [reply(body=b"%PDF-1.4", content_type="application/pdf")],
        "/boom": [reply(500, b"oops")],
        "/to-article": [reply(302, Location="/article")],
        "/to-listener": [reply(302, Location=f"http://127.0.0.1:{listener_port}/")],
        "/to-file": [reply(302, Location="file:///etc/passwd")],
        "/loop": [reply(302, Location="/loop")],
        "/big": [reply(body=b"<html>", Content_Length=50_000_000)],
        "/endless": itertools.chain([reply(Transfer_Encoding="chunked")],
                                    itertools.repeat(b"%x\r\n%s\r\n" % (len(chunk), chunk), 10_000)),
        "/drip-body": [slow[:-100], *[b"x"] * 100],
        "/drip-head": [bytes([byte]) for byte in slow],
    }


DRIPPING = {"/drip-body", "/drip-head"}


class Handler(http.server.BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def do_GET(self):
        self.server.seen.append((self.path, self.headers["Host"]))
        for piece in routes(self.server.listener.port).get(self.path, [reply(404, b"<html><body>not here</body></html>")]):
            self.wfile.write(piece)
            self.wfile.flush()
            if self.path in DRIPPING:
                time.sleep(0.2)


class Site(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request, client_address):
        pass  # the fetcher hanging up mid-response is expected here


class Listener:
    """A TCP port that never answers.  It needs no thread: the kernel completes and queues every
    connection attempt, and `connections()` drains the queue to count them."""

    def __init__(self):
        self.sock = socket.create_server(("127.0.0.1", 0), backlog=64)
        self.sock.setblocking(False)
        self.port = self.sock.getsockname()[1]
        self.accepted = 0

    def connections(self) -> int:
        with contextlib.suppress(BlockingIOError):
            while True:
                self.sock.accept()[0].close()
                self.accepted += 1
        return self.accepted


@pytest.fixture
def listener():
    listener = Listener()
    yield listener
    listener.sock.close()


@pytest.fixture
def site(listener):
    server = Site(("127.0.0.1", 0), Handler)
    server.seen, server.listener = [], listener
    server.origin = f"http://127.0.0.1:{server.server_address[1]}"
    threading.Thread(target=server.serve_forever, args=(0.02,), daemon=True).start()
    yield server
    server.shutdown()
    server.server_close()


@pytest.fixture
def fake_dns(monkeypatch):
    """Fake DNS: fill table[name] with answers (lists of IPs), given in turn, the last one sticking.
    Other names resolve for real; `lookups` records every name asked for."""
    real, table, lookups = socket.getaddrinfo, {}, []

    def getaddrinfo(host, port, *args, **kwargs):
        lookups.append(host)
        if host not in table:
            return real(host, port, *args, **kwargs)
        ips = table[host].pop(0) if len(table[host]) > 1 else table[host][0]
        if not ips:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return [(socket.AF_INET6 if ":" in ip else socket.AF_INET, socket.SOCK_STREAM, 6, "", (ip, port)) for ip in ips]

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    return table, lookups


@pytest.fixture
def no_connect(monkeypatch):
    """Fail the test if anything opens a TCP connection."""
    def forbidden(*args, **kwargs):
        raise AssertionError("the fetcher tried to connect")

    monkeypatch.setattr(socket, "create_connection", forbidden)
    monkeypatch.setattr(socket.socket, "connect", forbidden)


def refusal(fetcher: PageFetcher, url: str) -> str:
    with pytest.raises(Refused) as info:
        fetcher.fetch(url)
    return str(info.value)


@pytest.mark.parametrize(("url", "expected"), [
    *[(url, "only http:// and https:// URLs can be opened") for url in (
        "file:///etc/passwd", "ftp://example.com/x", "gopher://example.com/", "data:text/html,<b>hi</b>",
        "javascript:alert(1)", "example.com/page", "//example.com/page")],
    ("http://user:pass@example.com/", "user name or password"), ("https://user@example.com/", "user name or password"),
])
def test_only_plain_http_urls(url, expected, no_connect):
    assert expected in refusal(PageFetcher(), url)


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "2130706433", "0x7f.1", "127.1", "[::ffff:127.0.0.1]", "[::1]"])
def test_loopback_spellings_are_refused_without_connecting(listener, host):
    message = refusal(PageFetcher(), f"http://{host}:{listener.port}/")
    assert "loopback address (only public web addresses can be opened)" in message
    assert listener.connections() == 0


@pytest.mark.parametrize(("url", "reason"), [
    ("http://10.1.2.3/", "a private"), ("http://192.168.0.1/", "a private"), ("http://172.16.5.4/", "a private"),
    ("http://169.254.169.254/latest/meta-data/", "a cloud metadata"), ("http://100.100.100.200/", "a cloud metadata"),
    ("http://[fd00:ec2::254]/", "a cloud metadata"), ("http://100.64.0.1/", "a shared (carrier-grade NAT)"),
    ("http://169.254.1.1/", "a link-local"), ("http://[fe80::1]/", "a link-local"), ("http://[fc00::1]/", "a private"),
    ("http://0.0.0.0/", "the unspecified"), ("http://[::]/", "the unspecified"), ("http://224.0.0.1/", "a multicast"),
    ("http://240.0.0.1/", "a reserved"), ("http://[::ffff:10.0.0.1]/", "a private"), ("http://[2002:c0a8:1::]/", "a private"),
    ("http://[64:ff9b::a9fe:a9fe]/", "a cloud metadata"), ("http://[::192.168.1.1]/", "a private"),
])
def test_non_public_addresses_are_refused_without_connecting(url, reason, no_connect):
    assert f"is {reason} address (only public web addresses can be opened)" in refusal(PageFetcher(), url)


def test_names_are_checked_by_every_address_they_resolve_to(listener, fake_dns, no_connect):
    table, _ = fake_dns
    table.update({"evil.example": [["127.0.0.1"]], "mixed.example": [["93.184.216.34", "10.0.0.5"]], "nowhere.example": [[]]})
    assert refusal(PageFetcher(), f"http://evil.example:{listener.port}/") == \
        "refused: evil.example (127.0.0.1) is a loopback address (only public web addresses can be opened)"
    assert "mixed.example (10.0.0.5) is a private address" in refusal(PageFetcher(), "http://mixed.example/")
    assert refusal(PageFetcher(), "http://nowhere.example/x") == \
        "could not open http://nowhere.example/x: the host name nowhere.example does not resolve"
    assert listener.connections() == 0


def test_allowed_origin_is_fetched_and_boilerplate_dropped(site):
    page = PageFetcher(allowed_origins=[site.origin]).fetch(site.origin + "/article")
    assert page == Page(url=site.origin + "/article", status=200, content_type="text/html", text=page.text)
    assert "The Great Otter Migration" in page.text and "peaks in late April" in page.text
    assert "<p>" not in page.text and "tracking" not in page.text and "All rights reserved" not in page.text


def test_only_the_exact_allowed_origin_is_exempt(site, listener):
    fetcher = PageFetcher(allowed_origins=[site.origin, "https://Example.com:443"])
    assert fetcher.allowed_origins == {("http", "127.0.0.1", site.server_address[1]), ("https", "example.com", 443)}
    other_port, other_scheme = f"http://127.0.0.1:{listener.port}/", site.origin.replace("http:", "https:")
    for url in (other_port, other_scheme, site.origin.replace("127.0.0.1", "localhost")):
        assert "loopback" in refusal(fetcher, url)
    assert listener.connections() == 0 and site.seen == []


def test_connection_goes_to_the_address_that_was_checked(site, fake_dns):
    """DNS rebinding: the first answer is checked and used; a later, different one is never asked for."""
    port = site.server_address[1]
    fake_dns[0]["rebind.example"] = [["127.0.0.1"], ["10.0.0.1"]]
    page = PageFetcher(allowed_origins=[f"http://rebind.example:{port}"]).fetch(f"http://rebind.example:{port}/article")
    assert "Otter" in page.text and page.url == f"http://rebind.example:{port}/article"
    assert fake_dns[1].count("rebind.example") == 1
    assert site.seen == [("/article", f"rebind.example:{port}")]  # the real name still goes in the Host header


def test_redirects_within_the_allowed_origin_are_followed(site):
    page = PageFetcher(allowed_origins=[site.origin]).fetch(site.origin + "/to-article")
    assert page.url == site.origin + "/article" and "Otter" in page.text


def test_redirect_to_another_loopback_port_is_refused_without_connecting(site, listener):
    message = refusal(PageFetcher(allowed_origins=[site.origin]), site.origin + "/to-listener")
    assert message == "refused: 127.0.0.1 is a loopback address (only public web addresses can be opened)"
    assert listener.connections() == 0


def test_redirect_loop_stops_after_max_redirects(site):
    fetcher = PageFetcher(allowed_origins=[site.origin], max_redirects=3)
    assert refusal(fetcher, site.origin + "/loop") == f"refused: {site.origin}/loop redirects more than 3 times"
    assert len(site.seen) == 4  # the first request and three redirects


@pytest.mark.parametrize(("path", "knobs", "expected"), [
    ("/to-file", {}, "not a file: URL"),
    ("/big", {"max_bytes": 1000}, "is larger than 1,000 bytes"),
    ("/endless", {"max_bytes": 10_000}, "is larger than 10,000 bytes"),
    ("/drip-body", {"timeout_s": 1}, "did not answer within 1 s"),
    ("/drip-head", {"timeout_s": 1}, "did not answer within 1 s"),
    ("/pdf", {}, "/pdf is application/pdf, not a web page"),
    ("/nope", {}, "HTTP 404 from http://127.0.0.1:"),
    ("/boom", {}, "HTTP 500 from http://127.0.0.1:"),
])
def test_bad_pages_are_refused_promptly(site, path, knobs, expected):
    started = time.monotonic()
    assert expected in refusal(PageFetcher(allowed_origins=[site.origin], **knobs), site.origin + path)
    assert time.monotonic() - started < 1.6


def test_connection_refused_is_a_refusal(listener):
    listener.sock.close()  # nothing listens there any more
    origin = f"http://127.0.0.1:{listener.port}"
    assert refusal(PageFetcher(allowed_origins=[origin]), origin + "/").startswith(f"could not open {origin}/: ")


@pytest.mark.parametrize(("path", "content_type", "expected"), [
    ("/plain", "text/plain", "line one\n  line two\n"),
    ("/untyped", "text/html", "Otter Migration"),
    ("/latin1", "text/html", "Un café à Paris, s'il vous plaît."),
    ("/utf8", "text/html", "Naïve café in 東京 — 5 €."),
])
def test_text_types_and_charsets(site, path, content_type, expected):
    page = PageFetcher(allowed_origins=[site.origin]).fetch(site.origin + path)
    assert page.content_type == content_type and expected in page.text


def test_page_text_keeps_the_article_one_block_per_line():
    lines = page_text(ARTICLE).splitlines()
    assert "The Great Otter Migration" in lines and "Why they move" in lines
    assert not any("Copyright" in line or "tracking" in line for line in lines)


def test_page_text_falls_back_to_the_visible_text():
    html = "<html><head><style>p {color: red}</style><title>Hours</title></head><body>" \
           "<aside>Open 9 to 5<script>var hidden = 1;</script></aside><footer>Ask at the desk</footer></body></html>"
    assert trafilatura.extract(html, favor_recall=True) is None  # nothing "main" on this page
    assert page_text(html) == "Open 9 to 5 Ask at the desk"


def test_page_text_passes_plain_text_through():
    assert page_text("just words, no markup\nsecond line\n") == "just words, no markup\nsecond line"
    assert page_text("<!-- nothing -->") == ""
