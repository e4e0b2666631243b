"""tfgrpo: Training-Free GRPO for DSPy programs."""

import os

# Never reach for the network at import: litellm otherwise fetches its model cost map.
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

__version__ = "0.1.0"
