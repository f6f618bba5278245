"""A whole qwen-tts `generate_custom_voice` call at the real 0.6B size, CPU: upstream, accelerated AR, accelerated
speculative, streamed and not; time to first audio, whole-utterance time, real-time factor, and where a frame's
time goes (talker, code predictor, speech decoder).

The system is upstream's own code with random weights at the real sizes: a 28-layer talker (hidden 1024, 16 / 8
heads of 128, MLP 3072), the 5-layer code predictor with acceptance-controlled heads (rvqspec.bench.controlled,
bisected to the paper's 2.47 tokens/step at N = 32 on random frames; the figure in the report is what the run
measured), and the real-size 12 Hz speech decoder (qwen-tts's default decoder config). Text goes through a
character-level tokenizer (tests/helpers/upstream_tts.py): the text side is a few embedding rows per frame.
EOS is made unreachable so that every run decodes FRAMES frames (a 10 s utterance). Timing does not depend on
weight values (docs/design.md, section 5). Runs are interleaved, each setting once per repeat; figures are medians.

    nice -n 0 .venv/bin/python benchmarks/end_to_end.py   # writes benchmarks/results/end-to-end.{json,md}
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # upstream's model classes, built as the tests build them

import rvqspec  # noqa: E402
from rvqspec.bench.controlled import PAPER_ACCEPTANCE, calibrate_strength, controlled_predictor  # noqa: E402
from rvqspec.bench.timing import finish_machine, machine, machine_text, write_reports  # noqa: E402
from rvqspec.engine.checkpoint import TALKER_C0_TABLE, official_state_dict  # noqa: E402
from rvqspec.engine.config import QWEN3_TTS_0_6B  # noqa: E402
from rvqspec.integrations.qwen_tts import accelerate, import_qwen_tts  # noqa: E402
from rvqspec.integrations.qwen_tts_audio import StreamingCodec  # noqa: E402

from helpers.upstream_models import upstream_config_dict  # noqa: E402
from helpers.upstream_tts import CODEBOOK, make_audible, tiny_text_processor, tiny_tts_config_dict  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
FRAMES = 125  # 10 s at 12.5 frames a second
TREE_SIZE = 32
TARGETS = {"speculative_over_ar": 1.4, "first_audio_over_upstream_whole": 1 / 8, "streamed_over_whole": 1.05}


def real_size_tts(dtype: torch.dtype, seed: int = 0):
    """Upstream's Qwen3TTSModel at the 0.6B sizes (random weights), with a real-size 12 Hz speech decoder."""
    qwen_tts = import_qwen_tts()
    from qwen_tts.core import Qwen3TTSTokenizerV2Config, Qwen3TTSTokenizerV2Model

    config = tiny_tts_config_dict()
    real = upstream_config_dict(talker_hidden=1024, predictor_hidden=1024, vocab=2048, groups=16,
                                predictor_layers=5, predictor_heads=16, predictor_kv_heads=8, predictor_head_dim=128,
                                predictor_intermediate=3072, talker_vocab=2048 + 1024)["talker_config"]
    specials = {k: v + 2048 - CODEBOOK for k, v in config["talker_config"].items()
                if k.startswith("codec_") and k.endswith("_id") and isinstance(v, int)}
    config["talker_config"].update(
        code_predictor_config=real["code_predictor_config"], vocab_size=real["vocab_size"], hidden_size=1024,
        intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
        text_hidden_size=2048, rope_scaling={"rope_type": "default", "mrope_section": [24, 20, 20],
                                             "interleaved": False},
        codec_language_id={"english": specials["codec_pad_id"] + 7}, spk_id={"tiny": specials["codec_pad_id"] + 8},
        **specials)
    torch.manual_seed(seed)
    model = qwen_tts.core.models.Qwen3TTSForConditionalGeneration(qwen_tts.core.models.Qwen3TTSConfig(**config))
    model = model.to(dtype).eval().requires_grad_(False)
    encoder = dict(hidden_size=32, num_filters=4, num_residual_layers=1, codebook_size=2048, codebook_dim=16,
                   num_quantizers=16, num_semantic_quantizers=1, num_hidden_layers=1, num_attention_heads=2,
                   num_key_value_heads=2, head_dim=16, intermediate_size=64, frame_rate=12.5, upsample_groups=32,
                   vector_quantization_hidden_dimension=16)  # never run: only the decoder decodes
    codec = Qwen3TTSTokenizerV2Model(Qwen3TTSTokenizerV2Config(encoder_config=encoder, decoder_config={"codebook_dim": 512}))  # the released tokenizer's
    tokenizer = qwen_tts.Qwen3TTSTokenizer()
    tokenizer.model, tokenizer.config, tokenizer.device = codec.to(dtype).eval(), codec.config, torch.device("cpu")
    model.load_speech_tokenizer(tokenizer)
    model.config.talker_config.codec_eos_token_id = model.config.talker_config.vocab_size  # never drawn: FRAMES frames
    return qwen_tts.Qwen3TTSModel(model, tiny_text_processor(), generate_defaults={})


def controlled_heads(tts, dtype: torch.dtype, log) -> dict:
    """Load acceptance-controlled predictor weights (and their c0 table) into the talker; the calibration."""
    predictor, tree = controlled_predictor(QWEN3_TTS_0_6B, dtype=dtype), rvqspec.default_tree(TREE_SIZE)
    frames = predictor.frames(12)
    calibrated = calibrate_strength(predictor, tree, PAPER_ACCEPTANCE[TREE_SIZE], rvqspec.Sampler(), frames,
                                    iterations=6, low=3.0, high=12.0)
    log(f"heads: strength {calibrated.strength:.2f} gives {calibrated.measured:.2f} tokens/step at N={TREE_SIZE} "
        f"on random frames (target {PAPER_ACCEPTANCE[TREE_SIZE]})")
    state = official_state_dict(predictor.model)
    talker_state = {key.removeprefix("talker."): value for key, value in state.items() if key != TALKER_C0_TABLE}
    missing = tts.model.talker.load_state_dict(talker_state, strict=False)
    assert not missing.unexpected_keys, missing.unexpected_keys
    tts.model.talker.model.codec_embedding.weight.copy_(state[TALKER_C0_TABLE])
    return {"strength": calibrated.strength, "tokens_per_step_random_frames": calibrated.measured}


class Timers:
    """Seconds spent inside the code predictor's per-frame call and the speech decoder, during one run."""

    def __init__(self, tts):
        self.tts, self.predictor, self.decoder = tts, 0.0, 0.0

    def install(self) -> None:
        target, tokenizer = self.tts.model.talker.code_predictor, self.tts.model.speech_tokenizer
        self.saved = (vars(target).get("generate"), vars(tokenizer).get("decode"), StreamingCodec.decode)
        generate, decode, stream_decode = target.generate, tokenizer.decode, StreamingCodec.decode

        def timed(fn, field):
            def call(*args, **kwargs):
                start = time.perf_counter()
                try:
                    return fn(*args, **kwargs)
                finally:
                    setattr(self, field, getattr(self, field) + time.perf_counter() - start)
            return call

        target.generate, tokenizer.decode = timed(generate, "predictor"), timed(decode, "decoder")
        StreamingCodec.decode = timed(stream_decode, "decoder")

    def remove(self) -> None:
        target, tokenizer = self.tts.model.talker.code_predictor, self.tts.model.speech_tokenizer
        for owner, name, saved in ((target, "generate", self.saved[0]), (tokenizer, "decode", self.saved[1])):
            if saved is None:
                delattr(owner, name)
            else:
                setattr(owner, name, saved)
        StreamingCodec.decode = self.saved[2]


REQUEST = dict(text="the quick brown fox jumps over the lazy dog, again and again", speaker="tiny",
               language="english", max_new_tokens=FRAMES + 1)  # the last c0 drawn is never decoded


def run_once(tts, setting: str, chunk_frames: int, first_chunk_frames: int) -> dict:
    """One utterance in `setting`: upstream | ar | speculative | speculative-w8a8, whole or streamed."""
    mode, streamed = setting.split(":")
    handle = None
    if mode != "upstream":
        drafter = None if mode == "ar" else rvqspec.ReusedHeads()
        handle = accelerate(tts, drafter=drafter, tree=rvqspec.default_tree(TREE_SIZE) if drafter else None,
                            weights="w8a8" if mode.endswith("w8a8") else None)
    timers = Timers(tts)
    timers.install()
    torch.manual_seed(0)
    try:
        start, first = time.perf_counter(), None
        if streamed == "stream":
            samples = 0
            for audio, rate in handle.stream_custom_voice(**REQUEST, chunk_frames=chunk_frames,
                                                          first_chunk_frames=first_chunk_frames):
                first = time.perf_counter() - start if first is None else first
                samples += len(audio)
        else:
            wavs, rate = tts.generate_custom_voice(**REQUEST)
            samples = len(wavs[0])
        seconds = time.perf_counter() - start
    finally:
        timers.remove()
        stats = handle.stats if handle else None
        if handle:
            handle.undo()
    frames = samples // 1920
    return {"setting": setting, "seconds": seconds, "first_audio_seconds": first if first is not None else seconds,
            "frames": frames, "audio_seconds": samples / rate, "predictor_seconds": timers.predictor,
            "decoder_seconds": timers.decoder, "talker_seconds": seconds - timers.predictor - timers.decoder,
            "tokens_per_step": stats.tokens_per_step if stats else 1.0}


def summarize(runs: list[dict]) -> dict:
    keys = ["seconds", "first_audio_seconds", "predictor_seconds", "decoder_seconds", "talker_seconds",
            "tokens_per_step"]
    out = {key: statistics.median(run[key] for run in runs) for key in keys}
    frames = runs[0]["frames"]
    out.update(frames=frames, audio_seconds=runs[0]["audio_seconds"], repeats=len(runs),
               real_time_factor=out["seconds"] / runs[0]["audio_seconds"],
               ms_per_frame={part: 1e3 * out[f"{part}_seconds"] / frames for part in ("talker", "predictor", "decoder")})
    return out


SETTINGS = ["upstream:whole", "ar:whole", "ar:stream", "speculative:whole", "speculative:stream",
            "speculative-w8a8:stream"]


def figures(table: dict) -> dict:
    up, ar, spec = table["upstream:whole"], table["ar:whole"], table["speculative:whole"]
    streamed = table["speculative:stream"]
    return {"speculative_over_ar": ar["seconds"] / spec["seconds"],
            "speculative_over_upstream": up["seconds"] / spec["seconds"],
            "first_audio_over_upstream_whole": streamed["first_audio_seconds"] / up["seconds"],
            "streamed_over_whole": streamed["seconds"] / spec["seconds"],
            "w8a8_streamed_over_ar": ar["seconds"] / table["speculative-w8a8:stream"]["seconds"]}


def to_markdown(report: dict) -> str:
    lines = [f"# End to end: qwen-tts `generate_custom_voice`, 0.6B sizes, random weights, CPU {report['dtype']}",
             "", f"Generated by `benchmarks/end_to_end.py` on {machine_text(report['machine'])}.",
             f"{report['frames']} frames ({report['frames'] / 12.5:.0f} s of audio, EOS unreachable), code predictor heads controlled to the paper's "
             f"acceptance ({report['heads']['tokens_per_step_random_frames']:.2f} tokens/step at N={TREE_SIZE} on random "
             f"frames; the column below is what each run measured). Streams: first chunk {report['first_chunk_frames']} "
             f"frames, then {report['chunk_frames']}. Medians of {report['repeats']} interleaved repeats.", ""]
    for threads, block in report["threads"].items():
        lines += [f"## {threads} thread(s)", "",
                  "| setting | whole s | first audio s | RTF | talker ms/frame | predictor ms/frame | decoder ms/frame | "
                  "tokens/step |", "|---|---|---|---|---|---|---|---|"]
        for setting, row in block["table"].items():
            ms = row["ms_per_frame"]
            lines.append(f"| {setting} | {row['seconds']:.1f} | {row['first_audio_seconds']:.2f} | "
                         f"{row['real_time_factor']:.2f} | {ms['talker']:.0f} | {ms['predictor']:.0f} | "
                         f"{ms['decoder']:.0f} | {row['tokens_per_step']:.2f} |")
        f = block["figures"]
        lines += [] if not f else ["", f"- speculative over accelerated AR, whole utterance: {f['speculative_over_ar']:.2f}x (target >= "
                      f"{TARGETS['speculative_over_ar']}x); over upstream: {f['speculative_over_upstream']:.2f}x",
                  f"- time to first audio, speculative stream / upstream's whole utterance: "
                  f"{f['first_audio_over_upstream_whole']:.3f} (target <= {TARGETS['first_audio_over_upstream_whole']:.3f})",
                  f"- streamed / non-streamed whole-utterance time, speculative: {f['streamed_over_whole']:.3f} (target "
                  f"<= {TARGETS['streamed_over_whole']})",
                  f"- w8a8 speculative stream over bfloat16 accelerated AR (whole): {f['w8a8_streamed_over_ar']:.2f}x", ""]
    d = report["decoder_difference"]
    lines += ["## Streamed vs offline audio (the real-size 12 Hz decoder, random weights, float32)", "",
              f"{d['frames']} random frames decoded in chunks of {d['chunk_frames']} against one offline decode: max "
              f"|difference| {d['max_abs']:.2e} (peak {d['peak']:.2e}, relative {d['max_abs'] / d['peak']:.2e}), SNR "
              f"{d['snr_db']:.1f} dB.", ""]
    return "\n".join(lines)


def decoder_difference(tts, frames: int = 60, chunk_frames: int = 4) -> dict:
    """The real-size decoder in float32: streamed in chunks against upstream's offline decode of the same codes.
    Random std-0.02 weights decode to silence, so the weights are first redrawn to keep the signal's scale
    (`make_audible`, as in the tests): a random network, more sensitive to rounding than a trained one may be."""
    tokenizer = tts.model.speech_tokenizer
    dtype = next(tokenizer.model.parameters()).dtype
    tokenizer.model.float()
    make_audible(tokenizer.model.decoder)
    try:
        codes = torch.randint(0, 2048, (frames, 16), generator=torch.Generator().manual_seed(0))
        offline = torch.as_tensor(tokenizer.decode([{"audio_codes": codes}])[0][0]).double()
        stream = StreamingCodec(tokenizer.model.decoder)
        ours = torch.cat([stream.decode(codes[i:i + chunk_frames]) for i in range(0, frames, chunk_frames)]).double()
    finally:
        tokenizer.model.to(dtype)
    error = ours - offline
    return {"frames": frames, "chunk_frames": chunk_frames, "max_abs": float(error.abs().max()),
            "peak": float(offline.abs().max()),
            "snr_db": float(10 * torch.log10(offline.pow(2).mean() / error.pow(2).mean().clamp(min=1e-300)))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--chunk-frames", type=int, default=12)
    parser.add_argument("--first-chunk-frames", type=int, default=3)
    parser.add_argument("--settings", default=",".join(SETTINGS))
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--frames", type=int, default=FRAMES, help="frames per utterance (a quick look: fewer)")
    args = parser.parse_args()
    REQUEST["max_new_tokens"] = args.frames + 1
    info = machine()
    dtype = torch.bfloat16
    log = lambda text: print(text, flush=True)  # noqa: E731
    tts = real_size_tts(dtype)
    heads = controlled_heads(tts, dtype, log)
    settings = args.settings.split(",")
    report = {"dtype": "bfloat16", "frames": args.frames, "tree_size": TREE_SIZE, "heads": heads, "repeats": args.repeats,
              "chunk_frames": args.chunk_frames, "first_chunk_frames": args.first_chunk_frames, "threads": {},
              "targets": TARGETS}
    for threads in [int(t) for t in args.threads.split(",")]:
        torch.set_num_threads(threads)
        run_once(tts, "ar:stream", args.chunk_frames, args.first_chunk_frames)  # warm-up: first-call costs
        runs = {setting: [] for setting in settings}
        for repeat in range(args.repeats):
            for setting in settings if repeat % 2 == 0 else settings[::-1]:
                result = run_once(tts, setting, args.chunk_frames, args.first_chunk_frames)
                log(f"{threads}t {setting}: {result['seconds']:.1f} s, first audio {result['first_audio_seconds']:.2f} "
                    f"s, predictor {result['predictor_seconds']:.1f} s, decoder {result['decoder_seconds']:.1f} s, "
                    f"{result['tokens_per_step']:.2f} tokens/step")
                runs[setting].append(result)
        table = {setting: summarize(rows) for setting, rows in runs.items()}
        report["threads"][str(threads)] = {"table": table, "figures": figures(table) if set(SETTINGS) <= set(table)
                                           else {}}
    report["decoder_difference"] = decoder_difference(tts)
    report["machine"] = finish_machine(info)
    for path in write_reports(report, args.out, "end-to-end", to_markdown):
        log(f"wrote {path}")


if __name__ == "__main__":
    main()
