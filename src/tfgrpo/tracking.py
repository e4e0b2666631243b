"""MLflow tracking: what Training-Free GRPO knows beyond DSPy's generic autologging, in the same run.

`mlflow.dspy.autolog(log_compiles=True)` opens a run for every optimizer's `compile` and logs its trainset,
valset and best program. A TrainingFreeGRPO compile adds to whatever run is active (autolog's, the user's own
`mlflow.start_run()`, or the one `use_mlflow=True` starts):

    per step (the MLflow step)  train/ (mean reward, groups kept and skipped), learning/ (operations proposed,
                                applied, refused, ...), library/ (size, demos), usage/<stage>/ (calls, tokens;
                                cost where the model has a price)
    per epoch                   val/score, at the epoch's last step
    once                        the knobs as params; library.json, library.md, program.json, steps.jsonl and
                                learning_curve.png as artifacts; val/best_score; the tags tfgrpo.kept_epoch
                                (whose library the program carries), tfgrpo.stopped_early (a budget's reason) and
                                tfgrpo.limited_by (what limited the run)

The optimizer does not import this module: `MLFLOW`, the tracker, is registered under the entry point group
`tfgrpo.trackers` (pyproject.toml), and a compile reports its steps, validations and result to it through
`tfgrpo.base.hooks`; an optimizer's construction lets it join an autolog called before tfgrpo was imported.

The CLI's `[tracking]` section opens one run around compile and evaluation (`config_run`), and the evaluation
adds eval/ metrics (`log_evaluation`). The run's ID is kept in the log_dir, so a resumed compile goes on in
the same run. With no active run and tracking off, nothing here imports MLflow. Params hold LM names only and
program.json is saved without LM settings: no key or token reaches the store.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import logging
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator

from tfgrpo.base.hooks import CompileInfo
from tfgrpo.optimizers.checkpoint import Checkpoint
from tfgrpo.programs import save_program

logger = logging.getLogger(__name__)

RUN_KEY = "mlflow_run"  # log_dir/mlflow_run.json: {"run_id": ...}
AUTOLOG = "dspy"  # MLflow's name for DSPy's autologging integration
_JOINED: set[type] = set()  # optimizer classes whose first construction has joined autolog


def join_dspy_autolog(optimizer: Any) -> None:
    """Give an optimizer's class the compile patch of an autolog that was called before the class existed.

    `mlflow.dspy.autolog()` patches the `compile` of the Teleprompter subclasses that exist when it runs. When
    it ran before tfgrpo was imported, it is run once more, with the same settings, when the first optimizer of
    a class is built: it reverts its patches and patches every subclass that exists now, so calling it again
    changes nothing else. Without MLflow imported, or with autolog off, nothing happens."""
    if "mlflow" not in sys.modules or type(optimizer) in _JOINED:  # autolog was never called, or is joined
        return
    from mlflow.utils.autologging_utils import AUTOLOGGING_INTEGRATIONS, autologging_is_disabled

    if autologging_is_disabled(AUTOLOG):
        return
    import mlflow.dspy

    accepted = inspect.signature(mlflow.dspy.autolog).parameters
    settings = {k: v for k, v in AUTOLOGGING_INTEGRATIONS[AUTOLOG].items() if k in accepted}
    _JOINED.add(type(optimizer))
    try:
        mlflow.dspy.autolog(**settings)
    except Exception as exc:  # tracking must not stop a construction; say why the compiles will not be captured
        logger.warning("mlflow.dspy.autolog() could not patch tfgrpo's optimizers (%s): their compiles are not "
                       "autologged; call autolog after importing tfgrpo", exc)


def step_record(stats: Any) -> dict:
    """A step's stats as a plain dict, whether the step gave a dict or an object with `to_dict()`."""
    return stats.to_dict() if hasattr(stats, "to_dict") else dict(stats)


_NOT_METRICS = {"step", "epoch", "batch_size", "groups", "usage", "seconds", "demos", "operations_applied",
                "operations_rejected", "library_size", "wall_s", "details", "probe"}
_TRAIN = ("mean_reward", "groups_kept", "frac_skipped_zero_std", "rollout_failures", "tool_calls_mean")


def step_metrics(stats: Any) -> dict[str, float]:
    """A step's numbers under MLflow metric names, grouped by prefix as the MLflow UI draws them."""
    s = step_record(stats)
    metrics = {f"train/{k}": s[k] for k in _TRAIN if k in s}
    metrics["train/groups_skipped"] = s["groups"] - s["groups_kept"]
    applied = s.get("operations_applied", 0)
    metrics["learning/operations_applied"] = sum(applied.values()) if isinstance(applied, dict) else applied
    metrics["learning/operations_refused"] = s.get("operations_rejected", 0)
    for key, value in s.items():  # operations_proposed, learning_failures and each path's own counts
        if key not in _NOT_METRICS and key not in _TRAIN and _is_number(value):
            metrics[f"learning/{key}"] = value
    for key, value in (s.get("details") or {}).items():  # counts only one learning path keeps
        if _is_number(value):
            metrics[f"learning/{key}"] = value
    probe = s.get("probe") or {}
    if probe.get("candidates"):
        metrics["probe/candidates"] = len(probe["candidates"])
        metrics["probe/kept"] = sum(bool(c["kept"]) for c in probe["candidates"])
        metrics["probe/base_mean"] = probe["base_mean"]
    metrics["library/size"] = s["library_size"]
    metrics["library/demos"] = len(s.get("demos") or [])
    for stage, usage in s.get("usage", {}).items():
        tokens = usage.get("prompt_tokens", 0) + usage.get("completion_tokens", 0)
        # a cost is logged where it is above 0: an unpriced model then draws no flat zero curve, and a step in
        # which a stage made no call leaves a gap rather than a 0 in another stage's unknown cost
        usage = {**usage, "tokens": tokens, "cost": known_cost(usage) or None}
        metrics.update({f"usage/{stage}/{k}": v for k, v in usage.items() if _is_number(v)})
    metrics["time/step_s"] = s.get("wall_s", 0.0)
    return {k: float(v) for k, v in metrics.items()}


def known_cost(usage: dict) -> float | None:
    """The USD cost of a usage record, or None when it is not known: left out (DSPy kept no history), or 0 for
    calls that used tokens (LiteLLM has no price for the model: a local or self-hosted one)."""
    cost = usage.get("cost")
    tokens = usage.get("prompt_tokens", 0) + usage.get("completion_tokens", 0)
    return None if cost is None or (cost == 0 and tokens > 0) else cost


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def library_text(state: dict, *, demos: int = 0) -> str:
    """The library as Markdown, which MLflow's artifact viewer renders: one item per experience, with the step
    and training queries it came from and its edits."""
    active, retired = state.get("experiences", []), state.get("retired", [])
    lines = [f"# Experience library: {len(active)} experiences ({len(retired)} retired), {demos} demos", ""]
    for e in active:
        sources = ", ".join(e["sources"][:4]) + (f" and {len(e['sources']) - 4} more" if len(e["sources"]) > 4 else "")
        edits = " > ".join(f"{h['action']} at step {h['step']}" for h in e["history"]) or "none"
        lines += [f"- **{e['id']}** {e['text']}  ",  # two spaces: a line break in Markdown
                  f"  _learned at step {e['created_step']} from {sources or 'no recorded query'}; edits: {edits}_", ""]
    if not active:
        lines += ["(empty: no experience was kept)", ""]
    return "\n".join(lines)


def kept_epoch(results: Any) -> str:
    """Which epoch's library the compiled program carries, in words (the run's `tfgrpo.kept_epoch` tag)."""
    if results.best_epoch is not None:
        return f"{results.best_epoch} (best val/score {results.best_val_score:.3f}; ties go to the later epoch)"
    if not results.steps:
        return "none (no step was run)"
    return f"{step_record(results.steps[-1])['epoch']} (the last; no valset)"


class CompileTracker:
    """Logs one TrainingFreeGRPO compile into one MLflow run, by run ID (the step's worker threads and the
    fluent run stack do not matter). A failure to log is a warning: it never stops a long compile."""

    def __init__(self, run_id: str, log_dir: str | Path | None):
        from mlflow import MlflowClient

        self.client, self.run_id, self.log_dir, self.remembered = MlflowClient(), run_id, log_dir, False
        history = self.client.get_metric_history
        self.logged = {name: {m.step for m in history(run_id, name)} for name in ("train/mean_reward", "val/score")}

    def log_params(self, params: dict[str, str]) -> None:
        """New params only: a resumed run keeps its first values (MLflow refuses to change them)."""
        from mlflow.entities import Param

        old = self.client.get_run(self.run_id).data.params
        changed = sorted(k for k, v in params.items() if k in old and old[k] != v[:6000])
        if changed:
            logger.warning("MLflow run %s keeps its first values of %s", self.run_id, ", ".join(changed))
        new = [Param(k, v[:6000]) for k, v in params.items() if k not in old]
        self.client.log_batch(self.run_id, params=new)

    def step(self, stats: Any) -> None:
        """After each step: its metrics at MLflow step = the step's index (a step resumed from the log_dir and
        already in the run is not logged twice)."""
        if not self.remembered:  # once the log_dir has passed its checks: a resume goes on in this run
            _remember(self.log_dir, self.run_id)
            self.remembered = True
        index = step_record(stats)["step"]
        if index not in self.logged["train/mean_reward"]:
            self._metrics(step_metrics(stats), index)

    def validation(self, epoch: dict, step: int) -> None:
        """After each validation: the score, at the epoch's last step."""
        if step not in self.logged["val/score"]:
            self._metrics({"val/score": epoch["val_score"], "val/epoch": epoch["epoch"],
                           "val/library_size": epoch["library_size"]}, step)

    def finish(self, compiled: Any) -> None:
        """At the end: the learned library and program, the steps and their curve, as artifacts; the best
        validation score, the epoch whose library was kept and why a budget stopped the run, if one did."""
        from tfgrpo.plots import learning_curve  # matplotlib: only for a compile that is tracked

        results = compiled.detailed_results
        steps = [step_record(s) for s in results.steps]
        state = compiled.experience_library.dump_state()
        demos = sum(len(p.demos) for _, p in compiled.named_predictors())
        try:
            with tempfile.TemporaryDirectory() as tmp:
                out = Path(tmp)
                (out / "library.json").write_text(json.dumps(state, indent=2, ensure_ascii=False))
                (out / "library.md").write_text(library_text(state, demos=demos))
                save_program(compiled, out / "program.json")
                if steps:
                    (out / "steps.jsonl").write_text("".join(json.dumps(s) + "\n" for s in steps))
                    learning_curve({"compile": steps}, out / "learning_curve.png")
                if results.worth:
                    self._worth(results.worth.to_dict(), out)
                self.client.log_artifacts(self.run_id, str(out))
            if results.best_val_score is not None:
                self.client.log_metric(self.run_id, "val/best_score", results.best_val_score)
            self.client.set_tag(self.run_id, "tfgrpo.kept_epoch", kept_epoch(results))
            if getattr(results, "limits", None):  # what limited the run, in a sentence
                self.client.set_tag(self.run_id, "tfgrpo.limited_by", results.limits["verdict"])
            if results.stopped_early:
                self.client.set_tag(self.run_id, "tfgrpo.stopped_early", results.stopped_early)
        except Exception as exc:
            logger.warning("MLflow: the compile's artifacts were not logged (%s)", exc)

    def _worth(self, worth: dict, out: Path) -> None:
        """The attribution: worth.json, worth.md (the table `tfgrpo report` prints) and a table of the items that the
        MLflow UI shows and compares across runs (worth_table.json)."""
        from tfgrpo.report import worth_markdown

        (out / "worth.json").write_text(json.dumps(worth, indent=2, ensure_ascii=False))
        (out / "worth.md").write_text(worth_markdown(worth))
        items = worth["items"]
        self.client.log_table(self.run_id, {
            "item": [i["id"] for i in items], "kind": [i["kind"] for i in items], "worth": [i["worth"] for i in items],
            "ci95_low": [i["ci95"][0] for i in items], "ci95_high": [i["ci95"][1] for i in items],
            "pruned": [i["id"] in worth["pruned"] for i in items], "text": [i["text"] for i in items]},
            artifact_file="worth_table.json")
        self.client.log_metric(self.run_id, "worth/library", worth["library"])
        self.client.log_metric(self.run_id, "worth/control", worth["control"])

    def _metrics(self, metrics: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        try:
            self.client.log_batch(self.run_id, metrics=[Metric(k, v, now, step) for k, v in metrics.items()])
        except Exception as exc:
            logger.warning("MLflow: step %d's metrics were not logged (%s)", step, exc)


def stored_run_id(log_dir: str | Path | None) -> str | None:
    """The ID of the MLflow run a log_dir's compile logged to, if it did."""
    return (Checkpoint(log_dir).get(RUN_KEY) or {}).get("run_id")


def _remember(log_dir: str | Path | None, run_id: str) -> None:
    Checkpoint(log_dir).put(RUN_KEY, {"run_id": run_id})


@contextlib.contextmanager
def track_compile(info: CompileInfo) -> Iterator[CompileTracker | None]:
    """The tracker of one compile, or None when no MLflow run is active and the knob `use_mlflow` is off.

    The run is the active one; else (use_mlflow) the run this log_dir logged to before, or a new one, ended
    with the compile (FAILED when it raises). An autolog run opened for a compile whose log_dir already has a
    run is dropped for that one, so a resume goes on in the same run."""
    mlflow = sys.modules.get("mlflow")
    active = mlflow.active_run() if mlflow else None
    if active is None and not info.knobs["use_mlflow"]:
        yield None
        return
    mlflow = _import_mlflow()

    log_dir = info.knobs["log_dir"]
    params = info.params()  # before a run is started: a program without an LM fails here
    stored, owned = _stored_run(log_dir), active is None
    if owned:
        active = _resume_or_start(stored, run_name=Path(log_dir).name if log_dir else None)
    elif stored and stored.info.run_id != active.info.run_id and _fresh_autolog_run(active) \
            and stored.info.experiment_id == active.info.experiment_id:
        active = _continue_in(stored.info.run_id, active.info.run_id)
    try:
        tracker = CompileTracker(active.info.run_id, log_dir)
        tracker.log_params(params)
        yield tracker
    except BaseException as exc:
        if owned:
            mlflow.end_run("KILLED" if isinstance(exc, KeyboardInterrupt) else "FAILED")
        raise
    if owned:
        mlflow.end_run()


class MlflowTracker:
    """The tracker registered under `tfgrpo.trackers` (see `tfgrpo.base.hooks`)."""

    built = staticmethod(join_dspy_autolog)
    compile = staticmethod(track_compile)


MLFLOW = MlflowTracker()


def _import_mlflow() -> Any:
    try:
        import mlflow
    except ImportError:
        raise ImportError("tracking needs MLflow: pip install -e '.[mlflow]' (scripts/setup.sh installs it)") from None
    return mlflow


def _stored_run(log_dir: str | Path | None) -> Any | None:
    """The run this log_dir logged to, if it is in the current tracking store and not deleted."""
    if (run_id := stored_run_id(log_dir)) is None:
        return None
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException

    try:
        run = MlflowClient().get_run(run_id)
    except MlflowException:
        return None
    return run if run.info.lifecycle_stage == "active" else None


def _resume_or_start(stored: Any | None, run_name: str | None) -> Any:
    """The stored run, made active again; a new run when there is none or it cannot be resumed here (it is in
    another experiment than the one set)."""
    import mlflow
    from mlflow.exceptions import MlflowException

    if stored is not None:
        try:
            return mlflow.start_run(run_id=stored.info.run_id)
        except MlflowException as exc:
            logger.warning("MLflow: starting a new run, as this log_dir's run cannot be resumed here (%s)", exc)
    return mlflow.start_run(run_name=run_name)


def _fresh_autolog_run(run: Any) -> bool:
    """A run that DSPy's autolog has just opened for this compile (tagged by autolog, nothing logged yet)."""
    from mlflow import MlflowClient

    data = MlflowClient().get_run(run.info.run_id).data
    return data.tags.get("mlflow.autologging") == AUTOLOG and not data.metrics and not data.params


def _continue_in(run_id: str, fresh_id: str) -> Any:
    """Make `run_id` the active run instead of autolog's new, empty `fresh_id` (deleted, with the placeholder
    model autolog gave it). Autolog's own logging after the compile, and its end of the run, then go to
    `run_id`; its trainset.json and valset.json tables (mlflow.log_table appends) then list their rows once per
    compile of the log_dir."""
    import mlflow

    mlflow.end_run()
    client = mlflow.MlflowClient()
    experiment = client.get_run(fresh_id).info.experiment_id
    for model in mlflow.search_logged_models(experiment_ids=[experiment], output_format="list",
                                             filter_string=f"source_run_id = '{fresh_id}'"):
        client.delete_logged_model(model.model_id)
    client.delete_run(fresh_id)
    logger.info("MLflow: continuing run %s of this log_dir (autolog's new run %s dropped)", run_id, fresh_id)
    return mlflow.start_run(run_id=run_id)


# -- the CLI: one run per run_dir around compile and evaluation -----------------------------------------------

def store_uri(tracking: Any, run_dir: str | Path) -> str:
    """The `[tracking]` section's tracking URI, by default a SQLite store in run_dir/mlflow."""
    return tracking.tracking_uri or f"sqlite:///{Path(run_dir, 'mlflow', 'mlflow.db').resolve()}"


@contextlib.contextmanager
def config_run(tracking: Any, run_dir: str | Path, log_dir: str | Path) -> Iterator[Any]:
    """The MLflow run of a CLI command from its config's `[tracking]` section (None when there is none): the
    run this run_dir logged to before, else a new one named after it. Compile and evaluation log into it."""
    if tracking is None or not tracking.enabled:
        yield None
        return
    mlflow = _import_mlflow()
    logging.getLogger("mlflow").setLevel(logging.WARNING)  # no notes on creating tables in the CLI's output
    local = Path(run_dir, "mlflow").resolve()
    if not tracking.tracking_uri:
        local.mkdir(parents=True, exist_ok=True)
    mlflow.set_tracking_uri(store_uri(tracking, run_dir))
    client = mlflow.MlflowClient()
    experiment = client.get_experiment_by_name(tracking.experiment)  # a new one keeps a local store's artifacts in it
    experiment_id = experiment.experiment_id if experiment else client.create_experiment(
        tracking.experiment, artifact_location=None if tracking.tracking_uri else (local / "artifacts").as_uri())
    mlflow.set_experiment(experiment_id=experiment_id)
    with _resume_or_start(_stored_run(log_dir), run_name=Path(run_dir).name) as run:
        _remember(log_dir, run.info.run_id)
        yield run


def log_evaluation(summary: dict, folder: str | Path | None = None) -> None:
    """An evaluation's figures into the active MLflow run, if there is one: eval/baseline/... and
    eval/compiled/... (Mean@k, Pass@k, pass@1, extra metrics), eval/paired/... (difference, ci95_low, ci95_high,
    wins, losses; one group per paired metric), the problems and k as tags, and `folder` (the rows and
    summary.json, with tokens, errors and seconds) as artifacts."""
    mlflow = sys.modules.get("mlflow")
    if mlflow is None or mlflow.active_run() is None:
        return
    metrics = {}
    for name in ("baseline", "compiled"):
        s = summary[name]
        metrics.update({f"eval/{name}/{k}": s[k] for k in ("mean_at_k", "pass_at_k", "pass_at_1")})
        metrics.update({f"eval/{name}/{k}": v for k, v in (s.get("metrics") or {}).items()})
    for key, p in summary.items():
        if key.startswith("paired"):
            metrics.update({f"eval/{key}/difference": p["difference"], f"eval/{key}/ci95_low": p["ci95"][0],
                            f"eval/{key}/ci95_high": p["ci95"][1], f"eval/{key}/wins": p["wins"],
                            f"eval/{key}/losses": p["losses"]})
    mlflow.log_metrics(metrics)
    tags = {"problems": summary["paired"]["problems"], "k": summary["baseline"]["k"],
            **{f"set_{k}": v for k, v in (summary.get("evalset") or {}).items()}}
    mlflow.set_tags({f"eval.{k}": str(v) for k, v in tags.items()})
    if folder is not None:
        mlflow.log_artifacts(str(folder), artifact_path="eval")
