"""The 12 Hz speech decoder streamed against a whole-utterance decode: ms per frame by chunk size and dtype, where
the stream loses (per part of the decoder), and how far each dtype's audio is from the float32 whole decode.

The decoder is upstream's `Qwen3TTSTokenizerV2Decoder` at the released 12 Hz tokenizer's sizes
(`rvqspec.bench.systems.RELEASED_DECODER`: a transformer 512 wide, FFN 1024, 16 heads of 64, latent 1024; the
convolution stack from 1536 channels down; random weights made audible as the tests make them: timing does not
depend on weight values). "whole" is upstream's own decode of the
utterance (`chunked_decode`: one pass up to 300 frames); "stream N" is `StreamingCodec` fed N frames a call, as the
Engine's codec workers feed it (their default chunks: 3 frames first, then 12). Runs are interleaved (every way once
per repeat, the order turned each repeat) and figures are medians of the calling thread's CPU time (at one thread
the decoder runs in it; on a shared machine CPU time is what other processes disturb least: wall times are in the
JSON), so ratios within one run hold on a shared machine; lone times do not. "stream N, oneDNN convs" is the
stream with its kernel > 1 convolutions through torch's own (`qwen_tts_audio.GEMM_STEPS` = 0: the stream before
short chunks became matrix products); "stream N, upstream SnakeBeta" with upstream's activation module instead of the
fused kernel (`fused.enabled(False)`).

Where the stream loses: one extra pass per way with forward hooks on the decoder's layers (and timers around the
stream's own convolutions and activation, `convolve`, `convolve_transposed` and `snake`), the CPU time inside its
transformer, its convolutions (a residual unit's pointwise one with its residual add, `convolve_onto`), its transposed
convolutions, its SnakeBeta activations and the ConvNeXt blocks' linear layers (`product` outside a convolution);
"other" is the rest (codebook lookups, residual adds, copies, the Python around them).

    .venv/bin/python benchmarks/decoder_stream.py                 # 48 frames, chunks 1,3,12,24, float32 and bfloat16
    .venv/bin/python benchmarks/decoder_stream.py --smoke         # tiny sizes: the script runs (seconds)
    # writes benchmarks/results/decoder-stream.{json,md}
"""

import argparse
import math
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

from rvqspec.bench.systems import SIZES, speech_tokenizer
from rvqspec.bench.timing import SMOKE_HELP, finish_machine, machine, machine_text, report_folder, write_reports
from rvqspec.bench.upstream import make_audible
from rvqspec.core import fused
from rvqspec.integrations import qwen_tts_audio
from rvqspec.integrations.qwen_tts_audio import StreamingCodec

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results"
TARGETS = {"streamed_over_whole": 1.1, "ms_per_frame": 30.0}


def audible_decoder(size: str):
    """Upstream's 12 Hz decoder at `SIZES[size]`'s decoder sizes, float32, audible random weights."""
    decoder = speech_tokenizer(SIZES[size], torch.float32).model.decoder.requires_grad_(False)
    with torch.inference_mode():
        make_audible(decoder)
    return decoder


Way = tuple[int | None, bool, bool]  # (chunk frames or None: whole, short convolutions as products, fused kernels)
WHOLE: Way = (None, False, False)


def decode(decoder, codes: torch.Tensor, way: Way) -> torch.Tensor:
    """[frames, 16] codes -> audio: upstream's whole decode (chunk None) or streamed `chunk` frames a call, short
    convolutions as matrix products (`gemm`) or not, SnakeBeta fused (`fused`) or upstream's."""
    chunk, gemm, fused_on = way
    if chunk is None:
        return decoder.chunked_decode(codes.T[None]).reshape(-1)
    codec, saved = StreamingCodec(decoder), qwen_tts_audio.GEMM_STEPS
    qwen_tts_audio.GEMM_STEPS = saved if gemm else 0
    try:
        with fused.enabled(fused_on):
            return torch.cat([codec.decode(codes[start:start + chunk]) for start in range(0, len(codes), chunk)])
    finally:
        qwen_tts_audio.GEMM_STEPS = saved


def all_ways(chunks: list[int]) -> list[Way]:
    """Whole; each chunk size streamed as shipped, with torch's convolutions, and with upstream's SnakeBeta."""
    variants = ((True, True), (False, True), (True, False))
    return [WHOLE] + [(chunk, gemm, fused_on) for chunk in chunks for gemm, fused_on in variants]


def timed_ways(decoders: dict, codes: torch.Tensor, chunks: list[int], repeats: int, log) -> dict:
    """{(dtype, way): [seconds per repeat]}, every way once per repeat in a turning order (after one warm-up)."""
    ways = [(dtype, way) for dtype in decoders for way in all_ways(chunks)]
    times = defaultdict(list)
    for repeat in range(repeats + 1):
        turn = repeat % len(ways)
        for dtype, way in ways[turn:] + ways[:turn]:
            start, cpu = time.perf_counter(), time.thread_time()
            decode(decoders[dtype], codes, way)
            if repeat:
                times[dtype, way].append((time.thread_time() - cpu, time.perf_counter() - start))
        log(f"repeat {repeat}/{repeats} done")
    return times


def part_of(module: torch.nn.Module) -> str | None:
    """The part of the decoder a layer's time counts to (None: counted by the layer around it, or by "other")."""
    name = type(module).__name__
    if name == "Qwen3TTSTokenizerV2DecoderTransformerModel":
        return "transformer"
    if isinstance(module, torch.nn.ConvTranspose1d):
        return "transposed conv"
    if isinstance(module, torch.nn.Conv1d):
        return "conv"
    if isinstance(module, torch.nn.Linear) and "pwconv" in getattr(module, "_rvqspec_name", ""):
        return "ConvNeXt linear"
    if name == "SnakeBeta":
        return "SnakeBeta"
    return None


def part_times(decoder, codes: torch.Tensor, way: Way) -> dict:
    """CPU seconds inside each part of the decoder during one decode (hooks on its layers, timers around the stream's
    convolutions and products: whatever runs inside a timed part counts to it once), and "other"."""
    spent, started, hooks, inside = defaultdict(float), {}, [], []

    def add(part: str, since: float) -> None:
        if not inside:
            spent[part] += time.thread_time() - since

    def enter(module) -> None:  # a hooked layer: what runs inside it (the transformer's products) counts to it
        started[module] = time.thread_time()
        inside.append(module)

    def leave(module, part: str) -> None:
        inside.pop()
        add(part, started[module])

    for name, module in decoder.named_modules():
        module._rvqspec_name = name
        part = part_of(module)
        if part is not None:
            hooks.append(module.register_forward_pre_hook(lambda m, a: enter(m)))
            hooks.append(module.register_forward_hook(lambda m, a, o, part=part: leave(m, part)))
    originals = {name: getattr(qwen_tts_audio, name) for name in ("convolve", "convolve_onto", "convolve_transposed",
                                                                 "snake", "product")}

    def timed(name: str, part: str):
        def call(*args):
            since = time.thread_time()
            inside.append(name)
            try:
                return originals[name](*args)
            finally:
                inside.pop()
                add(part, since)
        return call

    qwen_tts_audio.convolve, qwen_tts_audio.convolve_transposed = timed("convolve", "conv"), timed(
        "convolve_transposed", "transposed conv")
    qwen_tts_audio.convolve_onto = timed("convolve_onto", "conv")
    qwen_tts_audio.product = timed("product", "ConvNeXt linear")  # outside a convolution: the ConvNeXt blocks' only
    qwen_tts_audio.snake = timed("snake", "SnakeBeta")
    try:
        start = time.thread_time()
        decode(decoder, codes, way)
        spent["other"] = time.thread_time() - start - sum(spent.values())
    finally:
        for hook in hooks:
            hook.remove()
        for name, original in originals.items():
            setattr(qwen_tts_audio, name, original)
    return dict(spent)


def snr_db(audio: torch.Tensor, reference: torch.Tensor) -> float:
    """The waveform's signal-to-noise ratio against `reference`, in dB (inf where they are equal)."""
    noise = float(((audio.double() - reference.double()) ** 2).sum())
    return math.inf if noise == 0 else 10 * math.log10(float((reference.double() ** 2).sum()) / noise)


def distances(decoders: dict, codes: torch.Tensor, chunks: list[int]) -> dict:
    """Each way's audio against its dtype's whole decode and against the float32 whole decode: SNR (dB), and the
    largest sample difference from the float32 one."""
    wholes = {dtype: decode(decoder, codes, WHOLE).float() for dtype, decoder in decoders.items()}
    reference, out = wholes.get("float32"), {}
    for dtype, decoder in decoders.items():
        for way in all_ways(chunks):
            audio = decode(decoder, codes, way).float()
            out[f"{dtype} {way_name(way)}"] = {"snr_db_own_whole": snr_db(audio, wholes[dtype])} | ({} if reference
                is None else {"snr_db": snr_db(audio, reference),
                              "largest_difference": float((audio - reference).abs().max())})
    return out


def way_name(way: Way) -> str:
    chunk, gemm, fused_on = way
    if chunk is None:
        return "whole"
    return f"stream {chunk}" + ("" if gemm else ", oneDNN convs") + ("" if fused_on else ", upstream SnakeBeta")


def rows(times: dict, parts: dict, frames: int) -> list[dict]:
    out = []
    for (dtype, way), pairs in sorted(times.items(), key=lambda item: (item[0][0], item[0][1][0] or 0)):
        seconds = [cpu for cpu, _ in pairs]
        ratios = [s / w for s, (w, _) in zip(seconds, times[dtype, WHOLE])]  # each repeat's pair
        out.append({"dtype": dtype, "way": way_name(way), "chunk": way[0], "gemm": way[1], "fused": way[2],
                    "ms_per_frame": statistics.median(seconds) / frames * 1e3,
                    "wall_ms_per_frame": statistics.median(wall for _, wall in pairs) / frames * 1e3,
                    "over_whole": statistics.median(ratios), "over_whole_range": [min(ratios), max(ratios)],
                    "parts_ms_per_frame": {part: s / frames * 1e3 for part, s in parts[dtype, way].items()}})
    return out


def run(args, log, argv: list[str]) -> dict:
    size = "smoke" if args.smoke else "0.6b"
    decoders = {dtype: audible_decoder(size).to(getattr(torch, dtype)) for dtype in args.dtypes}
    sizes = SIZES[size].decoder
    codes = torch.randint(0, sizes["codebook_size"], (args.frames, 16), generator=torch.Generator().manual_seed(0))
    info = machine()
    with torch.inference_mode():
        times = timed_ways(decoders, codes, args.chunks, args.repeats, log)
        parts = {(dtype, way): part_times(decoders[dtype], codes, way)
                 for dtype in decoders for way in all_ways(args.chunks)}
        audio = distances(decoders, codes, args.chunks)
    return {"machine": finish_machine(info), "threads": torch.get_num_threads(), "frames": args.frames,
            "repeats": args.repeats, "sizes": sizes, "smoke": args.smoke, "targets": TARGETS,
            "rows": rows(times, parts, args.frames), "audio": audio,
            "command": " ".join([".venv/bin/python benchmarks/decoder_stream.py", *argv])}


PARTS = ["transformer", "conv", "transposed conv", "SnakeBeta", "ConvNeXt linear", "other"]


def markdown(report: dict) -> str:
    lines = ["# The 12 Hz decoder streamed vs whole", "",
             f"{machine_text(report['machine'])}; {report['threads']} thread(s), "
             f"{report['frames']} frames, medians of {report['repeats']} interleaved repeats. `{report['command']}`.",
             "", "Decoder sizes: " + ", ".join(f"{k} {v}" for k, v in report["sizes"].items()) + ". Targets "
             "(issue 51): streamed <= "
             f"{TARGETS['streamed_over_whole']}x whole, <= {TARGETS['ms_per_frame']:.0f} ms per frame at 1 thread.",
             "", "| dtype | way | ms/frame | over whole (range) | " + " | ".join(PARTS) + " | SNR vs own whole | "
             "SNR vs float32 whole |", "|---" * (6 + len(PARTS)) + "|"]
    for r in report["rows"]:
        low, high = r["over_whole_range"]
        audio = report["audio"].get(f"{r['dtype']} {r['way']}")
        parts = " | ".join(f"{r['parts_ms_per_frame'].get(p, 0):.1f}" for p in PARTS)
        lines.append(f"| {r['dtype']} | {r['way']} | {r['ms_per_frame']:.1f} | {r['over_whole']:.2f}x "
                     f"({low:.2f}-{high:.2f}) | {parts} | {snr_text(audio, 'snr_db_own_whole')} | "
                     f"{snr_text(audio, 'snr_db')} |")
    lines += ["", "ms/frame: CPU time of the calling thread (medians; the ratio: each repeat's pair). Parts: CPU ms "
              "per frame inside each (one extra, hooked pass per way: the hooks' own cost lands in \"other\"). SNR: "
              "the "
              "audio against the whole decode of the same codes in its own dtype, and in float32, in dB (the random "
              "decoder amplifies rounding: a trained one is better conditioned)."]
    return "\n".join(lines) + "\n"


def snr_text(audio: dict | None, key: str) -> str:
    if audio is None or key not in audio:
        return "-"
    return "exact" if math.isinf(audio[key]) else f"{audio[key]:.1f} dB"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--frames", type=int, default=48)
    parser.add_argument("--chunks", default="1,3,12,24", help="streamed chunk sizes (frames per call)")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    args.chunks, args.dtypes = [int(c) for c in args.chunks.split(",")], args.dtypes.split(",")
    if args.smoke:
        args.frames, args.repeats, args.chunks = 6, 1, [1, 3]
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    log = lambda text: print(f"[{time.strftime('%H:%M:%S')}] {text}", flush=True)  # noqa: E731
    try:
        report = run(args, log, sys.argv[1:] if argv is None else argv)
    finally:
        torch.set_num_threads(threads)
    write_reports(report, report_folder(args.out, args.smoke), "decoder-stream", markdown)
    print(markdown(report))


if __name__ == "__main__":
    main()
