"""Training-Free GRPO on a model behind an API (DeepSeek here; any LiteLLM provider works the same way), at a known cost.

    export DEEPSEEK_API_KEY=...            # read from the environment, never saved
    python examples/api_model.py           # plan, then compile within the budget, then save to program.json

The program is DeepSeek-V3 (`deepseek-chat`); the learning calls go to DeepSeek's reasoning model, a stronger
reflection LM. `plan()` says what the compile will spend before anything is sent; `max_cost` is charged before every
call, so the run stops within it (and the same command resumes it with a larger one). `--api-base` points both LMs at
another OpenAI-compatible endpoint (the tests use the provider simulator in `tfgrpo.testing`).
"""

import argparse
import os

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # before dspy: no fetch of litellm's price map
import dspy

from tfgrpo.optimizers import TrainingFreeGRPO
from tfgrpo.programs import save_program


def exact(example, pred, trace=None):  # your metric
    return float(str(pred.answer).strip() == example.answer)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--api-base", help="another OpenAI-compatible endpoint (default: DeepSeek's own)")
    args = parser.parse_args()
    endpoint = {"api_base": args.api_base, "api_key": "x"} if args.api_base else {}

    # -- the API quick start (README, docs/usage.md, docs/api.md) --
    trainset = [  # your data: any list of dspy.Example
        dspy.Example(question=f"What is {i} + {2 * i}?", answer=str(3 * i))
        .with_inputs("question")
        for i in range(20)
    ]
    program = dspy.ChainOfThought("question -> answer")  # your program: any dspy.Module
    dspy.configure(lm=dspy.LM("deepseek/deepseek-chat", **endpoint))  # key: DEEPSEEK_API_KEY
    optimizer = TrainingFreeGRPO(
        exact,
        reflection_lm=dspy.LM("deepseek/deepseek-reasoner", **endpoint),
        max_cost=1.00,  # USD, every call charged before it is sent
        num_threads=16,
        log_dir="runs/api",  # the same call resumes an interrupted run
    )
    plan = optimizer.plan(program, trainset[:12], trainset[12:])
    print(plan.summary())  # calls, tokens and dollars expected
    compiled = optimizer.compile(program, trainset=trainset[:12], valset=trainset[12:])
    save_program(compiled, "program.json")
    # -- end of the quick start --

    print(compiled.detailed_results.usage, compiled.detailed_results.stopped_early)
    print(f"{len(compiled.experience_library)} experiences; saved to program.json (atomically, with no API key)")


if __name__ == "__main__":
    main()
