"""The web task's rewards: SQuAD-normalised EM/F1, and the LLM judge with its verdict cache."""

from __future__ import annotations

import dspy
import pytest
from scripted_lm import ScriptedLM, output_fields

from tfgrpo.optimizers.rewards import MetricError, call_metric
from tfgrpo.tasks.web.reward import JudgeAnswer
from tfgrpo.tasks.web import JudgeError, LLMJudge, em_metric, exact_match, f1_metric, judge_metric, normalize_answer, token_f1

Q, REF = "Which position did the actress hold?", "Chief of Protocol"


@pytest.mark.parametrize("pred,ref,em,f1", [
    ("The Chief of Protocol.", "Chief of Protocol", 1.0, 1.0),
    ("chief  of   PROTOCOL", "Chief of Protocol", 1.0, 1.0),
    ("Chief of Protocol of the United States", "Chief of Protocol", 0.0, 2 * (3 / 6) * 1 / (3 / 6 + 1)),
    ("yes", "no", 0.0, 0.0),
    ("yes it is", "yes", 0.0, 0.0),  # a yes/no answer gets no partial credit
    ("", "Melbourne", 0.0, 0.0),
])
def test_em_and_f1_follow_the_squad_rules(pred, ref, em, f1):
    assert exact_match(pred, ref) == em
    assert token_f1(pred, ref) == pytest.approx(f1)


def test_normalisation():
    assert normalize_answer("An Apple, the  Pie!") == "apple pie"


def judge_lm(replies: list):
    """The judge's replies in order (a dict of fields, or raw text); every call is logged."""
    replies = list(replies)

    def respond(messages, kwargs):
        assert output_fields(messages) == ["reason", "verdict"]
        return replies.pop(0)

    return ScriptedLM(respond)


def ask(judge, response="The Chief of Protocol"):
    return judge(Q, REF, response)


def test_judge_verdicts_are_cached_in_memory_and_on_disk(tmp_path):
    lm = judge_lm([{"reason": "same office", "verdict": "correct"}])
    judge = LLMJudge(lm, cache_path=tmp_path / "verdicts.jsonl")
    assert ask(judge) == (True, "same office") and ask(judge) == (True, "same office")
    assert len(lm.calls) == 1 and judge.calls == 1
    again = LLMJudge(judge_lm([]), cache_path=tmp_path / "verdicts.jsonl")  # a new run pays nothing
    assert ask(again) == (True, "same office") and again.calls == 0


def test_a_cut_cache_line_is_skipped_and_asked_again(tmp_path):
    path = tmp_path / "verdicts.jsonl"
    LLMJudge(judge_lm([{"reason": "r", "verdict": "incorrect"}]), cache_path=path)(Q, REF, "Governor")
    path.write_text(path.read_text() + '{"key": "abc", "corr')  # a crash in the middle of a write
    judge = LLMJudge(judge_lm([{"reason": "r2", "verdict": "correct"}]), cache_path=path)
    assert judge(Q, REF, "Governor") == (False, "r") and ask(judge) == (True, "r2")


def test_an_unreadable_reply_is_asked_once_more():
    lm = judge_lm(["no fields at all", {"reason": "ok", "verdict": "correct"}])
    assert ask(LLMJudge(lm)) == (True, "ok") and len(lm.calls) == 2


@pytest.mark.parametrize("bad", ["I think it is fine.", {"reason": "x", "verdict": "probably"}])
def test_two_unreadable_replies_raise_instead_of_scoring_zero(bad):
    with dspy.context(adapter=dspy.ChatAdapter(use_json_adapter_fallback=False)):
        judge = LLMJudge(judge_lm([bad, bad]))
        with pytest.raises(JudgeError, match="the judge: unusable reply twice"):
            ask(judge)
        metric = judge_metric(judge)
        example = dspy.Example(question=Q, answer=REF).with_inputs("question")
        judge.predict.lm = judge_lm([bad, bad])
        with pytest.raises(MetricError, match="JudgeError"):  # the run stops, naming the judge
            call_metric(metric, example, dspy.Prediction(answer="Governor"))


def test_judge_metric_skips_empty_answers_and_reports_the_reason():
    lm = judge_lm([{"reason": "a different office", "verdict": "incorrect"}])
    metric = judge_metric(LLMJudge(lm))
    example = dspy.Example(question=Q, answer=REF).with_inputs("question")
    assert call_metric(metric, example, dspy.Prediction(answer="  ")) == (0.0, "no answer was given")
    score, feedback = call_metric(metric, example, dspy.Prediction(answer="Governor"))
    assert score == 0.0 and "a different office" in feedback and len(lm.calls) == 1
    assert em_metric(example, dspy.Prediction(answer="chief of protocol")) == 1.0
    assert f1_metric(example, dspy.Prediction(answer="Protocol chief")).score == pytest.approx(0.8)


def test_constrained_judge_sends_the_verdict_schema():
    judge = LLMJudge(ScriptedLM(lambda m, k: '{"reason": "same", "verdict": "correct"}'), constrained="json_object")
    assert ask(judge) == (True, "same")
    kwargs = {}
    judge.adapter._prepare_response_format(None, kwargs, JudgeAnswer)
    fmt = kwargs["response_format"]
    assert fmt["type"] == "json_object" and fmt["schema"]["properties"]["verdict"]["enum"] == ["correct", "incorrect"]
