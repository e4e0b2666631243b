"""Fake LMs for tests and benchmarks, shipped with the package so that both import them the same way
(`from tfgrpo.testing import FakeLMServer`), and so can a user who tests a program of their own offline.

`FakeLMServer` is an OpenAI-compatible chat server on loopback that answers DSPy programs and tfgrpo's learning
calls deterministically, with faults and latencies to order; `prompts` holds the rules every fake LM of the
project uses to read a DSPy prompt (its output fields, which call it is).
"""

from tfgrpo.testing.fake_lm_server import FAULTS, REPLY_FAULTS, TRANSIENT_FAULTS, FakeLMServer
from tfgrpo.testing.prompts import KINDS, field_values, kind_of, output_fields

__all__ = ["FAULTS", "KINDS", "REPLY_FAULTS", "TRANSIENT_FAULTS", "FakeLMServer", "field_values", "kind_of",
           "output_fields"]
