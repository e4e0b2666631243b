"""The MLflow run page of a tracked compile, opened in a real browser (issue 37): a tiny compile (scripted LM) logs
into a SQLite store in tmp_path, `mlflow server` serves it on 127.0.0.1 only, and headless Chromium loads the run's
overview, its library.md and its learning_curve.png. Each page's screenshot is saved (under tmp_path, or the folder
$TFGRPO_BROWSER_SHOTS names) and its rendered text (--dump-dom) is checked, beside MLflow's REST API.

The documentation site too: built as CI builds it (mkdocs build --strict), served on 127.0.0.1, its home page and
then every page loaded at a laptop's width (1280 px) and a phone's (390 px), and measured in the page by a script the
test adds to it.

Chromium comes from Debian's packages (`apt-get install -y chromium`); without it the test is skipped, unless
TFGRPO_REQUIRE_BROWSER is set (CI, where a skip would hide that the check never ran)."""

import contextlib
import functools
import html
import http.server
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")  # before MLflow is imported: no usage reports

import dspy  # noqa: E402
import mlflow  # noqa: E402
import pytest  # noqa: E402

from scripted_lm import ScriptedLM  # noqa: E402
from test_optimizer import make_trainset, metric  # noqa: E402
from test_resume import learner  # noqa: E402
from tfgrpo.optimizers import TrainingFreeGRPO  # noqa: E402

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
HEADLESS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
            "--disable-background-networking", "--disable-component-update", "--disable-sync", "--hide-scrollbars",
            "--window-size=1400,1000", "--virtual-time-budget=15000"]  # virtual time: the page's data is fetched


def tiny_compile(tmp_path: Path):
    """Two epochs of two steps on a scripted LM, logged to a new store; (run ID, experiment ID, compiled)."""
    mlflow.set_tracking_uri(f"sqlite:///{tmp_path / 'mlflow.db'}")
    experiment = mlflow.create_experiment("browser", artifact_location=(tmp_path / "artifacts").as_uri())
    mlflow.set_experiment(experiment_id=experiment)
    dspy.configure(lm=ScriptedLM(learner))
    with mlflow.start_run(run_name="tiny") as run:
        compiled = TrainingFreeGRPO(metric, num_generations=2, num_train_epochs=2, batch_size=2, num_threads=1,
                                    progress=lambda *_: None).compile(
            dspy.Predict("question -> answer"), trainset=make_trainset(4), valset=make_trainset(2))
    return run.info.run_id, experiment, compiled


@contextlib.contextmanager
def mlflow_server(store: Path, log: Path):
    """`mlflow server` over `store`, listening on 127.0.0.1 only; its base URL. Stopped (its process group) on exit."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "MLFLOW_DISABLE_TELEMETRY": "true", "LITELLM_LOCAL_MODEL_COST_MAP": "True"}
    command = [str(Path(sys.executable).with_name("mlflow")), "server", "--backend-store-uri", f"sqlite:///{store}",
               "--host", "127.0.0.1", "--port", str(port), "--workers", "1"]
    with open(log, "w") as out:
        server = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 120
        while True:
            try:
                urllib.request.urlopen(f"{base}/health", timeout=2).close()
                break
            except OSError:
                assert server.poll() is None and time.time() < deadline, log.read_text()[-3000:]
                time.sleep(0.5)
        yield base
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()


def rest(base: str, path: str) -> dict:
    with urllib.request.urlopen(f"{base}/api/2.0/mlflow/{path}", timeout=30) as reply:
        return json.load(reply)


def browse(url: str, screenshot: Path) -> str:
    """The page's DOM once rendered, with a screenshot saved; one headless Chromium with a new profile."""
    profile = screenshot.with_suffix(".profile")
    done = subprocess.run([CHROMIUM, *HEADLESS, f"--user-data-dir={profile}", f"--screenshot={screenshot}",
                           "--dump-dom", url], capture_output=True, text=True, timeout=180)
    shutil.rmtree(profile, ignore_errors=True)
    assert done.returncode == 0 and screenshot.stat().st_size > 10_000, done.stderr[-3000:]
    return done.stdout


def visible_text(dom: str) -> str:
    dom = re.sub(r"<(script|style)\b.*?</\1>", " ", dom, flags=re.S)
    return re.sub(r"\s+", " ", html.unescape(re.sub(r"<[^>]+>", " ", dom)))


def require_chromium() -> None:
    if CHROMIUM is None:
        if os.environ.get("TFGRPO_REQUIRE_BROWSER"):
            pytest.fail("TFGRPO_REQUIRE_BROWSER is set but chromium is not installed (apt-get install -y chromium)")
        pytest.skip("chromium is not installed (apt-get install -y chromium); TFGRPO_REQUIRE_BROWSER makes this fail")


def test_the_mlflow_run_page_shows_the_learning_curve_and_the_library(tmp_path):
    require_chromium()
    run_id, experiment, compiled = tiny_compile(tmp_path)
    steps = compiled.detailed_results.to_dict()["steps"]
    shots = Path(os.environ.get("TFGRPO_BROWSER_SHOTS") or tmp_path / "screenshots")
    shots.mkdir(parents=True, exist_ok=True)
    with mlflow_server(tmp_path / "mlflow.db", tmp_path / "server.log") as base:
        curve = rest(base, f"metrics/get-history?run_id={run_id}&metric_key=train/mean_reward")["metrics"]
        artifacts = {f["path"] for f in rest(base, f"artifacts/list?run_id={run_id}")["files"]}
        page = f"{base}/#/experiments/{experiment}/runs/{run_id}"
        doms = {name: browse(page + path, shots / f"{name}.png") for name, path in
                [("overview", ""), ("library", "/artifacts/library.md"), ("curve", "/artifacts/learning_curve.png")]}
    assert sorted((m["step"], m["value"]) for m in curve) == [(s["step"], s["mean_reward"]) for s in steps]
    assert len(steps) == 4 and {"library.md", "learning_curve.png"} <= artifacts

    overview = visible_text(doms["overview"])
    assert "train/mean_reward" in overview and "val/best_score" in overview and "Finished" in overview, overview
    assert "tfgrpo.kept_epoch" in overview
    library = visible_text(doms["library"])
    experiences = list(compiled.experience_library.active.values())
    assert "Experience library: 4 experiences" in library and experiences, library
    assert all(f"{e.id} {e.text}" in library for e in experiences), library
    assert re.search(r'<img[^>]*alt="learning_curve.png"', doms["curve"]), visible_text(doms["curve"])


# -- the documentation site -----------------------------------------------------------------------------------------
ROOT = Path(__file__).resolve().parent.parent
SITE_PAGES = {"tutorial": "Tutorial", "choosing": "Choosing an optimizer", "contributing": "Contributing"}
# A phone's width: headless Chromium's window is at least 500 px wide, so the page is loaded in a frame 390 px wide.
PHONE = """<!doctype html><body style="margin:0"><iframe src="index.html" style="width:390px;height:900px;border:0">
</iframe></body>"""
# Measures the rendered page once it has loaded (and Material's script has wrapped its tables), and writes what it
# found into the page as JSON, where --dump-dom reads it:
#   cut: a code block or table whose content is wider than its box while the box does not scroll (overflow visible,
#        hidden or clip: what does not fit is cut off or spills over), or whose box reaches past the page's content;
#   scrolled: one that does scroll, its end out of sight until the reader scrolls it;
#   split: a word of a table cell broken across two lines (each word's text measured with a Range: two line boxes);
#   breaking: a table cell whose style allows breaking inside a word (word-break: break-all, overflow-wrap: anywhere).
MEASURE = """<script>
window.addEventListener("load", () => setTimeout(() => {
  const content = document.querySelector(".md-content");
  const right = content.getBoundingClientRect().right;
  const found = {width: window.innerWidth, overflow: document.documentElement.scrollWidth - window.innerWidth,
                 cut: [], scrolled: [], split: [], breaking: [], code: [], tables: 0};
  const name = el => el.tagName.toLowerCase() + ": " + el.textContent.trim().slice(0, 60);
  for (const el of content.querySelectorAll("pre, pre > code, table, .md-typeset__scrollwrap, .md-typeset__table")) {
    const scrolls = ["auto", "scroll"].includes(getComputedStyle(el).overflowX);
    if (el.scrollWidth > el.clientWidth + 1) (scrolls ? found.scrolled : found.cut).push("overflows: " + name(el));
    if (el.getBoundingClientRect().right > right + 1) found.cut.push("past the page: " + name(el));
  }
  for (const pre of content.querySelectorAll("pre")) found.code.push(pre.textContent);
  for (const cell of content.querySelectorAll("table td, table th")) {
    found.tables += 1;
    const style = getComputedStyle(cell);
    if (style.wordBreak === "break-all" || style.overflowWrap === "anywhere") found.breaking.push(name(cell));
    const walker = document.createTreeWalker(cell, NodeFilter.SHOW_TEXT);
    for (let node = walker.nextNode(); node; node = walker.nextNode()) {
      for (const word of node.textContent.matchAll(/[^\\s\\-\\/]+/g)) {
        const range = document.createRange();
        range.setStart(node, word.index);
        range.setEnd(node, word.index + word[0].length);
        const tops = new Set([...range.getClientRects()].filter(r => r.width > 0).map(r => Math.round(r.top)));
        if (tops.size > 1) found.split.push(word[0]);
      }
    }
  }
  const out = window.top.document.createElement("pre");  // in a frame (the phone's width): into the page around it
  out.id = "tfgrpo-measure";
  out.hidden = true;
  out.textContent = JSON.stringify(found);
  window.top.document.body.appendChild(out);
}, 300));
</script>"""


@contextlib.contextmanager
def served(folder: Path):
    """`folder` served over HTTP on 127.0.0.1 (a thread of this process); its base URL."""
    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Quiet, directory=str(folder)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def measured(url: str, width: int, screenshot: Path) -> tuple[dict, str]:
    """(what MEASURE found, the rendered DOM) of the page at `url` in a window `width` px wide."""
    flags = [f for f in HEADLESS if not f.startswith(("--window-size", "--virtual-time-budget"))]
    profile = screenshot.with_suffix(".profile")
    done = subprocess.run([CHROMIUM, *flags, f"--window-size={width},900", "--virtual-time-budget=5000",
                           f"--user-data-dir={profile}", f"--screenshot={screenshot}", "--dump-dom", url],
                          capture_output=True, text=True, timeout=120)
    shutil.rmtree(profile, ignore_errors=True)
    assert done.returncode == 0, done.stderr[-3000:]
    found = re.search(r'<pre id="tfgrpo-measure" hidden="">(.*?)</pre>', done.stdout, flags=re.S)
    assert found, "the measuring script left no result: " + visible_text(done.stdout)[:500]
    return json.loads(html.unescape(found.group(1))), done.stdout


def test_the_docs_home_page_reads_on_a_laptop_and_a_phone(tmp_path):
    """The site's first screen: an install command and a runnable example; at 1280 px no code block or table is cut
    off (nor needs scrolling); at 390 px no word of a table is split across lines; the tutorial, choosing and
    contributing pages exist."""
    require_chromium()
    pytest.importorskip("mkdocstrings_handlers.python", reason="the docs extra is not installed")
    site = tmp_path / "site"  # built as CI builds it; not -q, with which mkdocs 1.6 drops the warnings --strict counts
    build = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(site)], cwd=ROOT,
                           capture_output=True, text=True, timeout=300, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert build.returncode == 0, build.stderr[-3000:]
    home = site / "index.html"
    home.write_text(home.read_text(encoding="utf-8").replace("</body>", MEASURE + "</body>"), encoding="utf-8")
    (site / "phone.html").write_text(PHONE, encoding="utf-8")
    shots = Path(os.environ.get("TFGRPO_BROWSER_SHOTS") or tmp_path / "screenshots")
    shots.mkdir(parents=True, exist_ok=True)
    with served(site) as base:
        laptop, dom = measured(f"{base}/", 1280, shots / "docs-home-1280.png")
        phone, _ = measured(f"{base}/phone.html", 500, shots / "docs-home-390.png")
        for page, title in SITE_PAGES.items():
            with urllib.request.urlopen(f"{base}/{page}/", timeout=30) as reply:
                assert reply.status == 200 and re.search(rf"<h1[^>]*>{re.escape(title)}", reply.read().decode()), page
    assert (laptop["width"], phone["width"]) == (1280, 390), (laptop["width"], phone["width"])
    assert any("pip install" in code for code in laptop["code"]), laptop["code"]
    assert any("TrainingFreeGRPO(" in code and "import dspy" in code and ".compile(" in code
               for code in laptop["code"]), "no runnable example on the home page"
    assert all(f'href="{page}/"' in dom for page in SITE_PAGES), "the home page links every page named above"
    assert laptop["overflow"] <= 0 and not laptop["cut"], laptop["cut"]
    assert not laptop["scrolled"], f"at 1280 px the home page's code and tables fit: {laptop['scrolled']}"
    assert phone["overflow"] <= 0 and not phone["cut"], phone["cut"]  # at 390 px code scrolls in its box: not cut
    assert phone["tables"] > 0 and not phone["split"] and not phone["breaking"], (phone["split"], phone["breaking"])


def test_every_docs_page_reads_on_a_laptop_and_a_phone(tmp_path):
    """Every page of the built site at 1280 px and at 390 px (in a frame of that width): the page never scrolls
    sideways and nothing in it is cut off, and no word of a table cell is split across lines (no column narrower than
    its longest word); at 1280 no code block needs scrolling; at 390 no cell breaks words. A screenshot of each page at each width is kept
    (under $TFGRPO_BROWSER_SHOTS, which CI keeps)."""
    require_chromium()
    pytest.importorskip("mkdocstrings_handlers.python", reason="the docs extra is not installed")
    site = tmp_path / "site"
    build = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(site)], cwd=ROOT,
                           capture_output=True, text=True, timeout=300, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert build.returncode == 0, build.stderr[-3000:]
    shots = Path(os.environ.get("TFGRPO_BROWSER_SHOTS") or tmp_path / "screenshots") / "pages"
    shots.mkdir(parents=True, exist_ok=True)
    pages = sorted(p.parent for p in site.rglob("index.html")
                   if not {"assets", "search", "404"} & set(p.relative_to(site).parts))
    problems = []
    with served(site) as base:
        for folder in pages:
            name = folder.relative_to(site).as_posix()
            page = folder / "index.html"
            page.write_text(page.read_text(encoding="utf-8").replace("</body>", MEASURE + "</body>"), encoding="utf-8")
            (folder / "phone.html").write_text(PHONE, encoding="utf-8")
            url, shot = f"{base}/{name}/".replace("/./", "/"), name.replace("/", "-").strip(".") or "home"
            laptop, _ = measured(url, 1280, shots / f"{shot}-1280.png")
            phone, _ = measured(url + "phone.html", 500, shots / f"{shot}-390.png")
            problems += [f"{shot} at 1280: {p}" for p in [*(["the page scrolls sideways"] if laptop["overflow"] > 0
                                                             else []), *laptop["cut"],
                                                           *(f"a word split in a table: {w}" for w in laptop["split"]),
                                                           *(s for s in laptop["scrolled"] if s.startswith(
                                                               ("overflows: pre", "overflows: code")))]]
            problems += [f"{shot} at 390: {p}" for p in [*(["the page scrolls sideways"] if phone["overflow"] > 0
                                                            else []), *phone["cut"],
                                                          *(f"a word split in a table: {w}" for w in phone["split"]),
                                                          *(f"a cell that breaks words: {c}" for c in phone["breaking"])]]
    assert len(pages) > 20, pages
    assert not problems, f"{len(problems)} problems:\n" + "\n".join(problems[:80])
