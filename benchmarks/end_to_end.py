"""A whole qwen-tts `generate_custom_voice` call at the real 0.6B (or 1.7B) sizes, CPU: upstream, accelerated AR,
accelerated speculative, streamed and not; time to first audio, whole-utterance time, real-time factor, and where a
frame's time goes (talker, code predictor, speech decoder), each part beside its floor.

The system is upstream's own code with random weights at the real sizes: a 28-layer talker (hidden 1024, 16 / 8
heads of 128, MLP 3072), the 5-layer code predictor with acceptance-controlled heads (rvqspec.bench.controlled,
bisected to the paper's 2.47 tokens/step at N = 32 on random frames; the figure in the report is what the run
measured), and the released Qwen3-TTS-Tokenizer-12Hz's 12 Hz speech decoder (a transformer 512 wide, not qwen-tts's
default 1024): rvqspec.bench.systems builds it (SIZES["0.6b"]). `--size 1.7b` builds Qwen3-TTS-12Hz-1.7B's
(SIZES["1.7b"]: a talker of hidden 2048 and MLP 6144, the same predictor behind a 2048 -> 1024 projection, the same
decoder) and writes end-to-end-1.7b.{json,md}. Text goes through a character-level tokenizer: the text side is a
few embedding rows per frame.

Each part's floor, per frame, at the thread count of its table (measured there: the copy bandwidth of
`floor.copy_bandwidth`, the matmul peaks of `floor.matmul_peak`): the talker's = the bytes of its layers, final norm and
c0 head as the setting stores them (bfloat16; int8 rows + float32 scales for engine-w8a8) / the bandwidth (one step,
one row: it reads every weight once); the predictor's = per call the larger of its bytes (layers, final norm, input
projection) / the bandwidth and its rows' FLOPs (2 per matrix weight per row: 1 row AR, N + 1 for a tree of N) / the
matmul peak of its scheme, times the calls the run's frames took (15 / tokens per step), plus its 15 heads read once;
the decoder's = its matmul and convolution FLOPs per frame (a whole decode, torch's FlopCounterMode) / the matmul peak
of its dtype.
EOS is made unreachable so that every run decodes FRAMES frames (a 10 s utterance). Timing does not depend on
weight values (docs/design.md, section 5). Runs are interleaved, each setting once per repeat; figures are medians.

Besides upstream and `accelerate`, it runs `rvqspec.Engine` (the whole frame loop: our talker, our predictor, the
streaming decoder), whole and streamed, bfloat16 and int8 (`weights="w8a8", talker_weights="w8a8"`, where the CPU
runs w8a8: every x86 class with AVX2), with the policy's tree ("auto") and the fixed N of the `accelerate` runs; the
talker step alone (the core's `talker.step`, which the Engine runs, against upstream's talker forward with its
DynamicCache, and against the weight-reading floor: layer weight bytes / this machine's measured copy bandwidth); and a
concurrency run (1, 2, 4, 8 requests submitted together and staggered, each consumed by a thread of its own as a server
would, so that vocoding counts), against upstream and `accelerate` one request at a time. "1 thread" pins the whole
process to one core (a caller thread's vocoding cannot borrow a second one); "2 threads" lets it use two.

    .venv/bin/python benchmarks/end_to_end.py           # the full run (a quiet machine: about 2 hours on 2 cores)
    .venv/bin/python benchmarks/end_to_end.py --quick   # 20 frames, 2 repeats, 1/2/4 requests: ~15-20 minutes
    .venv/bin/python benchmarks/end_to_end.py --smoke   # tiny sizes, seconds: checks that it runs (a temporary folder)
    .venv/bin/python benchmarks/end_to_end.py --size 1.7b --batches "" --settings upstream:whole \
        --engine-settings engine-w8a8:stream   # the 1.7B sizes: ~13 GB resident (each engine holds its own talker)
    # they write benchmarks/results/end-to-end.{json,md} (1.7B: end-to-end-1.7b.*); python benchmarks/make_results.py
    # then docs/RESULTS.md
"""

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]

import rvqspec  # noqa: E402
from rvqspec.bench.floor import copy_bandwidth, counted_flops, matmul_peak, matrix_bytes  # noqa: E402
from rvqspec.bench.streams import streamed_together  # noqa: E402
from rvqspec.bench.systems import SIZES, SMOKE_SIZES, controlled_heads, system_tts, utterance_request  # noqa: E402
from rvqspec.bench.timing import (ALL_CPUS, SMOKE_HELP, finish_machine, machine, machine_text, pin,  # noqa: E402
                                  report_folder, write_reports)
from rvqspec.bench.upstream import make_audible  # noqa: E402
import rvqspec.runtime.scheduler as scheduler_module  # noqa: E402
from rvqspec.core import cpu_class  # noqa: E402
from rvqspec.core import talker as talker_blocks  # noqa: E402
from rvqspec.core.errors import RvqspecError  # noqa: E402
from rvqspec.core.quantize import QuantizedLinear, check_scheme  # noqa: E402
from rvqspec.integrations.qwen_tts import accelerate  # noqa: E402
from rvqspec.integrations.qwen_tts_audio import StreamingCodec  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
FRAMES = 125  # 10 s at 12.5 frames a second
TREE_SIZE = 32
FLOOR_FRAMES = 24  # frames of the whole decode whose FLOPs give the decoder's per frame
TARGETS = {"speculative_over_ar": 1.4, "first_audio_over_upstream_whole": 1 / 8, "streamed_over_whole": 1.05}


class Timers:
    """Seconds spent, during one run, inside the code predictor's per-frame call, the speech decoder and the talker's
    transformer (upstream's `talker.model` forward; the engine's prefill and step)."""

    def __init__(self, tts):
        self.tts, self.predictor, self.decoder, self.talker_step = tts, 0.0, 0.0, 0.0

    def timed(self, fn, field):
        def call(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                setattr(self, field, getattr(self, field) + time.perf_counter() - start)
        return call

    def install(self) -> None:
        target, tokenizer = self.tts.model.talker.code_predictor, self.tts.model.speech_tokenizer
        transformer = self.tts.model.talker.model
        self.saved = (vars(target).get("generate"), vars(tokenizer).get("decode"), StreamingCodec.decode,
                      vars(transformer).get("forward"), scheduler_module.decode_checked, talker_blocks.step,
                      talker_blocks.prefill)
        target.generate = self.timed(target.generate, "predictor")
        tokenizer.decode = self.timed(tokenizer.decode, "decoder")
        StreamingCodec.decode = self.timed(StreamingCodec.decode, "decoder")
        transformer.forward = self.timed(transformer.forward, "talker_step")
        scheduler_module.decode_checked = self.timed(scheduler_module.decode_checked, "predictor")
        talker_blocks.step = self.timed(talker_blocks.step, "talker_step")
        talker_blocks.prefill = self.timed(talker_blocks.prefill, "talker_step")

    def remove(self) -> None:
        target, tokenizer = self.tts.model.talker.code_predictor, self.tts.model.speech_tokenizer
        transformer = self.tts.model.talker.model
        for owner, name, saved in ((target, "generate", self.saved[0]), (tokenizer, "decode", self.saved[1]),
                                   (transformer, "forward", self.saved[3])):
            if saved is None:
                delattr(owner, name)
            else:
                setattr(owner, name, saved)
        StreamingCodec.decode = self.saved[2]
        scheduler_module.decode_checked, talker_blocks.step, talker_blocks.prefill = self.saved[4:]


REQUEST = utterance_request(FRAMES)  # main sets its frames

# The engine's settings: name -> Engine options. "auto" is the decoding policy's tree per batch size; "n32" the fixed
# tree of the `accelerate` runs. The drafter is ReusedHeads on the controlled predictor in both.
ENGINES = {"engine": dict(tree="auto"), "engine-n32": dict(tree=TREE_SIZE),
           "engine-w8a8": dict(tree="auto", weights="w8a8", talker_weights="w8a8")}


def make_engine(tts, name: str, chunk_frames: int, first_chunk_frames: int) -> rvqspec.Engine:
    options = dict(ENGINES[name])
    tree = options.pop("tree")
    return rvqspec.Engine(tts, drafter=rvqspec.ReusedHeads(), tree=rvqspec.default_tree(tree) if tree != "auto"
                          else "auto", chunk_frames=chunk_frames, first_chunk_frames=first_chunk_frames, seed=0,
                          **options)


def int8_refusal() -> str | None:
    """Why int8 (w8a8) is skipped on this CPU, or None where it runs: `quantize.check_scheme` refuses w8a8 on CPUs with
    neither int8 dot products nor rvqspec's AVX2 kernel (its message is the reason)."""
    try:
        check_scheme("w8a8")
    except RvqspecError as e:
        return str(e)
    return None


def run_once(tts, setting: str, chunk_frames: int, first_chunk_frames: int, engines: dict | None = None) -> dict:
    """One utterance in `setting`: upstream | ar | speculative | speculative-w8a8 | engine | engine-n32 | engine-w8a8,
    whole or streamed."""
    mode, streamed = setting.split(":")
    handle, engine = None, (engines or {}).get(mode)
    if mode.startswith("engine") and engine is None:
        raise ValueError(f"{setting}: no engine {mode!r} was made")
    if mode != "upstream" and engine is None:
        drafter = None if mode == "ar" else rvqspec.ReusedHeads()
        handle = accelerate(tts, drafter=drafter, tree=rvqspec.default_tree(TREE_SIZE) if drafter else None,
                            weights="w8a8" if mode.endswith("w8a8") else None)
    timers = Timers(tts)
    timers.install()
    torch.manual_seed(0)
    stats_before = engine_stats(engine) if engine else None
    try:
        start, first = time.perf_counter(), None
        if streamed == "stream":
            samples = 0
            chunks = engine.stream_custom_voice(**REQUEST, seed=0) if engine else handle.stream_custom_voice(
                **REQUEST, chunk_frames=chunk_frames, first_chunk_frames=first_chunk_frames)
            for audio, rate in chunks:
                first = time.perf_counter() - start if first is None else first
                samples += len(audio)
        else:
            wavs, rate = (engine or tts).generate_custom_voice(**REQUEST, **({"seed": 0} if engine else {}))
            samples = len(wavs[0])
        seconds = time.perf_counter() - start
    finally:
        timers.remove()
        stats = handle.stats if handle else None
        if handle:
            handle.undo()
    if engine:
        (codes, calls), rows_per_call = engine_counts(engine, stats_before)
        tokens_per_step = codes / calls if calls else float("nan")
    else:
        tokens_per_step = stats.tokens_per_step if stats else 1.0
        rows_per_call = 1 if mode in ("upstream", "ar") else TREE_SIZE + 1
    frames = samples // 1920
    return {"setting": setting, "seconds": seconds, "first_audio_seconds": first if first is not None else seconds,
            "frames": frames, "audio_seconds": samples / rate, "predictor_seconds": timers.predictor,
            "decoder_seconds": timers.decoder, "talker_seconds": seconds - timers.predictor - timers.decoder,
            "talker_step_seconds": timers.talker_step, "tokens_per_step": tokens_per_step,
            "rows_per_call": rows_per_call}


def engine_stats(engine) -> tuple[int, int, dict]:
    """(codes, calls seen from one row, frame steps per tree size) the engine's predictor made so far."""
    stats = engine.scheduler.stats
    return stats.codes, stats.row_calls, dict(stats.tree_sizes)


def engine_counts(engine, before: tuple) -> tuple[tuple[int, int], float]:
    """Since `before` (`engine_stats`): (codes, calls seen from one row), and the mean rows of a call (N + 1 for a
    tree of N, 1 for an AR step)."""
    codes, calls, sizes = engine_stats(engine)
    steps = {n: count - before[2].get(n, 0) for n, count in sizes.items()}
    rows = sum((n + 1) * count for n, count in steps.items()) / max(1, sum(steps.values()))
    return (codes - before[0], calls - before[1]), rows


def summarize(runs: list[dict]) -> dict:
    keys = ["seconds", "first_audio_seconds", "predictor_seconds", "decoder_seconds", "talker_seconds",
            "talker_step_seconds", "tokens_per_step", "rows_per_call"]
    out = {key: statistics.median(run[key] for run in runs) for key in keys}
    frames = runs[0]["frames"]
    out.update(frames=frames, audio_seconds=runs[0]["audio_seconds"], repeats=len(runs),
               real_time_factor=out["seconds"] / runs[0]["audio_seconds"],
               ms_per_frame={part: 1e3 * out[f"{part}_seconds"] / frames
                             for part in ("talker", "talker_step", "predictor", "decoder")})
    return out


SETTINGS = ["upstream:whole", "ar:whole", "ar:stream", "speculative:whole", "speculative:stream",
            "speculative-w8a8:stream"]
ENGINE_SETTINGS = ["engine:whole", "engine:stream", "engine-n32:whole", "engine-w8a8:whole", "engine-w8a8:stream"]
QUICK_SETTINGS = ["upstream:whole", "speculative:whole", "speculative:stream"]  # --quick's accelerate ones


def figures(table: dict) -> dict:
    """Ratios of whole-utterance times within one thread count (only those whose settings ran)."""
    out = {}
    def ratio(name, over, under, key="seconds"):
        if over in table and under in table:
            out[name] = table[over][key] / table[under][key]
    ratio("speculative_over_ar", "ar:whole", "speculative:whole")
    ratio("speculative_over_upstream", "upstream:whole", "speculative:whole")
    if "speculative:stream" in table and "upstream:whole" in table:
        out["first_audio_over_upstream_whole"] = (table["speculative:stream"]["first_audio_seconds"]
                                                  / table["upstream:whole"]["seconds"])
    ratio("streamed_over_whole", "speculative:stream", "speculative:whole")
    ratio("w8a8_streamed_over_ar", "ar:whole", "speculative-w8a8:stream")
    for name in ("engine:whole", "engine-n32:whole", "engine-w8a8:whole", "engine:stream", "engine-w8a8:stream"):
        ratio(f"{name}_over_upstream", "upstream:whole", name)
        ratio(f"{name}_over_accelerate", "speculative:whole", name)
    return out


# ---------------------------------------------------------------- each part's floor (the module docstring)


def floor_inputs(tts, frames: int, schemes: tuple[str, ...]) -> dict:
    """What the floors are made of, whatever the thread count: per scheme the bytes of the talker's step and of a
    predictor call and its heads, the matrix weights of a predictor call, and the decoder's FLOPs per frame (a whole
    decode of `frames` random frames)."""
    talker, predictor = tts.model.talker, tts.model.talker.code_predictor
    parts = {"talker": [talker.model.layers, talker.model.norm, talker.codec_head],
             "predictor_call": [predictor.model.layers, predictor.model.norm, predictor.small_to_mtp_projection],
             "predictor_heads": [predictor.lm_head]}
    tokenizer = tts.model.speech_tokenizer
    codes = torch.randint(0, 2048, (frames, 16), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        decoder_flops = counted_flops(lambda: tokenizer.decode([{"audio_codes": codes}]))
    return {"bytes": {scheme: {name: matrix_bytes(modules, scheme) for name, modules in parts.items()}
                      for scheme in schemes},
            "predictor_call_weights": sum(p.numel() for m in parts["predictor_call"] for p in m.parameters()
                                          if p.dim() == 2),
            "codes_per_frame": len(predictor.lm_head), "decoder_flops_per_frame": decoder_flops / frames,
            "decoder_dtype": str(next(tokenizer.model.parameters()).dtype).removeprefix("torch.")}


def floor_rates(inputs: dict, gigabytes: float, peak_size: int) -> dict:
    """This thread count's copy bandwidth (GB/s) and matmul peak (GFLOP/s) per scheme the floors divide by."""
    schemes = sorted({*inputs["bytes"], inputs["decoder_dtype"]})
    return {"bandwidth_gb_s": copy_bandwidth(gigabytes) / 1e9,
            "peak_gflop_s": {scheme: matmul_peak(scheme, peak_size) / 1e9 for scheme in schemes}}


def part_floors(setting: str, row: dict, inputs: dict, rates: dict) -> dict:
    """ms per frame of each part of `setting`'s run (`row`: its tokens per step and rows per call) at its floor."""
    mode = setting.split(":")[0]
    talker_bytes = inputs["bytes"]["w8a8" if mode == "engine-w8a8" else "bfloat16"]["talker"]
    scheme = "w8a8" if mode.endswith("w8a8") else "bfloat16"
    predictor_bytes, bandwidth, peak = inputs["bytes"][scheme], rates["bandwidth_gb_s"], rates["peak_gflop_s"]
    call_ms = max(predictor_bytes["predictor_call"] / bandwidth,
                  row["rows_per_call"] * 2 * inputs["predictor_call_weights"] / peak[scheme]) / 1e6
    calls = inputs["codes_per_frame"] / row["tokens_per_step"]
    return {"talker": talker_bytes / bandwidth / 1e6,
            "predictor": calls * call_ms + predictor_bytes["predictor_heads"] / bandwidth / 1e6,
            "decoder": inputs["decoder_flops_per_frame"] / peak[inputs["decoder_dtype"]] / 1e6}


# ---------------------------------------------------------------- the talker step alone


@torch.inference_mode()
def talker_step(tts, talkers: dict, steps: int, log, copy_gigabytes: float = 1.0) -> dict:
    """One talker step (the transformer and the c0 head, one row, after the prompt's prefill): the Engine's
    `core.talker.step` on a RowCache against upstream's `talker.model` forward with its DynamicCache, the same input
    embedding and RoPE id, interleaved step by step; and the floor, layer weight bytes / copy bandwidth."""
    from transformers.cache_utils import DynamicCache

    upstream = tts.model.talker
    prompt = next(iter(talkers.values()))[1].prompts("custom_voice", dict(REQUEST))[0]
    length, hidden = len(prompt.embeds), upstream.config.hidden_size
    inputs = torch.randn(steps, 1, hidden, generator=torch.Generator().manual_seed(0)).to(prompt.embeds.dtype) * 0.05
    caches = {}
    for name, (talker, _) in talkers.items():
        cache = talker_blocks.RowCache(talker)
        talker_blocks.prefill(talker, cache, cache.add(), prompt.embeds, prompt.positions)
        caches[name] = cache
    past = DynamicCache()
    upstream.model(inputs_embeds=prompt.embeds[None], position_ids=prompt.positions[None], past_key_values=past,
                   use_cache=True)
    base = next(iter(talkers))  # the float engine where it runs: its states are compared with upstream's
    times = {name: [] for name in [*talkers, "upstream"]}
    differences = []
    for i in range(steps):
        position = torch.tensor([length + i])
        order = [*talkers, "upstream"] if i % 2 == 0 else ["upstream", *talkers][::-1]
        for name in order:
            start = time.perf_counter()
            if name == "upstream":
                out = upstream.model(inputs_embeds=inputs[i][None], position_ids=position[None], past_key_values=past,
                                     use_cache=True, cache_position=position).last_hidden_state[:, -1]
                upstream.codec_head(out)
                theirs = out
            else:
                talker, _ = talkers[name]
                ours = talker_blocks.step(talker, caches[name], inputs[i], position)
                talker.codec_head(ours)
                if name == base:
                    mine = ours
            times[name].append(time.perf_counter() - start)
        differences.append(float((mine.float() - theirs.float()).abs().max() / theirs.float().abs().max()))
    warm = steps // 4  # the first steps pay first-call costs
    ms = {name: 1e3 * statistics.median(t[warm:]) for name, t in times.items()}
    talker = talkers[base][0]
    layer_bytes = {name: weight_bytes(t.layers) for name, (t, _) in talkers.items()}
    rate = copy_bandwidth(copy_gigabytes)
    floor_ms = 1e3 * layer_bytes[base] / rate
    log("talker step: " + ", ".join(f"{name} {value:.1f} ms" for name, value in ms.items())
        + f"; floor {floor_ms:.1f} ms ({layer_bytes[base] / 1e6:.0f} MB at {rate / 1e9:.1f} GB/s)")
    return {"steps": steps - warm, "context": length, "ms": ms, "layer_bytes": layer_bytes[base],
            "layer_parameters": sum(p.numel() for p in talker.layers.parameters()),
            "bandwidth_gb_s": rate / 1e9, "floor_ms": floor_ms,
            "upstream_over_engine": ms["upstream"] / ms[base],
            "engine_over_floor": ms[base] / floor_ms,
            "of_floor": {name: 1e3 * layer_bytes[name] / rate / ms[name] for name in talkers},
            "compared": base, "max_relative_difference": max(differences)}


def weight_bytes(module: torch.nn.Module) -> int:
    """Bytes of the weights a step reads: the parameters, and int8 rows and scales of quantized layers."""
    int8 = sum(m.matmul.out_features * (m.matmul.in_features + 4) for m in module.modules()
               if isinstance(m, QuantizedLinear))
    return int8 + sum(p.numel() * p.element_size() for p in module.parameters())


# ---------------------------------------------------------------- many requests at once


def serve(engine, requests: int, stagger: float) -> dict:
    """`requests` requests submitted together (stagger 0) or one every `stagger` seconds, each iterated by a thread
    of its own (a server's): aggregate audio seconds per second (all the audio over the time from the first submit
    to the last chunk), and each request's time to first audio (from its own submit)."""
    arguments = [dict(REQUEST, kind="custom_voice", seed=index) for index in range(requests)]
    outs, seconds = streamed_together(engine, arguments, stagger)
    audio = sum(out["audio"] for out in outs)
    return {"seconds": seconds, "audio_seconds": audio, "audio_per_second": audio / seconds,
            "first_audio": [out["first"] for out in outs]}


def percentile(values: list[float], q: float) -> float:
    """The q-quantile, linear between order statistics (numpy's default)."""
    ordered = sorted(values)
    position = q * (len(ordered) - 1)
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def one_at_a_time(whole: float, first: float, audio: float, requests: int, stagger: float) -> dict:
    """A server that decodes one request at a time (upstream, `accelerate`), from its measured lone times: request i
    starts when it has arrived and the one before has ended; its first audio comes `first` s after it starts (a
    whole-utterance call: `first` = `whole`)."""
    free, firsts, end = 0.0, [], 0.0
    for index in range(requests):
        begin = max(free, index * stagger)
        firsts.append(begin + first - index * stagger)
        free = end = begin + whole
    return {"seconds": end, "audio_seconds": audio * requests, "audio_per_second": audio * requests / end,
            "first_audio": firsts}


def concurrency(tts, batches: list[int], stagger: float, repeats: int, single: dict, chunk_frames: int,
                first_chunk_frames: int, log) -> dict:
    """The engine (bfloat16, the policy's tree) serving 1..8 requests, together and staggered, interleaved per repeat;
    upstream and `accelerate` one at a time from their lone runs of the same thread count (`single`)."""
    engine = make_engine(tts, "engine", chunk_frames, first_chunk_frames)
    try:
        serve(engine, 1, 0.0)  # warm-up
        runs = {(mode, n): [] for n in batches for mode in ("together", "staggered")}
        for repeat in range(repeats):
            keys = list(runs) if repeat % 2 == 0 else list(runs)[::-1]
            for mode, n in keys:
                result = serve(engine, n, 0.0 if mode == "together" else stagger)
                log(f"concurrency {mode} x{n}: {result['audio_per_second']:.3f} audio s/s, first audio "
                    + ", ".join(f"{f:.2f}" for f in result["first_audio"]) + " s")
                runs[(mode, n)].append(result)
    finally:
        engine.close()
    rows = []
    for (mode, n), results in runs.items():
        firsts = [f for r in results for f in r["first_audio"]]  # every request of every repeat
        row = {"mode": mode, "requests": n, "repeats": len(results),
               "audio_per_second": statistics.median(r["audio_per_second"] for r in results),
               "seconds": statistics.median(r["seconds"] for r in results),
               "first_audio_p50": percentile(firsts, 0.5), "first_audio_p95": percentile(firsts, 0.95)}
        for name, setting, streamed in (("upstream", "upstream:whole", False),
                                        ("accelerate", "speculative:stream", True)):
            if setting not in single:
                continue
            s = single[setting]
            model = one_at_a_time(s["seconds"], s["first_audio_seconds"] if streamed else s["seconds"],
                                  s["audio_seconds"], n, 0.0 if mode == "together" else stagger)
            row[name] = {"audio_per_second": model["audio_per_second"],
                         "first_audio_p50": percentile(model["first_audio"], 0.5),
                         "first_audio_p95": percentile(model["first_audio"], 0.95)}
        rows.append(row)
    return {"stagger_seconds": stagger, "repeats": repeats, "rows": rows}


# ---------------------------------------------------------------- the issue's targets (issue 32)

ISSUE_TARGETS = {"engine_over_upstream_bf16": 2.0, "engine_over_upstream_int8": 2.5, "talker_step_over_upstream": 1.7,
                 "aggregate_at_4_over_1": 2.5, "first_audio_p95_at_4_over_lone": 2.0}


def issue_targets(report: dict) -> list[dict]:
    """Issue 32's targets (1 thread, this run) with the measured values; None where the run lacks them."""
    block = report["threads"].get("1", {})
    table, rows = block.get("table", {}), []

    def whole_ratio(name):
        if name in table and "upstream:whole" in table:
            return table["upstream:whole"]["seconds"] / table[name]["seconds"]
        return None

    rows.append({"target": "one stream, bfloat16: engine over upstream's generate_custom_voice (whole)",
                 "goal": f">= {ISSUE_TARGETS['engine_over_upstream_bf16']}x", "value": whole_ratio("engine:whole"),
                 "kind": ">=", "bound": ISSUE_TARGETS["engine_over_upstream_bf16"], "unit": "x"})
    int8 = whole_ratio("engine-w8a8:whole")
    rows.append({"target": "one stream, int8 talker and predictor: engine over upstream (whole)",
                 "goal": f">= {ISSUE_TARGETS['engine_over_upstream_int8']}x", "value": int8, "kind": ">=",
                 "bound": ISSUE_TARGETS["engine_over_upstream_int8"], "unit": "x",
                 "note": report.get("int8_skipped")})
    step = report.get("talker_step") or {}
    rows.append({"target": "talker step, bfloat16: upstream's / the engine's",
                 "goal": f">= {ISSUE_TARGETS['talker_step_over_upstream']}x", "value": step.get("upstream_over_engine"),
                 "kind": ">=", "bound": ISSUE_TARGETS["talker_step_over_upstream"], "unit": "x"})
    conc = {(r["mode"], r["requests"]): r for r in (report.get("concurrency") or {}).get("rows", [])}
    for mode in ("together", "staggered"):
        four, one = conc.get((mode, 4)), conc.get((mode, 1))
        rows.append({"target": f"aggregate audio s/s at 4 requests ({mode}) over one stream's",
                     "goal": f">= {ISSUE_TARGETS['aggregate_at_4_over_1']}x",
                     "value": four["audio_per_second"] / one["audio_per_second"] if four and one else None,
                     "kind": ">=", "bound": ISSUE_TARGETS["aggregate_at_4_over_1"], "unit": "x"})
        rows.append({"target": f"p95 time to first audio at 4 requests ({mode}) over a lone request's",
                     "goal": f"<= {ISSUE_TARGETS['first_audio_p95_at_4_over_lone']}x",
                     "value": four["first_audio_p95"] / one["first_audio_p50"] if four and one else None,
                     "kind": "<=", "bound": ISSUE_TARGETS["first_audio_p95_at_4_over_lone"], "unit": "x"})
    for row in rows:  # None where not measured
        row["met"] = None if row["value"] is None else (
            row["value"] >= row["bound"] if row["kind"] == ">=" else row["value"] <= row["bound"])
    return rows


# ---------------------------------------------------------------- the report


def talker_text(ms: dict) -> str:
    """The talker column: whole time minus the predictor and the decoder, "-" where that is below the talker's own
    step (the decoder ran beside the frame loop on another core, so the parts overlapped)."""
    return "-" if ms["talker"] < ms.get("talker_step", 0.0) else f"{ms['talker']:.0f}"


def setting_row(setting: str, row: dict) -> str:
    ms = row["ms_per_frame"]
    tps = row["tokens_per_step"]
    floor = row.get("floor_ms_per_frame") or {}
    at = {part: f"{floor[part]:.1f}" if part in floor else "-" for part in ("talker", "predictor", "decoder")}
    return (f"| {setting} | {row['seconds']:.1f} | {row['first_audio_seconds']:.2f} | {row['real_time_factor']:.2f} | "
            f"{talker_text(ms)} | {ms.get('talker_step', float('nan')):.0f} | {at['talker']} | "
            f"{ms['predictor']:.0f} | {at['predictor']} | {ms['decoder']:.0f} | {at['decoder']} | {tps:.2f} |")


def to_markdown(report: dict) -> str:
    m = report["machine"]
    size = report.get("size", "0.6b").upper()
    lines = [f"# End to end: qwen-tts `generate_custom_voice`, {size} sizes, random weights, CPU {report['dtype']}",
             "", f"Generated by `{report.get('command', 'benchmarks/end_to_end.py')}` on {machine_text(m)}, "
             f"CPU class {m.get('cpu_class', '?')}.",
             f"{report['frames']} frames ({report['frames'] / 12.5:.1f} s of audio, EOS unreachable), code predictor heads "
             f"controlled to the paper's acceptance ({report['heads']['tokens_per_step_random_frames']:.2f} tokens/step "
             f"at N={TREE_SIZE} on random frames; the column below is what each run measured). Streams: first chunk "
             f"{report['first_chunk_frames']} frames, then {report['chunk_frames']}. Medians of {report['repeats']} "
             "interleaved repeats; ratios are within one run, never across runs.", ""]
    if report.get("smoke"):
        lines += ["A `--smoke` run (tiny sizes): it checks that the benchmark runs; its figures mean nothing.", ""]
    if report.get("quick"):
        lines += [f"A `--quick` run ({report['frames']} frames, {report['repeats']} repeats, requests "
                  f"{'/'.join(map(str, report['batches']))}): for a full run (125 frames, 1..8 requests) use "
                  f"`{FULL_COMMAND}` on a quiet machine.", ""]
    lines += ["Settings: `upstream` is qwen-tts's own `generate_custom_voice`; `ar` / `speculative` are `accelerate(tts)` "
              f"(our predictor inside upstream's loop, AR or the fixed N={TREE_SIZE} tree); `engine` is `rvqspec.Engine` "
              "(our talker, predictor and loop; ReusedHeads, tree \"auto\" = the decoding policy), `engine-n32` the same "
              f"with the fixed N={TREE_SIZE} tree, `engine-w8a8` with `weights=\"w8a8\", talker_weights=\"w8a8\"` (int8 "
              "talker and predictor: another model, opt-in). `whole`: a whole-utterance call (engine: "
              "`generate_custom_voice`); `stream`: iterating the stream (engine: `stream_custom_voice`, a submitted "
              "request iterated in the caller's thread). Columns per frame: talker = whole time minus predictor and "
              "decoder (the talker and the loop around it, generate's machinery included; a dash where the decoder ran beside the "
              "loop on another core, so the parts overlap); talker step = time inside "
              "the talker's transformer alone (upstream's `talker.model` forward; the engine's prefill and step); "
              "predictor = the c1..c15 call; decoder = the 12 Hz speech decoder. In a streamed engine run the decoder "
              "runs in the engine's codec workers beside the frame loop (before issue 40: in the caller's thread).", "",
              "Floors (ms per frame, measured at each table's thread count): talker = the bytes of its layers, final "
              "norm and c0 head as the setting stores them (bfloat16; int8 rows and float32 scales for engine-w8a8) / "
              "the copy bandwidth (a step reads every weight once); predictor = per call the larger of its bytes "
              "(layers, norm, input projection) / the bandwidth and its rows' FLOPs (1 row AR, N + 1 for a tree of "
              "N) / the matmul peak of its scheme, times the run's calls per frame (15 / tokens per step), plus its 15 "
              "heads read once; decoder = its matmul and convolution FLOPs per frame (a whole decode, counted) / the "
              "matmul peak of its dtype. A floor is what the bytes or the arithmetic cost at this core's measured "
              "rates; elementwise work (norms, activations, the decoder's Snake) is not in it.", ""]
    floor = report.get("floor_inputs")
    if floor:
        b = floor["bytes"]
        lines += ["Bytes a frame reads at the floor: talker " + ", ".join(
                      f"{scheme} {b[scheme]['talker'] / 1e6:.0f} MB" for scheme in b) + "; predictor call "
                  + ", ".join(f"{scheme} {b[scheme]['predictor_call'] / 1e6:.0f} MB" for scheme in b) + " (heads "
                  + ", ".join(f"{scheme} {b[scheme]['predictor_heads'] / 1e6:.0f} MB" for scheme in b) + "); decoder "
                  f"{floor['decoder_flops_per_frame'] / 1e9:.2f} GFLOP per frame ({floor['decoder_dtype']}).", ""]
    if report.get("int8_skipped"):
        lines += [f"int8 (w8a8) skipped on this CPU: {report['int8_skipped']}", ""]
    for threads, block in report["threads"].items():
        lines += [f"## {threads} thread(s)" + (" (the process pinned to one core)" if threads == "1" else ""), "",
                  "| setting | whole s | first audio s | RTF | talker ms/frame | talker step ms/frame | talker floor | "
                  "predictor ms/frame | predictor floor | decoder ms/frame | decoder floor | tokens/step |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        lines += [setting_row(setting, row) for setting, row in block["table"].items()]
        f = block["figures"]
        lines.append("")
        rates = block.get("floor_rates")
        if rates:
            lines += [f"Floors' rates at {threads} thread(s): copy bandwidth {rates['bandwidth_gb_s']:.1f} GB/s; "
                      "matmul peak " + ", ".join(f"{scheme} {value:.0f} G{'OP' if 'w8' in scheme else 'FLOP'}/s"
                                                 for scheme, value in rates["peak_gflop_s"].items()) + ".", ""]
        if "speculative_over_ar" in f:
            lines.append(f"- speculative over accelerated AR, whole utterance: {f['speculative_over_ar']:.2f}x (target "
                         f">= {TARGETS['speculative_over_ar']}x); over upstream: {f['speculative_over_upstream']:.2f}x")
        if "first_audio_over_upstream_whole" in f:
            lines.append(f"- time to first audio, speculative stream / upstream's whole utterance: "
                         f"{f['first_audio_over_upstream_whole']:.3f} (target <= "
                         f"{TARGETS['first_audio_over_upstream_whole']:.3f})")
        if "streamed_over_whole" in f:
            lines.append(f"- streamed / non-streamed whole-utterance time, speculative: {f['streamed_over_whole']:.3f} "
                         f"(target <= {TARGETS['streamed_over_whole']})")
        if "w8a8_streamed_over_ar" in f:
            lines.append(f"- w8a8 speculative stream over bfloat16 accelerated AR (whole): "
                         f"{f['w8a8_streamed_over_ar']:.2f}x")
        for name in ("engine:whole", "engine-n32:whole", "engine-w8a8:whole", "engine:stream", "engine-w8a8:stream"):
            if f"{name}_over_upstream" in f:
                over_accelerate = f.get(f"{name}_over_accelerate")
                lines.append(f"- {name} over upstream (whole): {f[f'{name}_over_upstream']:.2f}x" + (
                    "" if over_accelerate is None or over_accelerate != over_accelerate  # not run: NaN
                    else f"; over accelerate speculative:whole: {over_accelerate:.2f}x"))
        lines.append("")
    step = report.get("talker_step")
    if step:
        lines += ["## The talker step alone (1 thread, one row)", "",
                  f"One step (28 layers and the c0 head) after the prompt's prefill ({step['context']} tokens), median of "
                  f"{step['steps']} steps interleaved step by step: the core's `talker.step` (the Engine's) on a RowCache, "
                  "upstream's `talker.model` forward with its DynamicCache (the same input embedding and RoPE id), and "
                  f"the floor: the layers' {step['layer_parameters'] / 1e6:.0f} M weights ({step['layer_bytes'] / 1e6:.0f}"
                  f" MB) read once at the copy bandwidth measured here ({step['bandwidth_gb_s']:.1f} GB/s, a 1 GiB "
                  "tensor copy, read + write).", "",
                  "| talker | ms per step | over the floor | upstream over it |", "|---|---|---|---|"]
        for name, value in step["ms"].items():
            lines.append(f"| {'upstream (Hugging Face forward)' if name == 'upstream' else 'engine, ' + name} | "
                         f"{value:.1f} | {value / step['floor_ms']:.2f}x | {step['ms']['upstream'] / value:.2f}x |")
        lines += [f"| floor (weights / bandwidth) | {step['floor_ms']:.1f} | 1.00x | |", "",
                  f"Engine ({step['compared']}) vs upstream hidden state: max relative difference "
                  f"{step['max_relative_difference']:.2e}.",
                  ""]
    conc = report.get("concurrency")
    if conc:
        lines += ["## Many requests at once (1 thread, the process pinned to one core)", "",
                  f"The engine (bfloat16, tree \"auto\") with N requests of {report['frames']} frames submitted together "
                  f"or one every {conc['stagger_seconds']} s, each iterated by a thread of its own (vocoding counted). "
                  "Aggregate: all the audio over the time from the first submit to the last chunk (median of "
                  f"{conc['repeats']} repeats); first audio: from each request's own submit, p50/p95 over every request "
                  "of every repeat. Upstream and `accelerate` (speculative, streamed) serve one request at a time; "
                  "their columns are computed from their lone runs of this thread count above (a queue: request i "
                  "starts when the one before ends), not measured with threads.", "",
                  "| submitted | requests | engine audio s/s | engine first audio p50 / p95 s | upstream audio s/s | "
                  "upstream first audio p50 / p95 s | accelerate audio s/s | accelerate first audio p50 / p95 s |",
                  "|---|---|---|---|---|---|---|---|"]
        for r in conc["rows"]:
            cells = [r["mode"], str(r["requests"]), f"{r['audio_per_second']:.3f}",
                     f"{r['first_audio_p50']:.2f} / {r['first_audio_p95']:.2f}"]
            for name in ("upstream", "accelerate"):
                o = r.get(name)
                cells += [f"{o['audio_per_second']:.3f}", f"{o['first_audio_p50']:.2f} / {o['first_audio_p95']:.2f}"] \
                    if o else ["-", "-"]
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
    targets = report.get("issue_targets")
    if targets:
        lines += ["## Issue 32's targets (1 thread, this run)", "",
                  "Lone engine figures are the engine's whole-utterance and 1-request runs above; \"a lone request's\" "
                  "first audio is the 1-request p50. On a shared 2-core machine, with few repeats, a ratio moves by "
                  "tens of percent between repeats (the log's per-run lines show it): a value within ~15% of its goal "
                  "is not decided by this run.", "", "| target | goal | measured | met |", "|---|---|---|---|"]
        for t in targets:
            value = "not measured" + (f" ({t['note']})" if t.get("note") else "") if t["value"] is None \
                else f"{t['value']:.3f}{t['unit']}"
            met = "-" if t["met"] is None else ("met" if t["met"] else "not met")
            lines.append(f"| {t['target']} | {t['goal']} | {value} | {met} |")
        lines.append("")
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
    saved = {k: v.clone() for k, v in tokenizer.model.decoder.state_dict().items()}
    tokenizer.model.float()
    make_audible(tokenizer.model.decoder)
    try:
        codes = torch.randint(0, 2048, (frames, 16), generator=torch.Generator().manual_seed(0))
        offline = torch.as_tensor(tokenizer.decode([{"audio_codes": codes}])[0][0]).double()
        stream = StreamingCodec(tokenizer.model.decoder)
        ours = torch.cat([stream.decode(codes[i:i + chunk_frames]) for i in range(0, frames, chunk_frames)]).double()
    finally:
        tokenizer.model.to(dtype)
        tokenizer.model.decoder.load_state_dict(saved)
    error = ours - offline
    return {"frames": frames, "chunk_frames": chunk_frames, "max_abs": float(error.abs().max()),
            "peak": float(offline.abs().max()),
            "snr_db": float(10 * torch.log10(offline.pow(2).mean() / error.pow(2).mean().clamp(min=1e-300)))}


FULL_COMMAND = ".venv/bin/python benchmarks/end_to_end.py"
QUICK = dict(frames=20, repeats=2, batches="1,2,4")
SMOKE = dict(frames=3, repeats=1, batches="1", settings="upstream:whole,speculative:stream", threads="1",
             engine_settings="engine:whole,engine:stream", step_repeats=4, copy_gigabytes=0.02, decoder_frames=8,
             peak_size=128)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    parser.add_argument("--size", choices=("0.6b", "1.7b"), default="0.6b",
                        help="the released Qwen3-TTS-12Hz sizes to build (1.7b: a talker of width 2048; its report is "
                             "end-to-end-1.7b)")
    parser.add_argument("--quick", action="store_true",
                        help=f"a bounded run: {QUICK['frames']} frames, {QUICK['repeats']} repeats, requests "
                             f"{QUICK['batches']}, fewer accelerate settings (about 15 minutes on 2 cores)")
    parser.add_argument("--threads", default=None, help="thread counts (default 1,2)")
    parser.add_argument("--repeats", type=int, default=None, help="interleaved repeats (default 3; --quick 2)")
    parser.add_argument("--chunk-frames", type=int, default=12)
    parser.add_argument("--first-chunk-frames", type=int, default=3)
    parser.add_argument("--settings", default=None, help="accelerate/upstream settings (default: all; --quick: "
                        + ",".join(QUICK_SETTINGS) + ")")
    parser.add_argument("--engine-settings", default=None, help="default: " + ",".join(ENGINE_SETTINGS))
    parser.add_argument("--batches", default=None, help="requests at once (default 1,2,4,8; --quick 1,2,4)")
    parser.add_argument("--stagger", type=float, default=0.5, help="seconds between staggered submits")
    parser.add_argument("--step-repeats", type=int, default=None, help="talker steps timed (the first quarter: warm-up)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--frames", type=int, default=None, help=f"frames per utterance (default {FRAMES}; --quick "
                        f"{QUICK['frames']})")
    args = parser.parse_args(argv)
    if args.smoke:
        for name, value in SMOKE.items():
            setattr(args, name, getattr(args, name, None) or value)
    frames = args.frames or (QUICK["frames"] if args.quick else FRAMES)
    repeats = args.repeats or (QUICK["repeats"] if args.quick else 3)
    batches = [int(b) for b in (QUICK["batches"] if args.quick and args.batches is None else
                                "1,2,4,8" if args.batches is None else args.batches).split(",") if b]  # "": none
    settings = [s for s in (",".join(QUICK_SETTINGS if args.quick else SETTINGS) if args.settings is None
                            else args.settings).split(",") if s]  # "": none
    engine_settings = [s for s in (",".join(ENGINE_SETTINGS) if args.engine_settings is None
                                   else args.engine_settings).split(",") if s]
    REQUEST["max_new_tokens"] = frames + 1
    info = machine()
    dtype = torch.bfloat16
    log = lambda text: print(f"[{time.strftime('%H:%M:%S')}] {text}", flush=True)  # noqa: E731
    log(f"CPU {cpu_class.describe()}; {len(ALL_CPUS)} CPUs")
    skipped = int8_refusal()
    if skipped:
        log(f"int8 skipped: {skipped}")
        engine_settings = [s for s in engine_settings if "w8a8" not in s]
        settings = [s for s in settings if "w8a8" not in s]
    sizes = SIZES[SMOKE_SIZES[args.size] if args.smoke else args.size]
    tts = system_tts(sizes, dtype)
    heads = controlled_heads(tts, sizes, dtype, log, TREE_SIZE, iterations=1 if args.smoke else 6)
    floor_parts = floor_inputs(tts, min(frames, FLOOR_FRAMES), ("bfloat16",) if skipped else ("bfloat16", "w8a8"))
    report = {"dtype": "bfloat16", "size": args.size, "floor_inputs": floor_parts, "frames": frames,
              "tree_size": TREE_SIZE, "heads": heads, "repeats": repeats,
              "chunk_frames": args.chunk_frames, "first_chunk_frames": args.first_chunk_frames, "threads": {},
              "targets": TARGETS, "quick": args.quick, "smoke": args.smoke, "batches": batches, "int8_skipped": skipped,
              "command": " ".join([".venv/bin/python benchmarks/end_to_end.py", *(sys.argv[1:] if argv is None
                                                                                  else argv)])}
    all_settings = settings + engine_settings
    for threads in [int(t) for t in (args.threads or "1,2").split(",")]:
        cpus = pin(threads)
        torch.set_num_threads(threads)
        log(f"{threads} thread(s) on CPUs {cpus}")
        engines = {}
        try:
            for name in sorted({s.split(":")[0] for s in engine_settings}):
                start = time.perf_counter()
                engines[name] = make_engine(tts, name, args.chunk_frames, args.first_chunk_frames)
                log(f"{name}: made in {time.perf_counter() - start:.1f} s, {engines[name].explain(1)}")
            run_once(tts, "speculative:stream", args.chunk_frames, args.first_chunk_frames)  # warm-up
            for name in engines:
                run_once(tts, f"{name}:stream", args.chunk_frames, args.first_chunk_frames, engines)  # warm-up
            runs = {setting: [] for setting in all_settings}
            for repeat in range(repeats):
                for setting in all_settings if repeat % 2 == 0 else all_settings[::-1]:
                    result = run_once(tts, setting, args.chunk_frames, args.first_chunk_frames, engines)
                    log(f"{threads}t {setting}: {result['seconds']:.1f} s, first audio "
                        f"{result['first_audio_seconds']:.2f} s, predictor {result['predictor_seconds']:.1f} s, decoder "
                        f"{result['decoder_seconds']:.1f} s, talker step {result['talker_step_seconds']:.1f} s, "
                        f"{result['tokens_per_step']:.2f} tokens/step")
                    runs[setting].append(result)
            if threads == 1:
                talkers = {"bfloat16": (engines["engine"].model.talker, engines["engine"].model)} \
                    if "engine" in engines else {}
                if "engine-w8a8" in engines:
                    talkers["w8a8"] = (engines["engine-w8a8"].model.talker, engines["engine-w8a8"].model)
                if talkers:
                    report["talker_step"] = talker_step(tts, talkers, args.step_repeats or 40, log,
                                                        getattr(args, "copy_gigabytes", 1.0))
        finally:
            for engine in engines.values():
                engine.close()
            # the next thread count builds its own engines: let these go first (the 1.7B sizes ran out of 24 GB)
            engines, talkers = {}, None
            gc.collect()
        table = {setting: summarize(rows) for setting, rows in runs.items()}
        rates = floor_rates(floor_parts, getattr(args, "copy_gigabytes", 1.0), getattr(args, "peak_size", 1024))
        for setting, row in table.items():
            row["floor_ms_per_frame"] = part_floors(setting, row, floor_parts, rates)
        report["threads"][str(threads)] = {"table": table, "figures": figures(table), "floor_rates": rates}
        if threads == 1 and batches:
            report["concurrency"] = concurrency(tts, batches, args.stagger, repeats, table, args.chunk_frames,
                                                args.first_chunk_frames, log)
    pin(len(ALL_CPUS))
    report["issue_targets"] = issue_targets(report)
    report["decoder_difference"] = decoder_difference(tts, getattr(args, "decoder_frames", 60))
    report["machine"] = finish_machine(info)
    name = "end-to-end" if args.size == "0.6b" else f"end-to-end-{args.size}"
    for path in write_reports(report, report_folder(args.out, args.smoke), name, to_markdown):
        log(f"wrote {path}")


if __name__ == "__main__":
    main()
