"""The API quick start, run offline against the provider simulator (docs/tutorial.md shows what it prints).

    python examples/provider_simulator.py

The simulator is `tfgrpo.testing.FakeLMServer`, an OpenAI-compatible server on 127.0.0.1 that bills as DeepSeek does
(prices, prompt caching, a reasoning model's hidden tokens). Its "model" is a rule, not an LLM: it answers the
additions right or wrong by a hash of the request, and writes short fixed lessons. So what this shows is the
optimizer's plumbing (the plan, the budget, the spend, what goes into the prompt), not what a real model would learn.
"""

import os
import tempfile

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # before dspy: no fetch of LiteLLM's price map
import dspy

from tfgrpo.optimizers import TrainingFreeGRPO
from tfgrpo.programs import save_program
from tfgrpo.testing import FakeLMServer, dspy_prices


def exact(example, pred, trace=None):  # your metric
    return float(str(pred.answer).strip() == example.answer)


def main():
    models = ("deepseek/deepseek-chat", "deepseek/deepseek-reasoner")
    simulator = FakeLMServer(prefix_cache=True, reasoning=True, token_chars=4,
                             prices={m: dspy_prices(m) for m in models})  # DeepSeek's prices, as DSPy bills them
    with simulator as server, tempfile.TemporaryDirectory() as folder:
        os.chdir(folder)  # runs/api and program.json go to a scratch folder
        # the one change to the quick start: the simulator's address (and no disk cache, so every call is made)
        endpoint = {"api_base": server.api_base, "api_key": "x", "cache": False}
        trainset = [
            dspy.Example(question=f"What is {i} + {2 * i}?", answer=str(3 * i)).with_inputs("question")
            for i in range(20)
        ]
        program = dspy.ChainOfThought("question -> answer")
        dspy.configure(lm=dspy.LM("deepseek/deepseek-chat", **endpoint))
        optimizer = TrainingFreeGRPO(
            exact,
            reflection_lm=dspy.LM("deepseek/deepseek-reasoner", **endpoint),
            max_cost=1.00,
            num_threads=16,
            log_dir="runs/api",
            progress=lambda *_: None,  # no progress bars in the output below
        )
        plan = optimizer.plan(program, trainset[:12], trainset[12:])
        print("== plan ==")
        print(plan.summary())
        compiled = optimizer.compile(program, trainset=trainset[:12], valset=trainset[12:])
        save_program(compiled, "program.json")

        result = compiled.detailed_results
        print("== spent ==")
        for role, usage in result.usage.items():
            print(f"{role}: {usage['calls']:.0f} calls, {usage['prompt_tokens']:.0f} prompt tokens "
                  f"({usage['cached_tokens']:.0f} cached), {usage['completion_tokens']:.0f} completion tokens, "
                  f"${usage.get('cost', 0):.4f}")
        print(f"the simulator billed ${server.stats()['billed_usd']:.4f}; stopped early: {result.stopped_early}")
        print("== learned ==")
        print(compiled.experience_library)
        print("== the compiled program's instructions ==")
        for name, predictor in compiled.named_predictors():
            print(f"[{name}]")
            print(predictor.signature.instructions)


if __name__ == "__main__":
    main()
