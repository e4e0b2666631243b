"""The deterministic "model" behind the fake LM server: the reply values for one request.

Student calls ("What is A + B?") are right or wrong by a hash of the request and a seed; the learning calls
(told apart by `prompts.kind_of`) get short, well-formed replies built from the prompt: a summary, 1-2
add/modify operations on IDs listed in the prompt, a plan echoing the proposals (with a merge once the library
is large), a best-vs-worst rule for the contrast path, its rewrite, and tips for the direct baseline. Where a learning
call lists the program's predictors, each lesson names one of them (or "all") by a hash.
"""

from __future__ import annotations

import hashlib
import json
import re

from tfgrpo.testing.prompts import field_values

_HINTS = ["add the ones digits first and carry", "estimate the size of the sum before adding",
          "check the result by subtracting one term", "write both numbers aligned by place value",
          "recount the tens after carrying", "restate the question before answering",
          "answer with the number only", "verify the last digit of the sum"]

_GAME24_SEARCH = """import itertools
numbers = {numbers}
for a, b, c, d in itertools.permutations(numbers):
    for p, q, r in itertools.product("+-*/", repeat=3):
        for e in (f"(({{a}}{{p}}{{b}}){{q}}{{c}}){{r}}{{d}}", f"({{a}}{{p}}{{b}}){{q}}({{c}}{{r}}{{d}})",
                  f"({{a}}{{p}}({{b}}{{q}}{{c}})){{r}}{{d}}", f"{{a}}{{p}}(({{b}}{{q}}{{c}}){{r}}{{d}})",
                  f"{{a}}{{p}}({{b}}{{q}}({{c}}{{r}}{{d}}))"):
            try:
                if abs(eval(e) - 24) < 1e-9:
                    print(e)
                    raise SystemExit
            except ZeroDivisionError:
                pass
"""


def hash_unit(*parts) -> float:
    """A number in [0, 1) fixed by `parts`."""
    raw = hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).digest()
    return int.from_bytes(raw[:8], "big") / 2**64


class Responder:
    """The deterministic "model": the reply values for one request."""

    def __init__(self, seed=0, correct_rate=0.5, tool_turns=0, vary_identical=True, merge_at=6):
        self.seed, self.correct_rate, self.tool_turns = seed, correct_rate, tool_turns
        self.vary_identical, self.merge_at = vary_identical, merge_at

    def values(self, kind, fields, system, user, digest, seen, invent=False):
        if kind == "student":
            return self._student(fields, system, user, digest, seen)
        inputs = field_values(user)
        values = {f: "The better attempts checked the carry; the worse ones skipped it." for f in fields}
        if kind == "summary":
            good = "judged correct" in inputs.get("outcome", "")
            values["summary"] = "1. Read the question. 2. Added the two numbers. 3. " + (
                "Checked the sum and answered." if good else "Dropped a carry and answered wrongly.")
            return values
        if kind in ("contrast", "rewrite", "direct"):
            return {**values, **self._small_learner(kind, fields, inputs)}
        ids = re.findall(r"^\[(E\d+)\]", inputs.get("experiences", ""), flags=re.MULTILINE)
        ops = self._advantage(inputs, ids) if kind == "advantage" else self._plan(inputs, ids)
        if kind == "advantage" and (names := _predictors(inputs)):  # a program of several predictors: each op placed
            for op in ops:
                op["predictors"] = [self._place(names, inputs.get("task_input", ""), op["text"])]
        if invent:  # IDs that were never issued
            ops = [{"action": "modify", "ids": ["E999"], "text": "When unsure, guess a round number."},
                   {"action": "delete", "ids": ["E777"]}, {"action": "merge", "ids": ["E1", "E888"], "text": "When adding, be careful."}]
        values["operations" if kind == "advantage" else "plan"] = ops
        return values

    def _student(self, fields, system, user, digest, seen):
        nums = re.findall(r"What is (-?\d+) \+ (-?\d+)\?", user)
        total = int(nums[-1][0]) + int(nums[-1][1]) if nums else 0
        right = hash_unit(self.seed, "right", digest, seen if self.vary_identical else 0) < self.correct_rate
        values = {f: "Adding the two numbers step by step." for f in fields}
        if "answer" in values:
            values["answer"] = str(total if right else total + 1)
        if "next_tool_name" in values:  # ReAct: `tool_turns` tool calls, then finish
            done = len(re.findall(r"\[\[ ## tool_name_\d+ ## \]\]", user))
            tools = re.findall(r"\(\d+\) (\w+), whose description.*?It takes arguments (\{.*?\})\.\s*$", system, flags=re.MULTILINE)
            tool = next(((n, a) for n, a in tools if n != "finish"), None)
            if done < self.tool_turns and tool:
                args = {name: int(nums[-1][i % 2]) if nums and typ in ("integer", "number") else "x"
                        for i, (name, typ) in enumerate(re.findall(r"'(\w+)': \{'type': '(\w+)'", tool[1]))}
                values.update(next_thought=f"Call {tool[0]}.", next_tool_name=tool[0], next_tool_args=args)
            else:
                values.update(next_thought="Done.", next_tool_name="finish", next_tool_args={})
        if "action" in values:  # the web task's step agent: `tool_turns` searches for the question, then an answer
            if user.count("[turn ") < self.tool_turns:
                values.update(action="search", argument=field_values(user).get("question", "x"))
            else:
                values.update(action="answer", argument="yes" if right else "no")
        if "verdict" in values:  # an LLM judge
            values.update(reason="Compared with the reference.", verdict="correct" if right else "incorrect")
        if "code" in values:  # the Game of 24 student: a program that searches, or one that prints a wrong sum
            puzzle = [int(n) for n in re.findall(r"\d+", field_values(user).get("numbers", ""))]
            values["code"] = _GAME24_SEARCH.format(numbers=puzzle) if right else f"print({' + '.join(map(str, puzzle))!r})"
        return values

    def _advantage(self, inputs, ids):
        key = inputs.get("task_input", "")
        ops = [{"action": "add", "ids": [], "text": f"When adding two numbers, {_HINTS[int(hash_unit(self.seed, 'hint', key) * 8)]}."}]
        if ids and hash_unit(self.seed, "two", key, ids) < 0.5:
            target = ids[int(hash_unit(self.seed, "target", key) * len(ids))]
            n = int(hash_unit(self.seed, "rev", key, ids) * 1000)
            ops.append({"action": "modify", "ids": [target],
                        "text": f"When a sum looks easy, {_HINTS[n % 8]} and double-check (revision {n})."})
        return ops

    def _place(self, names, *key):
        """The predictor a lesson is for: one of `names` by a hash of `key`, or "all" one time in four."""
        n = int(hash_unit(self.seed, "place", *key) * 4 * len(names))
        return names[n % len(names)] if n < 3 * len(names) else "all"

    def _small_learner(self, kind, fields, inputs):
        """The contrast path's calls (one rule per best-vs-worst pair, and its rewrite) and the direct baseline."""
        key = inputs.get("task", "") or inputs.get("rule", "")
        hint = _HINTS[int(hash_unit(self.seed, kind, key) * len(_HINTS))]
        if kind == "direct":
            return {"experiences": [f"When adding two numbers, {h}." for h in _HINTS]}
        if kind == "rewrite":
            return {"general_rule": f"When adding two numbers, {hint}."}
        values = {"difference": "The better attempt carried the ones digit; the worse one dropped it.",
                  "action": "add", "rule": f"When adding two numbers, {hint}."}
        if "target_id" in fields:
            values["target_id"] = "none"
        if "predictor" in fields:
            values["predictor"] = self._place(_predictors(inputs), key, hint)
        return values

    def _plan(self, inputs, ids):
        try:
            proposals = json.loads(inputs.get("proposals", "[]"))
        except ValueError:
            proposals = []
        plan, seen = [], set()
        if len(ids) >= self.merge_at:
            plan.append({"action": "merge", "ids": ids[:2], "text": f"When adding, {_HINTS[len(ids) % 8]} and re-add to confirm."})
        for p in proposals if isinstance(proposals, list) else []:
            op = {"action": p.get("action"), "ids": p.get("ids") or [], "text": p.get("text") or "",
                  **({"predictors": p["predictors"]} if p.get("predictors") else {})}
            if (k := json.dumps(op, sort_keys=True)) not in seen:
                seen.add(k)
                plan.append(op)
        return plan


def _predictors(inputs: dict) -> list[str]:
    """The predictor names a learning call lists in its `predictors` input ("name: what it does" a line)."""
    return [line.split(":")[0].strip() for line in inputs.get("predictors", "").splitlines() if ":" in line]
