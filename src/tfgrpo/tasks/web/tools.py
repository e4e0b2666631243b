"""The agent's two tools, `search(query)` and `open_page(url, goal)`, bound to a search backend.

`WebTools` binds the tools to a search backend (`tfgrpo.tasks.web.search`) and a safe page fetcher
(`tfgrpo.tasks.web.fetch`). A tool never raises into the agent's loop: a failed search or a refused page comes
back as a short message the model can read and act on. Budgets keep every observation small, because a ReAct
prompt carries all earlier observations and a 1.5B model on a CPU pays for each token of them on every turn.
"""

from __future__ import annotations

import dspy

from tfgrpo.base.util import clip
from tfgrpo.tasks.web.fetch import PageFetcher, Refused
from tfgrpo.tasks.web.search import SearchError, format_results


class PagePassages(dspy.Signature):
    """Copy out the passages of a web page that serve the goal, word for word, most useful first. Copy
    nothing else; if no passage serves the goal, say that the page does not cover it."""

    goal: str = dspy.InputField()
    page: str = dspy.InputField()
    passages: str = dspy.OutputField()


class WebTools:
    """search + open_page over one backend.

    top_k: results per search; snippet_chars / page_chars: what the agent sees of a result / of a page;
    page_lm: with a goal, an LM that keeps only the passages of the page that serve it (None: the page's main
    text, cut to page_chars); fetcher: the page fetcher (default: public web only)."""

    def __init__(self, backend, *, fetcher: PageFetcher | None = None, top_k: int = 5, snippet_chars: int = 300,
                 page_chars: int = 3000, page_lm: dspy.BaseLM | None = None):
        self.backend, self.fetcher = backend, fetcher or PageFetcher()
        self.top_k, self.snippet_chars, self.page_chars, self.page_lm = top_k, snippet_chars, page_chars, page_lm

    def search(self, query: str) -> str:
        """Search the web. Returns the top results, each with its title, URL and a snippet of its text."""
        try:
            return format_results(self.backend.search(query, self.top_k), snippet_chars=self.snippet_chars)
        except SearchError as exc:
            return f"search failed: {exc}"

    def open_page(self, url: str, goal: str = "") -> str:
        """Open a web page (a URL from the search results) and read its text. Give a goal (what you are looking
        for) to get only the passages about it."""
        try:
            page = self.fetcher.fetch(str(url).strip())
        except Refused as exc:
            return str(exc)
        text = page.text.strip() or "(the page has no readable text)"
        if goal and self.page_lm is not None:
            with dspy.context(lm=self.page_lm):
                text = str(dspy.Predict(PagePassages)(goal=goal, page=clip(text, 4 * self.page_chars, keep_tail=False)).passages)
        return clip(text, self.page_chars, keep_tail=False)

    def tools(self) -> list:
        return [self.search, self.open_page]


