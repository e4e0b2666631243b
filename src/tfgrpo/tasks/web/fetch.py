"""Fetch a web page for the agent's `open_page(url)` tool, safely.

The URL is written by a language model, so it is treated as hostile: the tool
must not become a way into the machine's own network (SSRF).  The policy:

* only `http://` and `https://` URLs, without a user name or password;
* the host is resolved once and EVERY address it resolves to must be public:
  loopback, private, link-local, cloud metadata, carrier-grade NAT, multicast,
  reserved and unspecified addresses are refused, also inside IPv6 forms
  (IPv4-mapped, IPv4-compatible, 6to4, NAT64) and in numeric spellings such as
  `2130706433` or `127.1`, which resolve to what they mean;
* the connection goes to the very address that was checked (the URL's host is
  swapped for it; the Host header and TLS server name keep the real name), so a
  second DNS answer cannot redirect it (DNS rebinding);
* origins in `allowed_origins` (scheme, host, port; e.g. the offline site on
  127.0.0.1) skip the address check, and only they do;
* redirects are followed by hand, each hop checked as above before connecting;
* only HTML and plain text, at most `max_bytes`, all within `timeout_s`.

Every refusal and every network or HTTP failure raises `Refused`, whose short
message is meant to be the tool's reply to the agent.
"""

from __future__ import annotations

import contextlib
import ipaddress
import socket
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import charset_normalizer
import httpx
import lxml.html
import trafilatura
from lxml import etree

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

_DEFAULT_PORTS = {"http": 80, "https": 443}
_REDIRECT_STATUSES = {301, 302, 303, 307, 308}
_PAGE_TYPES = {"text/html", "application/xhtml+xml", "text/plain"}
_METADATA = {ipaddress.ip_address(a) for a in ("169.254.169.254", "fd00:ec2::254", "100.100.100.200")}
_SHARED = ipaddress.ip_network("100.64.0.0/10")
_NAT64 = ipaddress.ip_network("64:ff9b::/96")
_INVISIBLE = ("script", "style", "noscript", "template", "svg")


class Refused(Exception):
    """The fetcher will not fetch this URL; str(exc) is a short, clear message meant to be shown to the agent as the tool's reply."""


@dataclass
class Page:
    url: str  # final URL after redirects
    status: int
    content_type: str
    text: str  # the page's main text (extracted), not HTML


class PageFetcher:
    def __init__(self, *, allowed_origins: Iterable[str] = (), max_bytes: int = 2_000_000, timeout_s: float = 15.0,
                 max_redirects: int = 5, user_agent: str = "tfgrpo-web/0.1 (+https://github.com/tfgrpo)"):
        self.allowed_origins = frozenset(_origin(_parse(origin)) for origin in allowed_origins)
        self.max_bytes = max_bytes
        self.timeout_s = timeout_s
        self.max_redirects = max_redirects
        self.user_agent = user_agent

    def fetch(self, url: str) -> Page:
        target = _parse(url)
        client = httpx.Client(trust_env=False, follow_redirects=False, headers={"User-Agent": self.user_agent},
                              limits=httpx.Limits(max_keepalive_connections=0))  # no connection reused across hosts
        with _Deadline(self.timeout_s) as deadline, client:
            for _ in range(self.max_redirects + 1):
                with _network_errors(target, deadline), contextlib.closing(self._send(client, target, deadline)) as response:
                    location = response.headers.get("location") if response.status_code in _REDIRECT_STATUSES else None
                    if not location:
                        return self._page(response, target)
                target = _parse(location, base=target)
        raise Refused(f"refused: {url} redirects more than {self.max_redirects} times")

    def _send(self, client: httpx.Client, url: httpx.URL, deadline: _Deadline) -> httpx.Response:
        address = self._checked_addresses(url)[0]
        if deadline.expired:
            raise Refused(_timed_out(url, deadline))
        extensions = {"trace": deadline.trace}
        if url.scheme == "https":
            extensions["sni_hostname"] = url.host  # TLS checks the certificate against the real name
        request = client.build_request("GET", url.copy_with(host=str(address)), headers={"Host": url.netloc.decode("ascii")},
                                       timeout=deadline.remaining, extensions=extensions)
        return client.send(request, stream=True)

    def _checked_addresses(self, url: httpx.URL) -> list[IPAddress]:
        addresses = _resolve(url)
        if _origin(url) not in self.allowed_origins:
            for address in addresses:
                problem = _non_public(address)
                if problem:
                    where = url.host if url.host == str(address) else f"{url.host} ({address})"
                    raise Refused(f"refused: {where} is {problem} (only public web addresses can be opened)")
        return addresses

    def _page(self, response: httpx.Response, url: httpx.URL) -> Page:
        if response.status_code >= 400:
            raise Refused(f"HTTP {response.status_code} from {url}")
        content_type = response.headers.get("content-type", "").split(";")[0].strip().lower() or "text/html"
        if content_type not in _PAGE_TYPES:
            raise Refused(f"refused: {url} is {content_type}, not a web page (only HTML and plain text can be opened)")
        declared = response.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > self.max_bytes:
            raise Refused(_too_large(url, self.max_bytes))
        body = bytearray()
        for chunk in response.iter_bytes():
            body += chunk
            if len(body) > self.max_bytes:
                raise Refused(_too_large(url, self.max_bytes))
        text = _decode(bytes(body), response.charset_encoding)
        if content_type != "text/plain":
            text = page_text(text, url=str(url))
        return Page(url=str(url), status=response.status_code, content_type=content_type, text=text)


def page_text(html: str, url: str | None = None) -> str:
    """Main text of an HTML page via trafilatura (favour recall; keep headings/paragraph breaks); fall back to the page's full visible text when trafilatura returns nothing (still via lxml/trafilatura, not regexes); plain-text bodies returned as they are.

    The text comes one block (heading, paragraph, list item, table row) per line;
    it is not markdown, whose escaping would mangle names like snake_case.
    """
    if "<" not in html:  # no markup at all: plain text
        return html.strip()
    try:  # as UTF-8 bytes, so that an XML declaration or a <meta charset> cannot confuse lxml
        tree = lxml.html.document_fromstring(html.encode("utf-8"), parser=lxml.html.HTMLParser(encoding="utf-8"))
    except etree.ParserError:  # nothing but comments or whitespace
        return ""
    main = trafilatura.extract(tree, url=url, favor_recall=True, include_tables=True)
    if main:
        return main
    etree.strip_elements(tree, *_INVISIBLE, with_tail=False)
    return trafilatura.html2txt(tree, clean=False)


class _Deadline:
    """The whole fetch's time limit.  Per-read timeouts cannot stop a server that sends a byte a second,
    so at the deadline a timer shuts down the fetch's sockets (known from httpx's `trace` extension)."""

    def __init__(self, seconds: float):
        self.seconds = seconds
        self._end = time.monotonic() + seconds
        self._sockets: list[socket.socket] = []
        self._timer = threading.Timer(seconds, self._expire)
        self._timer.daemon = True

    @property
    def remaining(self) -> float:
        return max(self._end - time.monotonic(), 0.0)

    @property
    def expired(self) -> bool:
        return self.remaining == 0.0

    def trace(self, event: str, info: dict) -> None:
        if event == "connection.connect_tcp.complete":  # a duplicate survives the TLS wrapper taking the original over
            self._sockets.append(info["return_value"].get_extra_info("socket").dup())
            if self.expired:  # connected just after the timer went off
                self._expire()

    def _expire(self) -> None:
        for sock in self._sockets:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def __enter__(self) -> _Deadline:
        self._timer.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._timer.cancel()
        self._timer.join()
        for sock in self._sockets:
            sock.close()


@contextlib.contextmanager
def _network_errors(url: httpx.URL, deadline: _Deadline) -> Iterator[None]:
    """Turn httpx's failures into a `Refused` that says what happened."""
    try:
        yield
    except httpx.HTTPError as exc:
        if deadline.expired or isinstance(exc, httpx.TimeoutException):
            raise Refused(_timed_out(url, deadline)) from None
        raise Refused(f"could not open {url}: {str(exc) or type(exc).__name__}") from None


def _parse(url: str, *, base: httpx.URL | None = None) -> httpx.URL:
    try:
        parsed = base.join(url) if base is not None else httpx.URL(str(url).strip())
    except (httpx.InvalidURL, TypeError, ValueError):
        raise Refused("refused: not a valid URL") from None
    if parsed.scheme not in _DEFAULT_PORTS:
        got = f"a {parsed.scheme}: URL" if parsed.scheme else "a URL without a scheme"
        raise Refused(f"refused: only http:// and https:// URLs can be opened, not {got}")
    if parsed.userinfo:
        raise Refused("refused: URLs with a user name or password cannot be opened")
    if not parsed.host:
        raise Refused(f"refused: {url} has no host")
    return parsed


def _origin(url: httpx.URL) -> tuple[str, str, int]:
    return url.scheme, url.host, url.port or _DEFAULT_PORTS[url.scheme]


def _resolve(url: httpx.URL) -> list[IPAddress]:
    _, host, port = _origin(url)
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        raise Refused(f"could not open {url}: the host name {host} does not resolve") from None
    return list(dict.fromkeys(ipaddress.ip_address(info[4][0]) for info in infos))


def _non_public(address: IPAddress) -> str | None:
    """Why `address` is not a public internet address, or None when it is."""
    if address.version == 6 and (address.ipv4_mapped or address.sixtofour):
        address = address.ipv4_mapped or address.sixtofour
    elif address.version == 6 and (address in _NAT64 or 1 < int(address) < 2**32):  # 64:ff9b::a.b.c.d, ::a.b.c.d
        address = ipaddress.IPv4Address(int(address) & 0xFFFF_FFFF)
    checks = (
        (address in _METADATA, "a cloud metadata address"),
        (address.is_unspecified, "the unspecified address"),
        (address.is_loopback, "a loopback address"),
        (address.is_link_local, "a link-local address"),
        (address.is_multicast, "a multicast address"),
        (address in _SHARED, "a shared (carrier-grade NAT) address"),
        (address.is_reserved, "a reserved address"),
        (address.is_private, "a private address"),
        (not address.is_global, "a non-public address"),
    )
    return next((reason for failed, reason in checks if failed), None)


def _decode(body: bytes, charset: str | None) -> str:
    """The body as text: the declared charset, else UTF-8, else charset_normalizer's best guess."""
    if charset:
        with contextlib.suppress(LookupError):
            return body.decode(charset, errors="replace")
    with contextlib.suppress(UnicodeDecodeError):
        return body.decode("utf-8-sig")
    guess = charset_normalizer.from_bytes(body).best()
    return str(guess) if guess is not None else body.decode("utf-8", errors="replace")


def _timed_out(url: httpx.URL, deadline: _Deadline) -> str:
    return f"timed out: {url} did not answer within {deadline.seconds:g} s"


def _too_large(url: httpx.URL, max_bytes: int) -> str:
    return f"refused: {url} is larger than {max_bytes:,} bytes"
