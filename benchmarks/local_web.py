"""dspy.ReAct vs the step agent on the offline web, embedded model: seconds, tool calls, failed calls, F1.

    .venv/bin/python -m benchmarks.local_web --questions 4 --offset 250

Runs each agent over the same HotpotQA dev questions (offset 250+: outside the 50 the local-web config
evaluates), one at a time, on the embedded 1.5B (started if no `tfgrpo lm start` server runs; `--api-base`:
another OpenAI-compatible endpoint) with the local site in this process, DSPy's cache off. A failed call is a
tool call whose observation is an error. Last lines:
  local_web: agent=react questions=N s_per_question=S tool_calls=T failed_calls=F f1=X
  local_web: agent=step ...
"""

from __future__ import annotations

import argparse
import statistics
import time


import benchmarks  # noqa: F401  (before dspy: LiteLLM's bundled price map, no fetch)
import dspy

from benchmarks.common import add_endpoint_args, endpoint
from tfgrpo.lms import local_dspy_lm
from tfgrpo.programs.render import FAILED_TOOL
from tfgrpo.tasks.web import PageFetcher, StepAgent, WebTools, load_web, react_agent, token_f1
from tfgrpo.tasks.web.search import make_backend
from tfgrpo.tasks.web.site import running_site


def run(agent, examples) -> dict:
    seconds, calls, failed, f1 = [], [], [], []
    for ex in examples:
        started = time.time()
        try:
            pred = agent(question=ex.question)
            answer, trajectory = str(pred.answer or ""), pred.trajectory
        except Exception as exc:  # an agent that raises scores 0 and is counted
            answer, trajectory = "", {}
            print(f"  raised {type(exc).__name__}: {str(exc)[:120]}")
        seconds.append(time.time() - started)
        names = [k for k, v in trajectory.items() if k.startswith("tool_name_") and v != "finish"]
        calls.append(len(names))
        failed.append(sum(str(trajectory.get(k.replace("tool_name", "observation"), "")).startswith(FAILED_TOOL) for k in names))
        f1.append(token_f1(answer, ex.answer))
        print(f"  {seconds[-1]:5.1f} s, {calls[-1]} calls ({failed[-1]} failed), F1 {f1[-1]:.2f}: {answer[:60]!r}")
    return {"s": statistics.fmean(seconds), "calls": statistics.fmean(calls), "failed": statistics.fmean(failed),
            "f1": statistics.fmean(f1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--questions", type=int, default=4)
    ap.add_argument("--offset", type=int, default=250)
    ap.add_argument("--max-iters", type=int, default=3)
    ap.add_argument("--agents", default="react,step")
    add_endpoint_args(ap)
    args = ap.parse_args()
    examples = load_web("hotpotqa_dev", limit=args.questions, offset=args.offset)
    lines = []
    with endpoint(args) as api_base:
        dspy.configure(lm=local_dspy_lm(args.model, api_base, max_tokens=256, temperature=0.3, cache=False,
                                        timeout=300))
        with running_site() as base:
            tools = WebTools(make_backend("local", base_url=base), fetcher=PageFetcher(allowed_origins=[base]), top_k=3,
                             snippet_chars=200, page_chars=1500)
            for name in args.agents.split(","):
                agent = react_agent(tools, max_iters=args.max_iters) if name == "react" else \
                    StepAgent(tools, max_iters=args.max_iters, constrained="json_object")
                print(f"{name}:")
                r = run(agent, examples)
                lines.append(f"local_web: agent={name} questions={len(examples)} s_per_question={r['s']:.1f} "
                             f"tool_calls={r['calls']:.2f} failed_calls={r['failed']:.2f} f1={r['f1']:.3f}")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
