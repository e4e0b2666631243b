"""The typed record of a run: `compiled.detailed_results` is a `TrainingFreeGRPOResult`.

Every step has the same fields whatever the learning path; what only one path counts (the contrast path's refused
or redundant rules, say) is under `details`. `to_dict()` gives plain JSON-ready data (what `steps.jsonl` holds), and
`result["steps"]` reads the same data by key, as the plain dict this record used to be.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True)
class StepResult:
    step: int
    epoch: int
    batch_size: int
    learning_path: str
    mean_reward: float  # over every attempt of the step
    groups: int
    groups_kept: int  # groups with reward contrast (or every group, with G = 1)
    frac_skipped_zero_std: float
    rollout_failures: int
    tool_calls_mean: float
    learning_failures: int
    operations_proposed: int
    operations_applied: dict[str, int]  # by action
    operations_rejected: int  # refused by the library's checks
    library_size: int
    consolidation: str  # how the plan was made
    usage: dict[str, dict[str, float]]  # per stage: calls, tokens (and cost where known)
    seconds: dict[str, float]  # when each stage's last unit finished, from the step's start
    wall_s: float
    metric_calls: int = 0  # attempts the metric scored: rollouts, then probe attempts (a failed one counts, scored 0)
    demos: list[str] = field(default_factory=list)  # the queries of the demos kept after the step
    probe: dict[str, Any] | None = None  # with probe_size: the probed edits, their mean rewards and the verdicts
    details: dict[str, Any] = field(default_factory=dict)  # path-specific counts
    usage_before_resume: dict[str, dict[str, float]] = field(default_factory=dict)  # of `usage`, what a run stopped
    # in this step had spent on the units a resume then reused (calls and tokens; their cost is not known)

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class EpochResult:
    epoch: int
    val_score: float
    library_size: int
    val_failures: int = 0  # validation examples on which the program raised (scored 0)


@dataclass(frozen=True)
class TrainingFreeGRPOResult:
    steps: list[StepResult]
    epochs: list[EpochResult]
    best_val_score: float | None  # None without a valset
    best_epoch: int | None  # the epoch whose library the compiled program carries (None without a valset: the last)
    usage: dict[str, dict[str, float]]  # per role, calls made by this compile(): policy (rollouts, probes) and
    # reflection (learning calls); steps reused from the log_dir are not counted
    run_usage: dict[str, dict[str, float]]  # the same for the whole run, reused steps included (what budgets count)
    reused_units: int  # units of work read back from the log_dir instead of recomputed
    stopped_early: str | None  # why a budget stopped the run, if one did

    def to_dict(self) -> dict:
        return asdict(self)

    def __getitem__(self, key: str) -> Any:
        return self.to_dict()[key]
