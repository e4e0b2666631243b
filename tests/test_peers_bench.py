"""benchmarks/peers.py at its smallest size on the real embedded model (the 0.5B), so that no arm can rot: every
optimizer compiles, is evaluated, and gets its line in the report and a point in the plot."""

import subprocess
import sys
from pathlib import Path

import pytest

from test_local_e2e import _missing

ROOT = Path(__file__).resolve().parent.parent
ARMS = ["baseline", "bootstrap", "simba", "gepa", "mipro", "tfgrpo-rules", "tfgrpo-probed+demos", "tfgrpo-excerpts"]


@pytest.mark.local_model
def test_every_arm_runs_and_reports(tmp_path):
    if (why := _missing()) is not None:
        pytest.skip(why)
    out = tmp_path / "peers"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "peers.py"), "--model", "qwen2.5-coder-0.5b", "--arms",
           ",".join(ARMS), "--seeds", "0", "--train", "2", "--eval", "2", "--generations", "2", "--batch", "2",
           "--max-tokens", "200", "--out", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=1500)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lines = [line for line in done.stdout.splitlines() if line.startswith("peers: ")]
    assert [line.split("optimizer=")[1].split()[0] for line in lines] == sorted(ARMS, key=lambda a: (a != "baseline", a))
    assert all("problems=2 " in line and "ci_low_vs_best=" in line for line in lines)
    assert (out / "game24" / "peers.png").stat().st_size > 0
    # a second run reuses everything it saved: no model call, same lines
    again = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert [line for line in again.stdout.splitlines() if line.startswith("peers: ")] == lines
