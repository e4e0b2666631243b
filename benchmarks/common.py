"""What the benchmarks on the embedded model share: where their LM calls go.

By default a benchmark runs on the embedded model (a `tfgrpo lm start` server of that model is reused, else one
is started and stopped at the end). `--api-base URL` sends the same calls to any OpenAI-compatible endpoint
instead: another llama.cpp server, an API, or the fake LM server (`tfgrpo.testing.FakeLMServer`), on which
tests/test_benchmarks.py runs every benchmark at its smallest size.
"""

from __future__ import annotations

import argparse
import contextlib

from tfgrpo.lms import serving
from tfgrpo.local_weights import DEFAULT_MODEL


def add_endpoint_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--model", default=DEFAULT_MODEL,
                    help="the embedded model to run, or the model name sent to --api-base")
    ap.add_argument("--api-base", default=None,
                    help="an OpenAI-compatible endpoint (http://host:port/v1) to use instead of the embedded model")


def endpoint(args: argparse.Namespace, **server_kw) -> contextlib.AbstractContextManager[str]:
    """The API base the benchmark's LM calls go to: `args.api_base`, or the embedded `args.model` (server
    options in `server_kw`), stopped on exit if it was started here."""
    return serving(args.model, args.api_base, **server_kw)
