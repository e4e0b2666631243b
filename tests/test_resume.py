"""Crash and resume: a call whose reply log_dir's record holds is never sent to an LM again."""

import json
import re

import dspy
import pytest

from scripted_lm import ScriptedLM, kind_of, output_fields
from test_optimizer import make_trainset, metric
from tfgrpo.optimizers import TrainingFreeGRPO
from tfgrpo.optimizers.checkpoint import RunMismatchError


class Crash(BaseException):
    """Stands for a kill: not an Exception, so nothing on the way catches it."""


def learner(messages, kwargs):
    """Every step learns something new: the student ignores the library (right on even rollout_ids only),
    each group proposes a lesson named after its query, and consolidation keeps every proposal."""
    kind, last = kind_of(messages), messages[-1]["content"]
    if kind == "student":
        a, b = re.findall(r"What is (\d+) \+ (\d+)\?", last)[-1]
        right = (kwargs.get("rollout_id") or 0) % 2 == 0
        return {**{f: "x" for f in output_fields(messages)}, "answer": str(int(a) + int(b)) if right else "-1"}
    if kind == "summary":
        return {"summary": "1. Added. 2. Lost the carry."}
    if kind == "advantage":
        a = re.findall(r"What is (\d+) \+", last)[-1]
        return {"operations": [{"action": "add", "text": f"When a sum starts from {a}, check the carry."}]}
    return {"plan": [{"action": "add", "text": t} for t in re.findall(r'"text": "([^"]+)"', last)]}


def crashing(at_kind, nth):
    base, seen = learner, {"n": 0}

    def respond(messages, kwargs):
        if kind_of(messages) == at_kind:
            seen["n"] += 1
            if seen["n"] == nth:
                raise Crash()
        return base(messages, kwargs)

    return respond


def run(lm, log_dir, **kw):
    dspy.configure(lm=lm)
    opts = dict(num_generations=4, num_train_epochs=1, batch_size=2, num_threads=1, log_dir=str(log_dir))
    opts.update(kw)
    return TrainingFreeGRPO(metric, **opts).compile(dspy.Predict("question -> answer"), trainset=make_trainset())


@pytest.mark.parametrize("at_kind, nth", [("consolidation", 2), ("advantage", 3), ("summary", 5), ("student", 10)])
def test_resume_after_a_crash_redoes_nothing_and_ends_the_same(tmp_path, at_kind, nth):
    reference_lm = ScriptedLM(learner)
    reference = run(reference_lm, tmp_path / "clean")
    assert len(reference.experience_library) == 4  # two steps, two lessons each
    first = ScriptedLM(crashing(at_kind, nth))
    with pytest.raises(Crash):
        run(first, tmp_path / "run")
    done = {f"step {int(p.stem)}" for p in (tmp_path / "run" / "steps").glob("*.json")}
    recorded = [json.loads(line) for line in (tmp_path / "run" / "calls.jsonl").read_text().splitlines()]
    unfinished = sum(1 for e in recorded if "key" in e and e["scope"] not in done)  # what the resume asks again
    resumed_lm = ScriptedLM(learner)
    resumed = run(resumed_lm, tmp_path / "run")
    assert resumed.experience_library.dump_state() == reference.experience_library.dump_state()
    # every call that returned before the crash was kept: together the two runs made the calls of one
    assert len(first.calls) + len(resumed_lm.calls) == len(reference_lm.calls)
    # the unfinished step ran again, each call it had made answered from the record; a finished step asked nothing
    assert resumed.detailed_results.to_dict()["reused_units"] == unfinished
    # and the run's cost counts them: a step stopped halfway keeps what its finished units spent
    calls = lambda result: {role: u.get("calls", 0) for role, u in result.detailed_results.to_dict()["run_usage"].items()}  # noqa: E731
    assert calls(resumed) == calls(reference)
    new = sum(u.get("calls", 0) for u in resumed.detailed_results.to_dict()["usage"].values())
    assert new == len(resumed_lm.calls)  # and this compile's own calls are those it made


def test_a_finished_run_resumes_with_zero_calls_and_reports_none_as_new(tmp_path):
    first = run(ScriptedLM(learner), tmp_path)
    lm = ScriptedLM(learner)
    again = run(lm, tmp_path)
    assert lm.calls == [] and again.experience_library.texts()
    usage, whole = again.detailed_results.to_dict()["usage"], again.detailed_results.to_dict()["run_usage"]
    assert usage["policy"].get("calls", 0) == 0 and usage["reflection"].get("calls", 0) == 0, usage
    assert whole == first.detailed_results.to_dict()["usage"] == first.detailed_results.to_dict()["run_usage"]  # what the run had cost


def test_changed_settings_are_refused_naming_each_field_old_and_new(tmp_path):
    run(ScriptedLM(learner), tmp_path)
    lm = ScriptedLM(learner)
    with pytest.raises(RunMismatchError) as info:
        run(lm, tmp_path, num_generations=3, temperature=1.5)
    message = str(info.value)
    assert "num_generations: 4 -> 3" in message and "temperature: 0.7 -> 1.5" in message
    assert "batch_size" not in message and "new log_dir" in message and lm.calls == []


def test_a_knob_newer_than_the_run_is_not_compared():
    """A run recorded before a knob existed resumes under the version that added it (an old fingerprint's missing
    entries are not compared); a knob the run did record is."""
    from tfgrpo.optimizers.checkpoint import fingerprint_changes

    old = {"knobs": {"probe_size": 4}}
    assert fingerprint_changes(old, {"knobs": {"probe_size": 4, "keep_tied_demos": False}}) == []
    assert fingerprint_changes(old, {"knobs": {"probe_size": 2, "keep_tied_demos": False}}) == ["knob probe_size: 4 -> 2"]


def test_a_retired_knob_resumes_at_the_value_this_version_computes_with():
    """A run recorded by a version that had probe_alpha resumes where it used the value this version computes with
    (1.0: any net gain), and is refused where it used another."""
    from tfgrpo.optimizers.checkpoint import fingerprint_changes

    new = {"knobs": {"probe_size": 8}}
    assert fingerprint_changes({"knobs": {"probe_size": 8, "probe_alpha": 1.0}}, new) == []
    assert fingerprint_changes({"knobs": {"probe_size": 8, "probe_alpha": 0.15}}, new) == [
        "knob probe_alpha: 0.15 -> '(unset)'"]


def test_a_different_model_is_refused_but_execution_settings_may_change(tmp_path):
    run(ScriptedLM(learner), tmp_path)
    other = ScriptedLM(learner)
    other.model = "other-model"
    with pytest.raises(RunMismatchError, match=r"policy.*'dummy'.*->.*'other-model'"):
        run(other, tmp_path)
    lm, seen = ScriptedLM(learner), []
    again = run(lm, tmp_path, num_threads=3, max_failure_rate=0.9, max_total_tokens=10**9,
                progress=lambda *a: seen.append(a))
    assert lm.calls == [] and again.experience_library.texts()


@pytest.mark.parametrize("damage", ["empty", "missing", "not a fingerprint"])
def test_saved_work_without_a_readable_run_json_is_never_reused(tmp_path, damage):
    """Issue 18: an unreadable run.json used to turn the check off, so another configuration's steps were reused."""
    run(ScriptedLM(learner), tmp_path, num_generations=4)
    record = tmp_path / "run.json"
    if damage == "empty":
        record.write_text("")
    elif damage == "missing":
        record.unlink()
    else:
        record.write_text("{}")
    before = {p: p.stat().st_mtime_ns for p in tmp_path.rglob("*.json*")}
    lm = ScriptedLM(learner)
    with pytest.raises(RunMismatchError) as info:
        run(lm, tmp_path, num_generations=2, temperature=1.5)
    message = str(info.value)
    assert "run.json" in message and "new log_dir" in message and f"delete {tmp_path}" in message
    assert lm.calls == [], "nothing is sent"
    assert {p: p.stat().st_mtime_ns for p in tmp_path.rglob("*.json*")} == before, "nothing is rewritten"


def test_a_log_dir_without_saved_work_starts_a_run(tmp_path):
    (tmp_path / "steps").mkdir()  # an empty folder, or one left by a run stopped before its first call
    (tmp_path / "run.json").write_text("")
    assert run(ScriptedLM(learner), tmp_path).experience_library.texts()
    assert (tmp_path / "run.json").read_text().startswith("{")


def test_a_log_dir_of_an_earlier_tfgrpo_is_refused_with_the_fix(tmp_path):
    """An earlier tfgrpo saved one file per unit of work (steps/0000/rollouts/...): this version cannot resume it, and
    says so rather than starting over inside it or misreading it."""
    (tmp_path / "steps" / "0000" / "rollouts").mkdir(parents=True)
    (tmp_path / "steps" / "0000" / "rollouts" / "0_0.json").write_text("{}")
    (tmp_path / "run.json").write_text("{}")
    lm = ScriptedLM(learner)
    with pytest.raises(RunMismatchError, match="earlier tfgrpo.*new log_dir"):
        run(lm, tmp_path)
    assert lm.calls == [] and not (tmp_path / "calls.jsonl").exists()


def test_a_record_with_a_torn_or_foreign_line_resumes_and_asks_only_those_again(tmp_path, caplog):
    """A kill mid-write leaves a torn last line of calls.jsonl, and a line of anything else may be in it: the resume
    drops the first, passes over the second (said once), and asks again only the calls they held."""
    first = run(ScriptedLM(learner), tmp_path)
    for p in (tmp_path / "steps").glob("*.json"):
        p.unlink()  # no finished step: every call is asked again, answered from the record
    path = tmp_path / "calls.jsonl"
    lines = path.read_text().splitlines(keepends=True)
    calls = [i for i, line in enumerate(lines) if line.startswith('{"key"')]
    lines[calls[0]] = "not a call\n"
    path.write_text("".join(lines[:calls[-1]]) + lines[calls[-1]][:40])
    lm = ScriptedLM(learner)
    with caplog.at_level("WARNING", logger="tfgrpo"):
        again = run(lm, tmp_path)
    assert again.experience_library.texts() == first.experience_library.texts()
    assert len(lm.calls) == 2  # the line overwritten and the torn one
    assert "1 line(s) do not read as calls" in caplog.text


@pytest.mark.parametrize("budget", [{"max_metric_calls": 12}, {"max_total_tokens": 1500}])
def test_a_step_the_budget_refused_is_refused_again_on_a_resume(tmp_path, budget):
    """The budget reads what the run's record holds, not what this process spent: the same call after a budget stop
    stops where the first one did, sending nothing, however many times it is run."""
    first = run(ScriptedLM(learner), tmp_path, **budget)
    assert first.detailed_results.stopped_early
    for _ in range(2):
        lm = ScriptedLM(learner)
        again = run(lm, tmp_path, **budget)
        assert lm.calls == [] and again.detailed_results.stopped_early == first.detailed_results.stopped_early
        assert again.detailed_results.run_usage == first.detailed_results.run_usage
