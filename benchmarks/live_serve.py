"""Live speech through the server (issue 52): the WebSocket at /v1/audio/speech/stream against the HTTP route, and
sentence mode's first audio and its joins between sentences.

`rvqspec serve`'s app runs in this process on a loopback port (uvicorn in a thread, the client's asyncio loop in the
main thread: both routes share that cost alike), serving the shipped stand-in (`rvqspec serve`'s default, sentence
mode) and a tiny random-weight qwen-tts CustomVoice (rvqspec.bench.upstream, token mode), seeded requests:

1. Routes: the same text, voice and seed sent whole over the WebSocket (session.config, one input.text, input.done)
   and over POST /v1/audio/speech (streamed pcm, as the session speaks it: the stand-in's with `sentences`, a
   token-mode model's with `non_streaming_mode: false`, upstream's dual-track prompt), in
   interleaved repeats (the order rotated) after a warm-up of each: each route's median first audio (from sending
   the request, or the session.config, to the first audio bytes; the WebSocket's handshake before it, the HTTP
   connection kept alive), their ratio (target: within 10%), and the largest difference between their samples (in
   16-bit steps: 0 is the same audio).
2. Sentence mode (the stand-in): several sentences fed over the WebSocket in pieces of 1-4 characters at 50 pieces a
   second (an LLM's tokens): the first audio from the first piece against the moment the first sentence was complete
   (the piece after which the server's splitter, `runtime/sentences.py`, decides its end), and at each join between
   two sentences the wait between their audio chunks against one chunk's duration (target: no longer), with the
   stall a player starting at the first audio would hear. Its audio is checked against the whole text spoken
   sentence by sentence (`engine.speech(text, sentences=True)`, the same seed).

Run after run, the stand-in's codes are the same bits while its waveform may differ by a 16-bit step here and there:
its codec decodes the same frames in chunks of other sizes (the engine merges the frames that are ready: timing).

    .venv/bin/python benchmarks/live_serve.py            # a few minutes on 2 shared cores
    .venv/bin/python benchmarks/live_serve.py --smoke    # seconds, short texts, a temporary folder
    # writes benchmarks/results/live-serve.{json,md}
"""

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import numpy as np
import torch
from websockets.asyncio.client import connect

from rvqspec.bench.streams import text_pieces
from rvqspec.bench.timing import RESULTS, SMOKE_HELP, machine, report_folder, run_record, write_reports
from rvqspec.bench.upstream import tiny_qwen3_tts
from rvqspec.runtime import Engine
from rvqspec.runtime.sentences import SentenceSplitter
from rvqspec.serve.app import create_app
from rvqspec.serve.audio import pcm_bytes
from rvqspec.serve.server import in_thread
from rvqspec.serve.voices import VoiceStore

SENTENCES = ["Hello there, how are you today?", "The sea is calm tonight.", "A small boat drifts past the harbour "
             "wall.", "We will be home before the rain comes."]
SMOKE_SENTENCES = ["Hi there.", "Good day."]
SEED, RATE, TOLERANCE = 7, 50.0, 0.10  # pieces a second; the routes' first audio within 10%
MODELS = {"standin": dict(voice="en"), "tiny-qwen": dict(voice="tiny", language="English")}
SMOKE = ["--repeats", "1"]


def build_engine(model: str) -> Engine:
    """The stand-in (`rvqspec serve`'s default), or a tiny random-weight qwen-tts CustomVoice (token mode)."""
    if model == "standin":
        return Engine("standin")
    return Engine(tiny_qwen3_tts(seed=1), drafter=None)


@contextmanager
def served(engine) -> Iterator[str]:
    """host:port of `rvqspec serve`'s app for `engine` on loopback, in a thread of this process."""
    with tempfile.TemporaryDirectory(prefix="rvqspec-voices-") as voices, \
            in_thread(create_app(engine, VoiceStore(voices))) as port:
        yield f"127.0.0.1:{port}"


# ---------------------------------------------------------------- one request over each route

async def audio_frames(websocket, started: float) -> dict:
    """The session's binary frames until the server closes: first audio (from `started`), arrival times, audio."""
    times, data = [], []
    async for frame in websocket:
        if isinstance(frame, bytes):
            times.append(time.perf_counter())
            data.append(frame)
        elif json.loads(frame)["type"] == "error":
            raise SystemExit(f"the WebSocket session failed: {frame}")
    return {"first": times[0] - started, "times": times, "sizes": [len(d) // 2 for d in data],
            "audio": b"".join(data)}


async def over_websocket(address: str, config: dict, text: str) -> dict:
    async with connect(f"ws://{address}/v1/audio/speech/stream") as websocket:
        started = time.perf_counter()
        await websocket.send(json.dumps(config))
        await websocket.send(json.dumps({"type": "input.text", "text": text}))
        await websocket.send(json.dumps({"type": "input.done"}))
        return await audio_frames(websocket, started)


async def over_http(client, address: str, body: dict) -> dict:
    started, first, data = time.perf_counter(), None, []
    async with client.stream("POST", f"http://{address}/v1/audio/speech", json=body) as response:
        if response.status_code != 200:
            raise SystemExit(f"POST /v1/audio/speech answered {response.status_code}: {(await response.aread())[:300]}")
        async for piece in response.aiter_raw():
            if piece and first is None:
                first = time.perf_counter()
            data.append(piece)
    return {"first": first - started, "audio": b"".join(data)}


def requests_of(engine, model: str, text: str) -> tuple[dict, dict]:
    """(the session.config, the HTTP body) of the same text, voice and seed."""
    config = {"type": "session.config", "model": engine.name, "response_format": "pcm", "seed": SEED,
              **MODELS[model]}
    body = {"model": engine.name, "input": text, "response_format": "pcm", "seed": SEED, **MODELS[model],
            **as_session(engine)}
    return config, body


def as_session(engine) -> dict:
    """The HTTP route's fields that speak the text as a session does: the stand-in sentence by sentence, a token-mode
    model with upstream's dual-track prompt (its default for custom voice is the whole-text prompt)."""
    return {"sentences": True} if engine.text_mode == "sentence" else {"non_streaming_mode": False}


def engine_pcm(engine, model: str, text: str, live: bool) -> bytes:
    """The engine's own audio for the text, seed and voice: `live` as text that arrives over time (what a session
    speaks), else whole (what the HTTP route speaks)."""
    return pcm_bytes(engine.speech(iter([text]) if live else text, seed=SEED, **({} if live else as_session(engine)),
                                   **MODELS[model]).audio())


async def routes(engine, model: str, address: str, text: str, repeats: int, log) -> dict:
    """Warm-up, then `repeats` interleaved pairs (the order rotated): each route's median first audio, the ratio;
    each run's audio against the engine's own for its route."""
    config, body = requests_of(engine, model, text)
    want = {"websocket": engine_pcm(engine, model, text, live=True), "http": engine_pcm(engine, model, text, False)}
    runs = {"websocket": [], "http": []}
    async with httpx.AsyncClient(timeout=120) as client:
        run = {"websocket": lambda: over_websocket(address, config, text),
               "http": lambda: over_http(client, address, body)}
        for route in run:  # warm-up
            await run[route]()
        for repeat in range(repeats):
            for route in (["websocket", "http"] if repeat % 2 == 0 else ["http", "websocket"]):
                result = await run[route]()
                result["steps"] = steps(result["audio"], want[route])
                runs[route].append(result)
                log(f"{model} repeat {repeat} {route}: first audio {result['first']:.3f} s")
    return route_row(engine, model, text, runs, want)


def route_row(engine, model: str, text: str, runs: dict, want: dict) -> dict:
    firsts = {route: [r["first"] for r in results] for route, results in runs.items()}
    ws, http = (statistics.median(firsts[route]) for route in ("websocket", "http"))
    own = {route: worst(r["steps"] for r in results) for route, results in runs.items()}
    across = worst(steps(w["audio"], h["audio"]) for w, h in zip(runs["websocket"], runs["http"]))
    return {"model": model, "mode": engine.text_mode, "text": text,
            "audio_seconds": len(want["http"]) / 2 / engine.sample_rate,
            "websocket_first_audio": ws, "http_first_audio": http, "ratio": ws / http,
            "within_tolerance": abs(ws / http - 1) <= TOLERANCE, "first_audio_runs": firsts,
            "websocket_vs_engine_live": own["websocket"], "http_vs_engine_whole": own["http"],
            "websocket_vs_http": across}


def steps(a: bytes, b: bytes) -> int | None:
    """The largest difference between two 16-bit pcm streams' samples, in steps; None if their lengths differ."""
    if len(a) != len(b):
        return None
    return int(np.abs(np.frombuffer(a, "<i2").astype(np.int32) - np.frombuffer(b, "<i2")).max(initial=0))


def worst(differences) -> int | None:
    differences = list(differences)
    return None if None in differences else max(differences, default=0)


def steps_text(difference: int | None) -> str:
    if difference is None:
        return "other lengths"
    return "0 (the same)" if difference == 0 else f"{difference} step" + ("s" if difference > 1 else "")


# ---------------------------------------------------------------- sentence mode: text fed as an LLM writes it

async def feed(websocket, split: list[str], sent: list[float]) -> None:
    """The pieces at RATE a second from now, then input.done; `sent` gets each message's time."""
    start = time.perf_counter()
    for index, piece in enumerate(split + [None]):
        await asyncio.sleep(max(0.0, start + index / RATE - time.perf_counter()))
        message = {"type": "input.done"} if piece is None else {"type": "input.text", "text": piece}
        sent.append(time.perf_counter())
        await websocket.send(json.dumps(message))


async def fed_session(address: str, config: dict, split: list[str]) -> dict:
    """One session fed `split`: the arrival of each audio frame and the send time of each piece (and input.done)."""
    sent: list[float] = []
    async with connect(f"ws://{address}/v1/audio/speech/stream") as websocket:
        await websocket.send(json.dumps(config))
        feeder = asyncio.create_task(feed(websocket, split, sent))
        result = await audio_frames(websocket, 0.0)
        await feeder
    return result | {"sent": sent}


def sentence_ends(split: list[str], sent: list[float]) -> list[float]:
    """When each sentence was complete: the send time of the piece (or input.done) after which the server's splitter
    gives it out."""
    splitter, ends = SentenceSplitter(), []
    for piece, at in zip(split, sent):
        ends += [at] * len(splitter.feed(piece))
    return ends + [sent[-1]] * len(splitter.end())


def reference(engine, text: str) -> tuple[bytes, list[int], int]:
    """The whole text spoken sentence by sentence (the same seed): its pcm, each sentence's frames, samples a
    frame."""
    passage = engine.speech(text, voice=MODELS["standin"]["voice"], seed=SEED, sentences=True)
    audio = passage.audio()
    frames = [len(request.decoded) for request in passage.requests]
    per_frame = len(audio) // sum(frames)
    if per_frame * sum(frames) != len(audio):
        raise SystemExit(f"{len(audio)} samples are not {sum(frames)} frames of one size: cannot place the joins")
    return pcm_bytes(audio), frames, per_frame


def stall(times: list[float], sizes: list[int], sample_rate: int) -> float:
    """Seconds a player starting at the first chunk, playing each as it comes, waits for audio in all."""
    played_until, waited = times[0], 0.0
    for at, size in zip(times, sizes):
        waited += max(0.0, at - played_until)
        played_until = max(played_until, at) + size / sample_rate
    return waited


def sentence_run(result: dict, split: list[str], lengths: list[int], sample_rate: int) -> dict:
    """One fed session's figures, in seconds from its first piece."""
    start, times, sizes = result["sent"][0], result["times"], result["sizes"]
    starts = np.cumsum([0, *sizes[:-1]])
    joins = [int(np.searchsorted(starts, at)) for at in np.cumsum(lengths[:-1])]
    if any(j >= len(starts) or starts[j] != at for j, at in zip(joins, np.cumsum(lengths[:-1]))):
        raise SystemExit("a sentence's audio does not start a chunk: the joins cannot be placed")
    gaps = np.diff(times)
    inside = np.delete(gaps, [j - 1 for j in joins])
    return {"first_audio": times[0] - start, "first_sentence_complete": sentence_ends(split, result["sent"])[0] - start,
            "text_complete": result["sent"][-1] - start, "join_gaps": [float(gaps[j - 1]) for j in joins],
            "largest_gap_inside": float(inside.max()) if len(inside) else 0.0,
            "player_stall": stall(times, sizes, sample_rate)}


def sentence_mode(engine, address: str, text: str, repeats: int, log) -> dict:
    """The stand-in fed `text` in pieces, `repeats` sessions: the figures of each, the audio checked."""
    want, frames, per_frame = reference(engine, text)
    lengths = [n * per_frame for n in frames]
    config, _ = requests_of(engine, "standin", text)
    runs = []
    for repeat in range(repeats):
        split = text_pieces(text, repeat)
        result = asyncio.run(fed_session(address, config, split))
        run = sentence_run(result, split, lengths, engine.sample_rate) | {"steps": steps(result["audio"], want)}
        runs.append(run)
        log(f"sentence mode repeat {repeat}: first audio {run['first_audio']:.3f} s (first sentence complete at "
            f"{run['first_sentence_complete']:.3f} s), join gaps {[round(g, 3) for g in run['join_gaps']]} s")
    return {"text": text, "sentence_frames": frames, "rate": RATE, "runs": runs,
            "chunk_seconds": engine.chunks[1] * per_frame / engine.sample_rate,
            "first_chunk_seconds": engine.chunks[0] * per_frame / engine.sample_rate}


def sentence_summary(mode: dict, whole_first_audio: float) -> dict:
    """Medians over the runs; the targets: first audio <= the first sentence's completion + the whole text's first
    audio over the WebSocket (within TOLERANCE), and no join gap over one chunk's duration."""
    runs = mode["runs"]
    after = statistics.median(r["first_audio"] - r["first_sentence_complete"] for r in runs)
    largest_join = max(max(r["join_gaps"], default=0.0) for r in runs)
    return {"first_audio": statistics.median(r["first_audio"] for r in runs),
            "first_sentence_complete": statistics.median(r["first_sentence_complete"] for r in runs),
            "first_audio_after_sentence": after, "whole_text_first_audio": whole_first_audio,
            "first_audio_met": after <= whole_first_audio * (1 + TOLERANCE),
            "largest_join_gap": largest_join, "join_gap_met": largest_join <= mode["chunk_seconds"],
            "largest_gap_inside": max(r["largest_gap_inside"] for r in runs),
            "player_stall": statistics.median(r["player_stall"] for r in runs),
            "steps": worst(r["steps"] for r in runs)}


# ---------------------------------------------------------------- the report

def markdown(report: dict) -> str:
    lines = [f"# Live speech through the server: the WebSocket against HTTP, sentence mode ({report['cpu']}, "
             f"{report['native']})", "",
             f"`rvqspec serve`'s app in this process on 127.0.0.1, seed {SEED}, {report['threads']} torch threads; "
             f"{report['machine_text']}.", "", f"Command: `{report['command']}`", "",
             "## The WebSocket against POST /v1/audio/speech (the same text, voice and seed, pcm)", "",
             f"Median first audio over {report['repeats']} interleaved repeats (the order rotated, after a warm-up "
             "of each): from sending the request (HTTP, on a kept-alive connection) or the session.config (the "
             "WebSocket, its handshake done; the whole text in one input.text, then input.done) to the first audio "
             f"bytes. Target: the ratio within {TOLERANCE:.0%}; the same samples. Audio: the largest difference "
             "between the samples, in 16-bit steps, of the two routes (each repeat's pair), and of each route against "
             "the engine's own audio for it: the text given as arriving over time (the WebSocket's), or whole (the "
             "HTTP route's).", "",
             "| model | mode | audio (s) | WebSocket first audio (s) | HTTP first audio (s) | ratio | within 10% | "
             "WebSocket vs HTTP | WebSocket vs engine, live text | HTTP vs engine, whole text |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for row in report["routes"]:
        lines.append(f"| {row['model']} | {row['mode']} | {row['audio_seconds']:.2f} | "
                     f"{row['websocket_first_audio']:.3f} | {row['http_first_audio']:.3f} | {row['ratio']:.2f} | "
                     f"{yes(row['within_tolerance'])} | {steps_text(row['websocket_vs_http'])} | "
                     f"{steps_text(row['websocket_vs_engine_live'])} | {steps_text(row['http_vs_engine_whole'])} |")
    if any(row["mode"] == "token" for row in report["routes"]):
        lines += ["", "A token-mode model's HTTP request asks for upstream's dual-track prompt "
                  "(`\"non_streaming_mode\": false`), the prompt the WebSocket runs with the text taken a token a "
                  "frame as it arrives (without the field, custom voice's default is the whole-text prompt: other "
                  "audio)."]
    if any(row["model"] == "standin" for row in report["routes"]):
        lines += ["", "A difference of a 16-bit step or so on the stand-in: run after run in one process, the same "
                  "request's codes are the same bits while its waveform may differ by about 5e-6, its codec decoding "
                  "the same frames in chunks of other sizes (the engine merges the frames that are ready when the "
                  "codec is free, which depends on timing)."]
    if report["sentence_mode"]:
        lines += sentence_lines(report)
    return "\n".join(lines + ["", "A shared machine: compare within this run."]) + "\n"


def sentence_lines(report: dict) -> list[str]:
    mode, s = report["sentence_mode"], report["sentence_summary"]
    runs = mode["runs"]
    return ["", "## Sentence mode (the stand-in): text fed as an LLM writes it", "",
            f"{len(mode['sentence_frames'])} sentences ({sum(mode['sentence_frames'])} frames, "
            f"{mode['sentence_frames']} each) fed over the WebSocket in pieces of 1-4 characters at {mode['rate']:g} "
            f"pieces a second, {len(runs)} sessions (medians; gaps: the largest over all). All the text was sent "
            f"{statistics.median(r['text_complete'] for r in runs):.2f} s after the first piece.", "",
            "| figure | value | target | met |", "|---|---|---|---|",
            f"| first audio, from the first piece | {s['first_audio']:.3f} s | - | - |",
            f"| the first sentence complete (its end decided) | {s['first_sentence_complete']:.3f} s | - | - |",
            f"| first audio after the first sentence completed | {s['first_audio_after_sentence']:.3f} s | <= the "
            f"whole text's first audio over the WebSocket, {s['whole_text_first_audio']:.3f} s (+10%) | "
            f"{yes(s['first_audio_met'])} |",
            f"| largest wait between chunks at a sentence join | {s['largest_join_gap']:.3f} s | <= one chunk, "
            f"{mode['chunk_seconds']:.2f} s (the first chunk of a sentence: {mode['first_chunk_seconds']:.2f} s) | "
            f"{yes(s['join_gap_met'])} |",
            f"| largest wait between chunks inside a sentence | {s['largest_gap_inside']:.3f} s | - | - |",
            f"| a player starting at the first audio waits in all | {s['player_stall']:.3f} s | - | - |",
            f"| largest difference from the whole text spoken sentence by sentence | {steps_text(s['steps'])} | "
            f"0 | {yes(s['steps'] == 0)} |", "",
            "Join gaps per session (s): " + "; ".join(", ".join(f"{g:.3f}" for g in r["join_gaps"]) for r in runs)
            + "."]


def yes(flag: bool) -> str:
    return "yes" if flag else "no"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    parser.add_argument("--models", default=",".join(MODELS), help="of " + ", ".join(MODELS))
    parser.add_argument("--repeats", type=int, default=5, help="interleaved pairs of the routes")
    parser.add_argument("--sessions", type=int, default=3, help="sentence mode's fed sessions")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    if args.smoke:
        args = parser.parse_args([*SMOKE, "--sessions", "1", *(sys.argv[1:] if argv is None else argv)])
    log = lambda text: print(f"[{time.strftime('%H:%M:%S')}] {text}", flush=True)  # noqa: E731
    sentences = SMOKE_SENTENCES if args.smoke else SENTENCES
    info, rows, mode = machine(), [], None
    for model in args.models.split(","):
        with build_engine(model) as engine, served(engine) as address:
            rows.append(asyncio.run(routes(engine, model, address, " ".join(sentences[:2]), args.repeats, log)))
            if model == "standin":
                mode = sentence_mode(engine, address, " ".join(sentences), args.sessions, log)
                whole = rows[-1]["websocket_first_audio"]
    report = {"threads": torch.get_num_threads(), "repeats": args.repeats, "routes": rows, "sentence_mode": mode,
              "sentence_summary": sentence_summary(mode, whole) if mode else None,
              **run_record("live_serve.py", sys.argv[1:] if argv is None else argv, info)}
    write_reports(report, report_folder(args.out, args.smoke), "live-serve", markdown)
    print(markdown(report))


if __name__ == "__main__":
    main()
