"""The shared helpers: one text clipper and one atomic file writer for the whole package."""

import os
import stat

import pytest

from tfgrpo.base.util import clip, write_atomic


def test_clip_keeps_short_text_and_says_how_much_it_cut():
    assert clip("short", 5) == "short"
    text = "a" * 50 + "b" * 50
    cut = clip(text, 20)
    assert cut == "a" * 10 + "\n[... 80 characters cut ...]\n" + "b" * 10  # head and tail: an error is often last
    assert clip("x" * 11, 5).startswith("xxx\n[... 6 characters cut ...]\nxx")  # odd limits keep exactly `limit`


def test_clip_head_only_ends_at_a_word_boundary():
    assert clip("one two three four", 9, keep_tail=False) == "one two [... 11 characters cut ...]"
    assert clip("one two three four", 8, keep_tail=False) == "one two [... 11 characters cut ...]"  # cut at a space
    assert clip("abcdefghij", 4, keep_tail=False) == "abcd [... 6 characters cut ...]"  # one long word: cut inside it
    with pytest.raises(ValueError, match="limit must be >= 0"):
        clip("text", -1)


def test_write_atomic_replaces_the_whole_file_and_leaves_no_temporary(tmp_path):
    path = tmp_path / "new" / "folder" / "state.json"
    assert write_atomic(path, "first") == path and path.read_text() == "first"
    write_atomic(path, "second, longer than the first")
    assert path.read_text() == "second, longer than the first"
    assert [p.name for p in path.parent.iterdir()] == ["state.json"]
    mask = os.umask(0)
    os.umask(mask)
    assert stat.S_IMODE(path.stat().st_mode) == 0o666 & ~mask  # the usual permissions, not a temp file's 0600


def test_a_failed_write_keeps_the_old_file(tmp_path):
    path = tmp_path / "rows.jsonl"
    write_atomic(path, "old\n")
    with pytest.raises(TypeError):
        write_atomic(path, None)  # fails while writing
    assert path.read_text() == "old\n" and [p.name for p in tmp_path.iterdir()] == ["rows.jsonl"]
