"""Experiences where they belong, over a long compile: each predictor's library tokens step by step, with and without
`max_library_tokens`, and the prompt tokens a call pays with the placed library against the whole library in every
predictor.

    .venv/bin/python -m benchmarks.library_budget --steps 40 --budget 96 --plot docs/assets/library-tokens.png

A three-predictor program (a plan, a ChainOfThought solver, a check: all plain text fields) compiles on the fake LM
server (`tfgrpo.testing.FakeLMServer`, started here), whose learning calls add a lesson every step and place each on
one predictor, or on "all" one time in four (and never merge): twice on the same training queries, without a cap
(`placed`) and with `--budget` tokens (`budget`). Tokens are counted as plan() counts them for this model (the
fake server has no tokenizer: LiteLLM's estimate). Then each learned library, placed as learned and written whole
into every predictor (the layout before placement), answers the same held-out queries, and the server counts the
prompt tokens of each call. The fake model does not read its prompt, so scores say nothing here and are not printed.

Prints one line per step and arm, `library_budget step=N arm=A plan=T solve=T check=T retired=R`, then per arm
`library_budget arm=A steps=N max_tokens=T retired=R experiences=K` and per layout
`library_budget layout=L arm=A prompt_tokens_per_call=X calls=N`.
"""

from __future__ import annotations

import argparse
import json
import logging
import tempfile
from pathlib import Path

import benchmarks  # noqa: F401  (before dspy: LiteLLM's bundled price map, no fetch)
import dspy

from tfgrpo.optimizers import TrainingFreeGRPO
from tfgrpo.optimizers.spend import token_counter
from tfgrpo.programs import ExperienceLibrary, apply_library
from tfgrpo.testing import FakeLMServer


class Pipeline(dspy.Module):
    def __init__(self):
        super().__init__()
        self.plan = dspy.Predict("question -> approach")
        self.solve = dspy.ChainOfThought("question, approach -> answer")
        self.check = dspy.Predict("question, answer -> critique")

    def forward(self, question):
        approach = self.plan(question=question).approach
        answer = self.solve(question=question, approach=approach).answer
        return dspy.Prediction(answer=answer, critique=self.check(question=question, answer=answer).critique)


NAMES = ["plan", "solve.predict", "check"]


def sums(first: int, n: int) -> list[dspy.Example]:
    return [dspy.Example(question=f"What is {i} + {2 * i + 7}?", answer=str(3 * i + 7)).with_inputs("question")
            for i in range(first, first + n)]


def metric(example, pred, trace=None) -> float:
    return float(str(pred.answer).strip() == example.answer)


def compile_arm(lm: dspy.LM, log_dir: Path, steps: int, budget: int | None) -> dspy.Module:
    dspy.configure(lm=lm)
    optimizer = TrainingFreeGRPO(metric, auto=None, num_generations=4, batch_size=2, num_train_epochs=steps // 10,
                                 num_threads=4, max_library_tokens=budget, log_dir=str(log_dir),
                                 progress=lambda *_: None)  # (no bars)
    return optimizer.compile(Pipeline(), trainset=sums(0, 20))


def per_step(log_dir: Path, count) -> list[dict]:
    """Each step's libraries in tokens by predictor, and its retirements, from the finished steps in `log_dir`."""
    rows = []
    for path in sorted((log_dir / "steps").glob("[0-9]*.json")):
        step = json.loads(path.read_text())
        library = ExperienceLibrary.from_state(step["library"])
        rows.append({"step": int(path.stem), **{n: count(library.for_predictor(n).render()) for n in NAMES},
                     "retired": len(step["stats"]["details"].get("retired", []))})
    return rows


def prompt_tokens(server: FakeLMServer, lm: dspy.LM, program: dspy.Module, held_out: list) -> tuple[float, int]:
    """Prompt tokens per call of `program` on `held_out`, as the server counted them, and the calls."""
    server.reset_stats()
    with dspy.context(lm=lm):
        for example in held_out:
            program(**example.inputs())
    student = server.stats()["kinds"]["student"]
    return student["prompt_tokens"] / max(student["calls"], 1), student["calls"]


def everywhere(program: dspy.Module) -> dspy.Module:
    """The program with its whole library in every predictor: each experience for every one."""
    library = program.experience_library.copy()
    for exp in library:
        exp.predictors = []
    return apply_library(program.deepcopy(), library)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=40, help="steps of each compile (a multiple of 10)")
    ap.add_argument("--budget", type=int, default=96, help="max_library_tokens of the capped arm")
    ap.add_argument("--held-out", type=int, default=10, help="held-out queries each layout answers")
    ap.add_argument("--plot", default=None, help="write a plot of the library tokens per step here (PNG)")
    args = ap.parse_args()
    logging.getLogger("tfgrpo").setLevel(logging.ERROR)
    held_out = sums(100, args.held_out)
    with FakeLMServer(merge_at=10**6) as server, tempfile.TemporaryDirectory() as tmp:
        lm = server.lm(cache=False)
        count = token_counter(lm)[0]
        arms, rows = {}, {}
        for arm, budget in (("placed", None), ("budget", args.budget)):
            arms[arm] = compile_arm(lm, Path(tmp) / arm, args.steps, budget)
            rows[arm] = per_step(Path(tmp) / arm, count)
            for r in rows[arm]:
                print(f"library_budget step={r['step']} arm={arm} " + " ".join(
                    f"{n.split('.')[0]}={r[n]}" for n in NAMES) + f" retired={r['retired']}")
        for arm, steps in rows.items():
            print(f"library_budget arm={arm} steps={len(steps)} max_tokens={max(r[n] for r in steps for n in NAMES)} "
                  f"retired={sum(r['retired'] for r in steps)} experiences={len(arms[arm].experience_library)}")
        for arm, program in arms.items():
            for layout, shown in (("placed", program), ("everywhere", everywhere(program))):
                tokens, calls = prompt_tokens(server, lm, shown, held_out)
                print(f"library_budget layout={layout} arm={arm} prompt_tokens_per_call={tokens:.1f} calls={calls}")
    if args.plot:
        plot(rows, args.budget, Path(args.plot))


def plot(rows: dict, budget: int, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.6))
    for arm, style in (("placed", "--"), ("budget", "-")):
        for name in NAMES:
            ax.plot([r["step"] for r in rows[arm]], [r[name] for r in rows[arm]], style,
                    label=f"{name.split('.')[0]} ({'no cap' if arm == 'placed' else f'max_library_tokens={budget}'})")
    ax.axhline(budget, color="grey", linewidth=0.8)
    ax.set_xlabel("step")
    ax.set_ylabel("library tokens in the predictor")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    print(f"library_budget plot={path}")


if __name__ == "__main__":
    main()
