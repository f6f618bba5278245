"""`rvqspec serve`: an OpenAI-compatible speech server on the continuous-batching engine (rvqspec.serve).

With no --model it serves the shipped stand-in. It binds to 127.0.0.1 unless told otherwise; with --api-key (or
RVQSPEC_API_KEY) every endpoint but /health and the page at / needs `Authorization: Bearer <key>`.
"""

import os
import sys
from pathlib import Path

from rvqspec.cli import flags
from rvqspec.engine.errors import RvqspecError
from rvqspec.engine.quantize import SCHEMES

LOOPBACK = {"127.0.0.1", "::1", "localhost"}
port = flags.bounded_int(0, 65535)
max_queue = flags.bounded_int(0, 1024)
replicas = flags.bounded_int(1, 1024)
RAY_FLAGS = ("address", "replicas", "min_replicas", "max_replicas")  # meaningful with --ray only


def run_serve(args) -> int:
    if args.ray:
        return run_ray(args)
    given = [name for name in RAY_FLAGS if getattr(args, name) is not None]
    if given:
        raise RvqspecError(f"--{given[0].replace('_', '-')} is a flag of Ray serving: add --ray")
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


def run_ray(args) -> int:
    """`rvqspec serve --ray`: the app on Ray Serve (rvqspec/serve/ray.py), one Engine per replica."""
    flags.require_extra("rvqspec serve --ray", "ray", "ray", "fastapi", "uvicorn", "soundfile")
    if args.model != "standin" and not Path(args.model).is_dir():
        raise RvqspecError(f"--model {args.model} is not a checkpoint folder (with --address: give a path that "
                           "every node can read)")
    from rvqspec.serve import ray

    api_key = args.api_key or os.environ.get("RVQSPEC_API_KEY") or None
    if args.host not in LOOPBACK and not api_key:
        print(f"rvqspec serve: warning: listening on {args.host} without an API key: anyone who reaches this port "
              "can use it (set --api-key or RVQSPEC_API_KEY)", file=sys.stderr)
    application = ray.app(args.model, replicas=args.replicas, min_replicas=args.min_replicas,
                          max_replicas=args.max_replicas, threads_per_replica=args.threads_per_replica,
                          max_batch=args.max_batch, max_queue=args.max_queue, weights=args.weights,
                          talker_weights=args.talker_weights, voices_dir=args.voices_dir, api_key=api_key,
                          grace=args.grace)
    ray.run(application, args.model, args.address, args.host, args.port, args.grace)
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
    # Ray Serve (`rvqspec[ray]`): replicas on one machine or a cluster.
    p.add_argument("--ray", action="store_true",
                   help="serve on Ray Serve, one engine per replica (needs rvqspec[ray]; README: Serving on many "
                        "machines)")
    p.add_argument("--address", metavar="auto|HOST:PORT",
                   help="with --ray: the Ray cluster to join (default: start a local Ray instance)")
    p.add_argument("--replicas", type=replicas, metavar="N", help="with --ray: a fixed number of replicas (default 1)")
    p.add_argument("--min-replicas", type=replicas, metavar="A",
                   help="with --ray: autoscale from this many replicas ...")
    p.add_argument("--max-replicas", type=replicas, metavar="B",
                   help="... to this many, on ongoing requests (a full batch each)")
    p.add_argument("--threads-per-replica", type=flags.bounded_int(1, 256), default=1, metavar="T",
                   help="with --ray: torch threads (and Ray CPUs) of each replica (default 1)")
    p.set_defaults(run=run_serve)
