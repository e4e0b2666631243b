"""A compile against an API model at a known cost, on the provider simulator (no network here: `tfgrpo.testing`).

The simulator stands for DeepSeek: the model `deepseek/deepseek-chat` as DSPy names it, billed at DSPy's own prices
for it, its prompt prefixes cached and billed as DeepSeek does (64-token blocks), a token per 4 characters, and a share
of requests answered 429 with a Retry-After (`--rate429`). The program is `dspy.Predict("question -> answer")` on
sums the simulator answers right or wrong by a hash; the optimizer is the default construction (`auto` takes the
`paper` preset for a model whose name gives no size), on `--threads` threads.

Three compiles, each on a fresh simulator:
  1. unbudgeted: what the run spends, against `optimizer.plan(...)` made before it (`plan_error`: its calls;
     `plan_cost_error`: its dollars, the plan told `--reply-tokens`, the simulator's reply length), the cached share of the prompt tokens, the calls that failed after their
     retries, and whether any of them entered a group (`failures_in_groups`: rollouts recorded as failed that got a
     reward);
  2. the same with `max_cost` at `--budget-share` of run 1's bill: `overshoot_calls`, the calls billed after the bill
     first reached the budget (at most the units in flight, `--threads`);
  3. run 2 resumed with no cost budget: it goes on from the units run 2 saved (`redone`: saved units written again;
     its library is said beside run 1's, which the 429s it meets, drawn anew, may make differ);
  4. `--budget-train` examples under `max_metric_calls=--budget-calls`, planned with no reply length given: the steps
     the plan says the budget lets the run start against those it ran, and its calls and dollars against the
     simulator's count (`plan_budget:` line; the simulator's replies are a few tokens, a real model's longer), and
     the dollars of a plan made with `pilot=4` (`pilot_cost_error`: its sizes from 4 calls to the simulator);
  5. `attribution=True` on `--attribution-queries` held-out sums: the plan's calls (the attribution's for the items
     the steps are expected to keep) and dollars against the simulator's count (`plan_attribution:` line).
`reference_cost`: what run 1's workload costs the way the reference implementation runs it (../shared/SPEC.md: one
more call per group with contrast, a per-group update, and no cached prefix), from run 1's own tokens.

    python -m benchmarks.api_run [--train 10] [--threads 8] [--rate429 0.3] [--budget-share 0.5]

The last line is `api_run: preset=paper calls=N cost=$C budget=$B overshoot_calls=K plan_error=E cached_share=S
failed_calls=F failures_in_groups=0 reference_cost=$R`.

    python -m benchmarks.api_run --carry-to openai/gpt-4o-mini [--refit-queries 8]

learns with the simulator's model, then carries the program to another model on the same simulator: a `carry_api:`
line with the refit's calls and dollars against a fresh compile on the new model (see `carried`).

    python -m benchmarks.api_run --train 2 --rate-limit-rpm 30 [--rate-threads 4,16,64]

runs one compile per thread count against a provider that takes 30 requests a sliding minute, first with the
LM unpaced (every 429 waits its Retry-After), then with a RequestPacer at 30 (`max_requests_per_minute`): a
`rate_limit:` line each.
"""

from __future__ import annotations

import argparse
import json
import logging
import tempfile
import time
from pathlib import Path

# isort: off
import benchmarks  # noqa: F401  (before dspy: LiteLLM's bundled price map, no fetch)
import dspy
from benchmarks.log_dir_checks import record_keys, resent, unit_files
from tfgrpo.optimizers import TrainingFreeGRPO
from tfgrpo.optimizers.spend import RequestPacer
from tfgrpo.programs import load_program, save_program
from tfgrpo.testing import FakeLMServer, dspy_prices
# isort: on

MODEL = "deepseek/deepseek-chat"


def metric(example, pred, trace=None):
    return float(str(getattr(pred, "answer", "")).strip() == example.answer)


def trainset(n: int, start: int = 0) -> list[dspy.Example]:
    return [dspy.Example(question=f"What is {3 * i + 7} + {5 * i + 11}?", answer=str(8 * i + 18)).with_inputs("question")
            for i in range(start, start + n)]


def simulator(rate429: float) -> FakeLMServer:
    return FakeLMServer(prefix_cache=True, prices={MODEL: dspy_prices(MODEL)}, token_chars=4, log_requests=True,
                        faults={"http429": rate429} if rate429 else {}, retry_after=0.01)


def compile_on(server: FakeLMServer, log_dir: Path, args, **knobs):
    """One compile on the simulator: the optimizer, its plan and the compiled program."""
    lm = dspy.LM(MODEL, api_base=server.api_base, api_key="x", cache=False, num_retries=3, max_tokens=512)
    with dspy.context(lm=lm):
        optimizer = TrainingFreeGRPO(metric, num_threads=args.threads, log_dir=str(log_dir), **knobs)
        plan = optimizer.plan(dspy.Predict("question -> answer"), trainset(args.train), reply_tokens=args.reply_tokens)
        compiled = optimizer.compile(dspy.Predict("question -> answer"), trainset=trainset(args.train))
    return optimizer, plan, compiled


def billed_calls(stats: dict) -> list[float]:
    """The bill of each served call, in the order the simulator answered them."""
    return [r["billed_usd"] for r in stats["requests"] if r["status"] == 200]


def overshoot(bills: list[float], budget: float) -> int:
    """Calls billed after the running bill first reached `budget`."""
    total = 0.0
    for i, bill in enumerate(bills):
        total += bill
        if total >= budget:
            return len(bills) - 1 - i
    return 0


def failures_in_groups(log_dir: Path) -> int:
    """Rollouts recorded as failed (no answer) that nevertheless got a reward."""
    found = 0
    for path in log_dir.glob("steps/*/rollouts/*.json"):
        if json.loads(path.read_text()).get("failed") and (path.parent.parent / "rewards" / path.name).exists():
            found += 1
    return found


def rate_limited(rpm: int, threads: int, paced: bool, args, log_dir: Path) -> str:
    """One unbudgeted compile against a provider that takes `rpm` requests a sliding minute and answers the rest 429
    with the wait as Retry-After, with or without the LM's RequestPacer at `rpm` (`max_requests_per_minute`): its
    minutes against answered / rpm (`per_r`; a run of that many requests at R a minute) and against the least such a
    run takes (`floor`: the first minute's rpm at once, then rpm a minute), and the share of requests answered 429."""
    with FakeLMServer(prices={MODEL: dspy_prices(MODEL)}, token_chars=4, log_requests=True,
                      rate_limit_rpm=rpm) as server:
        lm = dspy.LM(MODEL, api_base=server.api_base, api_key="x", cache=False, num_retries=8, max_tokens=512,
                     callbacks=[RequestPacer(rpm)] if paced else [])
        started = time.time()
        with dspy.context(lm=lm):
            TrainingFreeGRPO(metric, num_threads=threads, log_dir=str(log_dir)).compile(
                dspy.Predict("question -> answer"), trainset=trainset(args.train))
        minutes, stats = (time.time() - started) / 60, server.stats()
    answered = stats["statuses"].get("200", 0)
    floor = max(answered - rpm, 0) / rpm
    return (f"rate_limit: rpm={rpm} threads={threads} paced={'yes' if paced else 'no'} requests={stats['calls']} "
            f"answered={answered} minutes={minutes:.2f} per_r={answered / rpm:.2f} "
            f"ratio={minutes / (answered / rpm):.2f} floor={floor:.2f} "
            f"share_429={stats['statuses'].get('429', 0) / stats['calls']:.2f}")


def carried(target: str, args, root: Path) -> str:
    """A program learned with MODEL, carried to `target` on the same simulator: the refit's calls and dollars
    (`refit=True, num_train_epochs=0`, each carried item measured on `args.refit_queries` sums outside the trainset)
    against a fresh compile on `target` from the uncompiled program (the default construction, the same trainset).
    The simulator answers by a hash, so what an item is worth there says nothing of a real model: only the costs
    carry over. Each phase's calls and dollars are the simulator's own count."""
    prices = {MODEL: dspy_prices(MODEL), target: dspy_prices(target)}
    with FakeLMServer(prefix_cache=True, prices=prices, token_chars=4, log_requests=True) as server:

        def run(model: str, student: dspy.Module, name: str, **knobs) -> tuple[dspy.Module, dict]:
            server.reset_stats()
            lm = dspy.LM(model, api_base=server.api_base, api_key="x", cache=False, num_retries=3, max_tokens=512)
            valset = trainset(args.refit_queries, start=1000) if knobs else None
            with dspy.context(lm=lm):
                optimizer = TrainingFreeGRPO(metric, num_threads=args.threads, log_dir=str(root / name), **knobs)
                planned = optimizer.plan(student, trainset(args.train), valset).expected["total"]["calls"]
                program = optimizer.compile(student, trainset=trainset(args.train), valset=valset)
            return program, {**server.stats(), "planned": planned}

        learned, first = run(MODEL, dspy.Predict("question -> answer"), "learn")
        save_program(learned, root / "learned.json")
        start = load_program(dspy.Predict("question -> answer"), root / "learned.json")
        refit, spent = run(target, start, "refit", refit=True, num_train_epochs=0)
        _, fresh = run(target, dspy.Predict("question -> answer"), "fresh")
    report = refit.detailed_results.refit
    items, pruned = (report.items, report.pruned) if report else ([], [])
    return (f"carry_api: from={MODEL} to={target} learned_calls={first['calls']} learned_cost=${first['billed_usd']:.4f} "
            f"items={len(items)} kept={len(items) - len(pruned)} "
            f"calls_refit={spent['calls']} planned_refit={spent['planned']} cost_refit=${spent['billed_usd']:.4f} calls_fresh={fresh['calls']} "
            f"cost_fresh=${fresh['billed_usd']:.4f} cost_share={spent['billed_usd'] / fresh['billed_usd']:.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--train", type=int, default=10)
    ap.add_argument("--threads", type=int, default=8)
    ap.add_argument("--rate429", type=float, default=0.3)
    ap.add_argument("--budget-share", type=float, default=0.5)
    ap.add_argument("--reply-tokens", type=int, default=30, help="what the plan is told a reply takes (the "
                    "simulator's replies take 10-40 tokens; a real model's are longer)")
    ap.add_argument("--budget-train", type=int, default=200, help="run 4: training examples, more than its budget reads")
    ap.add_argument("--budget-calls", type=int, default=500, help="run 4: its max_metric_calls")
    ap.add_argument("--attribution-queries", type=int, default=6, help="run 5: held-out sums the attribution reads")
    ap.add_argument("--rate-limit-rpm", type=int, default=None, help="only measure runs against a provider that "
                    "takes this many requests a minute, at --rate-threads threads each, unpaced then paced "
                    "(rate_limit: lines)")
    ap.add_argument("--rate-threads", default="4,16,64")
    ap.add_argument("--carry-to", default=None, help="only measure a program learned with the simulator's model "
                    "carried to this one: the refit's calls and dollars against a fresh compile (carry_api: line)")
    ap.add_argument("--refit-queries", type=int, default=8, help="--carry-to: sums outside the trainset for the refit")
    args = ap.parse_args()
    logging.basicConfig(level=logging.ERROR)
    root = Path(tempfile.mkdtemp(prefix="api_run-"))
    if args.carry_to:
        print(carried(args.carry_to, args, root), flush=True)
        return
    if args.rate_limit_rpm:
        for paced in (False, True):
            for threads in [int(t) for t in args.rate_threads.split(",")]:
                print(rate_limited(args.rate_limit_rpm, threads, paced, args, root / f"rpm-{threads}-{paced}"),
                      flush=True)
        return
    with simulator(args.rate429) as server:  # 1. unbudgeted, against its plan
        _, plan, compiled = compile_on(server, root / "full", args)
        full = server.stats()
    results = compiled.detailed_results
    calls = sum(u.get("calls", 0) for u in results.usage.values())
    cost = full["billed_usd"]
    planned = plan.expected["total"]
    steps = results.steps
    groups_kept = sum(s.groups_kept for s in steps)
    advantage_cost = sum(s.usage.get("advantage", {}).get("cost", 0.0) for s in steps) / max(1, groups_kept)
    price = dspy_prices(MODEL)
    uncached = full["prompt_tokens"] * price["input"] + full["completion_tokens"] * price["output"]
    reference = uncached + groups_kept * advantage_cost  # one more call per group with contrast, no cached prefix
    print(f"run 1: {calls} calls (planned {planned['calls']}), ${cost:.4f} billed (planned ${planned['cost']:.4f}), "
          f"{full['cached_tokens']:,} of {full['prompt_tokens']:,} prompt tokens cached, "
          f"{full['statuses'].get('429', 0)} answers 429, {sum(s.failed_calls for s in steps)} attempts failed")
    budget = round(cost * args.budget_share, 6)
    with simulator(args.rate429) as server:  # 2. a cost budget, charged before each call
        _, _, stopped = compile_on(server, root / "budgeted", args, max_cost=budget)
        cut = server.stats()
    saved, keys = unit_files(root / "budgeted"), record_keys(root / "budgeted")
    with simulator(args.rate429) as server:  # 3. resumed with a larger budget
        _, _, resumed = compile_on(server, root / "budgeted", args)
        rest = server.stats()
    after = unit_files(root / "budgeted")
    redone = sum(after.get(path) != sig for path, sig in saved.items() if path != "run.json") + \
        len(resent(root / "budgeted", keys, root / "full"))
    print(f"run 2: stopped early: {stopped.detailed_results.stopped_early}; ${cut['billed_usd']:.4f} billed")
    print(f"run 3: {len(billed_calls(rest))} calls, library equal to run 1's: "
          f"{resumed.experience_library.texts() == compiled.experience_library.texts()}, redone={redone}")
    with simulator(0.0) as server:  # 4. a trainset larger than the budget lets the run read, the plan's own reply length
        lm = dspy.LM(MODEL, api_base=server.api_base, api_key="x", cache=False, num_retries=3, max_tokens=512)
        with dspy.context(lm=lm):
            optimizer = TrainingFreeGRPO(metric, num_threads=args.threads, max_metric_calls=args.budget_calls)
            budgeted = optimizer.plan(dspy.Predict("question -> answer"), trainset(args.budget_train))
            piloted = optimizer.plan(dspy.Predict("question -> answer"), trainset(args.budget_train), pilot=4)
            server.reset_stats()  # the pilot's 4 calls are not the run's
            ran = optimizer.compile(dspy.Predict("question -> answer"), trainset=trainset(args.budget_train))
        served = server.stats()
    want, sent = budgeted.expected["total"], len(billed_calls(served))
    print(f"plan_budget: scheduled={budgeted.steps} reachable={want['steps']} steps_run={len(ran.detailed_results.steps)} "
          f"calls={sent} planned={want['calls']} error={abs(want['calls'] - sent) / max(sent, 1):.2f} "
          f"cost_error={abs(want['cost'] - served['billed_usd']) / max(served['billed_usd'], 1e-12):.2f} "
          f"pilot_cost_error={abs(piloted.expected['total']['cost'] - served['billed_usd']) / served['billed_usd']:.2f} "
          f"read={want['examples_read']['trainset']} of {args.budget_train} ({want['reply']})")
    with simulator(0.0) as server:  # 5. attribution on: the plan's calls for the items the steps keep, and the run's
        lm = dspy.LM(MODEL, api_base=server.api_base, api_key="x", cache=False, num_retries=3, max_tokens=512)
        with dspy.context(lm=lm):
            optimizer = TrainingFreeGRPO(metric, num_threads=args.threads, attribution=True)
            attributed = optimizer.plan(dspy.Predict("question -> answer"), trainset(args.train),
                                        trainset(args.attribution_queries, start=1000))
            kept = optimizer.compile(dspy.Predict("question -> answer"), trainset=trainset(args.train),
                                     valset=trainset(args.attribution_queries, start=1000))
        served = server.stats()
    want, worth = attributed.expected["total"], kept.detailed_results.worth
    print(f"plan_attribution: queries={args.attribution_queries} items_planned={want['attribution']['items']} "
          f"items={len(worth.items) if worth else 0} calls={served['calls']} planned={want['calls']} "
          f"bound={attributed.bound['total']['calls']} error={abs(want['calls'] - served['calls']) / served['calls']:.2f} "
          f"cost_error={abs(want['cost'] - served['billed_usd']) / served['billed_usd']:.2f}")
    print(f"api_run: preset={plan.preset} calls={calls} cost=${cost:.4f} budget=${budget:.4f} "
          f"overshoot_calls={overshoot(billed_calls(cut), budget)} "
          f"plan_error={abs(planned['calls'] - calls) / calls:.2f} plan_cost_error={abs(planned['cost'] - cost) / cost:.2f} "
          f"cached_share={full['cached_tokens'] / full['prompt_tokens']:.2f} "
          f"failed_calls={sum(s.failed_calls for s in steps)} failures_in_groups={failures_in_groups(root / 'full')} "
          f"reference_cost=${reference:.4f}")


if __name__ == "__main__":
    main()
