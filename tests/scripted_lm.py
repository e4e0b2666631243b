"""A scripted LM for tests: its reply is a function of the prompt and the request settings (rollout_id,
temperature), never of call order, so tests stay deterministic under threads."""

from __future__ import annotations

import threading
from typing import Callable

from dspy.clients.engines.dummy_engine import AsyncDummyEngine, DummyEngine
from dspy.lm15 import Message, Response, TextPart, Usage
from dspy.utils.dummies import DummyLM

from tfgrpo.testing import prompts

# respond(messages, kwargs) -> {field: value} (formatted in DSPy's chat format) or a raw string reply
Responder = Callable[[list[dict], dict], "dict | str"]


class _Engine(DummyEngine):
    def _complete_messages(self, messages):
        owner = self.owner
        reply = owner.respond(messages, dict(owner.kwargs))
        text = reply if isinstance(reply, str) else owner._format_answer_fields(reply)
        with owner.lock:
            owner.calls.append({"messages": messages, "kwargs": dict(owner.kwargs), "reply": text})
        words_in = sum(len(m["content"].split()) for m in messages)
        return Response(id=None, model="scripted", message=Message.assistant([TextPart(text)]), finish_reason="stop",
                        usage=Usage(input_tokens=words_in, output_tokens=len(text.split()),
                                    total_tokens=words_in + len(text.split())))


class ScriptedLM(DummyLM):
    def __init__(self, respond: Responder):
        super().__init__([])
        self.respond = respond
        self.calls: list[dict] = []  # shared by all copies: every call made through this LM or its copies
        self.lock = threading.Lock()
        self._set_engine()

    def _set_engine(self):
        self._engine_spec = _Engine(self)
        self._async_engine_spec = AsyncDummyEngine(self._engine_spec)

    def copy(self, **kwargs):
        copied = super().copy(**kwargs)
        copied._set_engine()
        return copied  # calls and lock are shared by reference: one log for the LM and its copies


def system_text(messages: list[dict]) -> str:
    return messages[0]["content"] if messages and messages[0]["role"] == "system" else ""


def output_fields(messages: list[dict]) -> list[str]:
    """The output field names DSPy's chat adapter asks for in the system message."""
    return prompts.output_fields(system_text(messages))


def kind_of(messages: list[dict]) -> str:
    """Which call this is ('student', 'summary', 'advantage', 'consolidation', 'contrast', ...), by the rules
    every fake LM of the project uses (tfgrpo.testing.prompts)."""
    return prompts.kind_of(output_fields(messages))
