"""`rvqspec serve` under load: 1, 4, 8 and 16 concurrent streaming clients on loopback, each level a fixed time.

    python benchmarks/serve_load.py [--model standin|0.6b|PATH] [--clients 1,4,8,16] [--seconds 20] [--ray REPLICAS]

`--model 0.6b` serves qwen-tts at the real 0.6B sizes with random weights, its code predictor's heads controlled to
the paper's acceptance and the released 12 Hz decoder (rvqspec.bench.systems builds it), bfloat16, each request
REAL_SIZE_FRAMES frames (EOS is unreachable with random weights). `--ray N`: `rvqspec serve --ray --replicas N` (one
thread each) on a local Ray instance; frames/s is then not counted (/metrics is one replica's).

Starts a server process (`rvqspec serve --port 0`, one torch thread for the model), warms it with one request, then
per level runs that many clients, each sending streaming pcm requests one after another until the level's time is
up (in-flight requests are awaited, so nothing is cut short), and stops the server with SIGTERM. Per level: time to
first byte p50/p95 (request sent -> first audio bytes), aggregate audio seconds per wall second, errors (a status
other than 200, a failed connection) and truncated streams (a body that broke off or held no audio). Writes
benchmarks/results/serve-load.json and .md, with the CPU named beside the figures; all ratios come from one run.
`--smoke`: the 0.6b path at tiny sizes, 1 and 2 clients for a second each, the reports in a temporary folder.
"""

import argparse
import json
import os
import re
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import numpy as np

from rvqspec.bench.timing import SMOKE_HELP, report_folder

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "results" / "serve-load"
TEXTS = ["Hello there, how are you today?", "The quick brown fox jumps over the lazy dog.",
         "Speech comes out as it is decoded.", "Every client waits its turn at the frame boundary."]
REAL_SIZE = "0.6b"
REAL_SIZE_FRAMES = 40  # 3.2 s of audio a request
MAX_SECONDS = 1800  # the whole run stops by itself: each level's time, plus its in-flight requests


def cpu_name() -> str:
    """The CPU's model name, its class (rvqspec's) and whether it has AMX (whose tiles change what is fast)."""
    from rvqspec.core import cpu_class

    return f"{cpu_class.describe()} ({'with' if 'amx_tile' in cpu_class.cpu_flags() else 'no'} AMX)"


def serve_real_size(max_batch: int, max_queue: int, sizes: str) -> None:
    """The server process of `--model 0.6b` (this script with --serve-real-size): prints its address, serves."""
    import torch

    from rvqspec.bench.systems import SIZES, controlled_heads, system_tts
    from rvqspec.runtime import Engine
    from rvqspec.serve.server import bind, serve
    from rvqspec.serve.voices import VoiceStore

    tts = system_tts(SIZES[sizes], torch.bfloat16)
    tts.generate_defaults["max_new_tokens"] = 3 if sizes == "smoke" else REAL_SIZE_FRAMES
    controlled_heads(tts, SIZES[sizes], torch.bfloat16, log=lambda line: print(line, file=sys.stderr),
                     iterations=1 if sizes == "smoke" else 6)
    engine = Engine(tts, max_batch=max_batch, max_queue=max_queue)
    serve(engine, bind("127.0.0.1", 0), VoiceStore(tempfile.mkdtemp(prefix="rvqspec-voices-")))


def start_server(model: str, max_batch: int, max_queue: int, ray: int | None, sizes: str = REAL_SIZE
                 ) -> tuple[subprocess.Popen, str]:
    env = dict(os.environ, OMP_WAIT_POLICY=os.environ.get("OMP_WAIT_POLICY", "PASSIVE"))
    env.pop("OMP_NUM_THREADS", None)  # the engine's default thread budget (runtime/threads.py) decides
    limits = ["--max-batch", str(max_batch), "--max-queue", str(max_queue)]
    command = ([__file__, "--serve-real-size", "--sizes", sizes, *limits] if model == REAL_SIZE else
               ["-m", "rvqspec.cli", "serve", "--host", "127.0.0.1", "--port", "0", "--model", model, *limits])
    if ray:
        command += ["--ray", "--replicas", str(ray), "--threads-per-replica", "1"]
    log = tempfile.TemporaryFile()  # the server's stderr, shown if it fails to start
    process = subprocess.Popen([sys.executable, *command], stdout=subprocess.PIPE, stderr=log, env=env, cwd=ROOT)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline and process.poll() is None:
        if select.select([process.stdout], [], [], 0.5)[0]:
            if found := re.search(r"on (http://\S+)", process.stdout.readline().decode()):
                threading.Thread(target=process.stdout.read, daemon=True).start()  # its access log
                return process, found.group(1)
    process.kill()
    log.seek(0)
    raise SystemExit(f"the server did not start (exit status {process.poll()}): {log.read().decode()[-3000:]}")


def one_request(client: httpx.Client, url: str, body: dict) -> dict:
    """Send one streaming request; its time to first byte, audio bytes and how it ended."""
    start, first, size, last, gap = time.perf_counter(), None, 0, None, 0.0
    try:
        with client.stream("POST", f"{url}/v1/audio/speech", json=body, timeout=300) as response:
            if response.status_code != 200:
                response.read()
                return {"error": f"{response.status_code}: {response.text[:200]}"}
            for piece in response.iter_raw():
                now = time.perf_counter()
                first = now - start if first is None and piece else first
                gap, last = (max(gap, now - last) if last is not None else gap), now
                size += len(piece)
    except httpx.HTTPError as e:
        return {"truncated": first is not None, "error": None if first is not None else f"{type(e).__name__}: {e}"}
    return {"ttfb": first, "bytes": size, "end": time.perf_counter(), "truncated": size == 0 or size % 2 == 1, "gap": gap,
            "sample_rate": int(response.headers["x-sample-rate"])}


def frames_decoded(url: str) -> float:
    """The engine's frames so far (nan behind Ray: whichever replica answers /metrics counts its own)."""
    response = httpx.get(f"{url}/metrics")
    if "x-rvqspec-replica" in response.headers:
        return float("nan")
    return float(re.search(r"^rvqspec_frames_total (\S+)$", response.text, re.M).group(1))


def run_level(url: str, clients: int, seconds: float, model: str, voice: str | None) -> dict:
    results: list[dict] = []
    frames = frames_decoded(url)
    lock = threading.Lock()
    start = time.perf_counter()
    stop_at = start + seconds

    def client(index: int) -> None:
        with httpx.Client() as session:
            n = 0
            while time.perf_counter() < stop_at:
                body = {"model": model, "input": TEXTS[(index + n) % len(TEXTS)], "response_format": "pcm",
                        "seed": index * 1000 + n, **({"voice": voice} if voice else {})}
                result = one_request(session, url, body)
                with lock:
                    results.append(result)
                n += 1

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wall = max([r.get("end", 0) for r in results] + [stop_at]) - start
    return {"clients": clients, "results": results, "wall": wall, "frames": frames_decoded(url) - frames,
            "load": os.getloadavg()[0]}


def summarize(level: dict, sample_rate: int) -> dict:
    done = [r for r in level["results"] if "ttfb" in r and not r["truncated"]]
    ttfb = np.array([r["ttfb"] for r in done]) if done else np.array([np.nan])
    audio = sum(r["bytes"] for r in done) / 2 / sample_rate
    return {"clients": level["clients"], "requests": len(level["results"]),
            "errors": sum(bool(r.get("error")) for r in level["results"]),
            "truncated": sum(bool(r.get("truncated")) for r in level["results"]),
            "ttfb_p50": float(np.percentile(ttfb, 50)), "ttfb_p95": float(np.percentile(ttfb, 95)),
            "largest_gap": max((r["gap"] for r in done), default=float("nan")),
            "audio_seconds": audio, "wall_seconds": level["wall"], "audio_per_second": audio / level["wall"],
            "frames_per_second": level["frames"] / level["wall"], "load_average": level["load"]}


def markdown(report: dict) -> str:
    rows = report["levels"]
    lone = rows[0]
    what = (f"qwen-tts at the 0.6B sizes (random weights, heads at the paper's acceptance, bfloat16, "
            f"{REAL_SIZE_FRAMES} frames a request) served by rvqspec.serve" if report["model"] == REAL_SIZE else
            f"`rvqspec serve --model {report['model']}`")
    if report.get("ray"):
        what += f" on Ray Serve, {report['ray']} replica(s) of one thread (`--ray --replicas {report['ray']}`)"
    lines = [f"# Serving under load: {what}", "",
             f"Measured on {report['cpu']}, the server at its default thread budget (no thread flags: "
             f"{report.get('budget', '?')}), {report['cores']} cores shared with the clients; max batch {report['max_batch']}, each level {report['seconds']:.0f} s of "
             "clients sending streaming pcm requests back to back (a short English sentence each, "
             f"{report['sample_rate']} Hz), loopback. `python benchmarks/serve_load.py`.", "",
             "Frames/s is the engine's decoding alone (codes; /metrics); audio s/s also counts vocoding each "
             "request's chunks, in the engine's codec workers. Largest gap: the longest wait between two pieces of "
             "one response, over the level. Load average: the machine's 1-minute load at the level's end (other jobs "
             "included; 2 cores).", "",
             "| clients | requests | errors | truncated | first byte p50 (s) | p95 (s) | audio s / s | vs 1 client | "
             "frames / s | vs 1 client | largest gap (s) | load average |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['clients']} | {r['requests']} | {r['errors']} | {r['truncated']} | {r['ttfb_p50']:.2f} | "
                     f"{r['ttfb_p95']:.2f} | {r['audio_per_second']:.2f} | "
                     f"{r['audio_per_second'] / lone['audio_per_second']:.2f}x | {r['frames_per_second']:.1f} | "
                     f"{r['frames_per_second'] / lone['frames_per_second']:.2f}x | {r.get('largest_gap', float('nan')):.2f} | "
                     f"{r['load_average']:.1f} |")
    lines += ["", "Targets (issues 33 and 40), this run:", ""]
    for name, (value, target, ok) in report["targets"].items():
        lines.append(f"- {name}: {value} (target {target}): {'met' if ok else 'NOT met'}")
    return "\n".join(lines) + "\n"


def targets(levels: list[dict]) -> dict:
    by = {r["clients"]: r for r in levels}
    found = {}
    if 16 in by:
        bad = by[16]["errors"] + by[16]["truncated"]
        found["errors and truncated streams at 16 clients"] = (bad, 0, bad == 0)
    if 1 in by and 4 in by:
        ratio = by[4]["ttfb_p95"] / by[1]["ttfb_p95"]
        found["first byte p95 at 4 clients / a lone client's"] = (f"{ratio:.2f}x", "<= 2x", ratio <= 2)
    if 1 in by and 8 in by:
        ratio = by[8]["audio_per_second"] / by[1]["audio_per_second"]
        found["audio seconds per second at 8 clients / a lone client's"] = (f"{ratio:.2f}x", ">= 3x", ratio >= 3)
    return found


SMOKE = ["--model", REAL_SIZE, "--sizes", "smoke", "--clients", "1,2", "--seconds", "1"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    p.add_argument("--model", default="standin")
    p.add_argument("--voice", default=None, help="default: the first of the model's voices, if it has any")
    p.add_argument("--clients", default="1,4,8,16")
    p.add_argument("--seconds", type=float, default=20.0, help="per level")
    p.add_argument("--max-batch", type=int, default=16)
    p.add_argument("--ray", type=int, metavar="REPLICAS", help="serve on a local Ray instance with this many replicas")
    p.add_argument("--out", type=Path, default=None, help="default: benchmarks/results/serve-load[-0.6b][-rayN]")
    p.add_argument("--serve-real-size", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--max-queue", type=int, default=32, help=argparse.SUPPRESS)
    p.add_argument("--sizes", default=REAL_SIZE, help=argparse.SUPPRESS)  # --model 0.6b's system: 0.6b, or smoke
    argv = sys.argv[1:] if argv is None else argv
    args = p.parse_args(argv)
    if args.smoke:
        args = p.parse_args([*SMOKE, *argv])
    if args.serve_real_size:
        return serve_real_size(args.max_batch, args.max_queue, args.sizes)
    out = args.out or report_folder(OUT.parent, args.smoke) / (
        OUT.name + ("-" + REAL_SIZE if args.model == REAL_SIZE else "") + (f"-ray{args.ray}" if args.ray else ""))
    levels = [int(c) for c in args.clients.split(",")]
    if args.seconds * len(levels) > MAX_SECONDS / 2:
        raise SystemExit(f"--seconds x levels must stay under {MAX_SECONDS // 2} s")
    process, url = start_server(args.model, args.max_batch, max(levels) * 2, args.ray, args.sizes)
    try:
        model = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
        voice = args.voice or next((v["id"] for v in httpx.get(f"{url}/v1/audio/voices").json()["data"]), None)
        warm = one_request(httpx.Client(), url, {"model": model, "input": TEXTS[0], "response_format": "pcm",
                                                 **({"voice": voice} if voice else {})})
        assert "ttfb" in warm, warm
        sample_rate = warm["sample_rate"]
        rows = []
        for clients in levels:
            rows.append(summarize(run_level(url, clients, args.seconds, model, voice), sample_rate))
            print(json.dumps(rows[-1]), flush=True)
    finally:
        process.send_signal(signal.SIGTERM)
        status = process.wait(timeout=120)
    from rvqspec.runtime.threads import ThreadBudget

    budget = ThreadBudget.split(cores=1 if args.ray else None)  # a replica has one core (--threads-per-replica 1)
    report = {"model": args.model, "ray": args.ray, "cpu": cpu_name(), "cores": os.cpu_count(),
              "budget": f"{budget.cores} cores: the frame loop {budget.loop} thread(s), {budget.codec} codec workers",
              "max_batch": args.max_batch, "seconds": args.seconds, "sample_rate": sample_rate, "levels": rows,
              "targets": targets(rows), "server_exit_status": status,
              "command": " ".join(["python benchmarks/serve_load.py", *argv])}
    out.parent.mkdir(parents=True, exist_ok=True)
    Path(f"{out}.json").write_text(json.dumps(report, indent=1) + "\n")
    Path(f"{out}.md").write_text(markdown(report))
    print(markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
