"""Chunked prefill (issue 40, item 3) at the 0.6B sizes, bfloat16, one thread: how long a running stream waits between
two frames and between two audio chunks while other requests arrive, with prompts prefilled whole (`prefill_chunk=None`)
and in pieces (`PREFILL_CHUNK`); and what a prefill costs per token and per piece beside one talker step.

The Engine serves upstream's 0.6B-size qwen-tts with random weights (rvqspec.bench.systems, as benchmarks/end_to_end.py),
an AR predictor, streamed in chunks of 12 frames (the first 3). One stream runs alone for `--warm` frames, then
`--arrivals` requests arrive one every `--stagger` seconds, each with a prompt of `--prompt` tokens (a voice clone's
reference-sized prompt: the 0.6B custom_voice prompt's embeddings repeated; timing does not depend on their values) and
a few frames of their own. Gaps are the running stream's: between the ends of two of its frame steps, and between two
of its audio chunks as its consumer thread gets them (vocoding on the same core). Settings interleaved per repeat;
figures are medians over repeats.

    .venv/bin/python benchmarks/prefill_gap.py        # ~5 minutes; writes benchmarks/results/prefill-gap.{json,md}
    .venv/bin/python benchmarks/prefill_gap.py --smoke   # tiny sizes: seconds, a temporary folder
"""

import argparse
import statistics
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

import torch

import rvqspec
from rvqspec.bench.systems import SIZES, system_tts, utterance_request
from rvqspec.bench.timing import (ALL_CPUS, RESULTS, SMOKE_HELP, finish_machine, machine, machine_text, pin,
                                  report_folder, write_reports)
from rvqspec.core import talker as talker_blocks
from rvqspec.core.device_path import median_ms
from rvqspec.runtime.scheduler import PREFILL_CHUNK

CHUNK_FRAMES, FIRST_CHUNK_FRAMES = 12, 3


def prefill_costs(talker, prompt, lengths: list[int], repeats: int) -> dict:
    """ms of one prefill call of each length (a fresh row) and of one talker step of one row after a prompt, timed
    interleaved (`device_path.median_ms`)."""
    embeds = prompt.embeds.repeat(-(-max(lengths) // len(prompt.embeds)), 1)
    cache = talker_blocks.RowCache(talker)
    x, position = embeds[:1], torch.tensor([len(prompt.embeds)])

    def prefill(length: int):
        row = talker_blocks.RowCache(talker)
        talker_blocks.prefill(talker, row, row.add(), embeds[:length], torch.arange(length))

    def one_step():
        talker_blocks.step(talker, cache, x, position)
        cache.lengths[0] -= 1

    with torch.inference_mode():
        talker_blocks.prefill(talker, cache, cache.add(), prompt.embeds, prompt.positions)
        ms = median_ms({"step": one_step} | {n: lambda n=n: prefill(n) for n in lengths}, repeats)
    return {"step_ms": ms.pop("step"), "prefill_ms": {str(n): t for n, t in ms.items()}}


def run(engine, prompt, long_prompt, frames: int, warm: int, arrivals: int, stagger: float) -> dict:
    """One stream of `frames` frames; after its `warm`-th frame, `arrivals` long-prompt requests one every `stagger`
    s. Its frame gaps (before the arrivals; from the first arrival on) and chunk gaps, in seconds."""
    scheduler, step, ends = engine.scheduler, engine.scheduler.frame_step, []
    running = engine.enqueue(replace(prompt, max_new_tokens=frames + 1), 0)

    def timed():
        step()
        if any(row.request is running for row in scheduler.rows) or running.done:
            ends.append(time.perf_counter())

    scheduler.frame_step = timed
    chunks = []
    consumer = threading.Thread(target=lambda: chunks.extend(time.perf_counter() for _ in running), daemon=True)
    consumer.start()
    try:
        while len(running.decoded) < warm and not running.done:  # its frames, as the scheduler decodes them
            time.sleep(0.001)
        first_arrival = time.perf_counter()
        others = []
        for index in range(arrivals):
            time.sleep(max(0.0, first_arrival + index * stagger - time.perf_counter()))
            others.append(engine.enqueue(replace(long_prompt, max_new_tokens=4), index + 1))
        consumer.join(600)
        for request in others:
            request.wait(600)
    finally:
        del scheduler.frame_step
    before = [b - a for a, b in zip(ends, ends[1:]) if b <= first_arrival]
    during = [b - a for a, b in zip(ends, ends[1:]) if b > first_arrival]
    return {"frame_gap_before": statistics.median(before), "frame_gap_max": max(during),
            "chunk_gap_max": max(b - a for a, b in zip(chunks, chunks[1:]))}


SMOKE = ["--frames", "24", "--warm", "4", "--arrivals", "1", "--stagger", "0", "--prompt", "40", "--repeats", "1"]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    parser.add_argument("--frames", type=int, default=40)
    parser.add_argument("--warm", type=int, default=6)
    parser.add_argument("--arrivals", type=int, default=3)
    parser.add_argument("--stagger", type=float, default=1.0)
    parser.add_argument("--prompt", type=int, default=320, help="tokens of each arriving request's prompt")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", type=Path, default=RESULTS)
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    if args.smoke:
        args = parser.parse_args([*SMOKE, *argv])
    info = machine()
    pin(1)
    torch.set_num_threads(1)
    log = lambda text: print(f"[{time.strftime('%H:%M:%S')}] {text}", flush=True)  # noqa: E731
    tts = system_tts(SIZES["smoke" if args.smoke else "0.6b"], torch.bfloat16)
    settings = {"whole": None, "chunked": PREFILL_CHUNK}
    engines = {name: rvqspec.Engine(tts, drafter=None, chunk_frames=CHUNK_FRAMES, first_chunk_frames=FIRST_CHUNK_FRAMES,
                                    prefill_chunk=chunk, seed=0) for name, chunk in settings.items()}
    try:
        request = {k: v for k, v in utterance_request(args.frames).items() if k != "max_new_tokens"}
        prompt = engines["whole"].model.prompts("custom_voice", request)[0]
        copies = -(-args.prompt // len(prompt.embeds))
        long_prompt = replace(prompt, embeds=prompt.embeds.repeat(copies, 1)[:args.prompt],
                              positions=torch.arange(args.prompt))
        costs = prefill_costs(engines["whole"].model.talker, prompt,
                              sorted({1, 16, PREFILL_CHUNK, 2 * PREFILL_CHUNK, args.prompt, len(prompt.embeds)}), 5)
        log(f"costs: {costs}")
        runs = {name: [] for name in settings}
        for repeat in range(args.repeats):
            for name in settings if repeat % 2 == 0 else list(settings)[::-1]:
                result = run(engines[name], prompt, long_prompt, args.frames, args.warm, args.arrivals, args.stagger)
                log(f"{name}: {result}")
                runs[name].append(result)
    finally:
        for engine in engines.values():
            engine.close()
    chunk_seconds = CHUNK_FRAMES * engines["whole"].model.frame_seconds
    table = {name: {key: statistics.median(r[key] for r in results) for key in results[0]}
             for name, results in runs.items()}
    for row in table.values():
        row["frame_gap_max_over_before"] = row["frame_gap_max"] / row["frame_gap_before"]
        row["chunk_gap_max_over_chunk_audio"] = row["chunk_gap_max"] / chunk_seconds
    report = {"settings": settings, "prefill_chunk": PREFILL_CHUNK, "prompt_tokens": args.prompt,
              "custom_voice_prompt_tokens": len(prompt.embeds), "frames": args.frames, "warm": args.warm,
              "arrivals": args.arrivals, "stagger_seconds": args.stagger, "repeats": args.repeats,
              "chunk_audio_seconds": chunk_seconds, "costs": costs, "table": table, "runs": runs,
              "command": " ".join([".venv/bin/python benchmarks/prefill_gap.py", *argv]),
              "machine": finish_machine(info)}
    pin(len(ALL_CPUS))
    for path in write_reports(report, report_folder(args.out, args.smoke), "prefill-gap", to_markdown):
        log(f"wrote {path}")


def to_markdown(report: dict) -> str:
    costs, step = report["costs"], report["costs"]["step_ms"]
    lines = ["# Chunked prefill: a running stream's gaps while requests arrive (0.6B sizes, bfloat16, 1 thread)", "",
             f"Generated by `{report['command']}` on {machine_text(report['machine'])}, CPU class "
             f"{report['machine']['cpu_class']}.", "",
             f"One stream of {report['frames']} frames (AR predictor; chunks of {CHUNK_FRAMES} frames, "
             f"{report['chunk_audio_seconds']:.2f} s of audio, the first {FIRST_CHUNK_FRAMES}); after its "
             f"{report['warm']}th frame, {report['arrivals']} requests arrive one every {report['stagger_seconds']} s, "
             f"each with a {report['prompt_tokens']}-token prompt (a voice clone's reference-sized prompt; a "
             f"custom_voice prompt here is {report['custom_voice_prompt_tokens']} tokens). `whole`: prompts prefilled "
             f"whole (`prefill_chunk=None`); `chunked`: {report['prefill_chunk']} tokens a gap (the default). Medians "
             f"of {report['repeats']} interleaved repeats.", "",
             "| prefill | frame gap before arrivals s | largest frame gap during s | ratio | largest chunk gap s | "
             "over the chunk's audio |", "|---|---|---|---|---|---|"]
    for name, row in report["table"].items():
        lines.append(f"| {name} | {row['frame_gap_before']:.2f} | {row['frame_gap_max']:.2f} | "
                     f"{row['frame_gap_max_over_before']:.2f}x | {row['chunk_gap_max']:.2f} | "
                     f"{row['chunk_gap_max_over_chunk_audio']:.2f}x |")
    lines += ["", f"Prefill cost beside one talker step of one row ({step:.0f} ms; a fresh row, median of 5):", "",
              "| prompt tokens | ms | ms per token | over one step |", "|---|---|---|---|"]
    for tokens, ms in costs["prefill_ms"].items():
        lines.append(f"| {tokens} | {ms:.0f} | {ms / int(tokens):.2f} | {ms / step:.2f}x |")
    lines += ["", "A call costs a fixed part (the layers' weights read once: about one talker step) and a little per "
              "token; a long prompt prefilled whole costs several steps, all in one gap.", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
