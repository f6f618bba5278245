"""Live speech (issue 52): text fed to `rvqspec.Engine` as an LLM writes it, against the same text given whole.

At the 0.6B sizes (rvqspec.bench.systems, random weights, the talker never ends: every request decodes its frames),
bfloat16, 1 and 2 cores: the text arrives in pieces of 1-4 characters at 20, 50 and 200 pieces a second (an LLM's
tokens), or whole; each request streamed as a server streams it. Per setting (medians over the repeats):

- first audio, from the first piece: target <= the whole text's first audio + the time the first word takes to arrive
  (its pieces at that rate); the whole text with upstream's dual-track prompt (`non_streaming_mode=False`, the
  prompt live text runs: the default, the whole text in the prompt, has a longer prefill and other audio);
- the largest gap between two audio chunks once audio started: target <= the whole text's (while the text arrives
  faster than real time: 12.5 frames a second, one text token per frame);
- whether the audio is the whole text's (greedy: the same samples), on every run.

    .venv/bin/python benchmarks/live_speech.py            # ~10 minutes on 2 shared cores
    .venv/bin/python benchmarks/live_speech.py --smoke    # seconds, tiny sizes, a temporary folder
    # writes benchmarks/results/live-speech.{json,md}

The WebSocket against the HTTP route, and sentence mode on the stand-in: benchmarks/live_serve.py.
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

from rvqspec.bench.streams import text_pieces
from rvqspec.bench.systems import SIZES, system_tts, utterance_request
from rvqspec.bench.timing import RESULTS, SMOKE_HELP, machine, report_folder, run_record, write_reports
from rvqspec.runtime import Engine

RATES = (20, 50, 200)  # pieces a second
SMOKE = ["--frames", "6", "--repeats", "1", "--cores", "1", "--rates", "200"]


def first_word_seconds(split: list[str], rate: float) -> float:
    """When the text's first word is complete (a space after it), its pieces arriving at `rate` a second."""
    text = ""
    for index, piece in enumerate(split):
        text += piece
        if " " in text.strip(" ") or text.endswith(" "):
            return index / rate
    return len(split) / rate


def arriving(split: list[str], rate: float, started: list[float]):
    """The pieces at `rate` a second, the first at once; `started` gets the first piece's time."""
    for index, piece in enumerate(split):
        if index == 0:
            started.append(time.perf_counter())
        else:
            time.sleep(max(0.0, started[0] + index / rate - time.perf_counter()))
        yield piece


def streamed(engine, request: dict, text) -> dict:
    """One request's first audio (from `text`'s first piece, or the submit), largest chunk gap, and audio."""
    started = []
    source = arriving(text[0], text[1], started) if isinstance(text, tuple) else text
    submitted = time.perf_counter()
    chunks, times = [], []
    for chunk, _ in engine.stream_custom_voice(**{**request, "text": source}, seed=0):
        chunks.append(chunk)
        times.append(time.perf_counter())
    start = started[0] if started else submitted
    gaps = np.diff(times)
    return {"first": times[0] - start, "gap": float(gaps.max()) if len(gaps) else 0.0,
            "audio": np.concatenate(chunks)}


def measure(tts, cores: int, frames: int, rates: list[int], repeats: int, log) -> list[dict]:
    """Whole and live runs interleaved per repeat; a row per setting."""
    request = {**utterance_request(frames), "do_sample": False, "subtalker_dosample": False,
               "non_streaming_mode": False}  # the whole text with live text's (dual-track) prompt: like with like
    text = request["text"]
    split = text_pieces(text, 0)
    runs = {"whole": []} | {rate: [] for rate in rates}
    with Engine(tts, cores=cores) as engine:
        want = streamed(engine, request, text)["audio"]  # a warm-up run, not counted (first calls, caches)
        for repeat in range(repeats):
            for setting in list(runs)[repeat % len(runs):] + list(runs)[:repeat % len(runs)]:  # rotated order
                result = streamed(engine, request, text if setting == "whole" else (split, setting))
                result["same"] = bool(np.array_equal(result["audio"], want))
                runs[setting].append(result)
                log(f"cores {cores} repeat {repeat} {setting}: first audio {result['first']:.3f} s, largest gap "
                    f"{result['gap']:.3f} s")
    whole_first = statistics.median(r["first"] for r in runs["whole"])
    whole_gap = statistics.median(r["gap"] for r in runs["whole"])
    rows = [{"cores": cores, "setting": "whole", "first_audio": whole_first, "largest_gap": whole_gap}]
    for rate in rates:
        word = first_word_seconds(split, rate)
        first = statistics.median(r["first"] for r in runs[rate])
        gap = statistics.median(r["gap"] for r in runs[rate])
        rows.append({"cores": cores, "setting": f"{rate} pieces/s", "first_audio": first, "largest_gap": gap,
                     "first_word_arrives": word, "first_audio_target": whole_first + word,
                     "first_audio_met": first <= whole_first + word, "gap_met": gap <= whole_gap,
                     "same_audio": all(r["same"] for r in runs[rate])})
    return rows


def markdown(report: dict) -> str:
    lines = [f"# Live speech: text as an LLM writes it, against the whole text ({report['cpu']}, "
             f"{report['native']})", "",
             f"{report['sizes']} sizes, {report['frames']} frames, bfloat16, median of {report['repeats']} "
             f"interleaved runs (after one warm-up run), in rotated order; the text in pieces of 1-4 characters. {report['machine_text']}", "",
             f"Command: `{report['command']}`", "",
             "| cores | text | first audio (s) | target (s) | met | largest chunk gap (s) | gap <= whole's | "
             "same audio |", "|---|---|---|---|---|---|---|---|"]
    for row in report["rows"]:
        target = f"{row['first_audio_target']:.3f}" if "first_audio_target" in row else "-"
        met = ("yes" if row["first_audio_met"] else "no") if "first_audio_met" in row else "-"
        gap_met = ("yes" if row["gap_met"] else "no") if "gap_met" in row else "-"
        same = ("yes" if row["same_audio"] else "no") if "same_audio" in row else "-"
        lines.append(f"| {row['cores']} | {row['setting']} | {row['first_audio']:.3f} | {target} | {met} | "
                     f"{row['largest_gap']:.3f} | {gap_met} | {same} |")
    lines += ["", "Target: first audio from the first piece <= the whole text's first audio + the time its first word "
              "takes to arrive; no chunk gap larger than the whole text's. The whole text runs upstream's dual-track "
              "prompt (`non_streaming_mode=False`), as live text does. Same audio: every live run's samples equal "
              "the whole text's (greedy). A shared machine: compare within this run."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    parser.add_argument("--cores", default="1,2")
    parser.add_argument("--rates", default=",".join(map(str, RATES)), help="pieces a second")
    parser.add_argument("--frames", type=int, default=60)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    if args.smoke:
        args = parser.parse_args([*SMOKE, *(sys.argv[1:] if argv is None else argv)])
    log = lambda text: print(f"[{time.strftime('%H:%M:%S')}] {text}", flush=True)  # noqa: E731
    sizes = "smoke" if args.smoke else "0.6b"
    info = machine()
    tts = system_tts(SIZES[sizes], torch.bfloat16)
    rows = []
    for cores in [int(c) for c in args.cores.split(",")]:
        rows += measure(tts, cores, args.frames, [int(r) for r in args.rates.split(",")], args.repeats, log)
    report = {"sizes": sizes, "frames": args.frames, "repeats": args.repeats, "rows": rows,
              **run_record("live_speech.py", sys.argv[1:] if argv is None else argv, info)}
    write_reports(report, report_folder(args.out, args.smoke), "live-speech", markdown)
    print(markdown(report))


if __name__ == "__main__":
    main()
