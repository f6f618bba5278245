"""One stream on two cores: the Engine (w8a8 talker and predictor, streamed, the policy's tree) on one core, on two
with the frame loop fixed at one thread beside the codec worker, and on two with the frame loop taking both cores
while no chunk waits for the codec (runtime/threads.py); the first also "as before" (the prompt prefilled at the
steps' one thread), the second also with "whole steps" (each step's threads kept from its start to its end, every
decode on one thread: the schedule before `Grant.resize`) and with frames decoded ahead of their chunk's boundary
(`decode_ahead`, runtime/codec_worker.py). Where the first audio's time and the time after the last frame go.

The model is upstream's Qwen3TTSModel at the 0.6B sizes with random weights and the released 12 Hz decoder
(`rvqspec.bench.systems`, bfloat16; the predictor's heads acceptance-controlled to the paper's tokens/step, as
benchmarks/end_to_end.py runs it); EOS is out of reach, so every run decodes `--frames` frames. Per engine: the
real-time factor (wall time over audio time), the first chunk's time, every frame step's time with the thread
count it ran at (a step at 1 thread on two cores ran
beside a decode; at 2, alone), and the decoder's time per frame. Engines run interleaved, one utterance each per
repeat; figures are medians. Run it with OMP_WAIT_POLICY=PASSIVE (an idle OpenMP thread then sleeps at once).

    OMP_WAIT_POLICY=PASSIVE .venv/bin/python benchmarks/two_cores.py [--frames 42] [--repeats 2]
    OMP_WAIT_POLICY=PASSIVE .venv/bin/python benchmarks/two_cores.py --smoke   # tiny sizes: the script runs
    # -> benchmarks/results/two-cores.{json,md}; with --frames N (not 42): two-cores-N-frames.{json,md}
"""

import argparse
import statistics
import sys
import time
from collections import defaultdict
from dataclasses import replace
from pathlib import Path

import torch

import rvqspec
from rvqspec.bench.systems import SIZES, controlled_heads, system_tts, utterance_request
from rvqspec.bench.timing import SMOKE_HELP, finish_machine, machine, machine_text, report_folder, write_reports
from rvqspec.integrations.qwen_tts_audio import StreamingCodec
from rvqspec.runtime.request import Request

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results"
FRAMES = 42  # the issue's utterance: 3.36 s; --frames 125: 10 s, where the start and the tail weigh less
ENGINES = {"1 core": dict(cores=1), "2 cores, loop at 1 thread": dict(cores=2, threads=1),
           "2 cores, loop at 1 thread, as before": dict(cores=2, threads=1),
           "2 cores, loop takes free cores": dict(cores=2),  # as before too: its prefill took both cores already
           "2 cores, loop takes free cores, whole steps": dict(cores=2),
           "2 cores, loop takes free cores, decoding ahead": dict(cores=2, decode_ahead=True)}
BEFORE = "as before"  # an engine named so runs as before issue 51's start and tail: `as_before`
WHOLE_STEPS = "whole steps"  # an engine named so schedules its steps and decodes as before: `whole_steps`
TARGETS = {"1 core": 1.2, "2 cores, loop takes free cores": 0.8, "first_audio_seconds": 0.5}


def build_tts(smoke: bool, log):
    """The system in bfloat16: `SIZES["0.6b"]` with acceptance-controlled heads, or `SIZES["smoke"]` as it is."""
    sizes = SIZES["smoke" if smoke else "0.6b"]
    tts = system_tts(sizes, torch.bfloat16)
    if not smoke:
        controlled_heads(tts, sizes, torch.bfloat16, log)
    return tts


class Recorder:
    """Each frame step's (intra-op threads, start, end), each prefill piece's (threads, start, end), each frame's put
    and each request's end (its last frame drawn), and each decode's (start, end, frames, the decoding thread's CPU
    seconds) of the engines it wraps, on the perf_counter clock (`close` puts what it wrapped back)."""

    def __init__(self):
        self.steps, self.decodes = defaultdict(list), defaultdict(list)
        self.prefills, self.puts, self.ends = defaultdict(list), defaultdict(list), defaultdict(list)
        self.current = None  # the engine whose utterance runs now
        self.originals = [(StreamingCodec, "decode", StreamingCodec.decode), (Request, "put", Request.put),
                          (Request, "finish", Request.finish)]
        decode, put, finish = (original for _, _, original in self.originals)

        def timed_decode(codec, codes):
            start, cpu = time.perf_counter(), time.thread_time()
            out = decode(codec, codes)
            self.decodes[self.current].append((start, time.perf_counter(), len(codes), time.thread_time() - cpu,
                                               torch.get_num_threads()))
            return out

        def timed_put(request, frame):
            put(request, frame)
            self.puts[self.current].append(time.perf_counter())

        def timed_finish(request, *args, **kwargs):
            self.ends[self.current].append(time.perf_counter())
            finish(request, *args, **kwargs)

        StreamingCodec.decode, Request.put, Request.finish = timed_decode, timed_put, timed_finish

    def close(self) -> None:
        for owner, name, original in self.originals:
            setattr(owner, name, original)

    def wrap(self, name: str, engine) -> None:
        scheduler = engine.scheduler
        step, piece = scheduler.frame_step, scheduler.prefill_piece

        def timed_step():
            start, threads = time.perf_counter(), torch.get_num_threads()
            step()
            end = torch.get_num_threads()  # its talker forward's (`Scheduler.frame_step`)
            self.steps[name].append((str(threads) if end == threads else f"{threads}>{end}", start,
                                     time.perf_counter()))

        def timed_piece(tokens):
            start = time.perf_counter()
            piece(tokens)
            self.prefills[name].append((torch.get_num_threads(), start, time.perf_counter()))

        scheduler.frame_step, scheduler.prefill_piece = timed_step, timed_piece

    def events(self, name: str) -> dict:
        return {"steps": self.steps[name], "decodes": self.decodes[name], "prefills": self.prefills[name],
                "puts": self.puts[name], "ends": self.ends[name]}


def as_before(engine) -> None:
    """`engine` as it ran before: the prompt prefilled at the steps' thread count (runtime/threads.py)."""
    engine.scheduler.budget = replace(engine.scheduler.budget, prefill_most=engine.scheduler.budget.loop_most)


def whole_steps(engine) -> None:
    """`engine` scheduled as before `Grant.resize`: a step's threads chosen as it starts (the loop's share where a
    chunk waits, or comes due with the step's frame) and kept to its end."""
    scheduler, codec, step, stepping = engine.scheduler, engine.codec, engine.scheduler.frame_step, [False]

    def due_by_next_frame() -> bool:
        with codec.condition:
            return any(feed.stream is not None and not (feed.busy or feed.ended) and
                       (feed.request.done or feed.clock.due <= len(feed.request.decoded) + 1) for feed in codec.feeds)

    def step_threads() -> int:
        if stepping[0]:
            return scheduler.grant.count  # inside a step: kept
        if due_by_next_frame():
            return scheduler.budget.loop
        return scheduler.budget.loop_most if scheduler.rows or scheduler.parked else scheduler.budget.prefill_most

    def whole_step() -> None:
        stepping[0] = True
        try:
            step()
        finally:
            stepping[0] = False

    scheduler.step_threads, scheduler.frame_step = step_threads, whole_step


def utterance(engine, request: dict) -> dict:
    start, first, samples, rate = time.perf_counter(), None, 0, 1
    for audio, rate in engine.stream_custom_voice(**request, seed=0):
        first = time.perf_counter() - start if first is None else first
        samples += len(audio)
    end = time.perf_counter()
    return {"start": start, "end": end, "seconds": end - start, "first_audio_seconds": first,
            "rtf": (end - start) / (samples / rate)}


def run(args, log) -> dict:
    tts = build_tts(args.smoke, log)
    options = {} if args.smoke else dict(weights="w8a8", talker_weights="w8a8")
    engines = {name: rvqspec.Engine(tts, drafter=rvqspec.ReusedHeads(), tree="auto", seed=0, **options, **ENGINES[name])
               for name in args.engines}
    for name, engine in engines.items():
        if name.endswith(BEFORE):
            as_before(engine)
        if name.endswith(WHOLE_STEPS):
            whole_steps(engine)
    recorder, runs, request = Recorder(), defaultdict(list), utterance_request(args.frames)
    first_chunk = next(iter(engines.values())).chunks[0]
    try:
        for name, engine in engines.items():
            recorder.wrap(name, engine)
        for repeat in range(args.repeats + 1):  # the first: warm-up
            for name in list(engines)[repeat % len(engines):] + list(engines)[:repeat % len(engines)]:
                recorder.current = name
                result = utterance(engines[name], request)
                if repeat:
                    runs[name].append(result)
            log(f"repeat {repeat}/{args.repeats} done")
    finally:
        recorder.close()
        for engine in engines.values():
            engine.close()
    return {name: summary(runs[name], recorder.events(name), first_chunk) for name in engines}


def summary(runs: list[dict], events: dict, first_chunk: int) -> dict:
    steps, decodes = events["steps"], events["decodes"]
    by_threads, beside = defaultdict(list), defaultdict(list)
    for threads, start, end in steps:
        by_threads[threads].append(end - start)
        if threads == "1":
            overlap = sum(max(0.0, min(end, d[1]) - max(start, d[0])) for d in decodes)
            beside["beside a decode" if overlap > (end - start) / 2 else "alone"].append(end - start)
    decoded, wall = sum(d[2] for d in decodes), sum(d[1] - d[0] for d in decodes)
    firsts = [next(d for d in decodes if d[0] >= r["start"]) for r in runs]
    return {"rtf": statistics.median(r["rtf"] for r in runs),
            "first_audio_seconds": statistics.median(r["first_audio_seconds"] for r in runs),
            "first_decode_seconds": [statistics.median(d[0] - r["start"] for d, r in zip(firsts, runs)),
                                     statistics.median(d[1] - r["start"] for d, r in zip(firsts, runs))],
            "first_audio_ms": median_split([first_audio_split(r, events, first_chunk) for r in runs]),
            "tail_ms": median_split([tail_split(r, events) for r in runs]),
            "prefill_threads": sorted({threads for threads, _, _ in events["prefills"]}),
            "step_ms": {str(t): statistics.median(s) * 1e3 for t, s in sorted(by_threads.items())},
            "steps_at": {str(t): len(s) for t, s in sorted(by_threads.items())},
            "step_ms_at_1_thread": {k: statistics.median(v) * 1e3 for k, v in sorted(beside.items())},
            "decoder_ms_per_frame": wall / decoded * 1e3 if decoded else None,
            "decoder_cpu_share": sum(d[3] for d in decodes) / wall if wall else None,
            "decoder_cpu_ms_per_frame": sum(d[3] for d in decodes) / decoded * 1e3 if decoded else None,
            "decoder_calls_per_frame": len(decodes) / decoded if decoded else None,
            "timeline": timeline(runs[-1], steps, decodes), "runs": runs}


def within(run: dict, times: list) -> list:
    """The events of `times` (times, or (threads, start, end) tuples: by their start) inside `run`."""
    return [t for t in times if run["start"] <= (t if isinstance(t, float) else t[1]) <= run["end"]]


def first_audio_split(run: dict, events: dict, first_chunk: int) -> dict:
    """Where the first audio's time went, in ms: the prompt's prefill (request to its last piece's end), its first
    `first_chunk` frames, the wait for a decode, the first chunk's decode(s), and its delivery to the caller."""
    prefill_end = max(end for _, _, end in within(run, events["prefills"]))
    frames_end = sorted(within(run, events["puts"]))[first_chunk - 1]
    first_audio = run["start"] + run["first_audio_seconds"]
    decodes = [d for d in events["decodes"] if run["start"] <= d[0] and d[1] <= first_audio]
    marks = [run["start"], prefill_end, frames_end, max(frames_end, decodes[-1][0]), decodes[-1][1], first_audio]
    return dict(zip(("prefill", "first chunk's frames", "wait for the decode", "decode", "delivery"),
                    ((b - a) * 1e3 for a, b in zip(marks, marks[1:]))))


def tail_split(run: dict, events: dict) -> dict:
    """Where the time after the last frame went, in ms: the request's end (the talker step and draw after the last
    frame), the wait for a decode, the last decode, and the delivery of the last audio and the end."""
    last_put = max(within(run, events["puts"]))
    ended = min(t for t in within(run, events["ends"]) if t >= last_put)
    last = max((d for d in events["decodes"] if run["start"] <= d[0] <= run["end"]), key=lambda d: d[0])
    marks = [last_put, ended, max(ended, last[0]), last[1], run["end"]]
    split = dict(zip(("to the end", "wait for the decode", "last decode", "delivery"),
                     ((b - a) * 1e3 for a, b in zip(marks, marks[1:]))))
    return split | {"frames in the last decode": last[2], "total": (run["end"] - last_put) * 1e3}


def median_split(splits: list[dict]) -> dict:
    return {key: statistics.median(split[key] for split in splits) for key in splits[0]}


def timeline(run: dict, steps: list[tuple], decodes: list[tuple]) -> list[list]:
    """The last utterance's frame steps ["step", threads, start ms, end ms] (threads "2>1": 2 for its c0 and
    predictor, 1 for its talker forward) and decodes ["decode", frames, start ms, end ms, threads], from its
    start."""
    ms = lambda t: round((t - run["start"]) * 1e3, 1)  # noqa: E731
    events = [["step", threads, ms(start), ms(end)] for threads, start, end in steps if start >= run["start"]]
    events += [["decode", frames, ms(start), ms(end), threads] for start, end, frames, _, threads in decodes
               if start >= run["start"]]
    return sorted(events, key=lambda event: event[2])


def markdown(report: dict) -> str:
    lines = ["# One stream on two cores", "", f"{machine_text(report['machine'])}; OMP_WAIT_POLICY="
             f"{report['machine']['omp_wait_policy']}; {report['frames']} frames, medians of {report['repeats']} "
             f"interleaved repeats. `{report['command']}`.", "",
             "| engine | RTF | first audio (s) | first chunk decoded (s) | frame step ms at 1 thread (steps) | "
             "at 2 threads (steps) | at 2, then 1 (steps) | decoder ms/frame | decoder CPU share | decoder CPU "
             "ms/frame (calls/frame) |", "|---|---|---|---|---|---|---|---|---|---|"]
    for name, r in report["engines"].items():
        steps = [f"{r['step_ms'][t]:.0f} ({r['steps_at'][t]})" if t in r["step_ms"] else "-"
                 for t in ("1", "2", "2>1")]
        first = "{:.2f}-{:.2f}".format(*r["first_decode_seconds"])
        lines.append(f"| {name} | {r['rtf']:.2f} | {r['first_audio_seconds']:.2f} | {first} | {steps[0]} | "
                     f"{steps[1]} | {steps[2]} | {r['decoder_ms_per_frame']:.0f} | {r['decoder_cpu_share']:.2f} | "
                     f"{r['decoder_cpu_ms_per_frame']:.0f} ({r['decoder_calls_per_frame']:.2f}) |")
    lines += split_tables(report["engines"])
    lines += ["", "A frame step: the talker's c0, the predictor's c1..c15 (speculative), one talker step; \"2, then "
              "1\": its c0 and predictor on 2 threads, its talker forward on 1 (a chunk came due with its frame, or a "
              "decode started meanwhile: `Scheduler.frame_step`). \"whole steps\": the schedule before that: a step's "
              "threads chosen as it starts (1 where a chunk comes due with its frame) and kept, every decode on one "
              "thread (now a stream's end decodes on both cores once the frame loop is idle). Targets "
              f"(issue 51): RTF <= {TARGETS['1 core']} on 1 core, <= {TARGETS['2 cores, loop takes free cores']} on "
              f"2, first audio <= {TARGETS['first_audio_seconds']} s on 2. First chunk decoded: when its decode "
              "started and ended, from the request. Decoder ms/frame: wall time inside the streaming codec (on 2 "
              "cores it shares the machine with the frame loop); its CPU share: the decoding thread's CPU time over "
              "that wall time (the rest it waited: for the GIL, or for a core); its CPU ms/frame: the decoding "
              "thread's CPU time per frame (frames decoded ahead in pieces cost more per frame than chunks) and its "
              "calls per frame. The JSON holds each engine's last timeline."]
    return "\n".join(lines) + "\n"


def split_tables(engines: dict) -> list[str]:
    """The first audio's and the tail's splits (ms, medians), one row per engine; the frame step at 1 thread beside
    a decode and alone."""
    lines = []
    for title, key in (("First audio", "first_audio_ms"),
                       ("The tail: from the last frame to the last audio", "tail_ms")):
        parts = list(next(iter(engines.values()))[key])
        lines += ["", f"{title} (ms):", "", "| engine | " + " | ".join(parts) + " |", "|---" * (len(parts) + 1) + "|"]
        lines += [f"| {name} | " + " | ".join(f"{r[key][part]:.0f}" for part in parts) + " |"
                  for name, r in engines.items()]
    lines += ["", "Frame step at 1 thread (ms), beside a decode (more than half of it overlapping one) and alone; "
              "prefill threads:", "", "| engine | beside a decode | alone | prefill threads |", "|---|---|---|---|"]
    for name, r in engines.items():
        at = r["step_ms_at_1_thread"]
        lines.append(f"| {name} | {at.get('beside a decode', float('nan')):.1f} | {at.get('alone', float('nan')):.1f} "
                     f"| {', '.join(map(str, r['prefill_threads']))} |")
    return lines


def main(argv: list[str] | None = None) -> None:
    def engines_option(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--engines", nargs="+", choices=list(ENGINES), default=list(ENGINES),
                            help="the engines to run (each holds its own int8 copy of the model: fewer, less memory)")

    run_script("two_cores", "two-cores", "engines", run, markdown, repeats=2, argv=argv, options=engines_option)


def run_script(script: str, report_name: str, key: str, measure, to_markdown, repeats: int, argv: list[str] | None,
               options=lambda parser: None) -> None:
    """A two-cores benchmark's command line (--frames, --repeats, --smoke, --out and `options`), its run (`measure`,
    in inference mode; its result under `key`) and its reports `report_name`.{json,md}."""
    parser = argparse.ArgumentParser(description=sys.modules[measure.__module__].__doc__.splitlines()[0])
    parser.add_argument("--frames", type=int, default=FRAMES, help="frames per utterance (12.5 a second of audio)")
    parser.add_argument("--repeats", type=int, default=repeats)
    options(parser)
    parser.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    if args.smoke:
        args.frames, args.repeats = 4, 1
    log = lambda text: print(f"[{time.strftime('%H:%M:%S')}] {text}", flush=True)  # noqa: E731
    info = machine()
    with torch.inference_mode():
        result = measure(args, log)
    command = [f"OMP_WAIT_POLICY=PASSIVE .venv/bin/python benchmarks/{script}.py",
               *(sys.argv[1:] if argv is None else argv)]
    report = {"machine": finish_machine(info), "frames": args.frames, "repeats": args.repeats, "smoke": args.smoke,
              key: result, "command": " ".join(command)}
    if key == "engines":
        report["targets"] = TARGETS
    if args.frames != FRAMES and not args.smoke:  # another length: a report of its own beside the 42-frame one
        report_name += f"-{args.frames}-frames"
    write_reports(report, report_folder(args.out, args.smoke), report_name, to_markdown)
    print(to_markdown(report))


if __name__ == "__main__":
    main()
