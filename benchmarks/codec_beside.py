"""The 12 Hz decoder beside the frame loop: what slows each down when the two share two cores, the GIL or the machine.

The frame loop is an Engine's (w8a8 talker and predictor, the policy's tree, 0.6B sizes, random weights with the
predictor's heads acceptance-controlled: `benchmarks/two_cores.py`'s system) at one intra-op thread, decoding an
utterance's codes without audio (a request that is not iterated is never decoded). The decoder is the released 12 Hz
decoder streamed (`StreamingCodec`, bfloat16, one intra-op thread) over random codes in the Engine's chunks (3 frames,
then 12), decoding without pause. Four measurements, interleaved per repeat:

- alone: the frame loop's ms per frame, then the decoder's;
- thread: the decoder in a thread of the frame loop's process (as the Engine's codec worker runs it: both threads
  need the GIL between their ops, and for as long as a native call that does not release it runs);
- process: the decoder in a spawned process of its own (no GIL shared; the cores, memory and L3 still are).

Where `process` runs near `alone` and `thread` does not, the GIL is the cause; where both are slow, the machine is.

    OMP_WAIT_POLICY=PASSIVE .venv/bin/python benchmarks/codec_beside.py [--frames 42] [--repeats 3]
    # -> benchmarks/results/codec-beside.{json,md}
"""

import multiprocessing
import statistics
import sys
import threading
import time
from pathlib import Path

import torch
from two_cores import build_tts, run_script

import rvqspec
from rvqspec.bench.systems import SIZES, speech_tokenizer, utterance_request
from rvqspec.bench.timing import machine_text
from rvqspec.integrations.qwen_tts_audio import StreamingCodec
from rvqspec.runtime.threads import GIL_SWITCH_SECONDS

CHUNKS = (3, 12, 12, 12, 3)  # an Engine's chunks of a 42-frame utterance
PARTS = ("wall", "run", "queued", "blocked")


def thread_clock(native_id: int) -> tuple[float, float]:
    """(seconds run on a CPU, seconds waited in the run queue for one) of a thread of this process (Linux schedstat)."""
    run, queued, _ = Path(f"/proc/self/task/{native_id}/schedstat").read_text().split()
    return int(run) / 1e9, int(queued) / 1e9


class Span:
    """One thread's wall, run and run-queue seconds over what it did between `start` and `stop` (summed over calls)."""

    def __init__(self, native_id: int):
        self.native_id, self.frames, self.totals = native_id, 0, [0.0, 0.0, 0.0]

    def start(self) -> None:
        self.begun = (time.perf_counter(), *thread_clock(self.native_id))

    def stop(self, frames: int) -> None:
        now = (time.perf_counter(), *thread_clock(self.native_id))
        self.totals = [total + b - a for total, a, b in zip(self.totals, self.begun, now)]
        self.frames += frames

    def per_frame(self) -> dict:
        """ms per frame: wall; run (on a CPU: memory stalls included); queued (waiting for a core another thread or
        process held); blocked (the rest: waiting for the GIL, for a thread that blocks on nothing else)."""
        wall, run, queued = (total / max(1, self.frames) * 1e3 for total in self.totals)
        return {"wall": wall, "run": run, "queued": queued, "blocked": wall - run - queued}


class Decoding:
    """The decoder over random codes in CHUNKS, pass after pass, until `stop` is set (`passes`: at most that many)."""

    def __init__(self, decoder: torch.nn.Module):
        self.decoder, self.stop = decoder, threading.Event()
        self.codes = torch.randint(0, 2048, (sum(CHUNKS), 16))
        self.span = None

    def run(self, passes: int | None = None) -> None:
        torch.set_num_threads(1)
        self.span = Span(threading.get_native_id())
        with torch.inference_mode():
            while not self.stop.is_set() and (passes is None or passes > 0):
                codec, end = StreamingCodec(self.decoder), 0
                self.span.start()
                for size in CHUNKS:
                    codec.decode(self.codes[end:end + size])
                    end += size
                    if self.stop.is_set():
                        break
                self.span.stop(end)
                passes = None if passes is None else passes - 1


def child(connection, smoke: bool) -> None:
    """The decoder in a process of its own: decodes from "go" to "stop", then sends its times per frame."""
    sys.setswitchinterval(GIL_SWITCH_SECONDS)
    decoding = Decoding(speech_tokenizer(SIZES["smoke" if smoke else "0.6b"], torch.bfloat16).model.decoder)
    decoding.run(passes=1)  # warm-up
    connection.send("ready")
    while connection.recv() == "go":
        decoding.stop.clear()
        waiter = threading.Thread(target=lambda: (connection.recv(), decoding.stop.set()))
        waiter.start()
        decoding.run()
        waiter.join()
        connection.send(decoding.span.per_frame())


def loop_times(engine, request: dict, frames: int) -> dict:
    """The frame loop's times per frame over an utterance (at one thread it does all its work itself)."""
    span = Span(engine.scheduler.thread.native_id)
    span.start()
    engine.submit("custom_voice", **request, seed=0).wait()
    span.stop(frames)
    return span.per_frame()


def beside_thread(engine, decoder, request: dict, frames: int) -> tuple[dict, dict]:
    decoding = Decoding(decoder)
    thread = threading.Thread(target=decoding.run)
    thread.start()
    try:
        loop = loop_times(engine, request, frames)
    finally:
        decoding.stop.set()
        thread.join()
    return loop, decoding.span.per_frame()


def beside_process(engine, connection, request: dict, frames: int) -> tuple[dict, dict]:
    connection.send("go")
    try:
        loop = loop_times(engine, request, frames)
    finally:
        connection.send("stop")
    return loop, connection.recv()


def run(args, log) -> dict:
    tts = build_tts(args.smoke, log)
    options = {} if args.smoke else dict(weights="w8a8", talker_weights="w8a8")
    engine = rvqspec.Engine(tts, drafter=rvqspec.ReusedHeads(), tree="auto", seed=0, cores=1, **options)
    decoder = tts.model.speech_tokenizer.model.decoder
    request = utterance_request(args.frames)
    parent, other = multiprocessing.get_context("spawn").Pipe()
    process = multiprocessing.get_context("spawn").Process(target=child, args=(other, args.smoke), daemon=True)
    process.start()
    results = {key: [] for key in ("loop alone", "decoder alone", "loop beside thread", "decoder in thread",
                                   "loop beside process", "decoder in process")}
    try:
        parent.recv()
        for repeat in range(args.repeats + 1):  # the first: warm-up
            alone = Decoding(decoder)
            measured = {"loop alone": loop_times(engine, request, args.frames)}
            alone.run(passes=2)
            measured["decoder alone"] = alone.span.per_frame()
            measured["loop beside thread"], measured["decoder in thread"] = beside_thread(
                engine, decoder, request, args.frames)
            measured["loop beside process"], measured["decoder in process"] = beside_process(
                engine, parent, request, args.frames)
            log(f"repeat {repeat}: " + ", ".join(f"{k} " + "/".join(f"{t:.0f}" for t in v.values())
                                                 for k, v in measured.items()) + " (wall/run/queued/blocked ms)")
            if repeat:
                for key, value in measured.items():
                    results[key].append(value)
    finally:
        parent.send("end")
        process.join(10)
        engine.close()
    return {key: {part: statistics.median(v[part] for v in values) for part in values[0]} | {"runs": values}
            for key, values in results.items()}


def markdown(report: dict) -> str:
    r = report["results"]
    cells = lambda key: " | ".join(f"{r[key][part]:.1f}" for part in PARTS)  # noqa: E731
    lines = ["# The decoder beside the frame loop: GIL or machine", "",
             f"{machine_text(report['machine'])}; {report['frames']}-frame utterances, medians of "
             f"{report['repeats']} interleaved repeats. `{report['command']}`.", "",
             "| thread | beside | ms/frame: wall | run | queued | blocked |", "|---|---|---|---|---|---|"]
    for thread, key in (("frame loop", "loop"), ("decoder", "decoder")):
        for beside, suffix in (("-", " alone"), ("the decoder in a thread", " beside thread"),
                               ("the decoder in a process", " beside process")):
            name = key + suffix.replace(" beside", " in") if key == "decoder" else key + suffix
            where = beside.replace("the decoder", "the loop, it") if key == "decoder" else beside
            lines.append(f"| {thread} | {where} | {cells(name)} |")
    lines += ["", "Frame loop: an Engine's talker and predictor (w8a8, the policy's tree) at one thread making an "
              "utterance's codes, prefill included, per frame. Decoder: the released 12 Hz decoder streamed in 3- and "
              "12-frame chunks (bfloat16, one thread), decoding without pause while the loop runs. From the kernel's "
              "schedstat per thread: run, on a CPU (memory stalls included: the machine's contention shows here); "
              "queued, ready but waiting for a core (another thread's or process's: on a shared machine, mostly "
              "other processes); blocked, the rest of the wall time: waiting for the GIL (neither thread blocks on "
              "anything else meanwhile)."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    sys.setswitchinterval(GIL_SWITCH_SECONDS)  # as an Engine on two cores sets it
    run_script("codec_beside", "codec-beside", "results", run, markdown, repeats=3, argv=argv)


if __name__ == "__main__":
    main()
