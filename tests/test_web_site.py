"""The offline local web (`python -m tfgrpo.tasks.web.site`), its index, and the shipped web data."""

from __future__ import annotations

import json
import subprocess
import sys

import httpx
import pytest

from tfgrpo.tasks.web import BUILTIN, load_web
from tfgrpo.tasks.web.site import CorpusIndex, corpus_path, read_corpus, running_site

DOCS = [{"title": "Shirley Temple", "text": "Shirley Temple was an American actress and diplomat, Chief of Protocol."},
        {"title": "Kiss and Tell (1945 film)", "text": "Kiss and Tell is a 1945 comedy starring Shirley Temple."},
        {"title": "Grand_Canyon", "text": "A canyon in Arizona carved by the Colorado River."}]


def write_corpus(tmp_path, docs=DOCS):
    path = tmp_path / "corpus.jsonl"
    path.write_text("".join(json.dumps(d) + "\n" for d in docs))
    return path


def test_index_ranks_titles_and_survives_fts_syntax_in_queries():
    index = CorpusIndex(DOCS)
    assert index.search("Kiss and Tell film", 3)[0]["title"] == "Kiss and Tell (1945 film)"
    assert index.search("diplomat", 3)[0]["url"] == "/wiki/Shirley_Temple"
    for nasty in ['"unbalanced', "NEAR(a b", "a AND OR NOT", "title:x*", "^ - + ( ) :"]:
        index.search(nasty, 3)  # quoted terms: FTS5 query syntax in a model's query is never a crash
    assert index.search("?!", 3) == [] and index.search("zzzqqq", 3) == []


def test_site_serves_search_and_pages_over_http(tmp_path):
    with running_site(write_corpus(tmp_path)) as base:
        body = httpx.get(f"{base}/search", params={"q": "Colorado river canyon", "k": 2}).json()
        assert body["results"][0] == {"title": "Grand_Canyon", "url": f"{base}/wiki/Grand_Canyon",
                                      "snippet": "A canyon in Arizona carved by the Colorado River."}
        page = httpx.get(body["results"][0]["url"])  # a title with an underscore still round-trips
        assert page.status_code == 200 and "Arizona" in page.text and page.headers["content-type"].startswith("text/html")
        url = httpx.get(f"{base}/search", params={"q": "Kiss Tell"}).json()["results"][0]["url"]
        assert "1945 comedy" in httpx.get(url).text
        assert httpx.get(f"{base}/wiki/Nobody").status_code == 404
        assert httpx.get(f"{base}/search", params={"q": "x", "k": "many"}).status_code == 400


def test_site_command_prints_its_address_first_and_serves(tmp_path):
    proc = subprocess.Popen([sys.executable, "-m", "tfgrpo.tasks.web.site", "--corpus", str(write_corpus(tmp_path)),
                             "--port", "0"], stdout=subprocess.PIPE, text=True)
    try:
        first = proc.stdout.readline().strip()
        assert first.startswith("serving http://127.0.0.1:")
        base = first.split(" ", 1)[1]
        assert httpx.get(f"{base}/search", params={"q": "Protocol"}).json()["results"][0]["title"] == "Shirley Temple"
    finally:
        proc.terminate()
        proc.wait(timeout=10)


@pytest.mark.parametrize("content,message", [
    ('{"title": "A", "text": "x"}\n{"title": "A", "text": "y"}\n', "appears twice"),
    ('{"title": "A"}\n', "non-empty 'title' and 'text'"),
    ('{"title": "A", "text": "x"}\nnot json\n', "line 2: not valid JSON"),
    ("", "no documents"),
])
def test_bad_corpus_files_are_named_with_their_line(tmp_path, content, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(content)
    with pytest.raises(ValueError, match=message):
        read_corpus(path)


def test_site_command_reports_a_missing_corpus(tmp_path):
    done = subprocess.run([sys.executable, "-m", "tfgrpo.tasks.web.site", "--corpus", str(tmp_path / "none.jsonl")],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "no such file" in done.stderr


def test_shipped_sets_load_and_every_hotpotqa_question_has_its_gold_pages_in_the_corpus():
    train, dev = load_web("hotpotqa_train"), load_web("hotpotqa_dev")
    assert (len(train), len(dev)) == (292, 300) and not {e.id for e in train} & {e.id for e in dev}
    assert set(dev[0].inputs().keys()) == {"question"} and dev[0].answer == "Chief of Protocol"
    titles = {d["title"] for d in read_corpus(corpus_path("hotpotqa"))}
    rows = [json.loads(line) for line in BUILTIN["hotpotqa_dev"].read_text().splitlines()]
    assert all(set(r["supporting_facts"]["title"]) <= titles for r in rows)
    walker = load_web("webwalkerqa", limit=3)
    assert len(walker) == 3 and walker[0].id == "webwalkerqa-0001" and walker[0].root_url.startswith("https://")


def test_hub_only_sets_fail_clearly_offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ValueError, match="hub only.*hotpotqa_train"):
        load_web("PersonalAILab/AFM-WebAgent-RL-Dataset")
    with pytest.raises(ValueError, match="unknown web question set"):
        load_web("no_such_set")
