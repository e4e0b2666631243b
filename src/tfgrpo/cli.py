"""The `tfgrpo` command line: compile, evaluate, run (both), show, report, lm start|stop|status.

An error ends a command with one clear message and exit code 2; `--debug` shows its traceback instead.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import os
import sys
import time
from pathlib import Path

import typer
from rich.console import Console
from rich.logging import RichHandler
from rich.markup import escape
from rich.progress import Progress
from rich.table import Table
from rich.text import Text

from tfgrpo.base.util import digest, write_atomic
from tfgrpo.cli_help import HELP_OPTIONS, VERSION, HelpCommand, HelpGroup, reference_text
from tfgrpo.cli_learned import (API_BASE, CONFIG_OR_NAME, FILE_OR_NAME, evaluate_shipped, print_demos, print_provenance,
                                 shipped)
from tfgrpo.cli_lm import lm_app
from tfgrpo.config import Config, ConfigError
from tfgrpo.progress import RunBars, progress_display

app = typer.Typer(add_completion=False, no_args_is_help=True, cls=HelpGroup, context_settings=HELP_OPTIONS,
                  help="Training-Free GRPO for DSPy programs. Every config field: tfgrpo config --reference.")
app.add_typer(lm_app, name="lm")
console = Console(width=None if sys.stdout.isatty() else 120)  # logs and CI: wide enough for the tables
DEBUG = typer.Option(False, "--debug", help="on an error, show the full traceback instead of one line")
VERBOSE = typer.Option(False, "--verbose", "-v", help="log the optimizer's debug messages too")
CONFIG = typer.Argument(..., metavar="CONFIG", help="the run's TOML config (every field: tfgrpo config --reference)")
DRY_RUN = "print the plan (calls, tokens, dollars) and make no LM call (unless --pilot)"
_debug = {"on": False}


@app.callback()
def _main(debug: bool = DEBUG, version: bool = VERSION) -> None:
    _debug["on"] = debug
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # before a command imports dspy: no network fetch


@contextlib.contextmanager
def _errors(debug: bool = False):
    """Turn an error into one clear message and exit code 2 (the traceback with --debug)."""
    try:
        yield
    except (typer.Exit, typer.Abort, KeyboardInterrupt):
        raise
    except Exception as exc:
        if debug or _debug["on"]:
            raise
        prefix = "" if isinstance(exc, (ValueError, OSError)) else f"{type(exc).__name__}: "
        _error(f"error: {prefix}{exc}")
        console.print("(--debug shows the traceback)", style="dim", markup=False, highlight=False)
        raise typer.Exit(2) from None


def _error(message: str) -> None:
    """An error message as it is: red, never wrapped, never read as rich markup ("[E1]", "['question']")."""
    console.print(message, style="red", markup=False, highlight=False, soft_wrap=True)


def _setup_logging(verbose: bool) -> None:
    logging.basicConfig(level=logging.WARNING, format="%(message)s", datefmt="[%X]",
                        handlers=[RichHandler(console=console, show_path=False)], force=True)
    logging.getLogger("tfgrpo").setLevel(logging.DEBUG if verbose else logging.INFO)
    for noisy in ("LiteLLM", "litellm", "httpx", "dspy"):
        logging.getLogger(noisy).setLevel(logging.ERROR)


def _load_config(path: Path, need_keys: bool = True) -> Config:
    """The config, or its errors and exit code 2; `need_keys=False` (a dry run) takes unset api_key_env variables."""
    try:
        return Config.load(path, need_keys=need_keys)
    except ConfigError as exc:
        _error(str(exc))
        raise typer.Exit(2) from None


def _progress() -> Progress:
    return progress_display(console)


def _bars(progress: Progress, num_train_epochs: int = 1) -> RunBars:
    """The optimizer's progress callback, drawn on `progress` (tfgrpo/progress.py)."""
    return RunBars(progress, num_train_epochs, plain_lines=not console.is_terminal)


def _load(load, name: str, key: str, **kwargs) -> list:
    """A dataset, or a message that names its config key (`task.trainset`) and exit code 2 (unknown name, missing or
    bad file, hub unreachable)."""
    try:
        return load(name, **kwargs)
    except ValueError as exc:
        _error(f"error: {key}: {exc}")
        raise typer.Exit(2) from None


def _datasets(load, t) -> tuple[list, list | None, list | None]:
    """The config's trainset, valset and attribution set (None where it names none)."""
    trainset = _load(load, t.trainset, "task.trainset", limit=t.train_limit, offset=t.train_offset)
    valset = _load(load, t.valset, "task.valset", limit=t.val_limit) if t.valset else None
    held_out = (_load(load, t.attribution_set, "task.attribution_set", limit=t.attribution_limit,
                      offset=t.attribution_offset) if t.attribution_set else None)
    return trainset, valset, held_out


@contextlib.contextmanager
def _session(cfg: Config):
    """(policy LM, reflection LM, task parts), with everything started for them stopped on exit."""
    from tfgrpo.lms import open_lms
    from tfgrpo.task import task_parts

    with open_lms(cfg) as (policy, reflection, judge), contextlib.ExitStack() as stack:
        yield policy, reflection, task_parts(cfg, stack, policy=policy, judge_lm=judge)


@contextlib.contextmanager
def _tracking(cfg: Config):
    """The MLflow run of this command when the config has a [tracking] section (tfgrpo.tracking); else None,
    and MLflow is not imported."""
    from tfgrpo.tracking import config_run, store_uri

    if cfg.tracking and cfg.tracking.enabled and importlib.util.find_spec("mlflow") is None:
        _error("[tracking] needs MLflow: pip install -e '.[mlflow]' (scripts/setup.sh installs it)")
        raise typer.Exit(2)
    run_dir = Path(cfg.run_dir)
    with config_run(cfg.tracking, run_dir, log_dir=run_dir / "checkpoint") as run:
        yield run
    if run is not None:  # a configured URI may hold credentials: only the local default store is printed
        see = "" if cfg.tracking.tracking_uri else ("; to see it: LITELLM_LOCAL_MODEL_COST_MAP=True mlflow ui --host "
                                                    f"127.0.0.1 --port 5000 --backend-store-uri {store_uri(cfg.tracking, run_dir)}")
        console.print(f"MLflow run {run.info.run_id}{see}", markup=False, highlight=False)


def _compile(config: Config, parts, policy, reflection, *, start: Path | None = None, steps: int = 0) -> Path:
    """The config's compile; with `start` (a saved program.json), from that program, refit on the config's model
    first, then `steps` learning steps (0: the refit alone)."""
    import dspy

    from tfgrpo.optimizers import DirectExperiences, TrainingFreeGRPO
    from tfgrpo.optimizers.checkpoint import RunMismatchError
    from tfgrpo.optimizers.knobs import resolve
    from tfgrpo.plots import learning_curve
    from tfgrpo.programs import load_program, save_program

    make, load, reward = parts.make, parts.load, parts.reward
    t, o, run_dir = config.task, config.optimizer, Path(config.run_dir)
    trainset, valset, held_out = _datasets(load, t)
    dspy.configure(lm=policy)
    started = time.time()
    if o.method == "direct":
        console.print(f"[bold]compile[/] {len(trainset)} training problems, {o.num_direct_experiences} directly "
                      f"generated experiences -> {escape(str(run_dir))}")
        optimizer = DirectExperiences(num_experiences=o.num_direct_experiences, lm=reflection,
                                      max_words_per_experience=o.max_words_per_experience,
                                      target_predictors=o.target_predictors)
        compiled, steps = optimizer.compile(make(), trainset=trainset), []
    else:
        knobs = config.optimizer_knobs()
        if start is not None:  # the refit decides what the steps start from; none asked: the refit alone
            knobs = {**knobs, "refit": True, **({"max_steps": steps} if steps else {"num_train_epochs": 0})}
        optimizer = TrainingFreeGRPO(reward, reflection_lm=reflection, log_dir=str(run_dir / "checkpoint"),
                                     use_mlflow=bool(config.tracking and config.tracking.enabled), **knobs)
        k = resolve(optimizer, optimizer.explicit_knobs(), str(reflection.model))[0]  # the `auto` preset applied
        console.print(f"[bold]compile[/] {len(trainset)} training problems, G={k.num_generations}, "
                      f"{k.num_train_epochs} epoch(s), batch {k.batch_size}, auto={k.auto!r} -> "
                      f"{escape(str(run_dir))}")
        try:
            with _progress() as progress:
                optimizer.progress = _bars(progress, k.num_train_epochs)
                student = make() if start is None else load_program(make(), start)
                compiled = optimizer.compile(student, trainset=trainset, valset=valset, attribution_set=held_out)
        except RunMismatchError as exc:  # in the config's terms: run_dir, not log_dir
            if not exc.changes:
                raise RunMismatchError(f"run_dir {run_dir}: {exc}") from exc
            raise RunMismatchError(f"run_dir {run_dir} already holds work of a run made with other settings:\n  " +
                                   "\n  ".join(exc.changes) + "\nKeep that run's settings to resume it, set another "
                                   f"run_dir, or delete {run_dir / 'checkpoint'} to start over", exc.changes) from exc
        steps = compiled.detailed_results.to_dict()["steps"]
    save_program(compiled, run_dir / "program.json")
    write_atomic(run_dir / "library.json", json.dumps(compiled.experience_library.dump_state(), indent=2))
    write_atomic(run_dir / "steps.jsonl", "".join(json.dumps(s) + "\n" for s in steps))
    if steps:
        learning_curve({run_dir.name: steps}, run_dir / "learning_curve.png")
    for name in ("worth", "refit"):  # an earlier compile's measurements do not describe this program: removed
        if measured := getattr(compiled.detailed_results, name, None):
            write_atomic(run_dir / f"{name}.json", json.dumps(measured.to_dict(), indent=2, ensure_ascii=False))
        else:
            (run_dir / f"{name}.json").unlink(missing_ok=True)
    demos = sum(len(p.demos) for _, p in compiled.named_predictors())
    console.print(f"compiled in {time.time() - started:.0f} s: {len(compiled.experience_library)} experiences, "
                  f"{demos} demos")
    results = compiled.detailed_results.to_dict() if o.method != "direct" else None  # a TrainingFreeGRPOResult, as data
    if results is not None and results.get("limits"):  # what limited the run, for `tfgrpo report`
        write_atomic(run_dir / "limits.json", json.dumps(results["limits"], indent=2, ensure_ascii=False))
    else:
        (run_dir / "limits.json").unlink(missing_ok=True)
    run_usage = results["run_usage"] if results is not None else {}
    for role, u in (results["usage"] if results is not None else {}).items():
        cached = f" ({u['cached_tokens']:,} from the server's prompt cache)" if u.get("cached_tokens") else ""
        reused = run_usage.get(role, {}).get("calls", 0) - u.get("calls", 0)
        earlier = f" ({reused} more in the run's record)" if reused else ""
        console.print(f"  {role}: {u.get('calls', 0)} new calls{earlier}, {u.get('prompt_tokens', 0):,} prompt{cached} "
                      f"+ {u.get('completion_tokens', 0):,} completion tokens, {_cost_text(u)}")
    if results is not None and results["stopped_early"]:
        console.print(f"stopped early: {results['stopped_early']}", style="yellow", markup=False, highlight=False)
    _print_library(compiled.experience_library.dump_state(),
                   hint=f"tfgrpo show {run_dir / 'library.json'} --retired lists them")
    _print_worth(run_dir)
    return run_dir / "program.json"


def _print_worth(folder: Path) -> None:
    """What each carried item was worth on this model (refit.json) and each learned item (worth.json), where the folder
    holds them."""
    from tfgrpo.report import worth_markdown

    if (path := folder / "refit.json").exists():
        console.print(worth_markdown(json.loads(path.read_text(encoding="utf-8")), "What each carried item is worth "
                                     "on this model"), markup=False, highlight=False, soft_wrap=True)
    if (path := folder / "worth.json").exists():
        console.print(worth_markdown(json.loads(path.read_text(encoding="utf-8"))), markup=False, highlight=False,
                      soft_wrap=True)


def _cost_text(usage: dict) -> str:
    from tfgrpo.tracking import known_cost

    cost = known_cost(usage)
    return "cost n/a (no price known for this model)" if cost is None else f"${cost:.4f}"


def _evaluation_inputs(config: Config, parts, program_path: Path) -> tuple[list, dict, Path]:
    """The evalset and the two programs, checked before the command's MLflow run is opened: a command that
    fails here leaves the run as it was (a finished run stays FINISHED)."""
    from tfgrpo.programs import load_program

    t = config.task
    examples = _load(parts.load, t.evalset, "task.evalset", limit=t.eval_limit, offset=t.eval_offset)
    return examples, {"baseline": parts.make(), "compiled": load_program(parts.make(), program_path)}, program_path


def _evaluate(config: Config, parts, policy, examples: list, programs: dict, program_path: Path) -> dict:
    from tfgrpo.evaluate import evaluate_program, paired_difference, summarize, write_rows
    from tfgrpo.tracking import log_evaluation

    metric, t, e, out = parts.metric, config.task, config.evaluate, Path(config.run_dir) / "eval"
    console.print(f"[bold]evaluate[/] {len(examples)} problems x {e.num_runs} run(s), baseline and "
                  f"{escape(str(program_path))}")
    rows, seconds = {}, {}
    with _progress() as progress:
        bars = _bars(progress)
        for name, program in programs.items():
            started = time.time()
            rows[name] = evaluate_program(program, examples, metric, lm=policy, num_runs=e.num_runs,
                                          num_threads=e.num_threads, name=name, progress=bars,
                                          extra_metrics=parts.extra_metrics, backend=config.optimizer.backend)
            seconds[name] = time.time() - started
            write_rows(rows[name], out / f"{name}.jsonl")
    summary = {name: {**summarize(r), "seconds": seconds[name]} for name, r in rows.items()}
    summary["paired"] = paired_difference(rows["baseline"], rows["compiled"], seed=e.seed)
    for key in parts.extra_metrics:
        summary[f"paired_{key}"] = paired_difference(rows["baseline"], rows["compiled"], seed=e.seed, key=key)
    if parts.judge is not None:
        summary["judge_calls"] = parts.judge.calls
    trained = {digest(x.toDict()) for x in _load(parts.load, t.trainset, "task.trainset", limit=t.train_limit,
                                                 offset=t.train_offset)}
    summary["evalset"] = {"name": t.evalset, "offset": t.eval_offset, "limit": t.eval_limit,
                          "in_trainset": sum(digest(x.toDict()) in trained for x in examples)}
    write_atomic(out / "summary.json", json.dumps(summary, indent=2))
    log_evaluation(summary, out)  # into the command's MLflow run, if it has one
    _print_summary(summary)
    return summary


def _print_summary(summary: dict) -> None:
    """The evaluation's table and paired differences; the tool-calls column only for a task whose programs call
    tools."""
    extras = list(summary["baseline"].get("metrics") or {})
    tools = ["tool calls"] if any(summary[name]["tool_calls_per_problem"] for name in ("baseline", "compiled")) \
        else []
    shared = summary.get("evalset", {}).get("in_trainset", 0)
    title = "held-out evaluation" if not shared else \
        f"evaluation: {shared} of the problems are also in the trainset, so it is not held out"
    table = Table(title=f"{title} (same problems, same runs)")
    if shared:
        console.print(f"[yellow]warning: {shared} evaluation problem(s) are also training problems: the scores below "
                      "are not held out (task.evalset and task.trainset overlap)")
    for col in ("program", "problems", "k", "Mean@k", "Pass@k", *extras, *tools, "tokens in/out", "errors", "seconds"):
        table.add_column(col)
    for name in ("baseline", "compiled"):
        s = summary[name]
        table.add_row(name, str(s["problems"]), str(s["k"]), f"{s['mean_at_k']:.3f}", f"{s['pass_at_k']:.3f}",
                      *(f"{s['metrics'][k]:.3f}" for k in extras),
                      *(f"{s['tool_calls_per_problem']:.2f}" for _ in tools),
                      f"{s['prompt_tokens']}/{s['completion_tokens']}", str(s["errors"]), f"{s['seconds']:.0f}")
    console.print(table)
    for label, key in [("", "paired")] + [(f" ({k})", f"paired_{k}") for k in extras]:
        p = summary[key]
        console.print(f"compiled - baseline{label} = {p['difference']:+.3f} (95% bootstrap CI {p['ci95'][0]:+.3f} .. "
                      f"{p['ci95'][1]:+.3f}) over {p['problems']} problems; {p['wins']} better, {p['losses']} worse")


def _print_library(state: dict, retired: bool = False, hint: str = "pass --retired to list them") -> None:
    """The library as a table (with `retired`, the retired experiences too, marked so), each experience that reads
    like a prompt injection marked "(!)" and named below it; where retired ones are left out, `hint` says how to
    see them. Every text is printed as written, never read as rich markup."""
    from tfgrpo.programs.library import injection_like

    gone = state.get("retired", [])
    shown = [(e, "") for e in state["experiences"]] + [(e, " (retired)") for e in gone if retired]
    title = f"experience library ({len(state['experiences'])} active, {len(gone)} retired)"
    if not shown:  # (no empty table)
        console.print(f"{title}: none active" + (f"; {len(gone)} retired experience(s) not shown: {hint}" if gone
                                                  else ""), markup=False, highlight=False, soft_wrap=True)
        return
    placed = any(e.get("predictors") for e, _ in shown)  # (a program of several predictors: where each one goes)
    table = Table(title=title)
    for col in ("id", "experience", *(("for",) if placed else ()), "step", "sources", "edits"):
        table.add_column(col, overflow="fold")
    flagged = {e["id"]: words for e in state["experiences"] if (words := injection_like(e["text"]))}
    for e, mark in shown:
        sources = ", ".join(e["sources"][:4]) + (" ..." if len(e["sources"]) > 4 else "")
        table.add_row(Text(e["id"] + (" (!)" if e["id"] in flagged else "") + mark), Text(e["text"]),
                      *((Text(", ".join(e.get("predictors") or ["every predictor"])),) if placed else ()),
                      str(e["created_step"]), Text(sources), Text(" > ".join(h["action"] for h in e["history"])))
    console.print(table)
    if gone and not retired:
        console.print(f"{len(gone)} retired experience(s) not shown: {hint}", style="dim", markup=False,
                      highlight=False, soft_wrap=True)
    for exp_id, words in flagged.items():
        console.print(f"(!) {exp_id} reads like a prompt injection ({words!r}), not a lesson: check it before you "
                      "deploy the program", style="yellow", markup=False, highlight=False, soft_wrap=True)


def _dry_run(cfg: Config, pilot: int) -> None:
    from tfgrpo.cli_dry_run import dry_run
    from tfgrpo.task import task_parts

    if pilot:  # the pilot's calls go to the config's own LMs, started as a run starts them
        with _session(cfg) as (policy, reflection, parts):
            dry_run(cfg, parts, _datasets(parts.load, cfg.task), cfg.optimizer_knobs(), console,
                    lms=(policy, reflection), pilot=pilot)
        return
    with contextlib.ExitStack() as stack:
        parts = task_parts(cfg, stack)
    dry_run(cfg, parts, _datasets(parts.load, cfg.task), cfg.optimizer_knobs(), console)


@contextlib.contextmanager
def _run_dir(cfg: Config):
    """Hold the run directory for the command: a second compile or run on it is refused at once, naming the holder
    (src/tfgrpo/optimizers/checkpoint.py); temporary files of writes a killed run left are cleared. Ctrl-C ends the command with
    one line that says where the finished work is, and exit code 130."""
    from tfgrpo.optimizers.checkpoint import RunLock, RunLockedError
    from tfgrpo.base.util import remove_stale_tmp

    run_dir = Path(cfg.run_dir)
    try:
        with RunLock(run_dir / "checkpoint"):
            for folder in (run_dir, run_dir / "eval"):  # the checkpoint's own are cleared as the compile starts
                remove_stale_tmp(folder, recursive=False)
            yield
    except RunLockedError as exc:
        _error(f"error: run_dir {run_dir} is in use by another run ({exc.holder}); wait for it to end or stop it, "
               "or set another run_dir")
        raise typer.Exit(2) from None
    except KeyboardInterrupt:
        console.print(f"interrupted; every reply so far is kept in {run_dir / 'checkpoint'}; run the same command "
                      "to resume", style="yellow", markup=False, highlight=False)
        raise typer.Exit(130) from None


@app.command(cls=HelpCommand)
def compile(config: Path = CONFIG, verbose: bool = VERBOSE,
            dry_run: bool = typer.Option(False, "--dry-run", help=DRY_RUN),
            pilot: int = typer.Option(0, "--pilot", min=0, metavar="N", help="with --dry-run: run the program on this many training "
                                      "queries first (real LM calls) and size the plan from them"),
            debug: bool = DEBUG) -> None:
    """Run Training-Free GRPO; writes program.json, library.json, steps.jsonl and learning_curve.png."""
    _setup_logging(verbose)
    if pilot and not dry_run:
        _error("error: --pilot sizes the plan of a dry run: give --dry-run too")
        raise typer.Exit(2)
    cfg = _load_config(config, need_keys=not dry_run or bool(pilot))
    with _errors(debug):
        if dry_run:
            return _dry_run(cfg, pilot)
        with _run_dir(cfg), _session(cfg) as (policy, reflection, parts), _tracking(cfg):
            path = _compile(cfg, parts, policy, reflection)
    console.print(f"artifacts in {path.parent}", markup=False, highlight=False)


@app.command(cls=HelpCommand)
def refit(program: Path = typer.Argument(..., metavar="PROGRAM", help="a saved program.json (tfgrpo's or stock DSPy's)"),
          config: Path = CONFIG, steps: int = typer.Option(0, "--steps", metavar="N", min=0, help="learning steps "
                                                           "after the refit (0: the refit alone)"),
          verbose: bool = VERBOSE, debug: bool = DEBUG) -> None:
    """Carry a learned program to the config's model: each experience and demo it holds measured there on held-out
    queries (task.valset or task.attribution_set), those that do not help left out, then --steps N steps from the
    rest; writes program.json, library.json and refit.json into the config's run_dir."""
    _setup_logging(verbose)
    cfg = _load_config(config)
    if not program.is_file():
        _error(f"no such program file: {program}")
        raise typer.Exit(2)
    with _errors(debug), _run_dir(cfg), _session(cfg) as (policy, reflection, parts), _tracking(cfg):
        path = _compile(cfg, parts, policy, reflection, start=program, steps=steps)
    console.print(f"artifacts in {path.parent}", markup=False, highlight=False)


@app.command(cls=HelpCommand)
def evaluate(config: Path = CONFIG_OR_NAME, program: Path = typer.Option(None, "--program", metavar="FILE",
             help="with a CONFIG: a compiled program.json"), api_base: str = API_BASE, verbose: bool = VERBOSE,
             debug: bool = DEBUG) -> None:
    """Evaluate the uncompiled baseline and a compiled program on the same held-out problems; or score a shipped
    learned program on its held-out split, sampled as its stated score was."""
    _setup_logging(verbose)
    with _errors(debug):
        if learned := shipped(config):
            return evaluate_shipped(learned, api_base, console)
    if program is None:
        _error("tfgrpo evaluate CONFIG needs --program P.json (a shipped program's NAME needs none)")
        raise typer.Exit(2)
    cfg = _load_config(config)
    with _errors(debug), _session(cfg) as (policy, _, parts):
        inputs = _evaluation_inputs(cfg, parts, program)
        with _tracking(cfg):
            _evaluate(cfg, parts, policy, *inputs)


@app.command(cls=HelpCommand)
def run(config: Path = CONFIG, verbose: bool = VERBOSE, debug: bool = DEBUG) -> None:
    """Compile, then evaluate the compiled program against the uncompiled baseline on the same held-out problems;
    writes program.json, library.json, steps.jsonl, learning_curve.png and eval/."""
    _setup_logging(verbose)
    cfg = _load_config(config)
    started = time.time()
    with _errors(debug), _run_dir(cfg), _session(cfg) as (policy, reflection, parts), _tracking(cfg):
        path = _compile(cfg, parts, policy, reflection)
        _evaluate(cfg, parts, policy, *_evaluation_inputs(cfg, parts, path))
    console.print(f"done in {(time.time() - started) / 60:.1f} min; artifacts in {path.parent}: program.json, "
                  "library.json, steps.jsonl, learning_curve.png, eval/", markup=False, highlight=False)


@app.command(cls=HelpCommand)
def show(path: Path = FILE_OR_NAME, retired: bool = typer.Option(False, "--retired", help="list the retired "
         "experiences too (merged, replaced or deleted while learning)"), debug: bool = DEBUG) -> None:
    """Print a library (library.json, a compiled program.json or a shipped program) with each experience's
    provenance, and a program's demos."""
    with _errors(debug):
        if learned := shipped(path):
            print_provenance(learned, console)
            path = learned.program_path
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ValueError(f"{path}: not a JSON file ({exc})") from exc
    state = data.get("experience_library", data) if isinstance(data, dict) else None
    if not isinstance(state, dict) or "experiences" not in state:
        _error(f"{path}: no experience library in this file")
        raise typer.Exit(2)
    _print_library(state, retired=retired)
    print_demos(data, console)
    _print_worth(path.parent)


@app.command(cls=HelpCommand)
def report(run_dirs: list[Path] = typer.Argument(..., metavar="RUN_DIR", help="run directories of compiles"),
           out: Path = typer.Option(Path("report"), metavar="FOLDER", help="folder for report.md/report.png")) -> None:
    """Rebuild the results table and learning-dynamics plot from saved run directories (no model calls)."""
    from tfgrpo.report import build_report

    try:
        md, plot = build_report(run_dirs, out)
    except (ValueError, OSError) as exc:
        _error(str(exc))
        raise typer.Exit(2) from None
    # Markdown as written: "[95% CI]" and "![learning dynamics](...)" are no markup, a table row is not cut in two
    console.print(md.read_text(), markup=False, highlight=False, soft_wrap=True)
    console.print(f"written: {md}" + (f", {plot}" if plot else ""), markup=False, highlight=False)


@app.command("config", cls=HelpCommand)
def config_command(reference: bool = typer.Option(False, "--reference", help="print the reference config")) -> None:
    """Print the reference config: every section and field with its default (a start for your own config)."""
    if not reference:
        _error("tfgrpo config: say what to print (--reference)")
        raise typer.Exit(2)
    console.out(reference_text(), end="", highlight=False)


if __name__ == "__main__":
    app()
