"""The web task: a ReAct agent with `search` and `open_page` tools, rewarded by an LLM judge or by EM/F1.

Online it searches with Serper, Tavily or Brave; offline with the local site (`python -m tfgrpo.tasks.web.site`)
over a shipped HotpotQA corpus. `open_page` refuses every address that is not on the public web (and the
configured local site), so model-written URLs cannot reach the machine's own services.
"""

from tfgrpo.tasks.web.datasets import BUILTIN, load_web
from tfgrpo.tasks.web.fetch import Page, PageFetcher, Refused, page_text
from tfgrpo.tasks.web.reward import (JudgeError, LLMJudge, em_metric, exact_match, f1_metric, judge_metric,
                                     normalize_answer, token_f1)
from tfgrpo.tasks.web.agent import AnswerQuestion, StepAgent, WebStep, react_agent
from tfgrpo.tasks.web.tools import WebTools

_safe_fetcher = PageFetcher()  # public web only: no loopback, private, link-local or metadata address


def open_page(url: str, goal: str = "") -> str:
    """Open a web page (public web addresses only) and read its main text, cut to 3000 characters. `goal` is
    accepted for the agent's sake; without a page LM (see `WebTools`) the whole text comes back."""
    return WebTools(None, fetcher=_safe_fetcher).open_page(url, goal)


__all__ = ["BUILTIN", "AnswerQuestion", "JudgeError", "LLMJudge", "Page", "PageFetcher", "Refused", "StepAgent",
           "WebStep", "WebTools", "em_metric", "exact_match", "f1_metric", "judge_metric", "load_web",
           "normalize_answer", "open_page", "page_text", "react_agent", "token_f1"]
