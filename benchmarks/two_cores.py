"""One stream on two cores: the Engine (w8a8 talker and predictor, streamed, the policy's tree) on one core, on two
with the frame loop fixed at one thread beside the codec worker (the split before issue 51), and on two with the
frame loop taking both cores while no chunk waits for the codec (runtime/threads.py).

The model is upstream's Qwen3TTSModel at the 0.6B sizes with random weights (benchmarks/end_to_end.py's
`real_size_tts`, bfloat16) and the released 12 Hz decoder's sizes (benchmarks/decoder_stream.py); EOS is out of
reach, so every run decodes `--frames` frames. Per engine: the real-time factor (wall time over audio time), the
first chunk's time, every frame step's time with the thread count it ran at (a step at 1 thread on two cores ran
beside a decode; at 2, alone), and the decoder's time per frame. Engines run interleaved, one utterance each per
repeat; figures are medians. Run it with OMP_WAIT_POLICY=PASSIVE (an idle OpenMP thread then sleeps at once).

    OMP_WAIT_POLICY=PASSIVE .venv/bin/python benchmarks/two_cores.py [--frames 42] [--repeats 2]
    OMP_WAIT_POLICY=PASSIVE .venv/bin/python benchmarks/two_cores.py --smoke   # tiny sizes: the script runs
    # -> benchmarks/results/two-cores.{json,md}
"""

import argparse
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

import rvqspec  # noqa: E402
from rvqspec.bench.timing import finish_machine, machine, machine_text, write_reports  # noqa: E402
from rvqspec.integrations.qwen_tts_audio import StreamingCodec  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
ENGINES = {"1 core": dict(cores=1), "2 cores, loop at 1 thread": dict(cores=2, threads=1),
           "2 cores, loop takes free cores": dict(cores=2)}
TARGETS = {"1 core": 1.2, "2 cores, loop takes free cores": 0.8, "first_audio_seconds": 0.5}


def build_tts(smoke: bool):
    """The model: the tests' tiny qwen-tts (`--smoke`), or the 0.6B sizes with the released decoder, bfloat16."""
    if smoke:
        from helpers.upstream_tts import tiny_qwen3_tts

        return tiny_qwen3_tts(seed=1)
    from benchmarks.decoder_stream import released_decoder
    from benchmarks.end_to_end import real_size_tts

    tts = real_size_tts(torch.bfloat16)
    tts.model.speech_tokenizer.model.decoder = released_decoder().to(torch.bfloat16)
    return tts


class Recorder:
    """Each frame step's (intra-op threads, seconds) and each decode's (seconds, frames) of the engines it wraps."""

    def __init__(self):
        self.steps, self.decodes = defaultdict(list), defaultdict(list)
        self.current = None  # the engine whose utterance runs now
        decode = StreamingCodec.decode

        def timed_decode(codec, codes):
            start = time.perf_counter()
            out = decode(codec, codes)
            self.decodes[self.current].append((time.perf_counter() - start, len(codes)))
            return out

        StreamingCodec.decode = timed_decode

    def wrap(self, name: str, engine) -> None:
        step = engine.scheduler.frame_step

        def timed_step():
            start = time.perf_counter()
            step()
            self.steps[name].append((torch.get_num_threads(), time.perf_counter() - start))

        engine.scheduler.frame_step = timed_step


def utterance(engine, request: dict) -> dict:
    start, first, samples, rate = time.perf_counter(), None, 0, 1
    for audio, rate in engine.stream_custom_voice(**request, seed=0):
        first = time.perf_counter() - start if first is None else first
        samples += len(audio)
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "first_audio_seconds": first, "rtf": seconds / (samples / rate)}


def run(args, log) -> dict:
    tts = build_tts(args.smoke)
    options = {} if args.smoke else dict(weights="w8a8", talker_weights="w8a8")
    recorder, runs = Recorder(), defaultdict(list)
    engines = {name: rvqspec.Engine(tts, drafter=rvqspec.ReusedHeads(), tree="auto", seed=0, **options, **extra)
               for name, extra in ENGINES.items()}
    request = dict(text="the quick brown fox jumps over the lazy dog, again and again", speaker="tiny",
                   language="english", max_new_tokens=args.frames + 1, eos_token_id=2048 + 1024 - 1)
    if args.smoke:
        request.pop("eos_token_id")
    try:
        for name, engine in engines.items():
            recorder.wrap(name, engine)
        for repeat in range(args.repeats + 1):  # the first: warm-up
            for name in list(engines)[repeat % 3:] + list(engines)[:repeat % 3]:
                recorder.current = name
                result = utterance(engines[name], request)
                if repeat:
                    runs[name].append(result)
            log(f"repeat {repeat}/{args.repeats} done")
    finally:
        for engine in engines.values():
            engine.close()
    return {name: summary(runs[name], recorder.steps[name], recorder.decodes[name]) for name in engines}


def summary(runs: list[dict], steps: list[tuple], decodes: list[tuple]) -> dict:
    by_threads = defaultdict(list)
    for threads, seconds in steps:
        by_threads[threads].append(seconds)
    decoded = sum(frames for _, frames in decodes)
    return {"rtf": statistics.median(r["rtf"] for r in runs),
            "first_audio_seconds": statistics.median(r["first_audio_seconds"] for r in runs),
            "step_ms": {str(t): statistics.median(s) * 1e3 for t, s in sorted(by_threads.items())},
            "steps_at": {str(t): len(s) for t, s in sorted(by_threads.items())},
            "decoder_ms_per_frame": sum(s for s, _ in decodes) / decoded * 1e3 if decoded else None, "runs": runs}


def markdown(report: dict) -> str:
    lines = ["# One stream on two cores", "", f"{machine_text(report['machine'])}; OMP_WAIT_POLICY="
             f"{report['machine']['omp_wait_policy']}; {report['frames']} frames, medians of {report['repeats']} "
             f"interleaved repeats. `{report['command']}`.", "",
             "| engine | RTF | first audio (s) | frame step ms at 1 thread (steps) | at 2 threads (steps) | "
             "decoder ms/frame |", "|---|---|---|---|---|---|"]
    for name, r in report["engines"].items():
        steps = [f"{r['step_ms'][t]:.0f} ({r['steps_at'][t]})" if t in r["step_ms"] else "-" for t in ("1", "2")]
        decoder = "-" if r["decoder_ms_per_frame"] is None else f"{r['decoder_ms_per_frame']:.0f}"
        lines.append(f"| {name} | {r['rtf']:.2f} | {r['first_audio_seconds']:.2f} | {steps[0]} | {steps[1]} | "
                     f"{decoder} |")
    lines += ["", "A frame step: the talker's c0, the predictor's c1..c15 (speculative), one talker step. Targets "
              f"(issue 51): RTF <= {TARGETS['1 core']} on 1 core, <= {TARGETS['2 cores, loop takes free cores']} on "
              f"2, first audio <= {TARGETS['first_audio_seconds']} s on 2. Decoder ms/frame: wall time inside the "
              "streaming codec (on 2 cores it shares the machine with the frame loop)."]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--frames", type=int, default=42)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--smoke", action="store_true", help="the tests' tiny qwen-tts, 8 frames, 1 repeat")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    if args.smoke:
        args.frames, args.repeats = 8, 1
    log = lambda text: print(f"[{time.strftime('%H:%M:%S')}] {text}", flush=True)  # noqa: E731
    info = machine()
    with torch.inference_mode():
        engines = run(args, log)
    report = {"machine": finish_machine(info), "frames": args.frames, "repeats": args.repeats, "smoke": args.smoke,
              "engines": engines, "targets": TARGETS,
              "command": " ".join(["OMP_WAIT_POLICY=PASSIVE .venv/bin/python benchmarks/two_cores.py", *sys.argv[1:]])}
    write_reports(report, args.out, "two-cores" + ("-smoke" if args.smoke else ""), markdown)
    print(markdown(report))


if __name__ == "__main__":
    main()
