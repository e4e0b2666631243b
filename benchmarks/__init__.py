"""Benchmarks and test fixtures of tfgrpo: a fake OpenAI-compatible LM server, step latency and fault runs."""
