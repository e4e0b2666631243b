"""What each learning mechanism of issue 54 is worth on the Game of 24, replayed on the 1.5B's own programs.

A compile on the main job's 12 training puzzles is mostly a search among the programs the student writes: a 1.5B
copies a kept demo's program on every later attempt (measured: 0 of 18 attempts changed it at temperature 0.7), so
once a demo is kept its attempts are that program's template again. This benchmark first samples the student's
zero-shot programs (`--collect N`, the embedded model or any endpoint) and runs each one directly on every training
puzzle of the main job (its reward there, as `game24_reward` gives it) and on 48 harder training puzzles (ranks
801-848: how general its search is). It then replays many compiles on that pool, exactly as the optimizer runs them
(batches, groups, dynamic sampling, exploring attempts, candidates, the probe's paired sign test, demo candidates
found on the way, the stop when nothing is left to learn, the metric-call budget), drawing a zero-shot attempt from
the pool and a demo-led attempt as the demo's program, and reports what the kept demo would solve of the harder
training puzzles. No held-out puzzle is read: settings are chosen here, on training puzzles, and confirmed on
held-out ones by `benchmarks.peers`. Its figures are leads, not results: its probe runs every candidate on every query
and its student is a draw from a fixed pool (a probe of 4 that tied the default here lost on held-out puzzles:
benchmarks/measurements.md).

    .venv/bin/python -m benchmarks.replay --collect 120            # sample the pool (~25 min on 2 cores)
    .venv/bin/python -m benchmarks.replay                          # replay every mechanism, with and without

Last lines, one per configuration:
  replay: config=NAME runs=R general_mean=G p10=A p50=B share_flat_or_better=F share_none=N metric_calls=C
(general: of the 48 harder training puzzles, what the kept demo's own program solves; flat or better: >= 24, what a
search over one flat expression solves there).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import time
from dataclasses import dataclass, replace
from pathlib import Path

from tfgrpo.optimizers.judge import probe_power

POOL = Path(__file__).resolve().parent / "results" / "replay" / "pool.json"
FLAT = 24  # what a flat a op b op c op d search solves of the 48 harder training puzzles


@dataclass(frozen=True)
class Setting:
    """The knobs a replayed compile runs with (the main job's split: 12 puzzles, G = 4, batches of 4)."""

    probe_alpha: float = 1.0
    num_explore_generations: int = 0
    focus_on_failures: bool = False
    max_resampled_queries: int = 0
    found_candidates: bool = True  # the probe's successes without demos, probed in the next step
    stop_when_nothing_to_learn: bool = False
    probe_min_power: float = 0.0  # the probe skipped (free slot filled by group advantage) and the run ended below it
    first_generations: int | None = None  # issue 66, item 3: more attempts per query in the first step
    first_look: bool = True  # with probe_min_power, G >= 4: the gate first judged on half of each group (step.py)
    max_metric_calls: int | None = None
    num_train_epochs: int = 1
    num_generations: int = 4
    batch_size: int = 4
    probe_size: int = 8
    max_probed_edits: int = 3


CONFIGS = {  # each mechanism alone on top of the arm before issue 54, then the preset (light) and it without each
    "before": Setting(found_candidates=False),
    "+sign_test": Setting(probe_alpha=0.15, found_candidates=False),
    "+explore": Setting(num_explore_generations=2, found_candidates=False),
    "+focus": Setting(focus_on_failures=True, found_candidates=False),
    "+dynamic_sampling": Setting(max_resampled_queries=4, found_candidates=False),
    "+found_candidates": Setting(),
    "+stop": Setting(stop_when_nothing_to_learn=True, found_candidates=False),
    "light": Setting(probe_alpha=0.15, num_explore_generations=2, stop_when_nothing_to_learn=True, max_metric_calls=120),
}
CONFIGS.update({f"light-{name}": replace(CONFIGS["light"], **{knob: off}) for name, knob, off in (
    ("sign_test", "probe_alpha", 1.0), ("explore", "num_explore_generations", 0),
    ("found_candidates", "found_candidates", False), ("stop", "stop_when_nothing_to_learn", False))})
# issue 66: the default now (light as measured on held-out puzzles, with its stops), and with more first-step attempts
CONFIGS["default"] = Setting(stop_when_nothing_to_learn=True, probe_min_power=0.4, max_metric_calls=150)
CONFIGS["default-first_look"] = replace(CONFIGS["default"], first_look=False)  # whole groups before the gate
CONFIGS.update({f"default+first_G={g}": replace(CONFIGS["default"], first_generations=g) for g in (6, 8)})
# and with a cheaper probe: fewer queries (its power falls too, so it is skipped sooner) or one candidate per step
CONFIGS.update({f"default+probe_size={n}": replace(CONFIGS["default"], probe_size=n) for n in (4, 6)})
CONFIGS["default+max_probed_edits=1"] = replace(CONFIGS["default"], max_probed_edits=1)
# the calls a smaller probe saves, spent on more first-step attempts (item 3)
CONFIGS.update({f"default+probe_size={n}+first_G=8": replace(CONFIGS["default"], probe_size=n, first_generations=8)
                for n in (4, 6)})


def sign_test_p(wins: int, losses: int) -> float:
    n = wins + losses
    return sum(math.comb(n, k) for k in range(wins, n + 1)) / 2 ** n if n else 1.0


def replay(pool: list[dict], s: Setting, rng: random.Random) -> tuple[int | None, int]:
    """One compile: the kept demo's program (an index of the pool, None without one) and its metric calls."""
    n = len(pool[0]["train"])
    demo, evidence, found, calls = None, {}, [], 0
    reward = lambda p, q: pool[p]["train"][q]  # noqa: E731
    for epoch in range(s.num_train_epochs):
        order = list(range(n))
        rng.shuffle(order)
        for at in range(0, n, s.batch_size):
            ranked = order[at:] + order[:at]
            if s.focus_on_failures:
                ranked.sort(key=lambda q: {False: 0, None: 1, True: 2}[evidence.get(q)])
            queries, reserve, groups = ranked[:s.batch_size], ranked[s.batch_size:s.batch_size + s.max_resampled_queries], []
            G = (s.first_generations or s.num_generations) if epoch == at == 0 else s.num_generations
            explore_from = G - s.num_explore_generations
            while queries:  # 1. rollouts (dynamic sampling: more queries while groups lack contrast)
                for q in queries:
                    progs = [demo if demo is not None and g < explore_from else rng.randrange(len(pool)) for g in range(G)]
                    groups.append((q, progs, [reward(p, q) for p in progs]))
                    calls += G
                missing = max(s.batch_size - sum(len(set(r)) > 1 for _, _, r in groups), 0)
                queries, reserve = reserve[:missing], reserve[missing:]
            half = G // 2  # the first look: where half of each group leaves the probe no power, the rest is not made
            if s.first_look and s.probe_min_power and G >= 4 and not s.max_resampled_queries and probe_power(
                    statistics.fmean(r >= 1 for _, _, rs in groups for r in rs[:half]), s.probe_size) < s.probe_min_power:
                calls -= sum(len(rs) - half for _, _, rs in groups)
                groups = [(q, ps[:half], rs[:half]) for q, ps, rs in groups]
            if demo is not None:
                for q, _, rs in groups:
                    evidence[q] = statistics.fmean(r >= 1 for r in rs[:explore_from]) >= 0.5
            if s.probe_min_power and probe_power(statistics.fmean(r >= 1 for _, _, rs in groups for r in rs),
                                                 s.probe_size) < s.probe_min_power:
                if demo is None:  # the free slot: the full success with the highest group advantage
                    wins = [(r - statistics.fmean(rs), p) for _, ps, rs in groups for p, r in zip(ps, rs) if r >= 1]
                    demo = max(wins, key=lambda w: w[0])[1] if wins else None
                return demo, calls
            kept, probe_calls, base_solved, found = _probe(pool, s, rng, demo, evidence, groups, found)
            calls += probe_calls
            if kept is not None:
                demo, evidence = kept
            informative = any(len(set(rs)) > 1 for _, _, rs in groups)
            if s.stop_when_nothing_to_learn and (not informative or base_solved):
                return demo, calls
            if s.max_metric_calls and calls >= s.max_metric_calls:
                return demo, calls
    return demo, calls


def _probe(pool, s: Setting, rng, demo, evidence, groups, found):
    """The probe stage: (the kept demo and its evidence, or None), calls, whether the current program solved every
    probe query, and the demo candidates found for the next step."""
    n = len(pool[0]["train"])
    cands = []
    for q, progs, rs in groups:
        if len(set(rs)) < 2:
            continue
        G = len(progs)
        explore_from = G - s.num_explore_generations
        idx = range(G)
        if s.num_explore_generations and demo is not None and len(set(rs[:explore_from])) == 1:
            idx = range(explore_from, G)  # the demo's own uniform copies are no candidate
        b = max(idx, key=lambda g: (rs[g], -g))
        if rs[b] > 0:
            cands.append((rs[b], rs[b] - statistics.fmean(rs), progs[b]))
    cands = (sorted(cands, key=lambda c: (-c[0], -c[1])) + [(1.0, 0.0, p) for p in found])[:(s.max_probed_edits + 1) // 2]
    tried = {q for q, _, _ in groups}
    outside = [q for q in range(n) if q not in tried] or list(range(n))
    failing = [q for q in outside if evidence.get(q) is False] if s.focus_on_failures else []
    chosen = rng.sample(failing, min(len(failing), (s.probe_size + 1) // 2))
    rest = [q for q in outside if q not in chosen]
    queries = chosen + rng.sample(rest, min(s.probe_size - len(chosen), len(rest)))
    if not cands:
        return None, 0, False, []
    base = [demo if demo is not None else rng.randrange(len(pool)) for _ in queries]
    base_ok = [pool[p]["train"][q] >= 1 for p, q in zip(base, queries)]
    new_found = [p for p, ok in zip(base, base_ok) if ok] if demo is None and s.found_candidates else []
    best, calls = None, len(queries)
    for _, _, p in cands:
        ok = [pool[p]["train"][q] >= 1 for q in queries]
        calls += len(queries)
        wins = sum(c and not b for c, b in zip(ok, base_ok))
        losses = sum(b and not c for c, b in zip(ok, base_ok))
        if wins > losses and sign_test_p(wins, losses) <= s.probe_alpha and (best is None or sum(ok) > best[0]):
            best = (sum(ok), p, ok)
    if best is None:
        evidence.update(zip(queries, base_ok))
        return None, calls, all(base_ok), new_found
    return (best[1], dict(zip(queries, best[2]))), calls, all(base_ok), new_found


def report(pool: list[dict], runs: int, seed: int) -> list[str]:
    lines = []
    for name, setting in CONFIGS.items():
        rng = random.Random(seed)
        results = [replay(pool, setting, rng) for _ in range(runs)]
        general = sorted(pool[d]["general"] if d is not None else 0 for d, _ in results)
        lines.append(f"replay: config={name} runs={runs} general_mean={statistics.fmean(general):.1f} "
                     f"p10={general[runs // 10]} p50={general[runs // 2]} "
                     f"share_flat_or_better={sum(g >= FLAT for g in general) / runs:.2f} "
                     f"share_none={sum(d is None for d, _ in results) / runs:.2f} "
                     f"metric_calls={statistics.fmean(c for _, c in results):.0f}")
    return lines


def collect(n: int, out: Path, endpoint_args) -> None:
    """Sample `n` zero-shot programs of the student (temperature 0.7, the learning temperature) on the main job's
    training puzzles, then score each one directly on them and on the 48 harder training puzzles."""
    import dspy

    from benchmarks.ceiling import solves, swapped
    from benchmarks.common import endpoint
    from tfgrpo.lms import local_dspy_lm
    from tfgrpo.tasks.game24 import Game24Solver, game24_reward, load_game24
    from tfgrpo.tasks.game24.program import last_line, strip_fences
    from tfgrpo.tasks.game24.verify import puzzle_numbers
    from tfgrpo.tasks.sandbox import run_python

    train = load_game24("game24_train", limit=12, offset=100)
    harder = [puzzle_numbers(p.numbers) for p in load_game24("game24_train", limit=48, offset=800)]
    pool, t0 = [], time.time()
    with endpoint(endpoint_args, n_ctx=8192) as api_base:
        lm = local_dspy_lm(endpoint_args.model, api_base, temperature=0.7, max_tokens=512, timeout=300, num_retries=2,
                           cache=False)
        for k in range(n):
            example = train[k % len(train)]
            student = Game24Solver()
            student.write_program.lm = lm.copy(rollout_id=10_000 + k)
            code = student(numbers=example.numbers).code or ""
            rewards = []
            for ex in train:
                program = swapped(strip_fences(code), example.numbers, puzzle_numbers(ex.numbers))
                result = run_python(program, wall_timeout_s=10.0, cpu_time_s=10, memory_mb=512) if program else None
                answer = dspy.Prediction(answer=last_line(result.stdout) if result else "", ran=bool(result and result.ok))
                rewards.append(game24_reward(ex, answer).score)
            general = sum(solves(code, example.numbers, nums) for nums in harder)
            pool.append({"numbers": example.numbers, "code": code, "train": rewards, "general": general})
            print(f"{k + 1}/{n}: general {general}/48, solves its own {rewards[k % len(train)] >= 1} "
                  f"({time.time() - t0:.0f} s)", flush=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"provenance": f"benchmarks.replay --collect {n}: zero-shot Game24Solver programs at "
                                             "temperature 0.7 on train ranks 101-112; general = of train ranks 801-848",
                               "programs": pool}, indent=1))


def main() -> None:
    from benchmarks.common import add_endpoint_args

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--collect", type=int, default=0, metavar="N", help="sample N programs into --pool first")
    ap.add_argument("--pool", type=Path, default=POOL)
    ap.add_argument("--runs", type=int, default=3000, help="replayed compiles per configuration")
    ap.add_argument("--seed", type=int, default=0)
    add_endpoint_args(ap)
    args = ap.parse_args()
    if args.collect:
        collect(args.collect, args.pool, args)
    pool = json.loads(args.pool.read_text())["programs"]
    print(f"pool: {len(pool)} programs; general (of 48): {sorted(p['general'] for p in pool)}")
    print("\n".join(report(pool, args.runs, args.seed)))


if __name__ == "__main__":
    main()
