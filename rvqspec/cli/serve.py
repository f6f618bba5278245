"""`rvqspec serve`: an OpenAI-compatible speech server on the continuous-batching engine (rvqspec.serve).

With no --model it serves the shipped stand-in. It binds to 127.0.0.1 unless told otherwise; with --api-key (or
RVQSPEC_API_KEY) every endpoint but /health and the page at / needs `Authorization: Bearer <key>`. Every flag, the
API key and the model folder's config.json are checked before the port is bound; SIGTERM is handled from the start.
"""

import argparse
import os
import sys
from pathlib import Path

from rvqspec.cli import flags
from rvqspec.core.errors import RvqspecError
from rvqspec.core.quantize import SCHEMES
from rvqspec.serve import BODY_SECONDS, HEADER_SECONDS, STALL_SECONDS
from rvqspec.serve.voices import MAX_VOICES, VOICES_QUOTA

LOOPBACK = {"127.0.0.1", "::1", "localhost"}
port = flags.bounded_int(0, 65535)
max_queue = flags.bounded_int(1, 1024)
replicas = flags.bounded_int(1, 1024)
RAY_FLAGS = ("address", "replicas", "min_replicas", "max_replicas")  # meaningful with --ray only


def model(text: str) -> str:
    """'standin', or a model folder whose config.json parses (`model_config`)."""
    from rvqspec.runtime.engine import model_config

    if text != "standin":
        try:
            model_config(Path(text))
        except RvqspecError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    return text


def api_key(text: str) -> str:
    if not text.strip() or text != text.strip() or not text.isprintable():
        raise argparse.ArgumentTypeError("the key is empty, or has spaces or control characters at its ends or within: "
                                         "pass a printable key (or leave the flag out for none)")
    return text


def host_names(text: str) -> tuple[str, ...]:
    names = tuple(name.strip() for name in text.split(","))
    if not all(names):
        raise argparse.ArgumentTypeError(f"{text!r} has an empty name: pass names separated by commas")
    return names


def key_of(args) -> str | None:
    """--api-key, else RVQSPEC_API_KEY (checked as the flag is), else None; warned about off loopback without one."""
    key = args.api_key
    if key is None and "RVQSPEC_API_KEY" in os.environ:
        try:
            key = api_key(os.environ["RVQSPEC_API_KEY"])
        except argparse.ArgumentTypeError as e:
            raise RvqspecError(f"RVQSPEC_API_KEY: {e}") from None
    if args.host not in LOOPBACK and not key:
        print(f"rvqspec serve: warning: listening on {args.host} without an API key: anyone who reaches this port "
              "can use it (set --api-key or RVQSPEC_API_KEY)", file=sys.stderr)
    return key


def run_serve(args) -> int:
    if args.ray:
        return run_ray(args)
    given = [name for name in RAY_FLAGS if getattr(args, name) is not None]
    if given:
        raise RvqspecError(f"--{given[0].replace('_', '-')} is a flag of Ray serving: add --ray")
    flags.require_extra("rvqspec serve", "serve", "fastapi", "uvicorn", "soundfile", "scipy", "prometheus_client")
    from rvqspec.runtime import Engine
    from rvqspec.serve.server import bind, exiting_on_sigterm, serve
    from rvqspec.serve.voices import VoiceStore

    with exiting_on_sigterm():
        key = key_of(args)
        sock = bind(args.host, args.port)  # a taken port fails now, before the model loads
        engine = Engine(args.model, max_batch=args.max_batch, max_queue=args.max_queue, weights=args.weights,
                        talker_weights=args.talker_weights, cores=args.cores, threads=args.threads)
        voices = VoiceStore(args.voices_dir or Path.home() / ".cache" / "rvqspec" / "voices" / engine.name,
                            args.max_voices, args.voices_quota * 2 ** 20)
    serve(engine, sock, voices, key, args.grace, threads=args.max_batch + args.max_queue + 16,
          allowed_hosts=args.allowed_hosts, header_seconds=args.header_timeout, body_seconds=args.body_timeout,
          stall_seconds=args.stall_timeout)
    return 0


def run_ray(args) -> int:
    """`rvqspec serve --ray`: the app on Ray Serve (rvqspec/serve/ray.py), one Engine per replica."""
    flags.require_extra("rvqspec serve --ray", "ray", "ray", "fastapi", "uvicorn", "soundfile")
    if args.cores is not None or args.threads is not None:
        raise RvqspecError("--cores and --threads size one server: with --ray, give --threads-per-replica")
    if args.model != "standin" and not Path(args.model).is_dir():
        raise RvqspecError(f"--model {args.model} is not a checkpoint folder (with --address: give a path that "
                           "every node can read)")
    from rvqspec.serve import ray

    key = key_of(args)
    application = ray.app(args.model, replicas=args.replicas, min_replicas=args.min_replicas,
                          max_replicas=args.max_replicas, threads_per_replica=args.threads_per_replica,
                          max_batch=args.max_batch, max_queue=args.max_queue, weights=args.weights,
                          talker_weights=args.talker_weights, voices_dir=args.voices_dir, api_key=key,
                          grace=args.grace, allowed_hosts=args.allowed_hosts, max_voices=args.max_voices,
                          voices_quota=args.voices_quota * 2 ** 20, body_seconds=args.body_timeout)
    ray.run(application, args.model, args.address, args.host, args.port, args.grace)
    return 0


def add_cli(subparsers) -> None:
    p = subparsers.add_parser("serve",
                              help="an OpenAI-compatible speech server (/v1/audio/speech, streaming) on the engine")
    p.add_argument("--model", type=model, default="standin",
                   help="'standin' (the shipped stand-in, default) or a checkpoint folder (Qwen3-TTS 12 Hz or "
                        "stand-in)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=port, default=8000, help="TCP port (default 8000; 0: any free port)")
    p.add_argument("--max-batch", type=flags.bounded_int(1, 256), default=8, help="requests decoded together (default 8)")
    p.add_argument("--max-queue", type=max_queue, default=32,
                   help="requests waiting for a row (default 32); past it, 429 with Retry-After")
    p.add_argument("--cores", type=flags.bounded_int(1, 4096),
                   help="threads that may do torch work at once (default: the CPUs this process may use)")
    p.add_argument("--threads", type=flags.bounded_int(1, 4096),
                   help="the frame loop's torch threads (default: all of --cores but one, which the codec takes)")
    p.add_argument("--weights", choices=SCHEMES, help="the code predictor with int8 weights (CPU; opt-in)")
    p.add_argument("--talker-weights", choices=SCHEMES, help="the talker's layers with int8 weights (CPU; lossy)")
    p.add_argument("--api-key", type=api_key, help="require 'Authorization: Bearer KEY' (default: $RVQSPEC_API_KEY; "
                                                   "none)")
    p.add_argument("--allowed-hosts", type=host_names, default=(),
                   help="host names the Host header may give, comma-separated ('*': any); addresses and localhost "
                        "always pass (default: none more)")
    p.add_argument("--voices-dir", type=flags.out_folder,
                   help="where registered voices are kept (default ~/.cache/rvqspec/voices/<model name>)")
    p.add_argument("--max-voices", type=flags.bounded_int(1, 100000), default=MAX_VOICES,
                   help=f"registered voices at most (default {MAX_VOICES}); past it, 507")
    p.add_argument("--voices-quota", type=flags.bounded_int(1, 2 ** 30), default=VOICES_QUOTA // 2 ** 20,
                   metavar="MIB", help=f"MiB all registered voices may take (default {VOICES_QUOTA // 2 ** 20}; a "
                                       "60 s voice takes ~3); past it, 507")
    p.add_argument("--grace", type=flags.positive_float, default=30.0,
                   help="seconds in-flight requests get to finish on SIGTERM before they are cancelled (default 30)")
    p.add_argument("--header-timeout", type=flags.positive_float, default=HEADER_SECONDS,
                   help=f"seconds a request's headers may take to arrive (default {HEADER_SECONDS:g})")
    p.add_argument("--body-timeout", type=flags.positive_float, default=BODY_SECONDS,
                   help=f"seconds a request's body may take to arrive (default {BODY_SECONDS:g}); past it, 408")
    p.add_argument("--stall-timeout", type=flags.positive_float, default=STALL_SECONDS,
                   help=f"seconds a streaming client may go without taking audio (default {STALL_SECONDS:g}); past "
                        "it, its request is cancelled (its row freed) and the connection closed")
    # Ray Serve (`rvqspec[ray]`): replicas on one machine or a cluster.
    p.add_argument("--ray", action="store_true",
                   help="serve on Ray Serve, one engine per replica (needs rvqspec[ray]; docs/serving.md: Ray "
                        "Serve)")
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
