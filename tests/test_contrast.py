"""The small-reflector learning path: typed per-call signatures, constrained decoding, generality in code,
pairwise contrast, folding, and the optimizer's path choice."""

import json
import re

import dspy
import pytest

from scripted_lm import ScriptedLM, kind_of, output_fields
from test_optimizer import LESSON, make_trainset, metric, student_answer
from tfgrpo.optimizers import TooManyFailuresError, TrainingFreeGRPO
from tfgrpo.optimizers.contrast_path import contrast_pairs, fold, overlap
from tfgrpo.optimizers.knobs import model_size_b
from tfgrpo.programs import ExperienceLibrary
from tfgrpo.programs.constrained import ConstrainedJSONAdapter, output_schema
from tfgrpo.programs.contrast_learner import ContrastLearner
from tfgrpo.programs.generality import restated_words, specific_terms
from tfgrpo.signatures.contrast import contrast_signature
from tfgrpo.signatures.operations import Operation


def resolved(optimizer, model):
    """The knobs a run with a reflection model of this name uses (the `auto` preset's values in place)."""
    from tfgrpo.optimizers.knobs import resolve

    return resolve(optimizer, optimizer.explicit_knobs(), model)[0]


def path_for(optimizer, model):
    from tfgrpo.optimizers.knobs import resolve

    return resolve(optimizer, optimizer.explicit_knobs(), model)[2]

BETTY = ("Betty is saving money for a new wallet which costs $100. Betty has only half of the money she needs. "
         "Her parents give her $15. How much more money does Betty need?")


@pytest.mark.parametrize("rule,specific", [
    ("When Betty saves money for a wallet, add the gifts.", True),
    ("When you have 15 and 100, subtract.", True),
    ("When a person has only half of the money she needs, double it.", True),  # a copied run of words
    ("When amounts are given as fractions of a total, compute each part first.", False),
    ("Convert minutes to hours by dividing by 60.", False),
])
def test_specific_terms_of_a_word_problem(rule, specific):
    assert bool(specific_terms(rule, BETTY)) is specific


NUGGETS = ("Alyssa, Keely, and Kendall ordered 100 chicken nuggets from a fast-food restaurant. Keely and Kendall "
           "each ate twice as many as Alyssa. How many did Alyssa eat?")
CARDS = ("John buys 10 packs of magic cards.  Each pack has 20 cards and 1/4 of those cards are uncommon.  How many "
         "uncommon cards did he get?")
BIKE = ("Ellie has found an old bicycle in a field and thinks it just needs some oil to work well again. She needs "
        "10ml of oil to fix each wheel and will need another 5ml of oil to fix the rest of the bike. How much oil "
        "does she need in total to fix the bike?")


GOATS = ("Paddington has 40 more goats than Washington. If Washington has 140 goats, how many goats do they have in "
         "total?")
TYPING = ("Janice can type 6 sentences per minute. Today at work, Janice continued working on a paper she started typing "
          "yesterday. She typed for 20 minutes, took a break, and typed 15 minutes longer. She then had to erase 40 "
          "sentences she had typed incorrectly. After a meeting, she typed for 18 minutes more. In all, the paper had 536 "
          "sentences by the end of today. How many sentences did she start with today?")


@pytest.mark.parametrize("rule,query", [  # rules the 1.5B wrote on GSM8K that named no one and no number
    ("Each person ate twice as many chicken nuggets as the person before them.", NUGGETS),
    ("Each pack contains 5 uncommon cards, which is consistent with the information provided in the task.", CARDS),
    ("Add 10ml of oil to each wheel and 5ml of oil to the rest of the bike. This will fix the bike.", BIKE),
    ("Add goats to the total number of goats.", GOATS),  # kept on 2026-11-27 when 3 shared words were required
])
def test_a_rule_made_of_its_problems_words_restates_it(rule, query):
    assert specific_terms(rule, query) == [] and restated_words(rule, query)


@pytest.mark.parametrize("rule", [
    "When amounts are given as fractions of a total, compute each part first.",
    "When a problem says 'twice as many', multiply the smaller quantity by two.",
    "When a fraction of a group has a property, multiply the group size by the fraction.",
    "Write each quantity with its unit and convert units before combining them.",
    "Compute the cost of each item separately, then add the costs to get the total cost.",
    "Multiply, then add.",  # no content word at all: nothing to restate
    "Convert minutes to hours before you add.",  # shares "minute" with TYPING, one of its three content words
])
def test_a_general_rule_shares_few_words_with_any_problem(rule):
    assert not any(restated_words(rule, query) for query in (BETTY, NUGGETS, CARDS, BIKE, GOATS, TYPING))


def test_words_of_the_instructions_are_the_tasks_own():
    rule = "Each pack contains cards; count the uncommon cards."
    assert restated_words(rule, CARDS)
    assert not restated_words(rule, CARDS, allowed="Count the uncommon cards in a pack of magic cards.")
    rule, query = "Cards, packs, boxes and sleeves hold uncommon cards.", "John buys cards, packs, boxes and sleeves."
    assert restated_words(rule, query) and not restated_words(rule, query, allowed="cards packs boxes sleeves")


def test_a_restated_rule_is_rewritten_once_then_refused():
    def replies(general):
        def respond(messages, kwargs):
            if output_fields(messages) == ["general_rule"]:
                return {"general_rule": general}
            return {"difference": "the better attempt doubled", "action": "add",
                    "rule": "Each person ate twice as many chicken nuggets as the person before them."}
        return respond

    for general, kept in [("When one amount is twice another, write both in terms of the smaller.", True),
                          ("Everyone ate twice as many chicken nuggets as the one before.", False)]:
        with dspy.context(lm=ScriptedLM(replies(general))):
            rec = ContrastLearner()(task=f"question: {NUGGETS}", better_attempt="answer: 20",
                                    worse_attempt="answer: 25", library=ExperienceLibrary())
        assert rec["rewritten"] and '"nugget"' in rec["specific"]
        assert (rec["operation"] is not None, rec["refused"] is None) == (kept, kept), rec


def test_specific_terms_allow_the_tasks_own_numbers():
    allowed = "Game of 24: combine the four numbers to make exactly 24"
    assert specific_terms("Print an expression worth 24 that uses all 4 numbers.", "4 5 6 10", allowed=allowed) == []
    assert specific_terms("When you have 6 and 4, multiply them.", "4 5 6 10", allowed=allowed) == ["4", "6"]
    assert specific_terms("Multiply 10 by two.", "4 5 6 10", allowed=allowed) == ["10"]


def test_rules_that_parrot_the_learning_prompt_are_caught():
    from tfgrpo.programs.generality import parroted_phrases
    assert parroted_phrases("Add a new rule that states: use eval.") == ['"new rule"']
    assert parroted_phrases("Like the better attempt, use eval.") == ['"better attempt"']
    assert parroted_phrases("Evaluate every candidate with exact fractions.") == []


def test_contrast_pairs():
    assert contrast_pairs([1, 0, 0, 1], 2) == [(0, 1), (3, 2)]
    assert contrast_pairs([1, 0, 0, 1], 1) == [(0, 1)]
    assert contrast_pairs([0.3, 0.3, 1, 0], 5) == [(2, 3)]  # then 0.3 vs 0.3: no contrast left
    assert contrast_pairs([0.5, 0.5], 3) == []


def test_fold_drops_what_is_already_said():
    existing = ["Check every candidate expression with exact fractions before printing it."]
    ops = [Operation(action="add", text="Check each candidate expression with exact fractions before printing."),
           Operation(action="add", text="Handle division by zero inside the search loop."),
           Operation(action="add", text="Handle division by zero inside the search loop!"),
           Operation(action="modify", ids=["E1"], text="A"), Operation(action="modify", ids=["E1"], text="B")]
    plan, redundant = fold(existing, ops)
    assert [o.text for o in plan] == ["Handle division by zero inside the search loop.", "A"] and redundant == 3
    assert overlap("a b c", "a b c") == 1.0


def test_signature_and_schema_follow_the_live_library():
    empty = output_schema(contrast_signature([], 20))
    assert empty["properties"]["action"]["enum"] == ["add", "none"] and "target_id" not in empty["properties"]
    assert empty["required"] == ["difference", "action", "rule"] and empty["additionalProperties"] is False
    full = output_schema(contrast_signature(["E2", "E5"], 20))
    assert full["properties"]["action"]["enum"] == ["add", "modify", "none"]
    assert full["properties"]["target_id"]["enum"] == ["E2", "E5", "none"]
    assert "20 words" in contrast_signature([], 20).output_fields["rule"].json_schema_extra["desc"]
    instructions = contrast_signature(["E2"], 20).instructions
    assert "E2" not in instructions and not any(ch.isdigit() for ch in instructions)  # nothing to copy


@pytest.mark.parametrize("mode,shape", [("json_object", "schema"), ("json_schema", "json_schema")])
def test_constrained_adapter_sends_the_schema(mode, shape):
    kwargs = {}
    ConstrainedJSONAdapter(mode)._prepare_response_format(None, kwargs, contrast_signature(["E1"], 10))
    fmt = kwargs["response_format"]
    assert fmt["type"] == mode
    schema = fmt["schema"] if shape == "schema" else fmt["json_schema"]["schema"]
    assert schema["properties"]["target_id"]["enum"] == ["E1", "none"]
    with pytest.raises(ValueError):
        ConstrainedJSONAdapter("grammar")


def test_length_bounds_reach_the_grammar_but_not_strict_schemas():
    """A field's max_length becomes maxLength for llama.cpp's grammar (a looping thought must close and the
    action still comes), and is left out of OpenAI's strict form, which rejects length keywords."""
    from tfgrpo.tasks.web.agent import WebStep
    kwargs = {}
    ConstrainedJSONAdapter("json_object")._prepare_response_format(None, kwargs, WebStep)
    props = kwargs["response_format"]["schema"]["properties"]
    assert props["thought"]["maxLength"] == props["argument"]["maxLength"] == 200
    assert props["action"]["enum"] == ["search", "open_page", "answer"] and "maxLength" not in props["action"]
    ConstrainedJSONAdapter("json_schema")._prepare_response_format(None, kwargs, WebStep)
    assert "maxLength" not in kwargs["response_format"]["json_schema"]["schema"]["properties"]["thought"]


def test_model_size_from_name():
    assert model_size_b("openai/qwen2.5-coder-1.5b") == 1.5
    assert model_size_b("ollama/llama3.1:8b") == 8
    assert model_size_b("openai/Qwen3-235B-A22B") == 235
    assert model_size_b("deepseek/deepseek-chat") == float("inf")


def contrast_learner(rule=LESSON, action="add", generalized=None):
    """Student as in test_optimizer; contrast calls propose `rule` ("{a}", "{b}": the task's numbers);
    rewrite calls answer `generalized` (formatted the same way)."""

    def respond(messages, kwargs):
        fields = output_fields(messages)
        text = "\n".join(m["content"] for m in messages)
        numbers = re.findall(r"What is (\d+) \+ (\d+)\?", text) or re.findall(r"adding (\d+) and (\d+)", text)
        a, b = numbers[-1] if numbers else ("", "")
        if fields == ["general_rule"]:
            return {"general_rule": (generalized or rule).format(a=a, b=b)}
        rule_now = rule.format(a=a, b=b)
        if "difference" in fields:
            reply = {"difference": "the better attempt carried the ones digit", "action": action, "rule": rule_now}
            if "target_id" in fields:
                reply["target_id"] = "none"
            return reply
        assert kind_of(messages) == "student"
        return student_answer(messages, kwargs)

    return respond


def compile_contrast(lm, **kw):
    dspy.configure(lm=lm)
    opts = dict(num_generations=4, num_train_epochs=1, batch_size=4, num_threads=4, learning_path="contrast",
                constrained_decoding="off", max_operations_per_group=1)
    opts.update(kw)
    return TrainingFreeGRPO(metric, **opts).compile(dspy.Predict("question -> answer"), trainset=make_trainset())


def test_contrast_path_learns_with_one_call_per_group():
    lm = ScriptedLM(contrast_learner())
    compiled = compile_contrast(lm)
    assert compiled.experience_library.texts() == [LESSON]
    step = compiled.detailed_results.to_dict()["steps"][0]
    assert step["groups_kept"] == 4 and step["operations_proposed"] == 4 and step["details"]["redundant"] == 3
    assert step["usage"]["contrast"]["calls"] == 4 and "summary" not in step["usage"]
    assert sum(1 for c in lm.calls if "difference" in output_fields(c["messages"])) == 4
    first = next(c for c in lm.calls if "difference" in output_fields(c["messages"]))
    assert "judged correct" in first["messages"][-1]["content"] and "judged wrong" in first["messages"][-1]["content"]


def test_specific_rules_are_rewritten_once_then_refused():
    lm = ScriptedLM(contrast_learner(rule="When adding {a} and {b}, carry.", generalized="When adding, carry the tens."))
    compiled = compile_contrast(lm)
    assert compiled.experience_library.texts() == ["When adding, carry the tens."]
    step = compiled.detailed_results.to_dict()["steps"][0]
    assert step["details"]["rewritten_specific"] >= 1 and step["details"]["refused_specific"] < step["operations_proposed"]

    lm = ScriptedLM(contrast_learner(rule="When adding {a} and {b}, carry.", generalized="Still {a} and {b}."))
    compiled = compile_contrast(lm)
    step = compiled.detailed_results.to_dict()["steps"][0]
    assert len(compiled.experience_library) == 0 and step["details"]["refused_specific"] == step["operations_proposed"] == 4


def test_invented_ids_cannot_pass_the_typed_reply():
    lib_start = ExperienceLibrary()
    lib_start.apply([Operation(action="add", text="When adding, start from the ones digit.")], step=0)
    student = dspy.Predict("question -> answer")
    student.experience_library = lib_start

    def respond(messages, kwargs):
        fields = output_fields(messages)
        if "difference" in fields:
            return {"difference": "d", "action": "modify", "target_id": "E7", "rule": LESSON}
        return student_answer(messages, kwargs)

    dspy.configure(lm=ScriptedLM(respond))
    opts = dict(num_generations=4, batch_size=4, num_train_epochs=1, num_threads=4, learning_path="contrast",
                constrained_decoding="off", max_operations_per_group=1)
    with pytest.raises(TooManyFailuresError, match="contrast calls"):  # every call failed: an outage, not "no lesson"
        TrainingFreeGRPO(metric, **opts).compile(student, trainset=make_trainset())
    compiled = TrainingFreeGRPO(metric, max_failure_rate=1.0, **opts).compile(student, trainset=make_trainset())
    step = compiled.detailed_results.to_dict()["steps"][0]
    assert step["learning_failures"] == 4 and step["operations_proposed"] == 0
    assert compiled.experience_library.texts() == ["When adding, start from the ones digit."]


def test_auto_path_picks_by_reflection_model_size():
    opt = TrainingFreeGRPO(metric)
    assert path_for(opt, "deepseek/deepseek-chat") == "paper"  # no size in the name: the paper's path
    assert path_for(opt, "openai/qwen2.5-coder-1.5b") == "contrast"
    assert path_for(TrainingFreeGRPO(metric, learning_path="paper"), "openai/qwen2.5-coder-1.5b") == "paper"
    with pytest.raises(ValueError, match="learning_path"):
        TrainingFreeGRPO(metric, learning_path="fast")
    with pytest.raises(ValueError, match="constrained_decoding"):
        TrainingFreeGRPO(metric, constrained_decoding="xml")


def test_a_contrast_run_resumes_without_calls(tmp_path):
    lm = ScriptedLM(contrast_learner())
    first = compile_contrast(lm, log_dir=str(tmp_path))
    calls = len(lm.calls)
    for step in (tmp_path / "steps").glob("*.json"):
        step.unlink()  # as if every step had been stopped before its end: run again, every call from the record
    again = compile_contrast(lm, log_dir=str(tmp_path))
    assert len(lm.calls) == calls and again.experience_library.texts() == first.experience_library.texts()
    stages = [json.loads(line).get("stage") for line in (tmp_path / "calls.jsonl").read_text().splitlines()]
    assert "contrast" in stages
