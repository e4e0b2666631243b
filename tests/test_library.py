"""The experience library: operations take effect, bad ones are refused one by one, IDs are stable."""

import pytest

from tfgrpo.programs.library import ExperienceLibrary
from tfgrpo.signatures.operations import Operation, normalize_id


def op(action, ids=(), text=""):
    return Operation(action=action, ids=list(ids), text=text)


def lib_with(*texts, **kw):
    lib = ExperienceLibrary(**kw)
    report = lib.apply([op("add", text=t) for t in texts], step=0, sources=["train#0"])
    assert report.num_applied == len(texts)
    return lib


def test_add_modify_delete_merge_take_effect():
    lib = lib_with("When adding, check carries.", "When dividing, check zero.", "When in doubt, verify.")
    report = lib.apply([op("modify", ["E1"], "When adding columns, check every carry."),
                        op("delete", ["E2"]),
                        op("merge", ["E1", "E3"], "When adding, verify each carry and the final sum.")],
                       step=1, sources=["train#5"])
    assert report.applied == {"add": 0, "modify": 1, "merge": 1, "delete": 1}
    assert [e.id for e in lib] == ["E4"]
    assert lib.texts() == ["When adding, verify each carry and the final sum."]
    merged = lib.active["E4"]
    assert merged.history[0].related == ["E1", "E3"] and set(merged.sources) == {"train#0", "train#5"}
    assert set(lib.retired) == {"E1", "E2", "E3"}
    assert lib.retired["E1"].history[-1].action == "merged_into"
    assert lib.retired["E2"].history[-1].action == "delete"


def test_ids_are_never_reused():
    lib = lib_with("When a.", "When b.")
    lib.apply([op("delete", ["E2"])], step=1)
    lib.apply([op("add", text="When c.")], step=2)
    assert [e.id for e in lib] == ["E1", "E3"]


@pytest.mark.parametrize("bad, reason", [
    (op("modify", ["E9"], "When x."), "unknown ID"),
    (op("delete", ["E9"]), "unknown ID"),
    (op("add", text=""), "empty"),
    (op("add", text="When a problem involves ..., ..."), "placeholder"),
    (op("add", text=" ".join(["word"] * 33)), "over the limit"),
    (op("add", text="when adding: check carries"), "duplicate"),
    (op("modify", ["E1", "E2"], "When x."), "takes 1"),
    (op("merge", ["E1"], "When x."), "at least 2"),
    (op("merge", ["E1", "E1"], "When x."), "repeated"),
    (op("add", ["E1"], "When x."), "takes 0"),
])
def test_invalid_operations_are_refused_and_the_rest_applied(bad, reason):
    lib = lib_with("When adding, check carries.", "When dividing, check zero.")
    report = lib.apply([bad, op("add", text="When stuck, restate the goal.")], step=1)
    assert report.applied["add"] == 1 and len(report.rejected) == 1
    assert reason in report.rejected[0][1]
    assert len(lib) == 3


def test_retired_ids_are_refused():
    lib = lib_with("When a.", "When b.")
    report = lib.apply([op("delete", ["E1"]), op("modify", ["E1"], "When z.")], step=1)
    assert report.applied["delete"] == 1 and "retired" in report.rejected[0][1]


def test_max_experiences_caps_the_library():
    lib = lib_with("When a.", "When b.", max_experiences=2)
    report = lib.apply([op("add", text="When c.")], step=1)
    assert "full" in report.rejected[0][1] and len(lib) == 2


def test_plan_is_all_or_nothing_on_unexpected_errors(monkeypatch):
    lib = lib_with("When a.")
    before = lib.dump_state()
    calls = {"n": 0}
    original = ExperienceLibrary._apply_one

    def flaky(self, operation, **kw):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("disk on fire")
        return original(self, operation, **kw)

    monkeypatch.setattr(ExperienceLibrary, "_apply_one", flaky)
    with pytest.raises(RuntimeError):
        lib.apply([op("add", text="When b."), op("add", text="When c.")], step=1)
    assert lib.dump_state() == before


def test_state_round_trip_and_corrupt_state():
    lib = lib_with("When a.", "When b.")
    lib.apply([op("delete", ["E1"])], step=1)
    again = ExperienceLibrary.from_state(lib.dump_state())
    assert again.dump_state() == lib.dump_state()
    for corrupt in [None, {}, {"format": "other"}, {**lib.dump_state(), "next_id": 2},
                    {**lib.dump_state(), "experiences": [{"id": "E1"}]}]:
        with pytest.raises(ValueError):
            ExperienceLibrary.from_state(corrupt)


def test_operation_normalizes_what_models_write():
    assert [normalize_id(x) for x in ["E3", "[e3]", "3", 3, "E-03", " (E12) "]] == ["E3"] * 5 + ["E12"]
    parsed = Operation.model_validate({"action": " ADD ", "ids": None, "text": None})
    assert parsed.action == "add" and parsed.ids == [] and parsed.text == ""
    assert Operation.model_validate({"action": "delete", "ids": "E2"}).ids == ["E2"]
    assert Operation.model_validate({"action": "Update", "ids": [1], "text": "When x."}).action == "modify"
    with pytest.raises(ValueError):
        Operation.model_validate({"action": "rewrite everything"})
