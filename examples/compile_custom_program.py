"""Compile a DSPy program of your own with Training-Free GRPO against any OpenAI-compatible endpoint.

    python examples/compile_custom_program.py --api-base http://127.0.0.1:8000/v1 --model my-model
    # key, if the endpoint needs one: export OPENAI_API_KEY=...   (read from the environment, never saved)
    # the embedded model: `tfgrpo lm start`, then pass the api_base it prints and --model qwen2.5-coder-1.5b

The program below is an ordinary two-step DSPy module (extract the quantities, then compute); nothing in it
knows about tfgrpo. After compiling, it is saved to JSON and loaded back into a freshly built copy.
"""

import argparse
import os

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # before dspy: no fetch of litellm's price map
import dspy

from tfgrpo.optimizers import TrainingFreeGRPO
from tfgrpo.programs import load_program, save_program


class UnitPrice(dspy.Module):
    """Your program: two predictors, chained."""

    def __init__(self):
        super().__init__()
        self.extract = dspy.Predict("question -> quantities")
        self.compute = dspy.ChainOfThought("question, quantities -> answer: float")

    def forward(self, question):
        quantities = self.extract(question=question).quantities
        return self.compute(question=question, quantities=quantities)


def close_enough(example, pred, trace=None):
    try:
        ok = abs(float(pred.answer) - float(example.answer)) < 1e-2
    except (TypeError, ValueError):
        return dspy.Prediction(score=0.0, feedback=f"answer {pred.answer!r} is not a number")
    return dspy.Prediction(score=float(ok), feedback="correct" if ok else f"expected {example.answer}")


TRAIN = [("A pack of 12 pens costs $3.60. What does one pen cost in dollars?", 0.30),
         ("5 kg of rice cost $7.50. What is the price per kg?", 1.50),
         ("A box of 8 apples is $4. How much is 3 apples?", 1.50),
         ("Two dozen eggs cost $6. What do 5 eggs cost?", 1.25),
         ("A 1.5 L bottle costs $2.25. What is the price per liter?", 1.50),
         ("Three shirts cost $54 in total. What do two shirts cost?", 36.0),
         ("Four tickets cost $38. What does one ticket cost?", 9.50),
         ("A 250 g bar of chocolate costs $3. What do 100 g cost?", 1.20),
         ("Ten pencils cost $2.50. What do 6 pencils cost?", 1.50),
         ("A 6-hour parking pass costs $9. What is the price per hour?", 1.50),
         ("Half a dozen bagels cost $4.20. What does one bagel cost?", 0.70),
         ("20 liters of fuel cost $31. What do 5 liters cost?", 7.75)]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--api-base", required=True, help="OpenAI-compatible endpoint, e.g. http://host:8000/v1")
    parser.add_argument("--model", required=True, help="model name the endpoint serves")
    parser.add_argument("--out", default="unit_price.json")
    args = parser.parse_args()

    lm = dspy.LM(f"openai/{args.model}", api_base=args.api_base, api_key=os.environ.get("OPENAI_API_KEY", "none"),
                 temperature=0.3, max_tokens=512)
    dspy.configure(lm=lm)
    trainset = [dspy.Example(question=q, answer=a).with_inputs("question") for q, a in TRAIN]

    # the settings measured on a small local model (configs/local.toml): 3 steps of 4 questions x 4 attempts, each
    # edit and demo kept only if it does no worse on the 8 questions outside its step
    optimizer = TrainingFreeGRPO(close_enough, num_generations=4, num_train_epochs=1, batch_size=4,
                                 max_operations_per_group=1, max_demos=2, probe_size=8, num_threads=2)
    compiled = optimizer.compile(UnitPrice(), trainset=trainset)
    for step in compiled.detailed_results.to_dict()["steps"]:
        print(f"step {step['step']}: mean reward {step['mean_reward']:.2f}, library size {step['library_size']}")
    print(compiled.experience_library.render() or "(no experience learned)")

    save_program(compiled, args.out)  # or compiled.save(args.out): both keep the experiences
    reloaded = load_program(UnitPrice(), args.out)  # stock DSPy: UnitPrice().load(args.out)
    print("reloaded:", reloaded(question="A 6-pack of juice costs $4.20. What does one juice cost?").answer)


if __name__ == "__main__":
    main()
