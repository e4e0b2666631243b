"""What a compile with an LLM-judge metric reports it spent, against what a billing server charged, and where a
`max_cost` stop lands.

The student, the judge (priced 10x the student) and the reflection model are three models of one `BillingServer`
(a plain chat server of the standard library that bills every call at its model's price; no API is reached): the
student answers "What is A + B?" right or wrong by how often it has seen the request, the judge says whether the
answer is the sum, the learning calls are answered by the fake server's responder. The metric asks the judge through
a `dspy.Predict` with its own LM, as the web task's `LLMJudge` does. For each backend, a run without a budget, then
runs with `max_cost` at each `--shares` of what that run was billed, each on a log_dir of its own and run again on it
`--resumes` times with the same budget (a user's second compile after the stop): the budget must hold over all of them.

    python -m benchmarks.judge_billing [--epochs 4] [--shares 0.4,0.15] [--backends threads,async] [--resumes 4]

It prints one line per run, and one per budget for its resumes:

    judge_billing backend=B max_cost=X|none billed=$X reported=$X (ratio R) judge_calls=N/N stopped=yes|no bill/budget=R overshoot=$X (U units)
    judge_billing_resumes backend=B max_cost=X runs=N billed=$X reported=$X (ratio R) bill/budget=R new_calls=N

where `ratio` is reported over billed (a resumed run reports its whole run: what its log_dir's record holds),
`judge_calls` the judge calls reported over those the server answered, `overshoot` the bill past the budget, in units
of the dearest stage's mean unit price in the unbudgeted run, and `new_calls` the calls the resumes sent.
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import json
import os
import re
import tempfile

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # before dspy: litellm reads its bundled price map
import dspy  # noqa: E402

from tfgrpo.optimizers import TrainingFreeGRPO  # noqa: E402
from tfgrpo.testing.billing import BillingServer, asked_fields, chat_reply  # noqa: E402
from tfgrpo.testing.prompts import kind_of  # noqa: E402
from tfgrpo.testing.responder import Responder  # noqa: E402

PRICES = {"student": {"input": 1.0, "output": 2.0}, "judge": {"input": 10.0, "output": 20.0},
          "reflection": {"input": 3.0, "output": 6.0}}  # USD per million tokens


class Verdict(dspy.Signature):
    """Say whether the answer is the sum the question asks for."""

    question: str = dspy.InputField()
    answer: str = dspy.InputField()
    right: bool = dspy.OutputField()


def respond_with(responder: Responder):
    seen = collections.Counter()

    def respond(body):
        fields, messages = asked_fields(body), body["messages"]
        user = str(messages[-1]["content"])
        if body["model"] == "judge":
            a, b = map(int, re.findall(r"What is (\d+) \+ (\d+)\?", user)[-1])
            answer = user.split("## answer ## ]]")[-1].split("[[")[0].strip()
            return chat_reply({"right": str(answer == str(a + b))})
        if body["model"] == "student":
            key = json.dumps(messages)
            seen[key] += 1
            a, b = map(int, re.findall(r"What is (\d+) \+ (\d+)\?", user)[-1])
            return chat_reply({f: str(a + b) if seen[key] % 2 else str(a + b + 1) if f == "answer" else "Adding."
                               for f in fields})
        system = str(messages[0]["content"])
        digest = hashlib.sha256(json.dumps(messages).encode()).hexdigest()
        values = responder.values(kind_of(fields), fields, system, user, digest, 0)
        return chat_reply({k: v if isinstance(v, str) else json.dumps(v) for k, v in values.items()})

    return respond


def compile_once(server: BillingServer, epochs: int, backend: str, max_cost: float | None, log_dir: str | None = None):
    judge = dspy.Predict(Verdict)
    judge.lm = server.lm("judge", cache=False)

    def metric(example, pred, trace=None):
        return float(judge(question=example.question, answer=pred.answer).right)

    dspy.configure(lm=server.lm("student", cache=False))
    examples = [dspy.Example(question=f"What is {i} + {2 * i + 3}?").with_inputs("question") for i in range(8)]
    optimizer = TrainingFreeGRPO(metric, num_generations=4, batch_size=4, num_train_epochs=epochs, num_threads=4,
                                 learning_path="paper", auto=None, backend=backend, max_cost=max_cost, log_dir=log_dir,
                                 reflection_lm=server.lm("reflection", cache=False),
                                 prices={f"openai/{m}": p for m, p in PRICES.items()})
    return optimizer.compile(dspy.Predict("question -> answer"), trainset=examples[:4], valset=examples[4:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--shares", default="0.4,0.15", help="max_cost as shares of the unbudgeted run's bill")
    parser.add_argument("--backends", default="threads,async")
    parser.add_argument("--resumes", type=int, default=4, help="compiles again on each budgeted run's log_dir")
    args = parser.parse_args()
    for backend in args.backends.split(","):
        whole, unit = None, None  # the unbudgeted run's bill, and its dearest stage's mean unit price
        for share in [None, *map(float, args.shares.split(","))]:
            budget = None if share is None else share * whole
            with BillingServer(respond_with(Responder()), PRICES) as server, tempfile.TemporaryDirectory() as log_dir:
                compiled = compile_once(server, args.epochs, backend, budget, log_dir)
                billed, answered = server.total(), server.calls["judge"]
                sent = sum(server.calls.values())
                for _ in range(args.resumes if budget is not None else 0):
                    again = compile_once(server, args.epochs, backend, budget, log_dir)
                if budget is not None and args.resumes:
                    total = server.total()
                    reported_all = sum(u.get("cost", 0.0) for u in again.detailed_results.run_usage.values())
                    resumes = (f"judge_billing_resumes backend={backend} max_cost={budget:.4f} runs={1 + args.resumes} "
                               f"billed=${total:.4f} reported=${reported_all:.4f} (ratio {reported_all / total:.3f}) "
                               f"bill/budget={total / budget:.3f} new_calls={sum(server.calls.values()) - sent}")
            result = compiled.detailed_results
            reported = sum(u.get("cost", 0.0) for u in result.run_usage.values())
            if share is None:
                whole = billed
                unit = max(u["cost"] / u["calls"] for s in result.steps for u in s.usage.values() if u.get("calls"))
            over = max(billed - budget, 0.0) if budget is not None else 0.0
            print(f"judge_billing backend={backend} max_cost={'none' if budget is None else f'{budget:.4f}'} "
                  f"billed=${billed:.4f} reported=${reported:.4f} (ratio {reported / billed:.3f}) "
                  f"judge_calls={result.run_usage['metric']['calls']}/{answered} "
                  f"stopped={'yes' if result.stopped_early else 'no'} "
                  f"bill/budget={billed / budget if budget else 0:.3f} overshoot=${over:.4f} "
                  f"({over / unit:.2f} units)", flush=True)
            if budget is not None and args.resumes:
                print(resumes, flush=True)

if __name__ == "__main__":
    main()
