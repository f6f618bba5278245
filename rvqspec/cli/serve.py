"""`rvqspec serve`: an OpenAI-compatible speech server on the continuous-batching engine (rvqspec.serve).

With no --model it serves the shipped stand-in. It binds to 127.0.0.1 unless told otherwise; with --api-key (or
RVQSPEC_API_KEY) every endpoint but /health and the page at / needs `Authorization: Bearer <key>`.
"""

import os
import sys
from pathlib import Path

from rvqspec.cli import flags
from rvqspec.engine.quantize import SCHEMES

LOOPBACK = {"127.0.0.1", "::1", "localhost"}
port = flags.bounded_int(0, 65535)
max_queue = flags.bounded_int(0, 1024)


def run_serve(args) -> int:
    flags.require_extra("rvqspec serve", "serve", "fastapi", "uvicorn", "soundfile")
    from rvqspec.runtime import Engine
    from rvqspec.serve.server import bind, serve
    from rvqspec.serve.voices import VoiceStore

    api_key = args.api_key or os.environ.get("RVQSPEC_API_KEY") or None
    sock = bind(args.host, args.port)  # a taken port fails now, before the model loads
    if args.host not in LOOPBACK and not api_key:
        print(f"rvqspec serve: warning: listening on {args.host} without an API key: anyone who reaches this port "
              "can use it (set --api-key or RVQSPEC_API_KEY)", file=sys.stderr)
    engine = Engine(args.model, max_batch=args.max_batch, max_queue=args.max_queue, weights=args.weights,
                    talker_weights=args.talker_weights)
    voices = VoiceStore(args.voices_dir or Path.home() / ".cache" / "rvqspec" / "voices" / engine.name)
    serve(engine, sock, voices, api_key, args.grace, threads=args.max_batch + args.max_queue + 16)
    return 0


def add_cli(subparsers) -> None:
    model = flags.model_flag(required=False, default="standin",
                             help="'standin' (the shipped stand-in, default) or a checkpoint folder (Qwen3-TTS 12 Hz "
                                  "or stand-in)")
    p = subparsers.add_parser("serve", parents=[model],
                              help="an OpenAI-compatible speech server (/v1/audio/speech, streaming) on the engine")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=port, default=8000, help="TCP port (default 8000; 0: any free port)")
    p.add_argument("--max-batch", type=flags.bounded_int(1, 256), default=8, help="requests decoded together (default 8)")
    p.add_argument("--max-queue", type=max_queue, default=32,
                   help="requests waiting for a row (default 32); past it, 429 with Retry-After")
    p.add_argument("--weights", choices=SCHEMES, help="the code predictor with int8 weights (CPU; opt-in)")
    p.add_argument("--talker-weights", choices=SCHEMES, help="the talker's layers with int8 weights (CPU; lossy)")
    p.add_argument("--api-key", help="require 'Authorization: Bearer KEY' (default: $RVQSPEC_API_KEY; none)")
    p.add_argument("--voices-dir", type=flags.out_folder,
                   help="where registered voices are kept (default ~/.cache/rvqspec/voices/<model name>)")
    p.add_argument("--grace", type=flags.positive_float, default=30.0,
                   help="seconds in-flight requests get to finish on SIGTERM before they are cancelled (default 30)")
    p.set_defaults(run=run_serve)
