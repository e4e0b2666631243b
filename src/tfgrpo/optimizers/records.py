"""The typed records of a run: what a step's stages pass forward, and `compiled.detailed_results`.

A rollout makes an `Attempt`, the reward stage a `Scored` attempt, and a query's scored attempts make a `Group`; a
learning path (`runner.LearningPath`) turns groups into `Lessons` (the plan of library operations), the judge turns lessons and winning
attempts into a `Verdict` (the operations and `Demo`s kept), and the state applies it. Each stage makes new values and
never writes into the ones before it. A learning call that raised is a `Failed` value, counted by its scope.

`compiled.detailed_results` is a `TrainingFreeGRPOResult`. Every step has the same fields whatever the learning path;
what only one path counts (the contrast path's refused or redundant rules, say) is under `details`. `to_dict()` gives
plain JSON-ready data (what `steps.jsonl` holds).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any

import dspy

from tfgrpo.signatures.operations import Operation



@dataclass(frozen=True)
class Attempt:
    """One run of the program on a query: its outputs (None when it raised), the error, DSPy's trace of every
    predictor call, the tool calls it made, and the attempt as the learning calls read it (`text`, cut to
    `render.MAX_ATTEMPT_CHARS`; `text_chars`: its length before, when it was cut). `failed`: an LM call of the attempt
    failed, or the provider replied with nothing (a rate limit, a timeout, a lost connection, a refused prompt): the
    attempt has no answer, so it is left out of its group and of the probe, and never scored. `unparsed`: the error is
    a reply with content the adapter could not parse, the program's own 0 and no outage.

    `prediction` is what the program returned, as the metric receives it (as `dspy.Evaluate` gives it: completions,
    typed values, an open file alike); `outputs` and `trace` are JSON-safe copies of it for the learning calls, the
    majority answer and the demos. `bare`: the program returned something other than a `dspy.Prediction` (None, a
    string), given to the metric as it is (`outputs["returned"]` its copy)."""

    outputs: dict | None
    error: str | None
    trace: list
    tool_calls: int
    text: str
    failed: bool = False
    unparsed: bool = False
    text_chars: int | None = None
    bare: bool = False
    prediction: Any = field(default=None, compare=False, repr=False)


@dataclass(frozen=True)
class Scored(Attempt):
    """An attempt with its score: the reward in [0, 1] (None for an attempt that got no answer, never scored), what
    the metric said of it (`feedback`, cut to `render.MAX_FEEDBACK_CHARS`; `feedback_chars`: its length before, when
    it was cut), `timeout` when the metric call timed out and `metric_error` when the metric raised on it (scored 0
    either way, as `dspy.Evaluate` scores it with its failure score), and which of its query's G attempts it is
    (`g`)."""

    reward: float | None = None
    feedback: str = ""
    timeout: str | None = None
    feedback_chars: int | None = None
    g: int = 0
    metric_error: str | None = None

    @property
    def metric_failed(self) -> str | None:
        """Why the metric gave this attempt no score of its own (it timed out, or raised), or None."""
        return self.timeout or self.metric_error

    @classmethod
    def of(cls, attempt: Attempt, score: dict, g: int = 0) -> Scored:
        """`attempt` with a score: its "reward", "feedback", "timeout", "metric_error" and "feedback_chars"."""
        return cls(**{f.name: getattr(attempt, f.name) for f in fields(Attempt)}, reward=score.get("reward"),
                   feedback=score.get("feedback", ""), timeout=score.get("timeout"),
                   feedback_chars=score.get("feedback_chars"), g=g, metric_error=score.get("metric_error"))


@dataclass(frozen=True)
class Group:
    """The scored attempts of one training query in one step: those that answered (an attempt whose LM call failed is
    not among them), out of `size` made."""

    index: int  # the query's position in the trainset
    key: str  # how provenance and logs name the query (`render.query_key`)
    example: dspy.Example
    attempts: tuple[Scored, ...]
    size: int = 0  # attempts made (G); 0: as many as answered

    @property
    def rewards(self) -> list[float]:
        return [a.reward for a in self.attempts]

    @property
    def informative(self) -> bool:
        """Whether the group carries a direction: its rewards differ, or it is a single attempt of a single one made
        (G = 1, judged against the ground truth alone)."""
        return len(set(self.rewards)) > 1 or (len(self.attempts) == 1 and (self.size or 1) == 1)


@dataclass(frozen=True)
class Failed:
    """A unit of work that raised, kept as a value so the caller can count it and go on: its error, as text."""

    error: str


@dataclass(frozen=True)
class Demo:
    """A winning attempt kept (or to be probed) as a few-shot demo of the target predictors: the query it answered (its
    key), its trace (every predictor call: inputs and outputs, which become the predictors' `demos`), and where it
    came from: the step, its reward, its group advantage, and its probe gain once a probe kept it. A demo read back
    from a saved program knows only its query and trace (the rest None)."""

    query: str
    trace: list
    step: int | None = None
    reward: float | None = None
    advantage: float | None = None
    gain: float | None = None

    def to_record(self) -> dict:
        return {k: v for k, v in asdict(self).items() if v is not None}

    @classmethod
    def from_record(cls, rec: dict) -> Demo:
        return cls(**{f.name: rec[f.name] for f in fields(cls) if f.name in rec})


@dataclass
class Lessons:
    """What a learning path makes of a step: the plan, every proposal with the key of the query it came from, how the
    plan was made (`consolidation`), the learning calls that failed, the operations proposed (left None: one per
    proposal; the contrast path counts the rules it refused too) and what only this path counts (`details`, as the
    step's record holds it)."""

    plan: list[Operation]
    proposals: list[tuple[str, Operation]] = field(default_factory=list)
    consolidation: str = ""
    learning_failures: int = 0
    operations_proposed: int | None = None
    details: dict[str, int] = field(default_factory=dict)

    def __post_init__(self):
        if self.operations_proposed is None:
            self.operations_proposed = len(self.proposals)


@dataclass(frozen=True)
class Verdict:
    """What the judge hands on: the operations to apply, the demos the program keeps, the probe's record (None when no
    probe ran), demo candidates found for the next step, where the probe found the current program's attempts
    (`State.probed`) and every attempt it made (`tried`)."""

    plan: list[Operation]
    demos: list[Demo]
    record: dict | None = None
    found: list[Demo] = field(default_factory=list)
    probed: dict[str, dict[str, int]] = field(default_factory=dict)  # the probe's attempts of the current program
    tried: dict[tuple[int, int], Scored] = field(default_factory=dict)  # the probe's attempts: (program, query) ->


class _Record:
    def to_dict(self) -> dict:
        """The record as plain JSON-ready data."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict):
        """The record from `to_dict()`'s data; a key this version no longer records is ignored."""
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})


@dataclass(frozen=True)
class StepResult(_Record):
    """One optimization step's record (a row of `steps.jsonl`).

    Attributes:
        step: The step's index over the whole run, from 0.
        epoch: The epoch the step belongs to, from 0.
        batch_size: Training queries the step rolled out (the last batch of an epoch may be smaller).
        learning_path: The learning path that made the step's edits ("paper", "contrast" or a path's own name).
        mean_reward: Mean reward over every attempt of the step.
        groups: Groups rolled out, one per query.
        groups_kept: Groups with reward contrast, the ones learned from (every group when G = 1).
        frac_skipped_zero_std: Share of the groups skipped because all their attempts scored the same.
        rollout_failures: Attempts that raised: those whose LM call failed (`failed_calls`) and those that raised
            anything else (scored 0).
        tool_calls_mean: Mean tool calls per attempt (0 for a program without tools).
        learning_failures: Learning calls (summaries, group advantages, contrasts) that failed after their retry.
        operations_proposed: Library edits the learning calls proposed.
        operations_applied: Edits applied, counted by action ("add", "modify", "merge", "delete").
        operations_rejected: Edits the library's checks refused (unknown ID, empty, too long, duplicate).
        library_size: Experiences in the library after the step.
        consolidation: How the plan was made: the consolidation call's outcome, or "folded in code" on the contrast
            path.
        usage: Per stage (rollout, summary, advantage, consolidation, probe, ...): calls, prompt and completion
            tokens, and the cost where DSPy knows the price.
        seconds: Per stage, when its last unit finished, in seconds from the step's start.
        wall_s: The step's wall-clock time in seconds.
        metric_calls: Attempts the metric scored: the rollouts, then the probe's attempts (one that failed counts,
            scored 0).
        demos: The training queries whose attempts the program keeps as demos after the step.
        probe: With `probe_size`: the probed edits, their rewards on the probe queries and the verdicts; else None.
        details: Counts only one learning path keeps (the contrast path's refused or redundant rules, say), and
            `metric_timeouts` when a metric call timed out.
        queries: The training queries rolled out.
        usage_before_resume: Of `usage`, what a run stopped in this step had spent on the units a resume then
            reused.
        failed_calls: Attempts whose LM call failed after its retries (a rate limit, a timeout, a lost connection):
            they have no answer, so they were left out of their groups and not scored.
        solved: Attempts that fully solved their own query (reward 1).
    """

    step: int
    epoch: int
    batch_size: int
    learning_path: str
    mean_reward: float
    groups: int
    groups_kept: int
    frac_skipped_zero_std: float
    rollout_failures: int
    tool_calls_mean: float
    learning_failures: int
    operations_proposed: int
    operations_applied: dict[str, int]
    operations_rejected: int
    library_size: int
    consolidation: str
    usage: dict[str, dict[str, float]]
    seconds: dict[str, float]
    wall_s: float
    metric_calls: int = 0
    demos: list[str] = field(default_factory=list)
    probe: dict[str, Any] | None = None
    details: dict[str, Any] = field(default_factory=dict)
    queries: list[int] = field(default_factory=list)
    usage_before_resume: dict[str, dict[str, float]] = field(default_factory=dict)
    failed_calls: int = 0
    solved: int = 0


@dataclass(frozen=True)
class EpochResult:
    """One epoch's validation record (with a valset).

    Attributes:
        epoch: The epoch's index, from 0.
        val_score: Mean metric over the valset with the epoch's library and demos.
        library_size: Experiences in the library at the end of the epoch.
        val_failures: Validation examples on which the program raised (scored 0).
    """

    epoch: int
    val_score: float
    library_size: int
    val_failures: int = 0


@dataclass(frozen=True)
class ItemWorth:
    """What one kept item is worth on the attribution queries.

    Attributes:
        kind: "experience" or "demo".
        id: The experience's ID (E3), or the demo's place among the kept demos (D1, D2, ...).
        text: The experience's text, or the start of the demo's query.
        worth: The mean score the program loses per query when the item is left out (leave-one-out), or the item's
            Shapley value (above `attribution_max_items` items). Negative: the program does better without it.
        ci95: 95% bootstrap CI of `worth` over the queries.
        learned_on: For an item the student carried (a refit): where it was learned, as the saved program recorded
            it (`policy`: the models; `worth`: what the attribution measured there, None if it measured nothing);
            else None.
    """

    kind: str
    id: str
    text: str
    worth: float
    ci95: tuple[float, float]
    learned_on: dict | None = None


@dataclass(frozen=True)
class WorthResult(_Record):
    """The attribution after a compile (`attribution=True`): `detailed_results.worth`.

    Attributes:
        method: "leave-one-out" or "shapley".
        queries: Attribution queries the worth was measured on (with `prune`, the half that chose what to drop).
        score: The compiled program's mean score on them, with every item.
        items: One `ItemWorth` per kept experience and demo.
        library: The compiled program's score minus the program's with nothing learned (per query, then averaged).
        library_ci95: 95% bootstrap CI of `library`.
        control: The compiled program's score minus the program's with an irrelevant text of the same length in place
            of what was learned: what the content is worth beyond its length.
        control_ci95: 95% bootstrap CI of `control`.
        pruned: IDs of the items the compiled program dropped (`prune`); empty when nothing was dropped.
        prune_check: With `prune` and an item to drop: the pruned program minus the unpruned one on the other half of
            the queries (`queries`, `dropped`, `difference`, `ci95`), and which of the two was `kept`; else None.
        program_runs: Program runs the attribution made (its cost; a resume's reused runs included).
    """

    method: str
    queries: int
    score: float
    items: list[ItemWorth]
    library: float
    library_ci95: tuple[float, float]
    control: float
    control_ci95: tuple[float, float]
    pruned: list[str]
    prune_check: dict[str, Any] | None
    program_runs: int

    def line(self, task: str, seed: int) -> str:
        """The one-line summary benchmarks/measurements.md keeps per run."""
        return (f"worth: task={task} seed={seed} items={len(self.items)} library={self.library:+.3f} "
                f"ci_low={self.library_ci95[0]:+.3f} control={self.control:+.3f} "
                f"ci_low_vs_control={self.control_ci95[0]:+.3f} pruned={len(self.pruned)}")


@dataclass(frozen=True)
class TrainingFreeGRPOResult(_Record):
    """A compile's record: `compiled.detailed_results`; `to_dict()` gives the whole record as plain JSON-ready data.

    Attributes:
        steps: One `StepResult` per optimization step, steps reused from `log_dir` included.
        epochs: One `EpochResult` per validated epoch; empty without a valset.
        best_val_score: The best epoch's validation score; None without a valset.
        best_epoch: The epoch whose library (and demos) the compiled program carries; None without a valset,
            where the program carries the last one.
        usage: Per role, the calls this `compile()` made, with their tokens and known cost: "policy" (rollouts,
            probes, validation), "reflection" (learning calls) and, where the metric calls an LM (an LLM judge),
            "metric" (its calls); steps reused from `log_dir` are not counted.
        run_usage: The same for the whole run, reused steps included: what the budgets count.
        reused_units: Units of work read back from `log_dir` instead of computed again.
        stopped_early: Why the run stopped before its last step (a budget ran out, say), or None.
        worth: With `attribution`, what each kept item is worth on held-out queries (`WorthResult`); else None.
        refit: With `refit`, what each item the student carried was worth on this run's model before the steps
            (`WorthResult`, each item's `learned_on` where the program recorded it; `pruned`: those left out); else
            None.
        limits: What limited the run: `attempts_solved` (the rollouts that solved their own query, of all answered),
            `best_written` (the demo candidate that solved most of its probe's queries: step, solved, of) against
            `kept` (the kept program on the last probe), a `verdict`, the `calls` this compile sent per stage, the
            `learning_failures` of its steps, why it `stopped`, and the `summary` sentence the log and
            `tfgrpo report` print.
    """

    steps: list[StepResult]
    epochs: list[EpochResult]
    best_val_score: float | None
    best_epoch: int | None
    usage: dict[str, dict[str, float]]
    run_usage: dict[str, dict[str, float]]
    reused_units: int
    stopped_early: str | None
    worth: WorthResult | None = None
    refit: WorthResult | None = None
    limits: dict = field(default_factory=dict)
