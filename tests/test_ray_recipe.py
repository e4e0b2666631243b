"""docs/ray.md's recipe as a user follows it on the pinned Ray: `ray start --head`, then a compile in another process
with only RAY_ADDRESS set, with and without a Ray token in the user's ~/.ray (where `ray start` turns token
authentication on), against the fake LM server. Each case starts its own cluster under a home folder of its own."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")

from benchmarks.fault_child import server  # noqa: E402
from tfgrpo.testing.ray_cluster import LocalRayCluster  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
DRIVER = """
import sys
from benchmarks.fault_child import compile_once
compiled = compile_once(sys.argv[1], None, child=True, queries=4, backend="ray")
print("library", len(compiled.experience_library))
"""


@pytest.mark.parametrize("token", [False, True])
def test_the_documented_cluster_recipe_compiles(token, tmp_path):
    home = tmp_path / "home"
    (home / ".ray").mkdir(parents=True)
    if token:
        from ray._private.authentication.authentication_token_generator import generate_new_authentication_token

        (home / ".ray" / "auth_token").write_text(generate_new_authentication_token())
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
    env.update(HOME=str(home), PYTHONPATH=str(ROOT))
    with LocalRayCluster(nodes=1, env={"HOME": str(home)}, auth=None) as cluster, server() as srv:
        env["RAY_ADDRESS"] = cluster.address
        run = subprocess.run([sys.executable, "-c", DRIVER, srv.api_base], cwd=ROOT, env=env, capture_output=True,
                             text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    assert "library" in run.stdout and "InvalidAuthToken" not in run.stderr
