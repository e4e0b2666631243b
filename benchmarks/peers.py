"""tfgrpo against DSPy's own optimizers: one split, one model, one budget, paired, several seeds.

    .venv/bin/python -m benchmarks.peers --task game24 --arms baseline,simba,tfgrpo-probed+demos --seeds 0,1,2
    .venv/bin/python -m benchmarks.peers --task game24 --report            # the table and the plot from what is saved

Every arm compiles the same student on the same training examples with the embedded model as policy (and as
reflection LM where the optimizer has one), then is evaluated on the same held-out examples with the same sampling
run as the baseline of its seed (rollout_id = seed, temperature 0.3): differences are taken per problem (the mean
over the seeds both arms have) with a 95% bootstrap CI over problems. Budgets are matched on attempts: tfgrpo makes
train x G rollouts; BootstrapFewShot gets as many attempts (max_rounds = G), SIMBA a batch of the whole trainset
with G candidates (`simba-solved`: the same, ranking its candidates by the held-out metric, solved or not, instead
of the partial-credit training reward; `bootstrap-rs-solved` likewise scores its demo sets), GEPA `max_metric_calls`
of the same size plus one evaluation of the trainset, MIPROv2 a light search; KNN (k = 3) retrieves each query's
demos from solved training examples: GSM8K's reference solutions (`knn`) or, as on the Game of 24, the student's
own traces, each example tried until solved, G times at most (`knn-bootstrapped`). Each arm's compile is metered (LM
calls and tokens of every model call, cache off; the calls of its training metric) and timed. With --budget-calls N
every arm is matched to N metric calls instead, as GEPA's max_metric_calls budgets a search.

Everything lands in --out/<task>/<arm>/seed<s>/ as it finishes (program.json, compile.json, eval.jsonl; tfgrpo
arms also checkpoint every unit), so an interrupted run resumes where it stopped. Last lines, one per arm:
  peers: task=game24 optimizer=NAME seeds=N problems=M calls=C score=0.xxx min=0.xxx lift=+0.xxx ci_low=+0.xxx vs_best_other=+0.xxx ci_low_vs_best=+0.xxx
(min: the worst seed's score)
each after a `#` line placing the arm on the cost frontier (dominated or not by a cheaper arm that beats it by a
paired CI; which of the arms spending no more calls it beats), and a plot, --out/<task>/peers.png: held-out score
against compile calls, one point per arm with its 95% CI: the arms of --out/<task>/table.md where there is one (the
results table the documentation includes, so the plot shows the table's rows), else the menu's measured arms. With
--mlflow URI every arm and seed is its own MLflow run (experiment peers-<task>), to compare them in MLflow's UI.
"""

from __future__ import annotations

import argparse
import functools
import json
import re
import statistics
import threading
import time
from pathlib import Path


import benchmarks  # noqa: F401  (before dspy: LiteLLM's bundled price map, no fetch)
import dspy

from benchmarks.ceiling import ceiling
from benchmarks.common import add_endpoint_args, endpoint
from tfgrpo.evaluate import bootstrap_ci, heldout_rows, paired_difference, per_problem, read_rows, write_rows
from tfgrpo.lms import local_dspy_lm
from tfgrpo.optimizers import TrainingFreeGRPO
from tfgrpo.optimizers.spend import metered
from tfgrpo.plots import score_against_cost
from tfgrpo.programs import save_program

TFGRPO_ARMS = {  # arm -> knobs on top of the shared ones; every arm that keeps demos has "demos" in its name
    # (tfgrpo-default too keeps demos: its preset's)
    "tfgrpo-rules": {},  # the contrast path's rules only: no probe, no excerpt, no demo
    "tfgrpo-rules+demos": {"max_demos": 2},  # demos picked by their own reward, as in the hand measurement
    "tfgrpo-probed+demos": {"max_demos": 2, "probe_size": 4},
    # demos probed on every training query outside the batch (8 of 12): room to tell a flat search from a bracketed
    # one; the main job (configs/local.toml: three steps of 4)
    "tfgrpo-probed-wide+demos": {"max_demos": 2, "probe_size": 8},
    # configs/local-onestep.toml: one step of 6 queries, each edit probed on 4 of the others
    "tfgrpo-onestep+demos": {"max_demos": 2, "probe_size": 4, "batch_size": 6, "max_steps": 1},
    # TrainingFreeGRPO(metric) as a user makes it, given only a seed, threads and the server's JSON form: its `auto`
    # preset picks every other knob for the 1.5B (configs/local.toml)
    "tfgrpo-default": None,
}
# arms made for one task; elsewhere they are not in the menu. knn-bootstrapped: KNN over the student's own solved
# traces instead of GSM8K's reference solutions (on the Game of 24 `knn` already retrieves from such a pool)
ONLY_FOR = {"knn-bootstrapped": "gsm8k"}
# Arms measured once and superseded, kept on disk with their results (the README tells what each taught): the report
# prints them as explored, apart from the menu, and never takes one as the best other arm.
EXPLORED = {
    "tfgrpo-probed-by-mean+demos": "probe ranked by mean reward (first version of probe_size)",
    "tfgrpo-excerpts": "max_excerpt_lines=20, the LM picks the lines; superseded by tfgrpo-solver-excerpts-wide",
    "tfgrpo-excerpts-ties": "the same, an excerpt kept when it only ties",
    "tfgrpo-long-excerpts": "max_excerpt_lines=40, the LM picks the lines",
    "tfgrpo-solver-excerpts": "the whole attempt as the excerpt, probed on 4 queries",
    "tfgrpo-solver-excerpts-wide-dropped": "probed on 8, the line holding the query's values dropped, not masked",
    "tfgrpo-solver-excerpts-wide-lists-unmasked": "probed on 8, the query's values masked one by one",
    "tfgrpo-solver-excerpts-wide": "a rule carries the better attempt's whole program, query values masked, probed on "
                                   "8 (max_excerpt_lines, excerpt_whole_attempt: behind probed demos, removed)",
    "tfgrpo-solver-excerpts-wide+demos": "the same beside probed demos (behind probed demos alone, removed)",
    "tfgrpo-probed-ties+demos": "a demo kept when it ties a program solving some probe queries (keep_tied_demos: "
                                "no gain on GSM8K, removed)",
    "tfgrpo-compound+demos": "a demo kept on a sign test (probe_alpha=0.15), half of each group without the demos "
                             "(num_explore_generations=2): lower on held-out puzzles, removed",
    "tfgrpo-default-no-stops": "the default before issue 66's stops (probe_min_power, stop_when_nothing_to_learn): "
                               "the settings of tfgrpo-probed-wide+demos run again",
    "tfgrpo-default-first-stops": "issue 66's first stops: a step's learning calls made before its probe was "
                                  "skipped (tfgrpo-default replays these draws without them)",
    "tfgrpo-default-stop-ahead": "the same draws stopped one step sooner, where the program a probe kept left the "
                                 "next probe no power (replayed; it lost the free demo slot's fill: left off)",
    "tfgrpo-default-reliable-fill": "the same draws, a skipped probe's free demo slots filled by the queries the "
                                    "program solved most often, not by group advantage (replayed; no gain: left off)",
    "tfgrpo-default+probe4": "the default construction with probe_size=4, chosen on training puzzles by "
                             "benchmarks.replay (fresh draws; not confirmed: lower, and no cheaper: left off)",
    "tfgrpo-default-whole-groups": "the default before its first look (a step's whole groups before the probe "
                                   "gate; the same draws as tfgrpo-default)",
    "tfgrpo-default-look-contrast-fill": "the first look with a skipped probe's free slots filled from groups with "
                                         "contrast only (replayed; fewer demos kept: superseded)",
}
PEER_ARMS = ("baseline", "bootstrap", "bootstrap-rs", "bootstrap-rs-solved", "infer-rules", "knn",
             "knn-bootstrapped", "simba", "simba-solved", "gepa", "mipro")
KNN_ARMS = ("knn", "knn-bootstrapped")  # compile a pool of solved examples; evaluate by retrieving from it
MAIN_ARM = "tfgrpo-default"  # the arm configs/local.toml runs (the default construction): the others' budget is matched to it


def menu(task: str) -> list[str]:
    """The arms the benchmark runs and reports on `task`."""
    return [a for a in (*PEER_ARMS, *TFGRPO_ARMS) if ONLY_FOR.get(a, task) == task]


def task_parts(task: str):
    """(student factory, training reward, held-out metric, train loader, held-out loader) of a task."""
    if task == "game24":
        from tfgrpo.tasks.game24 import Game24Solver, game24_metric, game24_reward, load_game24

        return (Game24Solver, game24_reward, game24_metric,
                lambda n, off: load_game24("game24_train", limit=n, offset=off),
                lambda n, off: load_game24("game24_test", limit=n, offset=off))
    if task == "gsm8k":
        from tfgrpo.tasks.math.datasets import load_math
        from tfgrpo.tasks.math.metric import math_metric
        from tfgrpo.tasks.math.programs import direct_program

        return (direct_program, math_metric, math_metric, lambda n, off: load_math("gsm8k_train", limit=n, offset=off),
                lambda n, off: load_math("gsm8k_test", limit=n, offset=off))
    raise SystemExit(f"unknown task {task!r}: game24 or gsm8k")


class Counted:
    """The training metric, counting its calls (from any thread): what each arm's compile spent in metric calls, the
    unit of GEPA's budget, saved as `metric_calls` in compile.json."""

    def __init__(self, metric):
        functools.update_wrapper(self, metric)  # its signature too: TrainingFreeGRPO reads whether it takes a trace
        self.calls, self._lock = 0, threading.Lock()

    def __call__(self, *args, **kwargs):
        with self._lock:
            self.calls += 1
        return self.__wrapped__(*args, **kwargs)


def scalar(metric):
    """The metric as a plain float, as DSPy's optimizers want it."""
    return lambda example, pred, trace=None, *_: float(getattr(m := metric(example, pred, trace), "score", m))


def compile_arm(arm: str, student, reward, trainset: list, lm: dspy.LM, seed: int, args, where: Path) -> dspy.Module:
    G, threads, T, budget = args.generations, args.threads, len(trainset), args.match_calls
    if TFGRPO_ARMS.get(arm, {}) is None:  # the default construction: nothing but what runs it here
        return TrainingFreeGRPO(reward, seed=seed, num_threads=threads, constrained_decoding="json_object",
                                log_dir=str(where / "checkpoint")).compile(student, trainset=trainset)
    if arm in TFGRPO_ARMS:
        shared = dict(num_generations=G, num_train_epochs=1, batch_size=args.batch, seed=seed, learning_path="contrast",
                      constrained_decoding="json_object", max_operations_per_group=1, num_threads=threads,
                      log_dir=str(where / "checkpoint"))
        knobs = {**shared, **TFGRPO_ARMS[arm]}  # an arm may set a shared knob its own way
        if budget:  # as many epochs as the budget may need (the rollouts alone spend T x G an epoch), then stop
            knobs.update(max_metric_calls=budget, num_train_epochs=-(-budget // (T * G)), max_steps=None)
        return TrainingFreeGRPO(reward, **knobs).compile(student, trainset=trainset)
    metric = scalar(reward)
    if arm == "bootstrap":  # the student's own traces that pass, as demos; G rounds over the trainset at most
        opt = dspy.BootstrapFewShot(metric=metric, metric_threshold=1.0, max_bootstrapped_demos=2, max_labeled_demos=0,
                                    max_rounds=G)
        return opt.compile(student, trainset=trainset)
    if arm in ("simba", "simba-solved"):  # -solved: ranks its candidates by the held-out metric (solved or not)
        # a step samples T x G trajectories and scores G + 1 programs on its batch; at the end G + 1 programs are
        # scored on the trainset
        steps = max(1, (budget - (G + 1) * T) // (T * (2 * G + 1))) if budget else 1
        opt = dspy.SIMBA(metric=metric, bsize=T, num_candidates=G, max_steps=steps, max_demos=2, num_threads=threads)
        return opt.compile(student, trainset=trainset, seed=seed)
    if arm in ("bootstrap-rs", "bootstrap-rs-solved"):  # validated demo sets: each set scored on the trainset, the
        # best kept; -solved scores them by the held-out metric (solved or not), as tfgrpo's probe ranks full successes
        opt = dspy.BootstrapFewShotWithRandomSearch(
            metric=metric, metric_threshold=1.0, max_bootstrapped_demos=2, max_labeled_demos=0, max_rounds=1,
            num_candidate_programs=max(1, args.budget_calls // T - 3), num_threads=threads)
        return opt.compile(student, trainset=trainset, valset=trainset)
    if arm == "infer-rules":  # validated rules: rules induced from bootstrapped demos, the best rule set kept
        opt = dspy.InferRules(metric=metric, metric_threshold=1.0, max_bootstrapped_demos=2, max_labeled_demos=0,
                              num_candidates=max(1, args.budget_calls // (T + 1)), num_rules=5,
                              num_threads=threads)
        return opt.compile(student, trainset=trainset, valset=trainset)
    if arm in KNN_ARMS:  # the pool of solved training examples KNN retrieves from, saved as demos (see knn_program)
        if arm == "knn" and args.task == "gsm8k":  # the training problems come solved: their reference solutions
            pool = student.deepcopy()
            pool.predictors()[0].demos = [dspy.Example(ex, reasoning=ex.solution.split("####")[0].strip())
                                          for ex in trainset]
            return pool
        # the student solves each training example once (G tries at most, as bootstrap does): its own traces
        return dspy.BootstrapFewShot(metric=metric, metric_threshold=1.0, max_bootstrapped_demos=T,
                                     max_labeled_demos=0, max_rounds=G).compile(student, trainset=trainset)
    if arm == "gepa":
        def feedback_metric(gold, pred, trace=None, pred_name=None, pred_trace=None):
            result = reward(gold, pred, trace)
            return dspy.Prediction(score=float(getattr(result, "score", result)),
                                   feedback=str(getattr(result, "feedback", "") or ""))

        opt = dspy.GEPA(metric=feedback_metric, reflection_lm=lm.copy(max_tokens=1024, extra_body={"max_tokens": 1024}),
                        max_metric_calls=budget or T * (G + 1), num_threads=threads, seed=seed,
                        log_dir=str(where / "gepa"))
        return opt.compile(student, trainset=trainset, valset=trainset)
    if arm == "mipro":
        opt = dspy.MIPROv2(metric=metric, auto=None, num_candidates=3, max_bootstrapped_demos=2, max_labeled_demos=0,
                           num_threads=threads, seed=seed, verbose=False)
        # a trial scores one candidate on the whole valset (the trainset), after the demo sets are bootstrapped
        trials = max(1, budget // T - 2) if budget else G
        return opt.compile(student, trainset=trainset, valset=trainset, num_trials=trials, minibatch=False,
                           requires_permission_to_run=False)
    raise AssertionError(f"arm {arm!r} has no compile step")  # main() lets only the menu's arms through


class TfidfEmbedding:
    """A TF-IDF vectorizer fitted on the first texts it embeds (KNN embeds its trainset first): words and numbers
    as tokens, rows of unit length, so a dot product is the cosine. A well-kept local vectorizer (scikit-learn),
    deterministic and free, where a neural embedder would need weights from a hub or a second server mode. Its
    vectors depend on the texts it was fitted on, so the Embedder must not cache them: DSPy's disk cache keys a
    callable embedder by the texts alone and would hand one pool's vectors to another (a shape error, or worse)."""

    def __init__(self):
        self.vectorizer = None

    def __call__(self, texts: list[str]):
        from sklearn.feature_extraction.text import TfidfVectorizer

        if self.vectorizer is None:
            self.vectorizer = TfidfVectorizer(token_pattern=r"(?u)\b\w+\b", ngram_range=(1, 2)).fit(texts)
        return self.vectorizer.transform(texts).toarray()


def knn_program(student, pool: dspy.Module) -> dspy.Module:
    """dspy.KNNFewShot with k = 3, as the paper's appendix compares (the top-3 retrieved solved examples): each query
    gets the 3 nearest of the pool's solved examples as demos, by TF-IDF over their inputs. No LM call of its own."""
    predictor = pool.predictors()[0]
    inputs = list(predictor.signature.input_fields)
    solved = [dspy.Example({k: v for k, v in (d.toDict() if isinstance(d, dspy.Example) else d).items()
                            if k != "augmented"}).with_inputs(*inputs) for d in predictor.demos]
    if not solved:  # nothing was solved: nothing to retrieve
        return student
    return dspy.KNNFewShot(k=3, trainset=solved, vectorizer=dspy.Embedder(TfidfEmbedding(), caching=False),
                           max_bootstrapped_demos=0, max_labeled_demos=3).compile(student)


def run_arm(arm: str, seed: int, args, lm: dspy.LM) -> None:
    """Compile (unless saved) and evaluate (unless saved) one arm for one seed; with --mlflow, as its own MLflow run
    (a tfgrpo arm logs its steps into it, tfgrpo.tracking), with the arm's figures at the end."""
    where = Path(args.out) / args.task / arm / f"seed{seed}"
    where.mkdir(parents=True, exist_ok=True)
    if (where / "eval.jsonl").exists():
        return
    if not args.mlflow:
        return _run_arm(arm, seed, args, lm, where)
    import mlflow

    mlflow.set_tracking_uri(args.mlflow)
    name = f"peers-{args.task}"
    if mlflow.get_experiment_by_name(name) is None:  # artifacts beside the results, not in ./mlruns of the cwd
        mlflow.create_experiment(name, artifact_location=(Path(args.out).resolve() / "mlflow-artifacts").as_uri())
    mlflow.set_experiment(name)
    with mlflow.start_run(run_name=f"{arm} seed {seed}"):
        mlflow.log_params({"arm": arm, "seed": seed, "train": args.train, "eval": args.eval, "model": args.model})
        _run_arm(arm, seed, args, lm, where)
        info = json.loads((where / "compile.json").read_text()) if (where / "compile.json").exists() else {}
        rows = read_rows(where / "eval.jsonl")
        mlflow.log_metrics({"heldout/score": statistics.fmean(r["score"] for r in rows),
                            **{f"compile/{k}": float(v) for k, v in info.items() if isinstance(v, (int, float))}})


def _run_arm(arm: str, seed: int, args, lm: dspy.LM, where: Path) -> None:
    make_student, reward, metric, load_train, load_eval = task_parts(args.task)
    program = make_student()
    if arm != "baseline":
        if not (where / "program.json").exists():
            trainset = load_train(args.train, args.train_offset)
            t0 = time.time()
            train_metric = Counted(metric if arm.endswith("-solved") else reward)
            with metered() as used:
                compiled = compile_arm(arm, make_student(), train_metric, trainset, lm, seed, args, where)
            usage, spent = used.totals(), {"metric_calls": train_metric.calls}
            run = getattr(getattr(compiled, "detailed_results", None), "run_usage", None)
            if run and sum(u.get("calls", 0) for u in run.values()) > usage["calls"]:  # tfgrpo resumed from its log
                usage = {k: sum(u.get(k, 0) for u in run.values()) for k in usage}  # what the whole run spent
                # wall_s is this process's alone; the metric calls are the steps' own count
                spent = {"resumed": True, "metric_calls": sum(s.metric_calls for s in compiled.detailed_results.steps)}
            save_program(compiled, where / "program.json")
            (where / "compile.json").write_text(json.dumps({"wall_s": round(time.time() - t0, 1), **usage, **spent}))
            print(json.dumps({"arm": arm, "seed": seed, "compile_s": round(time.time() - t0), **usage}), flush=True)
        program.load(str(where / "program.json"))
        if arm in KNN_ARMS:  # the saved program holds the pool; the demos are retrieved per query from it
            program = knn_program(make_student(), program)
    rows = heldout_rows(program, load_eval(args.eval, args.eval_offset), metric, lm=lm, seed=seed,
                        num_threads=args.threads, name=arm)  # eval_calls: more than one a problem where KNN picks demos
    write_rows(rows, where / "eval.jsonl")
    print(json.dumps({"arm": arm, "seed": seed, "eval_s": round(rows[0]["wall_s"]),
                      "score": statistics.fmean(r["score"] for r in rows)}), flush=True)


def load_results(out: Path, task: str) -> dict[str, dict[int, dict]]:
    """arm -> seed -> {"rows", "compile"} for every evaluation saved under out/task."""
    found: dict[str, dict[int, dict]] = {}
    for path in sorted((out / task).glob("*/seed*/eval.jsonl")):
        arm, seed = path.parent.parent.name, int(path.parent.name[4:])
        info = path.parent / "compile.json"
        found.setdefault(arm, {})[seed] = {"rows": read_rows(path),
                                           "compile": json.loads(info.read_text()) if info.exists() else {}}
    return found


def paired(results, a: str, b: str) -> dict:
    """Paired difference a - b over the seeds both arms have (per problem: the mean over those seeds)."""
    seeds = sorted(set(results[a]) & set(results[b]))
    rows_a = [dict(r, run=s) for s in seeds for r in results[a][s]["rows"]]
    rows_b = [dict(r, run=s) for s in seeds for r in results[b][s]["rows"]]
    return paired_difference(rows_b, rows_a)


def table_arms(table: Path) -> list[str] | None:
    """The arms a results table names, row by row (the first cell's first `code`), or None where there is no table."""
    if not table.exists():
        return None
    return re.findall(r"^\|\s*(?:\*\*)?`([^`]+)`", table.read_text(encoding="utf-8"), re.MULTILINE)


def plot_points(results, arms: list[str]) -> list[tuple[str, float, float, float, float]]:
    """(arm, mean compile calls per seed, held-out score, 95% CI low, high) of each of `arms` from the saved results:
    the points of the report's plot. The CI is a bootstrap over problems of each problem's mean over the seeds."""
    if missing := [a for a in arms if a not in results]:
        raise SystemExit(f"no saved results for {', '.join(missing)}")
    points = []
    for arm in arms:
        seeds = results[arm].values()
        means = list(per_problem([r for s in seeds for r in s["rows"]]).values())
        lo, hi = bootstrap_ci([statistics.fmean(m) for m in means])
        points.append((arm, statistics.fmean(s["compile"].get("calls", 0) for s in seeds),
                       statistics.fmean(r["score"] for s in seeds for r in s["rows"]), lo, hi))
    return points


def report(args) -> None:
    results = load_results(Path(args.out), args.task)
    if "baseline" not in results:
        raise SystemExit(f"no baseline evaluation under {args.out}/{args.task}: run --arms baseline first")
    score = {arm: statistics.fmean(r["score"] for s in seeds.values() for r in s["rows"]) for arm, seeds in results.items()}
    arms = [a for a in menu(args.task) if a in results]  # the menu's measured arms; the rest were explored
    for arm in sorted(set(results) - set(arms)):
        lift = paired(results, arm, "baseline")
        print(f"# explored, not in the menu: {arm} ({EXPLORED.get(arm, 'no longer an arm')}): seeds "
              f"{sorted(results[arm])}, score {score[arm]:.3f}, lift {lift['difference']:+.3f} (CI "
              f"{lift['ci95'][0]:+.3f} .. {lift['ci95'][1]:+.3f})")
    if missing := [a for a in menu(args.task) if a not in results]:
        print(f"# not measured on {args.task}: {', '.join(missing)}")
    spent = {a: statistics.fmean(s["compile"].get("calls", 0) for s in results[a].values()) for a in arms}
    for arm in sorted(arms, key=lambda a: (a != "baseline", a)):
        seeds, calls = results[arm], spent[arm]
        lift = paired(results, arm, "baseline")
        others = [o for o in arms if o != arm]
        best = max(others, key=lambda o: score[o]) if others else None
        vs = paired(results, arm, best) if best else {"difference": 0.0, "ci95": (0.0, 0.0)}
        wall = statistics.fmean(s["compile"].get("wall_s", 0) for s in seeds.values())
        tokens = statistics.fmean(s["compile"].get("prompt_tokens", 0) + s["compile"].get("completion_tokens", 0)
                                  for s in seeds.values())
        solved = ", ".join(f"{sum(r['score'] for r in seeds[s]['rows']):g}" for s in sorted(seeds))
        per_query = statistics.fmean(s["rows"][0].get("eval_calls", len(s["rows"])) / len(s["rows"]) for s in seeds.values())
        counted = [s["compile"]["metric_calls"] for s in seeds.values() if "metric_calls" in s["compile"]]
        metric_calls = f", {statistics.fmean(counted):.0f} metric calls" if counted else ""  # counted since 2026-11-26
        print(f"# {arm}: seeds {sorted(seeds)} scored {solved} of {lift['problems']}, compile {wall:.0f} s and "
              f"{tokens:.0f} tokens{metric_calls} per seed, {per_query:.1f} LM calls per held-out problem, best other arm {best} ({vs['difference']:+.3f}, CI {vs['ci95'][0]:+.3f} .. "
              f"{vs['ci95'][1]:+.3f})")
        if args.task == "game24" and (ceilings := template_ceilings(args, arm, seeds)):
            print(f"# {arm}: the kept demos' own search solves {ceilings} of {lift['problems']} (their ceiling), the "
                  f"student {solved}")
        print(f"# {arm}: {frontier(results, arm, spent)}")
        print(f"peers: task={args.task} optimizer={arm} seeds={len(seeds)} problems={lift['problems']} calls={calls:.0f} "
              f"score={score[arm]:.3f} min={min(statistics.fmean(r['score'] for r in s['rows']) for s in seeds.values()):.3f} "
              f"lift={lift['difference']:+.3f} ci_low={lift['ci95'][0]:+.3f} vs_best_other={vs['difference']:+.3f} ci_low_vs_best={vs['ci95'][0]:+.3f}", flush=True)
    where = Path(args.out) / args.task
    shown = table_arms(where / "table.md") or arms  # the results table's rows, where there is a table
    title = f"{args.task}: held-out score against compile cost"
    print(f"plot: {score_against_cost(plot_points(results, shown), where / 'peers.png', title)}")


def frontier(results, arm: str, spent: dict[str, float]) -> str:
    """Where `arm` stands on the cost frontier: the arms with fewer compile calls that beat it by a paired CI above
    zero (it is dominated by them), and the arms with no more calls that it does not beat by such a CI."""
    fewer = [o for o in spent if o != arm and spent[o] <= spent[arm]]
    ci = {o: paired(results, arm, o)["ci95"] for o in fewer}  # arm - o; o beats arm where its upper end is below 0
    dominated = [o for o in fewer if spent[o] < spent[arm] and ci[o][1] < 0]
    beaten = [o for o in fewer if ci[o][0] > 0]
    level = [o for o in fewer if o not in beaten]
    where = f"dominated by {', '.join(dominated)}" if dominated else "on the cost frontier"
    parts = [f"ahead (paired CI above zero) of {', '.join(beaten)}"] * bool(beaten)
    parts += [f"not ahead of {', '.join(level)}"] * bool(level)
    return f"{where}; of the {len(fewer)} arm(s) spending no more compile calls: {'; '.join(parts) or 'none'}"


def template_ceilings(args, arm: str, seeds: dict) -> str:
    """Per seed, the held-out puzzles the arm's kept demos solve when their own program is run directly (see
    benchmarks/ceiling.py), or "" for an arm that keeps no demos."""
    puzzles = task_parts("game24")[4](args.eval, args.eval_offset)
    found = {s: ceiling(Path(args.out) / "game24" / arm / f"seed{s}", puzzles) for s in sorted(seeds)}
    return ", ".join("-" if c is None else str(sum(c)) for c in found.values()) if any(found.values()) else ""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--task", default="game24", choices=["game24", "gsm8k"])
    ap.add_argument("--arms", default=None, help="comma-separated arms; default: every arm of the task's menu")
    ap.add_argument("--seeds", default="0,1,2", help="comma-separated seeds")
    ap.add_argument("--train", type=int, default=12, help="training examples (the earlier main job's 12 puzzles)")
    ap.add_argument("--train-offset", type=int, default=100)
    ap.add_argument("--eval", type=int, default=48, help="held-out examples")
    ap.add_argument("--eval-offset", type=int, default=None,
                    help="first held-out example (rank - 1); default: examples no other benchmark uses (game24 test "
                         "ranks 953-1000; gsm8k the last --eval of its 1319 test problems)")
    ap.add_argument("--generations", type=int, default=4, help="G, and the matched attempts of the other arms")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=512)
    ap.add_argument("--budget-calls", type=int, default=None, metavar="N",
                    help="match every arm to N metric calls of its compile, GEPA's max_metric_calls: tfgrpo's and "
                         "GEPA's max_metric_calls, SIMBA's steps, MIPROv2's trials, the candidate sets of bootstrap-rs "
                         "and infer-rules (BootstrapFewShot and KNN spend what they need: at most train x G, and "
                         "none); give it its own --out. Default: each arm's own settings, and bootstrap-rs and "
                         f"infer-rules matched to the mean compile calls of {MAIN_ARM} in --out (else 120)")
    ap.add_argument("--out", default="runs/bench-peers")
    ap.add_argument("--report", action="store_true", help="only print the lines and the plot from saved results")
    ap.add_argument("--mlflow", default=None, metavar="URI",
                    help="log each arm and seed as its own MLflow run in this store (e.g. sqlite:///runs/mlflow.db)")
    add_endpoint_args(ap)
    args = ap.parse_args()
    if args.eval_offset is None:
        args.eval_offset = {"game24": 52, "gsm8k": 1319 - args.eval}[args.task]
    args.match_calls = args.budget_calls  # given: every arm is matched to it
    if args.budget_calls is None:
        main = load_results(Path(args.out), args.task).get(MAIN_ARM, {})
        args.budget_calls = round(statistics.fmean(s["compile"]["calls"] for s in main.values())) if main else 120
    arms = [a.strip() for a in args.arms.split(",")] if args.arms else menu(args.task)
    if not args.report and (unknown := [a for a in arms if a not in menu(args.task)]):
        why = [f"{a} was explored and superseded ({EXPLORED[a]})" if a in EXPLORED else
               f"{a} is made for {ONLY_FOR[a]}" if a in ONLY_FOR else f"{a} is no arm" for a in unknown]
        raise SystemExit(f"{'; '.join(why)}: the arms on {args.task} are {', '.join(menu(args.task))}")
    if not args.report:
        with endpoint(args, n_ctx=8192) as api_base:
            lm = local_dspy_lm(args.model, api_base, temperature=0.3, max_tokens=args.max_tokens, timeout=300,
                               num_retries=2, cache=False)
            dspy.configure(lm=lm)
            for seed in [int(s) for s in args.seeds.split(",")]:
                for arm in arms:
                    run_arm(arm, seed, args, lm)
    report(args)


if __name__ == "__main__":
    main()
