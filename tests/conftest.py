import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # the scripted LM helpers

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # before dspy: litellm reads its bundled price map
import dspy  # noqa: E402


@pytest.fixture(autouse=True)
def _fresh_dspy_settings():
    """Each test configures its own LM; none leaks into the next."""
    dspy.configure(lm=None)
    yield
    dspy.configure(lm=None)
