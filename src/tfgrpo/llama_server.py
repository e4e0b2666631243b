"""llama.cpp's HTTP server from the prebuilt ``xllamacpp`` wheel, run with ``llama-server``'s own command line.

``python -m tfgrpo.llama_server -m MODEL.gguf --port 8080 ...`` serves what ``llama-server`` would (the same C++
server, its OpenAI routes, ``/metrics``, speculative decoding) from a wheel pinned by hash in ``requirements.lock``,
so setup compiles nothing. It understands the flags ``tfgrpo.local_model.LocalServer.server_args`` passes, and
refuses any other with an error. It serves until SIGTERM or SIGINT.
"""

from __future__ import annotations

import argparse
import signal
import sys

from tfgrpo.local_model import SPECULATIVE

# the --spec-type values LocalServer passes; xllamacpp names each COMMON_SPECULATIVE_TYPE_ + its upper-case form
SPEC_TYPES = [flags[1] for flags in SPECULATIVE.values() if flags]


def parse(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m tfgrpo.llama_server", description=__doc__.split("\n\n")[0])
    ap.add_argument("-m", "--model", required=True, help="GGUF file")
    ap.add_argument("--alias", default=None, help="the model name the server reports")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("-c", "--ctx-size", type=int, default=4096, help="KV cache of all slots together (tokens)")
    ap.add_argument("-np", "--parallel", type=int, default=1, help="slots decoded in one batch")
    ap.add_argument("--kv-unified", action="store_true", help="one KV pool shared by the slots")
    ap.add_argument("-b", "--batch-size", type=int, default=2048)
    ap.add_argument("-t", "--threads", type=int, default=None)
    ap.add_argument("-tb", "--threads-batch", type=int, default=None)
    ap.add_argument("--metrics", action="store_true", help="serve /metrics")
    ap.add_argument("--no-webui", action="store_true")
    ap.add_argument("--spec-type", choices=SPEC_TYPES, default=None)
    ap.add_argument("--spec-draft-model", default=None, help="GGUF of the draft model (--spec-type draft-simple)")
    ap.add_argument("-td", "--threads-draft", type=int, default=None)
    return ap.parse_args(argv)


def params(args: argparse.Namespace):
    """xllamacpp's CommonParams for the parsed command line."""
    import xllamacpp as xlc

    p = xlc.CommonParams()
    p.model.path = args.model
    if args.alias:
        p.model_alias = {args.alias}
    p.hostnames, p.port = [args.host], args.port
    p.n_ctx, p.n_parallel, p.kv_unified, p.n_batch = args.ctx_size, args.parallel, args.kv_unified, args.batch_size
    if args.threads:
        p.cpuparams.n_threads = args.threads
    if args.threads_batch or args.threads:
        p.cpuparams_batch.n_threads = args.threads_batch or args.threads
    p.endpoint_metrics, p.ui = args.metrics, not args.no_webui
    if args.spec_type:
        name = "COMMON_SPECULATIVE_TYPE_" + args.spec_type.upper().replace("-", "_")
        p.speculative.types = [getattr(xlc.common_speculative_type, name)]
    if args.spec_draft_model:
        p.speculative.draft.mparams.path = args.spec_draft_model
        if args.threads_draft:
            p.speculative.draft.cpuparams.n_threads = p.speculative.draft.cpuparams_batch.n_threads = args.threads_draft
    return p


def main(argv: list[str] | None = None) -> None:
    args = parse(sys.argv[1:] if argv is None else argv)
    try:
        import xllamacpp as xlc
    except ImportError as exc:
        raise SystemExit(f"xllamacpp is not installed ({exc}): run `bash scripts/setup.sh`") from exc
    stop = {signal.SIGTERM, signal.SIGINT}
    signal.pthread_sigmask(signal.SIG_BLOCK, stop)  # delivered to sigwait below, in whichever thread the server runs
    server = xlc.Server(params(args))  # loads the model and starts listening; raises if it cannot
    print(f"tfgrpo.llama_server: listening on {server.listening_address}", flush=True)
    signal.sigwait(stop)
    del server  # stops the server loop and frees the model


if __name__ == "__main__":
    main()
