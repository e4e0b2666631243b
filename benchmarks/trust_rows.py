"""Rows of benchmarks/faults.py for inputs a run must not trust in silence (issue 37, items 2 and 4-7).

Each row tries one case as a user would meet it and says how it ended: `refused` (a clear error before anything is
spent or loaded), `recovered` or `nothing lost`; anything else is the silent failure the issue describes. They run
in this process and need no LM calls, except item 5's, which is sent to a fake server that must see none.
"""

from __future__ import annotations

import json
import logging
import traceback
from pathlib import Path

NON_LATIN = ["先加个位再进位。", "检查结果是否正确。", "تحقق من النتيجة قبل الإجابة.", "בדוק את התוצאה לפני התשובה.",
             "🔢 ➕ ✅ 🔁"]  # the rules of the issue that were all taken for duplicates of E1


def _row(name: str, cases: int, status: str, size="-", output: str = "", crashed: bool = False) -> dict:
    return dict(name=name, injected=cases, crashes=int(crashed), corrupted=0, redone=0, extra=0, size=size,
                equal=None, status=status, output=output)


def _guarded(name: str, cases: int, measure) -> dict:
    """The row `measure()` gives, or one that counts a crash (with the traceback as its output)."""
    try:
        return measure()
    except Exception:  # an unexpected error is a crash of the row, shown above the table
        return _row(name, cases, "crashed", output=traceback.format_exc(), crashed=True)


def _refused(call) -> str | None:
    """The ValueError's text when `call()` refuses, else None."""
    try:
        call()
    except ValueError as exc:
        return str(exc)
    return None


def non_latin_row() -> dict:
    """Item 2: five non-Latin rules and a 3,000-character Chinese one go to a library that holds one Latin rule."""
    from tfgrpo.programs.library import ExperienceLibrary
    from tfgrpo.signatures.operations import Operation

    def measure():
        library = ExperienceLibrary(max_words=32)
        texts = ["Add the ones first, then carry."] + NON_LATIN
        quiet = logging.getLogger("tfgrpo.programs.library")
        level = quiet.level
        quiet.setLevel(logging.ERROR)  # the refusals are the row's to tell, not the log's
        try:
            library.apply([Operation(action="add", ids=[], text=t) for t in texts], step=0)
            kept = sum(t in library.texts() for t in NON_LATIN)
            long_rule = ExperienceLibrary(max_words=32)  # on its own: refused for its length, not as a duplicate
            bounded = long_rule.apply([Operation(action="add", ids=[], text="先" * 3000)], step=0).num_applied == 0
        finally:
            quiet.setLevel(level)
        ok = kept == len(NON_LATIN) and bounded
        return _row("non_latin_rules", len(NON_LATIN) + 1, ("nothing lost" if ok else "LOST") + f": {kept} of "
                    f"{len(NON_LATIN)} non-Latin rules kept; the 3,000-character rule "
                    f"{'refused' if bounded else 'accepted'}", size=len(library))

    return _guarded("non_latin_rules", len(NON_LATIN) + 1, measure)


def other_program_row(root: Path) -> dict:
    """Item 4: a program.json whose predictor has the same name as the program's and other fields."""
    import dspy

    from benchmarks.fault_child import make_program
    from tfgrpo.programs import load_program, save_program

    class Labeller(dspy.Module):
        def __init__(self):
            super().__init__()
            self.solve = dspy.Predict("text -> label")  # the name of make_program()'s predictor

    def measure():
        path = save_program(Labeller(), root / "labeller.json")
        why = _refused(lambda: load_program(make_program(), path))
        return _row("other_program_json", 1, "refused: the saved fields differ" if why and "fields" in why else
                    "loaded silently")

    return _guarded("other_program_json", 1, measure)


def valset_keys_row(root: Path) -> dict:
    """Item 5: a valset with `query` where the program (a dspy.Predict, which only logs a missing input) takes
    `question`: refused before any LM call, or scored 0 in silence?"""
    import dspy

    from benchmarks.fault_child import make_trainset, metric, server
    from tfgrpo.optimizers import TrainingFreeGRPO

    def measure():
        valset = [dspy.Example(query=x.question, answer=x.answer).with_inputs("query") for x in make_trainset(3)]
        with server() as srv, dspy.context(lm=dspy.LM("openai/fake", api_base=srv.api_base, api_key="x", cache=False,
                                                       num_retries=0)):
            optimizer = TrainingFreeGRPO(metric, num_generations=2, num_train_epochs=1, batch_size=2,
                                         log_dir=str(root / "log"), progress=lambda *_: None)
            why = _refused(lambda: optimizer.compile(dspy.Predict("question -> answer"), trainset=make_trainset(4),
                                                     valset=valset))
            sent = srv.stats()["calls"]
        ok = bool(why) and "valset" in why and sent == 0
        return _row("valset_input_keys", 1, "refused, nothing sent" if ok else f"NOT refused ({sent} calls sent)")

    return _guarded("valset_input_keys", 1, measure)


def same_file_name_row(root: Path) -> dict:
    """Item 6: `team_a/agent.py:Agent` and `team_b/agent.py:metric`: is team_b's metric the one imported?"""
    from tfgrpo.user_task import metric_function, program_factory

    def measure():
        for team, score in (("team_a", 1.0), ("team_b", 0.5)):
            (root / team).mkdir()
            (root / team / "agent.py").write_text(
                "import dspy\n\n\nclass Agent(dspy.Module):\n    def __init__(self):\n        super().__init__()\n"
                "        self.gen = dspy.Predict('question -> answer')\n\n\n"
                f"def metric(example, pred, trace=None):\n    return {score}\n")
        program_factory(str(root / "team_a" / "agent.py") + ":Agent")
        score = metric_function(str(root / "team_b" / "agent.py") + ":metric")(None, None)
        return _row("same_file_name", 1, "nothing lost: each file imported as itself" if score == 0.5 else
                    "team_a's metric ran in place of team_b's")

    return _guarded("same_file_name", 1, measure)


def hand_edit_row(root: Path) -> dict:
    """Item 7: a saved program.json edited by hand four ways: a reworded [E2] line, a deleted </experiences>, a
    second E1 and an ID X1. Each must be refused, not reverted to the stored library or half-read."""
    from benchmarks.fault_child import make_program
    from tfgrpo.programs import ExperienceLibrary, apply_library, load_program, save_program
    from tfgrpo.signatures.operations import Operation

    edits = {"reworded": ("by subtracting", "by adding again"), "no close tag": ("</experiences>", ""),
             "second E1": ("[E2]", "[E1]"), "X1": ("[E1]", "[X1]")}

    def measure():
        library = ExperienceLibrary()
        library.apply([Operation(action="add", ids=[], text=t) for t in
                       ("Add the ones first, then carry.", "Check the sum by subtracting.")], step=0)
        saved = json.loads(save_program(apply_library(make_program(), library), root / "program.json").read_text())
        refused = []
        for name, (old, new) in edits.items():
            state = json.loads(json.dumps(saved))
            signature = state["solve"]["signature"]
            signature["instructions"] = signature["instructions"].replace(old, new)
            (root / "edited.json").write_text(json.dumps(state))
            if _refused(lambda: load_program(make_program(), root / "edited.json")):
                refused.append(name)
        missed = [n for n in edits if n not in refused]
        return _row("hand_edited_json", len(edits), f"refused: {len(refused)} of {len(edits)} edits" +
                    (f" (loaded silently: {', '.join(missed)})" if missed else ""))

    return _guarded("hand_edited_json", len(edits), measure)


def trust_rows(folder) -> list[dict]:
    """The rows, each in a fresh folder that `folder(name)` makes."""
    return [non_latin_row(), other_program_row(folder("other_program")), valset_keys_row(folder("valset_keys")),
            same_file_name_row(folder("same_file_name")), hand_edit_row(folder("hand_edit"))]
