"""The web agents: `dspy.ReAct` over the two tools, and `StepAgent`, a leaner loop made for small local models.

`StepAgent` asks one predictor per turn for a thought, an action (`search`, `open_page` or `answer`) and one
string argument (the query, the URL, or the final answer). The differences from `dspy.ReAct` are what a 1.5B
model on a CPU needs: no JSON tool arguments to get wrong (the embedded model copies the argument schema into
its arguments), no separate extraction call at the end, a short history instead of the whole trajectory with
tracebacks, and (with `constrained`) decoding under the step's JSON schema, so an unknown action cannot be
written. Its trajectory uses ReAct's keys (`tool_name_0`, ...), so tool calls are counted the same way.
"""

from __future__ import annotations

from typing import Literal

import dspy

from tfgrpo.base.util import clip
from tfgrpo.programs.constrained import ConstrainedJSONAdapter, Mode
from tfgrpo.tasks.web.tools import WebTools


class AnswerQuestion(dspy.Signature):
    """Answer the question with facts found on the web. Search for each person, place or thing the question
    depends on, open a page when the snippets do not settle it, and answer with the shortest phrase that
    answers the question (a name, a date, a number, or yes/no), not a sentence."""

    question: str = dspy.InputField()
    answer: str = dspy.OutputField(desc="a short phrase")


def react_agent(tools: WebTools, *, max_iters: int = 5) -> dspy.ReAct:
    return dspy.ReAct(AnswerQuestion, tools=tools.tools(), max_iters=max_iters)


class WebStep(dspy.Signature):
    """Answer the question with facts found on the web, one action per turn. Actions: "search" (argument: a
    search query), "open_page" (argument: a URL from the search results, to read the whole page), "answer"
    (argument: the final answer, the shortest phrase that answers the question: a name, a date, a number, or
    yes/no). Search for each person, place or thing the question depends on before answering."""

    question: str = dspy.InputField()
    history: str = dspy.InputField(desc="your earlier actions and what they returned")
    thought: str = dspy.OutputField(desc="one short sentence: what you know and what you need next", max_length=200)
    action: Literal["search", "open_page", "answer"] = dspy.OutputField()
    argument: str = dspy.OutputField(desc="the search query, the URL, or the final answer", max_length=200)


NO_HISTORY = "(nothing yet)"
OBSERVATION_CHARS = 1200  # what the history keeps of one tool reply


class StepAgent(dspy.Module):
    def __init__(self, tools: WebTools, *, max_iters: int = 4, constrained: Mode | None = None):
        super().__init__()
        self.tools = tools
        self.max_iters = max_iters  # tool calls before an answer is required
        self.step = dspy.Predict(WebStep)
        self.adapter = ConstrainedJSONAdapter(constrained) if constrained else None

    def forward(self, question: str) -> dspy.Prediction:
        trajectory, history, done = {}, [], {}
        for turn in range(self.max_iters + 1):
            last = turn == self.max_iters
            signature = self.step.signature.with_updated_fields("action", type_=Literal["answer"]) if last else None
            reply = self._call(question, "\n".join(history) or NO_HISTORY, signature)
            action, argument = reply.action, str(reply.argument or "").strip()
            trajectory[f"thought_{turn}"] = str(reply.thought or "")
            if action == "answer":
                trajectory[f"tool_name_{turn}"], trajectory[f"tool_args_{turn}"] = "finish", {}
                return dspy.Prediction(answer=argument, trajectory=trajectory)
            earlier = done.get((action, argument))
            if earlier is not None:  # the same call again: its reply is already in the history
                observation = f"(the same as turn {earlier}: its result is above)"
            else:
                observation = self.tools.search(argument) if action == "search" else self.tools.open_page(argument)
                done[(action, argument)] = turn + 1
            trajectory[f"tool_name_{turn}"], trajectory[f"tool_args_{turn}"] = action, {"argument": argument}
            trajectory[f"observation_{turn}"] = observation
            history.append(f"[turn {turn + 1}] {action}: {argument}\n{clip(observation, OBSERVATION_CHARS, keep_tail=False)}")
        raise AssertionError("unreachable: the last turn can only answer")

    def _call(self, question: str, history: str, signature) -> dspy.Prediction:
        predict = self.step
        if signature is not None:  # the last turn: the same predictor (and learned instructions), only "answer" legal
            predict = dspy.Predict(signature)
            predict.lm, predict.demos = self.step.lm, self.step.demos
        if self.adapter is None:
            return predict(question=question, history=history)
        with dspy.context(adapter=self.adapter):
            return predict(question=question, history=history)
