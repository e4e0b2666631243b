"""How fast the embedded model serves: one request at a time vs N at once, prefix reuse in a real compile step,
and (with --main-job) the README's main job end to end.

    .venv/bin/python benchmarks/local_throughput.py               # ~8 min on 2 cores
    .venv/bin/python benchmarks/local_throughput.py --main-job    # + the main job in a fresh DSPy cache (~10-20 min)
    .venv/bin/python benchmarks/local_throughput.py --model qwen2.5-coder-0.5b --parallel 1 --rounds 1 --tokens 8 \
        --step-batch 1 --step-generations 2                       # the smallest run (CI: tests/test_benchmarks.py)

1. Decode throughput. For each N of --parallel, a llama-server with N slots gets --rounds x N requests from N
   client threads at once; each request has its own prompt (no cache hit) and decodes exactly --tokens tokens
   (ignore_eos). Rate = completion tokens / wall seconds. single_tok_s is N=1 on the same binary; the ratio is
   taken at the best N. With --engines both, llama-cpp-python's server (one request at a time) is timed too.
2. Prefix reuse. One optimization step of the main job (configs/local.toml: Game24, batch 4, G=4, contrast
   path; --step-batch and --step-generations shrink it) against a fresh server with the chosen N, DSPy's cache off; prefix_saved = prompt tokens the server
   took from a slot's KV cache / all prompt tokens, read from its own /metrics counters.
3. With --main-job: `tfgrpo run configs/local.toml` as a subprocess in a temp run dir and an empty DSPy cache.

Last line: local_throughput: model=... single_tok_s=X parallel=N parallel_tok_s=Y ratio=Y/X prefix_saved=0.xx main_job_s=Z
"""

from __future__ import annotations

import argparse
import contextlib
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
sys.path.insert(0, str(ROOT))

import tfgrpo  # noqa: E402,F401
import dspy  # noqa: E402

from tfgrpo.config import Config  # noqa: E402
from tfgrpo.lms import local_dspy_lm  # noqa: E402
from tfgrpo.local_model import LocalServer  # noqa: E402

TOPICS = ["rivers", "volcanoes", "bridges", "comets", "forests", "deserts", "harbors", "glaciers", "canyons",
          "islands", "tunnels", "lighthouses", "orchards", "caves", "reefs", "meadows"]


def _post(api_base: str, body: dict) -> dict:
    req = urllib.request.Request(f"{api_base}/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as resp:
        return json.loads(resp.read())


def decode_rate(server: LocalServer, clients: int, rounds: int, tokens: int, salt: str) -> float:
    """Completion tokens per second with `clients` requests in flight, each decoding exactly `tokens` tokens."""
    def one(i: int) -> int:
        topic = TOPICS[i % len(TOPICS)]
        body = {"model": server.model_alias, "max_tokens": tokens, "temperature": 0.7, "ignore_eos": True,
                "messages": [{"role": "user", "content": f"[{salt}-{i}] Write a long essay about {topic} "
                              f"number {i}: their history, how they form, and why people visit them."}]}
        return _post(server.api_base, body)["usage"]["completion_tokens"]

    one(-1)  # warm-up: the first request pays for loading pages of the weights
    t0 = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        done = sum(pool.map(one, range(clients * rounds)))
    return done / (time.perf_counter() - t0)


def metrics(api_base: str) -> dict[str, float]:
    text = urllib.request.urlopen(api_base.removesuffix("/v1") + "/metrics", timeout=30).read().decode()
    return {m[1]: float(m[2]) for m in re.finditer(r"^llamacpp:(\w+) ([0-9.e+-]+)$", text, re.M)}


def one_step_prefix_saved(args, parallel: int) -> tuple[float, float]:
    """(prefix_saved, seconds) of one optimization step of the main job's task on a fresh server."""
    from tfgrpo.cli import _tfgrpo_knobs
    from tfgrpo.optimizers import TrainingFreeGRPO
    from tfgrpo.task import task_parts

    config = Config.load(ROOT / "configs" / "local.toml")
    t = config.task
    knobs = {**_tfgrpo_knobs(config), "num_train_epochs": 1, "num_threads": max(parallel, 2)}
    knobs["batch_size"] = args.step_batch or knobs["batch_size"]
    knobs["num_generations"] = args.step_generations or knobs["num_generations"]
    with contextlib.ExitStack() as stack, \
            LocalServer(args.model, n_ctx=config.policy.n_ctx, parallel=parallel, engine="llama-server") as server:
        parts = task_parts(config, stack)
        trainset = parts.load(t.trainset, limit=knobs["batch_size"], offset=t.train_offset)
        lm = local_dspy_lm(server.model_alias, server.api_base, max_tokens=config.policy.max_tokens,
                           temperature=config.policy.temperature, cache=False, timeout=600)
        before, t0 = metrics(server.api_base), time.perf_counter()
        with dspy.context(lm=lm):
            TrainingFreeGRPO(parts.reward, progress=lambda *_: None, **knobs).compile(parts.make(), trainset=trainset)
        seconds, after = time.perf_counter() - t0, metrics(server.api_base)
    cached = after["prompt_tokens_cached_total"] - before.get("prompt_tokens_cached_total", 0)
    processed = after["prompt_tokens_total"] - before.get("prompt_tokens_total", 0)
    print(f"  one step: {seconds:.0f} s, prompt tokens {processed:.0f} processed + {cached:.0f} from cache", flush=True)
    return cached / max(1.0, cached + processed), seconds


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
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--parallel", type=int, nargs="+", default=[1, 2, 4, 8], help="slot counts to time")
    ap.add_argument("--rounds", type=int, default=2, help="requests per client thread")
    ap.add_argument("--tokens", type=int, default=96, help="completion tokens per request")
    ap.add_argument("--engines", choices=["llama-server", "both"], default="llama-server")
    ap.add_argument("--step-batch", type=int, default=None, help="queries in the prefix-reuse step (default: the config's)")
    ap.add_argument("--step-generations", type=int, default=None, help="G of the prefix-reuse step (default: the config's)")
    ap.add_argument("--main-job", action="store_true", help="also time README command 1 (fresh DSPy cache)")
    args = ap.parse_args()

    rates = {}
    for n in sorted(set(args.parallel) | {1}):
        with LocalServer(args.model, n_ctx=2048, parallel=n, engine="llama-server") as server:
            rates[n] = decode_rate(server, n, args.rounds, args.tokens, salt=f"p{n}")
        print(f"  llama-server, {n} slot(s), {n} request(s) in flight: {rates[n]:.1f} completion tok/s", flush=True)
    if args.engines == "both":
        with LocalServer(args.model, n_ctx=2048, engine="llama-cpp-python") as server:
            rate = decode_rate(server, 2, args.rounds, args.tokens, salt="lcp")
        print(f"  llama-cpp-python (one at a time), 2 requests in flight: {rate:.1f} completion tok/s", flush=True)
    best = max(rates, key=rates.get)
    prefix_saved, _ = one_step_prefix_saved(args, best)
    main_s = f"{main_job_seconds():.0f}" if args.main_job else "not-run"
    print(f"local_throughput: model={args.model} single_tok_s={rates[1]:.1f} parallel={best} "
          f"parallel_tok_s={rates[best]:.1f} ratio={rates[best] / rates[1]:.2f} prefix_saved={prefix_saved:.2f} "
          f"main_job_s={main_s}")


if __name__ == "__main__":
    main()
