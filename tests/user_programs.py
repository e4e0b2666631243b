"""Programs a DSPy user writes, with DSPy's own modules and typed signatures, and a scripted student for them: the
conformance tests compile each one. Nothing here imports tfgrpo, so that a fresh process can load a saved program
in stock DSPy."""

from __future__ import annotations

import datetime
import enum
import hashlib
import json
import os

import dspy
import pydantic


class Color(enum.Enum):
    RED = "red"
    BLUE = "blue"


class Item(pydantic.BaseModel):
    name: str
    count: int


class Typed(dspy.Signature):
    """Describe the thing asked about."""

    question: str = dspy.InputField()
    color: Color = dspy.OutputField()
    things: list[Item] = dspy.OutputField()
    pair: tuple[int, int] = dspy.OutputField()
    day: datetime.date = dspy.OutputField()


class Chat(dspy.Signature):
    """Answer the question, given the conversation so far."""

    question: str = dspy.InputField()
    history: dspy.History = dspy.InputField()
    answer: str = dspy.OutputField()


RIGHT = {"color": "red", "things": [{"name": "apple", "count": 2}], "pair": [1, 2], "day": "2024-01-02",
         "answer": "yes"}
WRONG = {"color": "blue", "things": [{"name": "pear", "count": 1}], "pair": [2, 1], "day": "2023-05-06",
         "answer": "no"}
OTHER = {"reasoning": "Thinking it over.", "next_thought": "I know it.", "next_tool_name": "finish",
         "next_tool_args": {}, "discussion": "It went wrong.", "advice": {}}


def right(pred) -> bool:
    """What the metric calls right: RED, or the answer yes."""
    if isinstance(pred, dspy.Prediction):
        return pred.get("color") == Color.RED or pred.get("answer") == "yes"
    return pred == "yes"


def student(fields: list[str], user: str, kwargs: dict) -> dict:
    """The student's reply: right or wrong by a hash of the request and its rollout ID (so a group has contrast)."""
    roll = hashlib.sha256(f"{user}|{kwargs.get('rollout_id')}|{kwargs.get('temperature')}".encode()).digest()[0]
    values = RIGHT if roll % 2 else WRONG
    reply = {}
    for name in fields:
        value = values.get(name, OTHER.get(name, "ok"))
        reply[name] = value if isinstance(value, str) else json.dumps(value)
    return reply


def lookup(name: str) -> str:
    """Look a name up."""
    return f"{name} is red"


class AnswerOrNone(dspy.Module):
    """A program that returns None when its predictor says no (as dspy.BestOfN does when every try fails)."""

    def __init__(self):
        super().__init__()
        self.ask = dspy.Predict("question -> answer")

    def forward(self, question):
        pred = self.ask(question=question)
        return pred if pred.answer == "yes" else None


class AnswerText(dspy.Module):
    """A program whose forward returns a string, not a Prediction."""

    def __init__(self):
        super().__init__()
        self.ask = dspy.Predict("question -> answer")

    def forward(self, question):
        return self.ask(question=question).answer


class Compared(dspy.Module):
    """Two attempts of a ChainOfThought, compared by dspy.MultiChainComparison."""

    def __init__(self):
        super().__init__()
        self.attempt = dspy.ChainOfThought("question -> answer")
        self.compare = dspy.MultiChainComparison("question -> answer", M=2)

    def forward(self, question):
        completions = [self.attempt(question=question, config={"rollout_id": i}) for i in range(2)]
        return self.compare(completions=completions, question=question)


class TwoAtOnce(dspy.Module):
    """Two predictors run side by side with dspy.Parallel; the second's answer is returned."""

    def __init__(self):
        super().__init__()
        self.first = dspy.Predict("question -> answer")
        self.second = dspy.Predict("question -> answer")
        self.parallel = dspy.Parallel(num_threads=2)

    def forward(self, question):
        first, second = self.parallel([(self.first, {"question": question}), (self.second, {"question": question})])
        return second


class Several(dspy.Module):
    """One predictor asked for three completions (`n=3`): the metric gets all three."""

    def __init__(self):
        super().__init__()
        self.ask = dspy.Predict("question -> answer", n=3)

    def forward(self, question):
        return self.ask(question=question)


class Voted(dspy.Module):
    """Two answers of one predictor, returned as `dspy.Prediction.from_completions`."""

    def __init__(self):
        super().__init__()
        self.ask = dspy.Predict("question -> answer")

    def forward(self, question):
        rollout = (self.ask.lm or dspy.settings.lm).kwargs.get("rollout_id")
        answers = [self.ask(question=question, config={"rollout_id": f"{rollout}-{i}"}) for i in range(2)]
        return dspy.Prediction.from_completions([{"answer": a.answer} for a in answers])


class Dynamic(dspy.Module):
    """A predictor built inside forward (on the configured LM), beside a static one that answers."""

    def __init__(self):
        super().__init__()
        self.answer = dspy.Predict("question, hint -> answer")

    def forward(self, question):
        hint = dspy.Predict("question -> hint")(question=question).hint
        return self.answer(question=question, hint=hint)


class WithFile(dspy.Module):
    """A prediction that holds an open file (a log the program writes to): the metric gets it open, unread."""

    def __init__(self):
        super().__init__()
        self.ask = dspy.Predict("question -> answer")

    def forward(self, question):
        pred = self.ask(question=question)
        return dspy.Prediction(answer=pred.answer, log=open(os.devnull, "w"))  # noqa: SIM115 - the metric closes it


class WithGenerator(dspy.Module):
    """A prediction that holds a generator (the answer's words, lazily): the metric gets it unconsumed."""

    def __init__(self):
        super().__init__()
        self.ask = dspy.Predict("question -> answer")

    def forward(self, question):
        pred = self.ask(question=question)
        return dspy.Prediction(answer=pred.answer, words=(w for w in pred.answer.split()))


class Approach(dspy.Signature):
    """Say how to work out the sum."""

    question: str = dspy.InputField()
    approach: str = dspy.OutputField()


class Check(dspy.Signature):
    """Check the answer to the question."""

    question: str = dspy.InputField()
    answer: int = dspy.InputField()
    correct: bool = dspy.OutputField()


class Pipeline(dspy.Module):
    """Three predictors, each a step of its own: a plan, a solver (ChainOfThought) and a typed check."""

    def __init__(self):
        super().__init__()
        self.plan = dspy.Predict(Approach)
        self.solve = dspy.ChainOfThought("question, approach -> answer: int")
        self.check = dspy.Predict(Check)

    def forward(self, question):
        approach = self.plan(question=question).approach
        answer = self.solve(question=question, approach=approach).answer
        return dspy.Prediction(answer=answer, correct=self.check(question=question, answer=answer).correct)


def reward(args, pred) -> float:
    return 1.0 if right(pred) else 0.0


PROGRAMS = {
    "predict_typed": lambda: dspy.Predict(Typed),
    "chain_of_thought_typed": lambda: dspy.ChainOfThought(Typed),
    "history": lambda: dspy.Predict(Chat),
    "best_of_n": lambda: dspy.BestOfN(dspy.Predict(Typed), N=2, reward_fn=reward, threshold=1.0),
    "refine": lambda: dspy.Refine(dspy.Predict("question -> answer"), N=2, reward_fn=reward, threshold=1.0),
    "react": lambda: dspy.ReAct("question -> answer", tools=[lookup], max_iters=2),
    "multi_chain_comparison": Compared,
    "parallel": TwoAtOnce,
    "returns_none": AnswerOrNone,
    "returns_text": AnswerText,
    "several_completions": Several,
    "from_completions": Voted,
    "predictor_in_forward": Dynamic,
    "holds_a_file": WithFile,
    "holds_a_generator": WithGenerator,
}


def example(i: int, name: str) -> dspy.Example:
    if name == "history":
        history = dspy.History(messages=[{"question": f"Was thing {i} there?", "answer": "It was."}])
        return dspy.Example(question=f"Is thing {i} red?", history=history).with_inputs("question", "history")
    return dspy.Example(question=f"Is thing {i} red?").with_inputs("question")


def learned(program: dspy.Module) -> dict:
    """What a program carries, per predictor: its instructions and demos, as plain JSON."""
    return {name: {"instructions": p.signature.instructions,
                   "demos": json.loads(json.dumps([dict(d) for d in p.demos], sort_keys=True, default=str))}
            for name, p in program.named_predictors()}
