"""Experiences where they belong: in a program of several predictors each experience goes to the predictors the
learning calls name for it; a library keeps within `max_library_tokens`; a new experience that says what one already
says is folded into it; plan() refuses a budget with which the prompt would not fit the model's context."""

import http.server
import json
import re
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import dspy
import pytest

from scripted_lm import ScriptedLM, kind_of, output_fields
from tfgrpo.optimizers import TrainingFreeGRPO
from tfgrpo.programs import ExperienceLibrary, save_program
from tfgrpo.programs.inject import library_from_instructions
from tfgrpo.programs.library import overlap
from tfgrpo.signatures import Operation
from tfgrpo.signatures.operations import placed
from tfgrpo.testing.prompts import field_values
from user_programs import Pipeline


NAMES = ["plan", "solve.predict", "check"]


def trainset(n=8):
    return [dspy.Example(question=f"What is {i} + {i + 10}?", answer=str(2 * i + 10)).with_inputs("question")
            for i in range(n)]


def metric(example, pred, trace=None):
    return float(str(pred.answer) == example.answer)


LESSONS = ["When planning a sum, split it into tens and units first.",
           "When solving, carry every overflow into the next column.",
           "When checking an answer, subtract one addend from it.",
           "When anything looks off, restate the question in your own words.",
           "When planning, estimate the result's size before any digit work.",
           "When solving, write both addends aligned by place value.",
           "When checking, compare the last digit with the units' sum.",
           "When finishing, answer with the bare number and nothing else."]


def lesson(i: int) -> dict:
    """Query i's lesson: for one of the three predictors in turn, or for every one (one query in four)."""
    return {"action": "add", "text": LESSONS[i % 8], "predictors": [[NAMES[i % 3]], ["all"]][i % 4 == 3]}


def placement_of(text: str) -> list[str]:
    """Where an experience learned from `lesson` belongs: [] for every predictor."""
    i = LESSONS.index(text)
    return [] if i % 4 == 3 else [NAMES[i % 3]]


def learner(messages, kwargs):
    """The student is right on even rollout IDs; each group's advantage places its lesson (`lesson`), and the
    consolidation keeps every proposal as it came, placement included."""
    kind, last = kind_of(messages), messages[-1]["content"]
    fields = output_fields(messages)
    if kind == "student":
        right = (kwargs.get("rollout_id") or 0) % 2 == 0
        a, b = re.findall(r"What is (\d+) \+ (\d+)\?", last)[-1]
        return {**{f: "x" for f in fields}, "answer": str(int(a) + int(b)) if right else "-1", "correct": "true"}
    if kind == "summary":
        return {"summary": "1. Added. 2. Lost the carry."}
    if kind == "advantage":
        assert "solve.predict: question, approach -> reasoning, answer" in field_values(last)["predictors"]
        return {"operations": [lesson(int(re.findall(r"What is (\d+) \+", last)[-1]))]}
    proposals = json.loads(field_values(last)["proposals"])
    return {"plan": [{k: p[k] for k in ("action", "text", "predictors")} for p in proposals]}


def compile_(lm, log_dir, **kw):
    dspy.configure(lm=lm)
    knobs = dict(num_generations=4, num_train_epochs=1, batch_size=4, num_threads=2, log_dir=str(log_dir))
    return TrainingFreeGRPO(metric, **{**knobs, **kw}).compile(Pipeline(), trainset=trainset())


def carried(program) -> dict[str, list[str]]:
    """Each predictor's experience IDs, as its instructions carry them."""
    return {name: re.findall(r"^\[(E\d+)\]", p.signature.instructions, flags=re.MULTILINE)
            for name, p in program.named_predictors()}


def test_each_experience_goes_to_the_predictors_it_is_for(tmp_path):
    compiled = compile_(ScriptedLM(learner), tmp_path / "run")
    library = compiled.experience_library
    assert len(library) == 8
    for exp in library:
        assert exp.predictors == placement_of(exp.text), exp
    every = {e.id for e in library if not e.predictors}
    for name, ids in carried(compiled).items():
        assert set(ids) == every | {e.id for e in library if name in e.predictors}, name
    assert carried(compiled)["plan"] != carried(compiled)["check"]
    steps = compiled.detailed_results.to_dict()["steps"]
    assert sum(s["details"]["placed"]["some"] for s in steps) == 6
    assert sum(s["details"]["placed"]["all"] for s in steps) == 2


def test_the_placement_survives_save_a_fresh_process_and_stock_dspy(tmp_path):
    compiled = compile_(ScriptedLM(learner), tmp_path / "run")
    save_program(compiled, tmp_path / "program.json")
    script = textwrap.dedent(f"""
        import json, sys
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from user_programs import Pipeline  # (nothing of tfgrpo)
        program = Pipeline()
        program.load(sys.argv[1])
        assert "tfgrpo" not in sys.modules
        print(json.dumps({{n: p.signature.instructions for n, p in program.named_predictors()}}))
    """)
    out = subprocess.run([sys.executable, "-c", script, str(tmp_path / "program.json")], capture_output=True, text=True,
                         timeout=120, env={"LITELLM_LOCAL_MODEL_COST_MAP": "True", "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr
    loaded = json.loads(out.stdout.strip().splitlines()[-1])
    mine = {name: p.signature.instructions for name, p in compiled.named_predictors()}
    assert loaded == mine  # stock DSPy, nothing of tfgrpo imported: each predictor its own experiences
    fresh = Pipeline()
    fresh.load(tmp_path / "program.json")  # (a library read back from the instructions: placement and all)
    recovered = library_from_instructions(fresh, NAMES)
    assert {e.id: e.predictors for e in recovered} == {e.id: e.predictors for e in compiled.experience_library}


class Stop(BaseException):
    """Stands for a kill."""


def test_a_run_stopped_and_run_again_places_the_same(tmp_path):
    reference_lm = ScriptedLM(learner)
    reference = compile_(reference_lm, tmp_path / "clean")

    def stopping(messages, kwargs):
        if kind_of(messages) == "consolidation":
            raise Stop()
        return learner(messages, kwargs)

    stopped = ScriptedLM(stopping)
    with pytest.raises(Stop):
        compile_(stopped, tmp_path / "run")
    again = ScriptedLM(learner)
    resumed = compile_(again, tmp_path / "run")
    assert resumed.experience_library.dump_state() == reference.experience_library.dump_state()
    assert carried(resumed) == carried(reference)
    assert len(stopped.calls) + len(again.calls) == len(reference_lm.calls)  # nothing asked twice


def contrast_learner(messages, kwargs):
    """The contrast path's calls: each pair's rule for the predictor the query's lesson names (`lesson`)."""
    if kind_of(messages) != "contrast":
        return learner(messages, kwargs)
    inputs = field_values(messages[-1]["content"])
    assert inputs["predictors"].splitlines()[0].startswith("plan: question -> approach: Say how to work out the sum")
    i = int(re.search(r"What is (\d+) \+", inputs["task"]).group(1))
    where = lesson(i)["predictors"][0]
    return {"difference": "The better attempt rechecked.", "action": "add", "rule": lesson(i)["text"],
            "predictor": where, **({"target_id": "none"} if "target_id" in output_fields(messages) else {})}


def test_the_contrast_path_places_them_too(tmp_path):
    compiled = compile_(ScriptedLM(contrast_learner), tmp_path / "run", learning_path="contrast",
                        max_operations_per_group=1)
    library = compiled.experience_library
    assert len(library) == 8
    for exp in library:
        assert exp.predictors == placement_of(exp.text), exp
    for name, ids in carried(compiled).items():
        assert set(ids) == {e.id for e in library if e.is_for(name)}, name


def test_one_predictor_learning_calls_are_told_nothing_of_placement(tmp_path):
    lm = ScriptedLM(lambda messages, kwargs: {"summary": "ok"} if kind_of(messages) == "summary" else learner_one(
        messages, kwargs))
    dspy.configure(lm=lm)
    TrainingFreeGRPO(metric, num_generations=4, num_train_epochs=1, batch_size=4, log_dir=str(tmp_path / "one")
                     ).compile(dspy.Predict("question -> answer"), trainset=trainset(4))
    learning = [c for c in lm.calls if kind_of(c["messages"]) in ("advantage", "consolidation")]
    assert learning and not any("predictors" in c["messages"][0]["content"] for c in learning)


def learner_one(messages, kwargs):
    kind, last = kind_of(messages), messages[-1]["content"]
    if kind == "student":
        a, b = re.findall(r"What is (\d+) \+ (\d+)\?", last)[-1]
        return {"answer": str(int(a) + int(b)) if (kwargs.get("rollout_id") or 0) % 2 == 0 else "-1"}
    if kind == "advantage":
        return {"operations": [{"action": "add", "text": "When adding, recheck the carry."}]}
    return {"plan": [{"action": "add", "text": "When adding, recheck the carry."}]}


def test_forty_steps_never_leave_a_library_past_its_budget(tmp_path, caplog):
    """40 steps of 2 queries, each adding one experience of ~12 words: the libraries pass 60 tokens (counted as
    plan() counts them for a model without a tokenizer: LiteLLM's estimate) early, and every step's library stays
    within it; every retirement says why, in its step's record and in the run's summary."""
    lm = ScriptedLM(learner)
    compiled = compile_(lm, tmp_path / "long", batch_size=2, num_train_epochs=10, max_library_tokens=60)
    results = compiled.detailed_results.to_dict()
    steps = results["steps"]
    assert len(steps) == 40
    retired = [r for s in steps for r in s["details"].get("retired", [])]
    assert retired and all(r["tokens"] > 60 for r in retired)
    store = tmp_path / "long" / "steps"
    count = compiled_counter()
    for path in sorted(store.glob("[0-9]*.json")):
        library = ExperienceLibrary.from_state(json.loads(path.read_text())["library"])
        for name in NAMES:
            assert count(library.for_predictor(name).render()) <= 60, (path.name, name)
    assert all(count(compiled.experience_library.for_predictor(n).render()) <= 60 for n in NAMES)
    assert all(r["reason"].endswith("over max_library_tokens=60") for r in retired)
    assert f"{len(retired)} experience(s) retired past max_library_tokens" in caplog.text  # the end-of-run summary
    asked = [c["messages"][0]["content"] for c in lm.calls if kind_of(c["messages"]) == "consolidation"]
    assert any("may hold at most 60 tokens" in a and "Make room" in a for a in asked)  # where proposals would pass it
    assert not all("Make room" in a for a in asked)  # and only there


def compiled_counter():
    from tfgrpo.optimizers.spend import token_counter

    return token_counter(ScriptedLM(learner))[0]


def test_folding_an_experience_that_says_the_same():
    """The overlap of content words decides: at 0.7 a rewording that keeps the words is folded, a new lesson is not."""
    cases = [
        ("When adding two numbers, recount the tens after carrying.",
         "When adding two numbers recount the tens after carrying!", True),
        ("When adding two numbers, recount the tens after carrying.",
         "When adding numbers, recount tens after carrying over.", True),
        ("When adding two numbers, recount the tens after carrying.",
         "When adding two numbers, check the units digit first.", False),
        ("When a tool fails, retry once with simpler arguments.",
         "When the page is empty, search again with the title.", False),
    ]
    for old, new, same in cases:
        library = ExperienceLibrary()
        library.apply([Operation(action="add", text=old)], step=0, sources=["q1"])
        report = library.apply([Operation(action="add", text=new)], step=1, sources=["q2"], fold_at=0.7)
        assert (len(report.folded) == 1) == same == (overlap(old, new) >= 0.7), (old, new, overlap(old, new))
        assert len(library) == (1 if same else 2)
        if same:
            assert library.active["E1"].sources == ["q1", "q2"] and library.active["E1"].history[-1].action == "fold"


def test_the_same_lesson_for_another_predictor_widens_the_one_there_is():
    op = placed(NAMES)
    library = ExperienceLibrary()
    library.apply([op(action="add", text="When planning, list the steps first.", predictors=["plan"])], step=0)
    report = library.apply([op(action="add", text="When planning, list the steps first!", predictors=["check"])],
                           step=1, fold_at=0.7)
    assert len(report.folded) == 1 and len(library) == 1 and library.active["E1"].predictors == ["plan", "check"]
    library.apply([op(action="add", text="When planning, list all the steps first.", predictors=["all"])], step=2,
                  fold_at=0.7)
    assert library.active["E1"].predictors == []  # for every predictor now
    assert placed(NAMES).model_validate({"action": "add", "text": "x", "predictors": ["made_up", "plan"]}
                                        ).predictors == ["plan"]  # a name the model made up is dropped


class Server(http.server.ThreadingHTTPServer):
    """A llama.cpp server's two routes that plan() reads: /props (its context) and /tokenize (a token a word)."""

    def __init__(self, n_ctx: int):
        self.n_ctx, self.asked = n_ctx, []
        super().__init__(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.serve_forever, daemon=True).start()


class Handler(http.server.BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def _send(self, body: dict):
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        self.server.asked.append(self.path)
        self._send({"default_generation_settings": {"n_ctx": self.server.n_ctx}})

    def do_POST(self):
        self.server.asked.append(self.path)
        text = json.loads(self.rfile.read(int(self.headers["Content-Length"])))["content"]
        self._send({"tokens": list(range(len(text.split())))})


def served_lm(server: Server) -> ScriptedLM:
    lm = ScriptedLM(learner)
    lm.kwargs.update(api_base=f"http://127.0.0.1:{server.server_address[1]}/v1", max_tokens=200)
    return lm


def test_plan_refuses_a_budget_the_context_cannot_hold_and_says_its_basis(tmp_path):
    server = Server(n_ctx=1000)
    try:
        dspy.configure(lm=served_lm(server))
        optimizer = TrainingFreeGRPO(metric, max_library_tokens=900, max_demos=0, log_dir=str(tmp_path / "a"))
        with pytest.raises(ValueError, match=r"max_library_tokens=900: the longest prompt would not fit the context "
                                             r"window of .* \(1,000 tokens\).*Pass a smaller max_library_tokens"):
            optimizer.plan(Pipeline(), trainset=trainset())
        plan = TrainingFreeGRPO(metric, max_library_tokens="auto", log_dir=str(tmp_path / "b")).plan(
            Pipeline(), trainset=trainset())
        assert plan.library_tokens == 125  # an eighth of the context
        assert "counted by the model's own tokenizer" in plan.summary() and "of the context window's 1,000" in \
            plan.summary()
        assert "/tokenize" in server.asked and "/props" in server.asked
    finally:
        server.shutdown()
