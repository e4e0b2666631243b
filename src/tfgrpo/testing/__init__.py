"""Fake LMs for tests and benchmarks, shipped with the package so that both import them the same way
(`from tfgrpo.testing import FakeLMServer`), and so can a user who tests a program of their own offline.

`FakeLMServer` is an OpenAI-compatible chat server on loopback that answers DSPy programs and tfgrpo's learning
calls deterministically, with faults and latencies to order; `prompts` holds the rules every fake LM of the
project uses to read a DSPy prompt (its output fields, which call it is).

Asked to, the server also behaves like a paid API (`provider`): `PrefixCache` counts the cached share of each
prompt as DeepSeek and OpenAI bill it, `Provider` adds prices and a bill, reasoning models (OpenAI's refuse a
temperature other than 1 with HTTP 400) and a rate limit, and `dspy_prices(model)` reads the per-token prices DSPy
itself bills a model at, for a server that bills the same.

`BillingServer` is a plain chat server that answers with a function of the request and bills every call at its
model's price: what a compile reports it spent is checked against its bill.

`LocalRayCluster` starts a Ray cluster of several nodes on this machine, each its own `ray start` process, and can kill
one: for `backend="ray"`.
"""

from tfgrpo.testing.billing import BillingServer
from tfgrpo.testing.fake_lm_server import FAULTS, REPLY_FAULTS, TRANSIENT_FAULTS, FakeLMServer
from tfgrpo.testing.prompts import KINDS, field_values, kind_of, output_fields
from tfgrpo.testing.provider import PrefixCache, Provider, dspy_prices
from tfgrpo.testing.ray_cluster import LocalRayCluster

__all__ = ["FAULTS", "KINDS", "REPLY_FAULTS", "TRANSIENT_FAULTS", "BillingServer", "FakeLMServer", "LocalRayCluster", "PrefixCache", "Provider",
           "dspy_prices", "field_values", "kind_of", "output_fields"]
