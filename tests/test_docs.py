"""The documentation as a reader sees it: lists that render as lists, examples that run (the usage page's, against
the fake LM server, and the script it links), and an API page (the site built by mkdocs, as in CI) that shows every
knob of `TrainingFreeGRPO` and every field of the result records with its meaning."""

from __future__ import annotations

import ast
import builtins
import contextlib
import dataclasses
import html
import inspect
import os
import re
import subprocess
import sys
from pathlib import Path

import dspy
import pytest
import yaml

import tfgrpo.lms
from tfgrpo.config import tomllib
from tfgrpo.optimizers.knobs import KNOBS
from tfgrpo.optimizers.records import EpochResult, StepResult, TrainingFreeGRPOResult
from tfgrpo.optimizers.training_free_grpo import TrainingFreeGRPO
from tfgrpo.testing import FakeLMServer

ROOT = Path(__file__).resolve().parent.parent
PAGES = sorted((ROOT / "docs").rglob("*.md")) + [ROOT / "README.md"]
ITEM = re.compile(r"^\s*(?:[-*+]|\d+[.)])\s+\S")  # a list item's first line
FENCE = re.compile(r"^\s*(```+|~~~+)")


def lists_glued_to_text(text: str) -> list[tuple[int, str]]:
    """(line number, line) of each list item that directly follows a line of text outside any list: Python-Markdown
    reads such an item as part of the paragraph above it, so the whole list renders as one paragraph."""
    found, fence, in_list, previous = [], None, False, ""
    for number, line in enumerate(text.splitlines(), 1):
        if fence:  # inside a code block: nothing is markdown
            fence = None if line.strip().startswith(fence) else fence
            previous = ""
            continue
        if m := FENCE.match(line):
            fence, in_list, previous = m.group(1), False, line
            continue
        if ITEM.match(line):
            if previous.strip() and not in_list and not previous.lstrip().startswith("#"):
                found.append((number, line))
            in_list = True
        elif line.strip() and not line.startswith((" ", "\t")) and not previous.strip():
            in_list = False  # a paragraph after a blank line, not indented: the list has ended
        previous = line
    return found


def test_the_check_finds_a_list_glued_to_the_line_above():
    assert lists_glued_to_text("So:\n- a\n- b\n") == [(2, "- a")]
    assert lists_glued_to_text("So:\n\n- a\n  more of a\n- b\nlazy line of b\n- c\n\n1. one\n   - nested\n") == []
    assert lists_glued_to_text("## Title\n- a\n\n```\ntext\n- not a list\n```\n") == []
    assert lists_glued_to_text("- a\n\nA paragraph.\n- b\n") == [(4, "- b")]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_list_renders_as_a_list(page):
    glued = lists_glued_to_text(page.read_text(encoding="utf-8"))
    assert not glued, "a list item right after a line of text renders as part of that paragraph; put a blank line " \
                      "before the list:\n" + "\n".join(f"{page.name}:{n}: {line}" for n, line in glued)


def python_blocks(page: Path) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", page.read_text(encoding="utf-8"), flags=re.DOTALL | re.MULTILINE)


def undefined_names(code: str) -> list[str]:
    """Names the code reads but never imports, defines, assigns or takes as an argument (nor a builtin)."""
    bound, read = set(dir(builtins)), set()
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Name):
            (read if isinstance(node.ctx, ast.Load) else bound).add(node.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            bound.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound.add(node.name)
        elif isinstance(node, ast.arg):
            bound.add(node.arg)
        elif isinstance(node, ast.ExceptHandler) and node.name:
            bound.add(node.name)
    return sorted(read - bound)


@pytest.mark.parametrize("page", [p for p in PAGES if python_blocks(p)], ids=lambda p: str(p.relative_to(ROOT)))
def test_every_python_example_defines_what_it_uses(page):
    for code in python_blocks(page):
        assert not undefined_names(code), f"{page.name}: an example reads names it never defines:\n{code}"


def test_the_usage_example_runs_and_its_metric_gives_feedback(tmp_path, monkeypatch, capsys):
    """docs/usage.md's example, run as written against the fake LM server instead of the embedded model (only
    `serving` is replaced), and its metric-with-feedback snippet."""
    blocks = python_blocks(ROOT / "docs" / "usage.md")  # (the first, with a model behind an API: tests/test_api_models)
    example, snippet = next(b for b in blocks if "serving(" in b), blocks[-1]
    monkeypatch.chdir(tmp_path)
    with FakeLMServer() as server:
        monkeypatch.setattr(tfgrpo.lms, "serving", lambda *a, **k: contextlib.nullcontext(server.api_base))
        exec(compile(example, "usage.md", "exec"), {"__name__": "usage_example"})
    assert re.fullmatch(r"before \d+\.\d% after \d+\.\d%", capsys.readouterr().out.strip().splitlines()[-1])
    assert (tmp_path / "my_program.json").is_file() and (tmp_path / "runs" / "first").is_dir()
    scope = {}
    exec(compile(snippet, "usage.md", "exec"), scope)
    gold = dspy.Example(question="What is 2 + 3?", answer="5").with_inputs("question")
    assert scope["metric"](gold, dspy.Prediction(answer=" 5")).score == 1.0
    assert scope["metric"](gold, dspy.Prediction(answer="6")).feedback == "wrong: expected 5, got 6"


def test_the_example_script_runs(tmp_path):
    """examples/compile_custom_program.py, which the docs link, end to end against the fake LM server."""
    with FakeLMServer() as server:
        run = subprocess.run([sys.executable, str(ROOT / "examples" / "compile_custom_program.py"), "--api-base",
                              server.api_base, "--model", "fake", "--out", str(tmp_path / "unit_price.json")],
                             cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert re.search(r"^step 2: mean reward \d\.\d\d, library size \d+$", run.stdout, flags=re.MULTILINE), run.stdout
    assert "reloaded: " in run.stdout and (tmp_path / "unit_price.json").is_file()


@pytest.fixture(scope="module")
def built_site(tmp_path_factory) -> Path:
    """The site as CI builds it (mkdocs build --strict; not -q, with which mkdocs 1.6 drops its warnings before
    --strict counts them)."""
    pytest.importorskip("mkdocstrings_handlers.python", reason="the docs extra is not installed")
    site = tmp_path_factory.mktemp("site")
    build = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(site)], cwd=ROOT,
                           capture_output=True, text=True, timeout=300, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert build.returncode == 0, build.stderr[-3000:]
    return site


@pytest.fixture(scope="module")
def api_page(built_site) -> str:
    """The built API page's HTML."""
    return (built_site / "api" / "index.html").read_text(encoding="utf-8")


def text(fragment: str) -> str:
    return " ".join(html.unescape(re.sub(r"<[^>]+>", " ", fragment)).split())


def section(page: str, identifier: str, end: str) -> str:
    start = page.index(f'id="{identifier}"')
    return page[start: page.index(f'id="{end}"', start) if end else None]


def table_rows(fragment: str) -> dict[str, str]:
    """name -> description of each entry of the Parameters or Attributes lists in `fragment` (mkdocstrings'
    `docstring_section_style: list`)."""
    rows = re.findall(r'<li class="doc-section-item[^"]*">\s*<b>(.*?)</b>.*?<div class="doc-md-description">(.*?)</div>',
                      fragment, flags=re.DOTALL)
    return {text(name): text(description) for name, description in rows}


def test_the_api_page_documents_every_knob_from_its_one_declaration(api_page):
    cls = "tfgrpo.optimizers.training_free_grpo.TrainingFreeGRPO"
    rows = table_rows(section(api_page, cls, f"{cls}.compile"))
    assert list(rows) == list(inspect.signature(TrainingFreeGRPO).parameters) == ["metric", *KNOBS]
    for name, knob in KNOBS.items():
        said = "".join(knob.metadata["doc"].replace("`", "").split()[:6])  # spaces aside: markup leaves some
        assert "".join(rows[name].split()).startswith(said), f"{name}: the API page says {rows[name][:80]!r}"
    signature = text(section(api_page, cls, f"{cls}.compile"))
    compact = "".join(signature.split())  # (spaces aside: the highlighter splits tokens)
    assert "num_generations:int=5" in compact and "knob(" not in signature  # the defaults, not their declaration
    assert 'TrainingFreeGRPO(metric:Callable,*,auto:str|None="auto"' in compact  # typed, as declared


def test_the_api_page_documents_compile(api_page):
    cls = "tfgrpo.optimizers.training_free_grpo.TrainingFreeGRPO"
    rows = table_rows(section(api_page, f"{cls}.compile", "tfgrpo.optimizers.records.TrainingFreeGRPOResult"))
    assert set(rows) >= {"student", "trainset", "teacher", "valset"} and all(rows.values())


@pytest.mark.parametrize("record", [TrainingFreeGRPOResult, StepResult, EpochResult], ids=lambda c: c.__name__)
def test_the_api_page_gives_every_result_field_a_sentence(api_page, record):
    identifier = f"tfgrpo.optimizers.records.{record.__name__}"
    following = re.search(r'id="(tfgrpo\.[\w.]+)"', api_page[api_page.index(f'id="{identifier}"') + 10:])
    rows = table_rows(section(api_page, identifier, following.group(1) if following else ""))
    assert list(rows) == [f.name for f in dataclasses.fields(record)], "the Attributes section lists every field"
    assert all(len(description.split()) >= 3 for description in rows.values()), rows


def test_the_home_page_shows_the_readme_quick_start():
    """docs/index.md's API quick start is the README's, line for line (examples/api_model.py runs the README's:
    tests/test_api_models.py)."""
    readme = python_blocks(ROOT / "README.md")[0]
    assert "TrainingFreeGRPO(" in readme and readme in python_blocks(ROOT / "docs" / "index.md")


def test_the_tutorial_shows_what_the_simulator_script_prints(tmp_path):
    """docs/tutorial.md pastes the output of examples/provider_simulator.py (deterministic: the provider simulator's
    replies are fixed by each request); when the code changes what it prints, run the script and paste it again."""
    run = subprocess.run([sys.executable, str(ROOT / "examples" / "provider_simulator.py")], cwd=tmp_path,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.startswith("== plan ==\nplan: preset 'paper'"), run.stdout
    assert run.stdout in (ROOT / "docs" / "tutorial.md").read_text(encoding="utf-8"), \
        "docs/tutorial.md no longer shows what examples/provider_simulator.py prints:\n" + run.stdout


def test_the_presets_table_is_the_code_s():
    """docs/choosing.md's table of the `auto` presets: each knob's value per preset, and as declared."""
    from tfgrpo.optimizers.knobs import PRESETS

    page = (ROOT / "docs" / "choosing.md").read_text(encoding="utf-8")
    table = page[page.index("## The `auto` presets"):]
    header = next(line for line in table.splitlines() if line.startswith("| knob |"))
    columns = [c.strip().strip("`").split("`")[0] for c in header.strip("|").split("|")][1:]
    assert columns[:-1] == list(PRESETS) and columns[-1].startswith("declared default")
    rows = {cells[0].strip("`"): cells[1:] for line in table.splitlines() if line.startswith("| `")
            for cells in [[c.strip() for c in line.strip("|").split("|")]]}
    assert set(rows) == {k for preset in PRESETS.values() for k in preset}, "every knob a preset sets, no other"
    for name, cells in rows.items():
        declared = KNOBS[name].default
        expected = [repr(PRESETS[p].get(name, declared)) for p in PRESETS] + [repr(declared)]
        assert cells == expected, f"{name}: the page says {cells}, the code {expected}"


def user_pages() -> list[Path]:
    """The site's pages a user reads (every page of the navigation) and the README."""
    def walk(items):
        for item in items:
            for value in item.values():
                yield from walk(value) if isinstance(value, list) else [value]

    nav = yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"]
    return [ROOT / "docs" / page for page in walk(nav)] + [ROOT / "README.md"]


MAIN_JOB = ROOT / "benchmarks" / "results" / "main-job.md"  # what the main job gives: its one statement


def test_what_the_main_job_gives_is_stated_in_one_place():
    """The paragraph of benchmarks/results/main-job.md is what the README says of the main job's runs, and what the
    home, tutorial and Game of 24 pages include; no other sentence of a user page gives the main job's minutes or
    held-out scores."""
    said = MAIN_JOB.read_text(encoding="utf-8").rstrip("\n")
    include = f'--8<-- "{MAIN_JOB.relative_to(ROOT).as_posix()}"'
    assert said in (ROOT / "README.md").read_text(encoding="utf-8"), "the README's paragraph is the file's, as it is"
    for page in ("index.md", "tutorial.md", "tasks/game24.md"):
        assert include in (ROOT / "docs" / page).read_text(encoding="utf-8"), page
    elsewhere = []
    for path in user_pages():
        text = path.read_text(encoding="utf-8").replace(said, "").replace(include, "")
        blocks = re.split(r"\n\s*\n|\n(?=[|#])", text)  # paragraphs, table rows and headings apart
        for sentence in (s for block in blocks for s in re.split(r"(?<=[.!?])\s+", re.sub(r"\s+", " ", block))):
            if re.search(r"main job|configs/local\.toml|\bruns of it\b", sentence) and re.search(
                    r"\d\s*min|\d+ of 24|\d+/24", sentence):
                elsewhere.append(f"{path.relative_to(ROOT)}: {sentence[:200]}")
    assert not elsewhere, "a figure of the main job stated outside main-job.md:\n" + "\n".join(elsewhere)


def test_no_user_page_says_how_the_project_was_made():
    """No issue number, commit hash, session or superseded arm on a page a user reads, nor in what a page includes
    (`--8<--`: the results tables, the main job's paragraph): the pages say what the software does and what was
    measured, by which command."""
    words = re.compile(r"\bissues? \d+|\(issue\b|\bsessions?\b|\bsuperseded\b|\bleft off\b|\bsince removed\b",
                       re.I)
    commit = re.compile(r"\b(?=[0-9a-f]*\d)(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}\b")
    pages = user_pages()
    pages += sorted({ROOT / m for page in pages for m in re.findall(r'^--8<-- "([^"]+)"', page.read_text(
        encoding="utf-8"), re.M)})
    found = [f"{path.relative_to(ROOT)}:{i}: {m.group(0)}" for path in pages
             for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
             for m in [*words.finditer(line), *commit.finditer(line)]]
    assert not found, "\n".join(found)


def test_every_result_line_the_benchmarks_page_quotes_is_in_the_record():
    """docs/benchmarks.md quotes benchmarks' last lines (`faults: injected=...`); each is in the full record
    (benchmarks/measurements.md, benchmarks/README.md or a file under benchmarks/results/), word for word."""
    record = [ROOT / "benchmarks" / "measurements.md", ROOT / "benchmarks" / "README.md",
              *(p for p in (ROOT / "benchmarks" / "results").rglob("*") if p.suffix in (".md", ".txt", ".json"))]
    held = " ".join(" ".join(p.read_text(encoding="utf-8").split()) for p in record)
    quoted = re.findall(r"`([a-z_]+: [a-z_0-9]+=[^`]+)`", (ROOT / "docs" / "benchmarks.md").read_text(encoding="utf-8"))
    assert quoted, "the page quotes no benchmark's line"
    missing = [line for line in quoted if " ".join(line.split()) not in held]
    assert not missing, f"docs/benchmarks.md quotes lines the record does not hold: {missing}"


FIGURES = ROOT / "benchmarks" / "results" / "figures.toml"  # what setup and the tests take: their one statement


def test_setup_and_the_tests_are_given_one_figure_each():
    """The time setup takes and the size and time of the test suite are benchmarks/results/figures.toml's, wherever
    a user page or the README states them."""
    figures = tomllib.loads(FIGURES.read_text(encoding="utf-8"))
    said = {"setup": r"\b\d+(?:-\d+)? s on (?:this |a )?2-core", "tests": r"~?\b\d[\d,]* tests\b",
            "tests_time": r"\b\d+(?:-\d+)? minutes on 2 CPU cores, as CI"}
    readme = " ".join((ROOT / "README.md").read_text(encoding="utf-8").split())
    for name, figure in figures.items():
        assert figure in readme, f"the README does not give {name} as {figure!r}"
    found = [(path.relative_to(ROOT), name, m.group(0)) for path in user_pages()
             for name, pattern in said.items()
             for m in re.finditer(pattern, " ".join(path.read_text(encoding="utf-8").split()))
             if not m.group(0).startswith(figures[name])]
    assert not found, f"pages that give another figure than {FIGURES.relative_to(ROOT)}: {found}"


def test_the_api_page_shows_no_builtin_docstring_and_every_knob_s_type(api_page):
    """An attribute whose value is a plain bool, int, str or tuple is not documented by its type's own docstring
    ("bool(x) -> bool"), and each knob's entry gives its type as declared."""
    shown = text(api_page)
    for said in ("bool(x) -> bool", "int([x]) -> integer", "str(object='') -> str", "Built-in immutable sequence",
                 "S.format(*args, **kwargs)"):
        assert said not in shown, said
    cls = "tfgrpo.optimizers.training_free_grpo.TrainingFreeGRPO"
    entries = "".join(text(section(api_page, cls, f"{cls}.compile")).split())
    for name, knob in KNOBS.items():  # (the page names a type without its module: BaseLM, PathLike)
        assert f"{name}({re.sub(r'[a-z]+[.]', '', knob.type)},default:".replace(" ", "") in entries, name


PLAN_LINE = re.compile(r"^\s*expected: \d[\d,]* calls, .*$", re.M)  # a plan's figures, as `plan().summary()` says them


def test_every_plan_a_page_shows_is_what_the_code_prints_today(tmp_path):
    """Each `expected: N calls, ...` line a user page shows is one that `tfgrpo compile CONFIG --dry-run` prints today
    for a config a page names with --dry-run, or that examples/provider_simulator.py prints (the tutorial's first
    run): a change of the plan's estimate fails here until the pages show the new figures."""
    pages = {path: path.read_text(encoding="utf-8") for path in user_pages()}
    configs = sorted({c for text in pages.values() for c in re.findall(r"(configs/[\w.-]+\.toml) --dry-run", text)})
    assert "configs/local.toml" in configs, "the main job's plan is shown with the command that prints it"
    printed = [subprocess.run([sys.executable, "-m", "tfgrpo.cli", "compile", str(ROOT / config), "--dry-run"],
                              cwd=ROOT, capture_output=True, text=True, timeout=300) for config in configs]
    printed.append(subprocess.run([sys.executable, str(ROOT / "examples" / "provider_simulator.py")], cwd=tmp_path,
                                  capture_output=True, text=True, timeout=300))
    assert all(run.returncode == 0 for run in printed), [run.stderr[-2000:] for run in printed]
    today = {" ".join(line.split()) for run in printed for line in PLAN_LINE.findall(run.stdout + run.stderr)}
    assert today, "the dry runs print no plan line"
    shown = [(path.relative_to(ROOT), " ".join(line.split())) for path, text in pages.items()
             for line in PLAN_LINE.findall(text)]
    stale = [f"{path}: {line}" for path, line in shown if line not in today]
    assert shown and not stale, "a page shows a plan the code no longer prints:\n" + "\n".join(stale) + \
        "\nwhat it prints today:\n" + "\n".join(sorted(today))


def test_the_pages_give_the_code_s_address_from_pyproject_or_say_it_has_none(built_site, tmp_path):
    """Where a reader gets the code: pyproject.toml's [project.urls] (none is set: the pages say so, and make no
    address up); with one, the clone command and the site's repository link (docs/hooks/repository.py)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("repository_hook", ROOT / "docs" / "hooks" / "repository.py")
    hook = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hook)
    published = tmp_path / "pyproject.toml"
    published.write_text('[project]\nname = "tfgrpo"\n[project.urls]\nRepository = "https://example.org/tfgrpo.git"\n')
    assert hook.get_the_code(hook.address(published)).startswith(
        "Get the code with `git clone https://example.org/tfgrpo.git tfgrpo && cd tfgrpo`")
    assert hook.on_config({"repo_url": None}) == {"repo_url": hook.address()}
    said = "".join(hook.get_the_code(hook.address()).replace("`", "").split())  # (spaces aside: markup adds some)
    for page in ("index.md", "install.md", "contributing.md"):
        assert hook.MARKER in (ROOT / "docs" / page).read_text(encoding="utf-8"), page
        built = built_site / ("" if page == "index.md" else page[:-3]) / "index.html"
        assert said in "".join(text(built.read_text(encoding="utf-8")).split()), page
    assert not [p for p in user_pages() if "this site is built from" in p.read_text(encoding="utf-8")]
