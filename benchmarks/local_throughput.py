"""How fast the embedded model serves the main job's requests, per speculative decoding mode, and at what quality.

    .venv/bin/python -m benchmarks.local_throughput                    # ~20 min on 2 cores
    .venv/bin/python -m benchmarks.local_throughput --main-job         # + the main job end to end, fresh cache
    .venv/bin/python -m benchmarks.local_throughput --model qwen2.5-coder-0.5b --modes off ngram-mod --puzzles 1 \
        --max-tokens 48                                                # the smallest run (CI: tests/test_benchmarks.py)

1. Speculative decoding. For each mode of --modes (tfgrpo.local_model.SPECULATIVE), a fresh llama-server with that
   mode serves the main job's own kind of request: the Game of 24 program with the demo a probe kept
   (--program: the main job's arm of benchmarks/peers.py, seed 0) and the program without it, each on --puzzles
   held-out puzzles (test ranks from --offset + 1; never the peers' or the main job's), at the evaluation
   temperature of configs/local.toml, DSPy's cache off. From the server's own /metrics: completion tokens per
   second of wall time (prompt processing included), and the share of drafted tokens the model accepted. Quality:
   the puzzles solved, paired per request against mode "off" (difference with a 95% bootstrap CI): speculation
   must change how fast a reply comes, not what it says.
2. With --slots N...: decode rate with N slots and N requests in flight (the batching question, answered earlier:
   little on 2 cores).
3. With --main-job: `tfgrpo run configs/local.toml` as a subprocess in a temp run dir and an empty DSPy cache.

Last lines: one `local_throughput: mode=M tok_s=X acceptance=0.xx solved=S/N quality_diff=+0.xxx ci=[lo,hi]` per mode,
then `local_throughput: mode=BEST speedup=X.XXx quality_diff=+0.xxx ci=[lo,hi] main_job_s=Z` for the fastest mode.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

import benchmarks  # noqa: F401  (before dspy: LiteLLM's bundled price map, no fetch)
from tfgrpo.config import Config
from tfgrpo.evaluate import evaluate_program, paired_difference
from tfgrpo.lms import local_dspy_lm
from tfgrpo.local_model import SPECULATIVE, LocalServer
from tfgrpo.local_weights import DEFAULT_MODEL
from tfgrpo.tasks.game24 import Game24Solver, game24_metric, load_game24

MAIN_JOB_PROGRAM = ROOT / "benchmarks/results/peers/game24/tfgrpo-probed-wide+demos/seed0/program.json"


def metrics(api_base: str) -> dict[str, float]:
    text = urllib.request.urlopen(api_base.removesuffix("/v1") + "/metrics", timeout=30).read().decode()
    return {m[1]: float(m[2]) for m in re.finditer(r"^llamacpp:(\w+) ([0-9.e+-]+)$", text, re.M)}


def serve_requests(mode: str, args, temperature: float) -> dict:
    """The main job's two programs on the held-out puzzles, served by a fresh server in `mode`."""
    puzzles = load_game24("game24_test", limit=args.puzzles, offset=args.offset)
    compiled = Game24Solver()
    compiled.load(str(args.program))
    with LocalServer(args.model, n_ctx=4096, speculative=mode) as server:
        lm = local_dspy_lm(server.model_alias, server.api_base, max_tokens=args.max_tokens, temperature=temperature,
                           cache=False, timeout=600)
        before, t0 = metrics(server.api_base), time.perf_counter()
        rows = []
        for name, program in (("with-demo", compiled), ("plain", Game24Solver())):
            found = evaluate_program(program, puzzles, game24_metric, lm=lm, num_threads=args.threads, name=name)
            rows += [dict(r, problem=f"{name}/{r['problem']}") for r in found]
        seconds, after = time.perf_counter() - t0, metrics(server.api_base)
    delta = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    drafted = delta.get("spec_decode_num_draft_tokens_total", 0)
    return {"mode": mode, "seconds": seconds, "tokens": delta["tokens_predicted_total"],
            "tok_s": delta["tokens_predicted_total"] / seconds,
            "acceptance": delta.get("spec_decode_num_accepted_tokens_total", 0) / drafted if drafted else 0.0,
            "rows": rows}


def decode_rate(model: str, slots: int, tokens: int = 96) -> float:
    """Completion tokens per second with `slots` slots and as many requests in flight, each `tokens` long."""
    def one(server, i: int) -> int:
        body = {"model": server.model_alias, "max_tokens": tokens, "temperature": 0.7, "ignore_eos": True,
                "messages": [{"role": "user", "content": f"[{slots}-{i}] Write a long essay about river {i}."}]}
        req = urllib.request.Request(f"{server.api_base}/chat/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=600) as resp:
            return json.loads(resp.read())["usage"]["completion_tokens"]

    with LocalServer(model, n_ctx=2048, parallel=slots, speculative="off") as server:
        one(server, -1)  # warm-up: the first request pays for loading pages of the weights
        t0 = time.perf_counter()
        with ThreadPoolExecutor(slots) as pool:
            done = sum(pool.map(lambda i: one(server, i), range(2 * slots)))
    return done / (time.perf_counter() - t0)


def main_job_seconds() -> float:
    """Wall time of `tfgrpo run configs/local.toml` in a temp run dir with an empty DSPy cache."""
    with tempfile.TemporaryDirectory() as tmp:
        text = (ROOT / "configs" / "local.toml").read_text()
        text = re.sub(r'^run_dir = .*$', f'run_dir = "{tmp}/run"', text, count=1, flags=re.M)
        (cfg := Path(tmp) / "local.toml").write_text(text)
        env = {**os.environ, "DSPY_CACHEDIR": f"{tmp}/dspy-cache"}
        t0 = time.perf_counter()
        proc = subprocess.run([str(Path(sys.executable).parent / "tfgrpo"), "run", str(cfg)], env=env, cwd=ROOT,
                              capture_output=True, text=True)
        seconds = time.perf_counter() - t0
        print("\n".join(proc.stdout.splitlines()[-6:]), flush=True)
        if proc.returncode:
            raise SystemExit(f"the main job failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
        return seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--modes", nargs="+", default=["off", "ngram-simple", "ngram-mod", "ngram-map-k", "draft"],
                    choices=list(SPECULATIVE), help="speculative modes to time; off is always timed")
    ap.add_argument("--program", type=Path, default=MAIN_JOB_PROGRAM, help="a saved Game24Solver with its demo")
    ap.add_argument("--puzzles", type=int, default=12, help="held-out puzzles per program")
    ap.add_argument("--offset", type=int, default=24, help="first held-out puzzle (test rank - 901)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=None, help="default: the main job's (configs/local.toml)")
    ap.add_argument("--slots", type=int, nargs="*", default=[], help="also time decoding with these slot counts")
    ap.add_argument("--main-job", action="store_true", help="also time README command 1 (fresh DSPy cache)")
    args = ap.parse_args()
    policy = Config.load(ROOT / "configs" / "local.toml").policy
    args.max_tokens = args.max_tokens or policy.max_tokens

    for slots in args.slots:
        print(f"  {slots} slot(s), {slots} request(s) in flight: {decode_rate(args.model, slots):.1f} tok/s", flush=True)
    runs = {}
    for mode in ["off", *[m for m in args.modes if m != "off"]]:
        runs[mode] = run = serve_requests(mode, args, policy.temperature)
        solved = sum(r["score"] >= 1 for r in run["rows"])
        diff = paired_difference(runs["off"]["rows"], run["rows"])
        run["diff"] = diff
        print(f"local_throughput: mode={mode} tok_s={run['tok_s']:.1f} acceptance={run['acceptance']:.2f} "
              f"solved={solved}/{len(run['rows'])} tokens={run['tokens']:.0f} seconds={run['seconds']:.0f} "
              f"quality_diff={diff['difference']:+.3f} ci=[{diff['ci95'][0]:+.3f},{diff['ci95'][1]:+.3f}]", flush=True)
    best = max(runs, key=lambda m: runs[m]["tok_s"])
    diff = runs[best]["diff"]
    main_s = f"{main_job_seconds():.0f}" if args.main_job else "not-run"
    print(f"local_throughput: mode={best} speedup={runs[best]['tok_s'] / runs['off']['tok_s']:.2f}x "
          f"quality_diff={diff['difference']:+.3f} ci=[{diff['ci95'][0]:+.3f},{diff['ci95'][1]:+.3f}] "
          f"main_job_s={main_s}")


if __name__ == "__main__":
    main()
