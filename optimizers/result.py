"""The typed record of a run: `compiled.detailed_results` is a `TrainingFreeGRPOResult`.

Every step has the same fields whatever the learning path; what only one path counts (the contrast path's refused
or redundant rules, say) is under `details`. `to_dict()` gives plain JSON-ready data (what `steps.jsonl` holds).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True)
class StepResult:
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
        rollout_failures: Attempts that raised (scored 0).
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
        queries: The training queries rolled out, those dynamic sampling added included.
        evidence: Training query (as a string) -> whether the program after the step is known to solve it, as its
            rollouts or probe attempts showed; what `focus_on_failures` reads.
        usage_before_resume: Of `usage`, what a run stopped in this step had spent on the units a resume then
            reused (calls and tokens; their cost is not known).
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
    evidence: dict[str, bool] = field(default_factory=dict)
    usage_before_resume: dict[str, dict[str, float]] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)


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
    """

    kind: str
    id: str
    text: str
    worth: float
    ci95: tuple[float, float]


@dataclass(frozen=True)
class WorthResult:
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

    def to_dict(self) -> dict:
        return asdict(self)

    def line(self, task: str, seed: int) -> str:
        """The one-line summary docs/measurements.md keeps per run."""
        return (f"worth: task={task} seed={seed} items={len(self.items)} library={self.library:+.3f} "
                f"ci_low={self.library_ci95[0]:+.3f} control={self.control:+.3f} "
                f"ci_low_vs_control={self.control_ci95[0]:+.3f} pruned={len(self.pruned)}")


@dataclass(frozen=True)
class TrainingFreeGRPOResult:
    """A compile's record: `compiled.detailed_results`; `to_dict()` gives the whole record as plain JSON-ready data.

    Attributes:
        steps: One `StepResult` per optimization step, steps reused from `log_dir` included.
        epochs: One `EpochResult` per validated epoch; empty without a valset.
        best_val_score: The best epoch's validation score; None without a valset.
        best_epoch: The epoch whose library (and demos) the compiled program carries; None without a valset,
            where the program carries the last one.
        usage: Per role, the calls this `compile()` made, with their tokens and known cost: "policy" (rollouts,
            probes) and "reflection" (learning calls); steps reused from `log_dir` are not counted.
        run_usage: The same for the whole run, reused steps included: what the budgets count.
        reused_units: Units of work read back from `log_dir` instead of computed again.
        stopped_early: Why the run stopped before its last step (a budget ran out, say), or None.
        worth: With `attribution`, what each kept item is worth on held-out queries (`WorthResult`); else None.
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

    def to_dict(self) -> dict:
        return asdict(self)
