"""Property-based fuzzing of the library's edit operations and of loading saved programs.

1. Random plans of add/modify/merge/delete, with real, retired and invented IDs and texts of every length,
   parsed the way an LM reply is (`Operation.model_validate`) and applied: IDs stay unique and are never
   reused, active and retired stay disjoint, every text keeps the word limit, the size keeps its cap, a plan
   that raises midway changes nothing, and the state survives dump/load (and JSON) unchanged.
2. `load_program` on random bytes and on mutated copies of a valid file: it either loads or raises a
   ValueError that names the file, and a failed load leaves the target program exactly as it was.
"""

import atexit
import copy
import json
import math
import shutil
import tempfile
from pathlib import Path
from unittest import mock

import dspy
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule
from pydantic import ValidationError
from tfgrpo.programs import ExperienceLibrary, apply_library, load_program, save_program
from tfgrpo.signatures.operations import Operation

MAX_WORDS, CAP = 8, 6
WORDS = ["When", "adding,", "check", "the", "carry", "first", "and", "verify", "sum", "digits", "ones", "tens"]
FAST = settings(deadline=None, max_examples=120, suppress_health_check=[HealthCheck.too_slow])

texts = st.one_of(
    st.lists(st.sampled_from(WORDS), min_size=0, max_size=MAX_WORDS + 4).map(" ".join),  # around the limit
    st.text(max_size=60),  # anything, unicode and whitespace included
    st.sampled_from(["", "   ", "x" * 5000, "When\tx,\ny.", None, 7]),
)
actions = st.one_of(st.sampled_from(["add", "modify", "merge", "delete", " ADD ", "Update", "remove", "combine"]),
                    st.text(max_size=8), st.none(), st.integers())


def id_choices(lib: ExperienceLibrary):
    """IDs a model might write: live ones, retired ones, the next unissued one, invented ones, odd spellings."""
    real = list(lib.active) + list(lib.retired)
    odd = [f"E{lib.next_id}", "E999", "E0", "e1", "[E2]", "3", 3, 0, -1, "", "X", "E01", None]
    return st.sampled_from(real + odd) if real else st.sampled_from(odd)


def raw_operation(lib):
    ids = st.one_of(st.none(), id_choices(lib), st.lists(id_choices(lib), max_size=4))
    return st.fixed_dictionaries({"action": actions, "ids": ids, "text": texts})


def parse(raw) -> Operation | None:
    """Parse like an LM reply: a valid Operation, or a ValidationError (None); anything else is a bug."""
    try:
        return Operation.model_validate(raw)
    except ValidationError:
        return None


def ids_of(lib):
    return set(lib.active) | set(lib.retired)


class LibraryMachine(RuleBasedStateMachine):
    @initialize(cap=st.sampled_from([None, 0, 1, CAP]))
    def start(self, cap):
        self.lib = ExperienceLibrary(max_words=MAX_WORDS, max_experiences=cap)
        self.step, self.ever, self.last_next = 0, set(), 1

    def _plan(self, data):
        raws = data.draw(st.lists(raw_operation(self.lib), max_size=6))
        return [op for op in map(parse, raws) if op is not None]

    @rule(data=st.data())
    def apply_a_plan(self, data):
        plan, before = self._plan(data), ids_of(self.lib)
        report = self.lib.apply(plan, step=self.step, sources=[f"train#{self.step}"])
        self.step += 1
        assert report.num_applied + len(report.rejected) == len(plan)
        fresh = ids_of(self.lib) - before
        assert before <= ids_of(self.lib), "an ID was forgotten"
        assert not fresh & self.ever, "an ID was reused"
        assert all(int(i[1:]) >= self.last_next for i in fresh)

    @rule(data=st.data(), fail_at=st.integers(min_value=1, max_value=6))
    def a_plan_that_raises_changes_nothing(self, data, fail_at):
        plan, before = self._plan(data), self.lib.dump_state()
        assume(plan)
        original, seen = ExperienceLibrary._apply_one, {"n": 0}

        def flaky(lib, op, **kw):
            seen["n"] += 1
            if seen["n"] == min(fail_at, len(plan)):
                raise OSError("injected")
            return original(lib, op, **kw)

        with mock.patch.object(ExperienceLibrary, "_apply_one", flaky), pytest.raises(OSError):
            self.lib.apply(plan, step=self.step)
        assert self.lib.dump_state() == before

    @rule(raw=st.one_of(st.none(), st.integers(), st.text(max_size=10), st.dictionaries(st.text(max_size=6), st.integers())))
    def garbage_never_parses_into_anything_odd(self, raw):
        op = parse(raw)
        assert op is None or op.action in ("add", "modify", "merge", "delete")

    @invariant()
    def invariants_hold(self):
        lib = getattr(self, "lib", None)
        if lib is None:
            return
        assert not set(lib.active) & set(lib.retired)
        assert all(e.id == k for k, e in {**lib.active, **lib.retired}.items())
        assert all(0 < len(e.text.split()) <= MAX_WORDS for e in lib)
        assert lib.max_experiences is None or len(lib) <= lib.max_experiences
        assert all(int(i[1:]) < lib.next_id for i in ids_of(lib)) and lib.next_id >= self.last_next
        assert len(lib.render().splitlines()) >= len(lib)
        state = lib.dump_state()
        assert ExperienceLibrary.from_state(state).dump_state() == state
        assert ExperienceLibrary.from_state(json.loads(json.dumps(state))).dump_state() == state
        self.ever |= ids_of(lib)
        self.last_next = lib.next_id


TestLibraryMachine = LibraryMachine.TestCase
TestLibraryMachine.settings = settings(deadline=None, max_examples=60, stateful_step_count=15,
                                       suppress_health_check=[HealthCheck.too_slow])


@FAST
@given(ids=st.one_of(st.dictionaries(st.text(max_size=3), st.integers()), st.booleans(),
                     st.lists(st.one_of(st.none(), st.integers(), st.text(max_size=5), st.lists(st.integers())))))
def test_odd_id_containers_parse_or_fail_validation(ids):
    op = parse({"action": "delete", "ids": ids})
    assert op is None or all(isinstance(i, str) for i in op.ids)


def test_a_float_for_ids_is_a_validation_error():
    assert parse({"action": "delete", "ids": 2.5}) is None


# -- loading saved programs ------------------------------------------------------------------------------
WORKDIR = Path(tempfile.mkdtemp(prefix="tfgrpo-fuzz-"))
atexit.register(shutil.rmtree, WORKDIR, ignore_errors=True)
PROGRAMS = {"Predict": lambda: dspy.Predict("question -> answer"),
            "ChainOfThought": lambda: dspy.ChainOfThought("question -> answer")}


def saved(kind: str) -> dict:
    lib = ExperienceLibrary()
    lib.apply([Operation(action="add", text=t) for t in ("When adding, carry.", "When dividing, check zero.")], step=0)
    lib.apply([Operation(action="delete", ids=["E1"])], step=1)
    path = save_program(apply_library(PROGRAMS[kind](), lib), WORKDIR / f"valid-{kind}.json")
    return json.loads(path.read_text())


VALID = {kind: saved(kind) for kind in PROGRAMS}


def check_load(kind: str, data: bytes, name: str):
    """Load `data` as a saved program: success (a usable program) or ValueError naming the file, nothing between."""
    path = WORKDIR / name
    path.write_bytes(data)
    target = PROGRAMS[kind]()
    before = target.dump_state()
    try:
        load_program(target, path)
    except ValueError as exc:
        assert str(path) in str(exc) or path.name in str(exc)
        assert target.dump_state() == before, "a failed load changed the program"
        assert not hasattr(target, "experience_library")
        return False
    target.dump_state()  # a loaded program saves again ...
    for _, predictor in target.named_predictors():  # ... can build a prompt ...
        dspy.ChatAdapter().format(predictor.signature, predictor.demos, {"question": "q"})
    lib = getattr(target, "experience_library", None)
    if lib is not None:  # ... and its library takes edits
        copy.deepcopy(lib).apply([Operation(action="add", text="When fuzzing, stay calm.")], step=99)
    return True


@FAST
@given(data=st.binary(max_size=300), kind=st.sampled_from(list(PROGRAMS)))
def test_random_bytes_never_half_load(data, kind):
    check_load(kind, data, "random.json")


@FAST
@given(kind=st.sampled_from(list(PROGRAMS)),
       edits=st.lists(st.tuples(st.sampled_from(["overwrite", "insert", "cut"]), st.integers(0, 10**6),
                                st.binary(min_size=1, max_size=4)), min_size=1, max_size=4))
def test_byte_level_damage_to_a_valid_file(kind, edits):
    data = bytearray(json.dumps(VALID[kind]).encode())
    for how, at, new in edits:
        at %= len(data) + 1
        if how == "overwrite":
            data[at: at + len(new)] = new
        elif how == "insert":
            data[at:at] = new
        else:
            del data[at:]
    check_load(kind, bytes(data), "damaged.json")


json_values = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False)
                           | st.text(max_size=12), lambda inner: st.lists(inner, max_size=3)
                           | st.dictionaries(st.text(max_size=6), inner, max_size=3), max_leaves=6)


def paths(value, prefix=()):
    yield prefix
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for k, v in items:
        yield from paths(v, prefix + (k,))


def mutate(doc, path, how, new):
    doc = json.loads(json.dumps(doc))
    if not path:
        return new
    parent = doc
    for k in path[:-1]:
        parent = parent[k]
    if how == "delete":
        del parent[path[-1]]
    else:
        parent[path[-1]] = new
    return doc


@settings(deadline=None, max_examples=300)
@given(data=st.data(), kind=st.sampled_from(list(PROGRAMS)))
def test_structural_mutations_of_a_valid_file(data, kind):
    doc = VALID[kind]
    path = data.draw(st.sampled_from(list(paths(doc))))
    new = mutate(doc, path, data.draw(st.sampled_from(["delete", "replace"])), data.draw(json_values))
    check_load(kind, json.dumps(new).encode(), "mutated.json")


def with_library(**changes) -> bytes:
    doc = json.loads(json.dumps(VALID["Predict"]))
    doc["experience_library"].update(changes)
    return json.dumps(doc).encode()


@pytest.mark.parametrize("data", [
    pytest.param(b"[" * 50000, id="deeply-nested-json"),
    pytest.param(with_library(max_words=math.inf), id="infinite-max-words"),
    pytest.param(with_library(next_id=1e400), id="infinite-next-id"),
    pytest.param(json.dumps({**VALID["Predict"], "signature": {"instructions": 5, "fields": []}}).encode(),
                 id="instructions-not-text"),
    pytest.param(json.dumps({**VALID["Predict"], "demos": [1, 2]}).encode(), id="demos-not-objects"),
    pytest.param(with_library(max_experiences="many"), id="max-experiences-not-a-number"),
])
def test_known_bad_files_give_a_value_error(data):
    assert check_load("Predict", data, "known-bad.json") is False
