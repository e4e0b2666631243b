"""Benchmarks and test fixtures of tfgrpo: a fake OpenAI-compatible LM server, step latency and fault runs.

Importing this package (each script does, before DSPy) points LiteLLM at its bundled price map, so no benchmark
fetches it from the network: the one place that setting is made for the benchmarks."""

import os

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
