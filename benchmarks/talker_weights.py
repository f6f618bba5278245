"""The talker with int8 weights (`accelerate(tts, talker_weights=...)`, opt-in and lossy): what it saves per frame
at the real 0.6B size, and what it costs on c0.

Speed, at the 0.6B sizes (upstream's own code, random weights; the system of benchmarks/end_to_end.py,
rvqspec.bench.systems: 28-layer talker, acceptance-controlled predictor heads, the released 12 Hz decoder),
bfloat16, CPU:
- one talker step: the talker's transformer and c0 head, fed the recorded inputs of one generate call step by step
  (prefill of the text prompt, then one position per frame), per weights scheme;
- whole `generate_custom_voice` calls of FRAMES frames. Settings: accelerated AR (bfloat16 everywhere: the
  baseline), AR with the talker at w8a8, the predictor speculative at N = 32 with w8a8 weights (the fastest
  predictor setting, benchmarks/results/bench-weights.md), and that with the talker at w8a16 or w8a8. Per frame:
  the talker's share (wall time less the predictor's and the decoder's) and the whole frame.
Interleaved, each setting once per repeat; medians.

Quality: the talker's c0 distribution against its bfloat16 self, teacher forced on the same inputs (the measures
of benchmarks/quantization_quality.py: KL at temperature 0.9, TV of the deployed distributions, top-1 agreement):
- the stand-in's talker (trained weights) on the codes it synthesizes for quantization_quality's sentences, c0
  restricted to the codes and eos as the stand-in samples it;
- the 0.6B talker (random weights) on the inputs of one bfloat16 generate call, replayed step by step.

    .venv/bin/python benchmarks/talker_weights.py   # -> benchmarks/results/talker-weights.{json,md}
    .venv/bin/python benchmarks/talker_weights.py --smoke   # tiny sizes: seconds, a temporary folder
"""

import argparse
import contextlib
import copy
import statistics
import time
from pathlib import Path

import torch
from end_to_end import Timers
from quantization_quality import DEPLOYED, SENTENCES, distances

import rvqspec
from rvqspec.bench.systems import SIZES, controlled_heads, system_tts
from rvqspec.bench.timing import SMOKE_HELP, finish_machine, machine, machine_text, report_folder, write_reports
from rvqspec.core.quantize import quantize_linears, restore_linears
from rvqspec.integrations.qwen_tts import accelerate
from rvqspec.standin.settings import MODEL_DIR
from rvqspec.standin.synthesis import synthesize_codes
from rvqspec.standin.talker import StandinTTS, load_standin
from rvqspec.standin.training import Utterance, make_batch, talker_hidden

RESULTS = Path(__file__).resolve().parent / "results"
FRAMES = 40  # main sets REQUEST's
TREE_SIZE = 32
SETTINGS = {"ar": (None, None, None), "ar + talker-w8a8": (None, None, "w8a8"), "spec-w8a8": ("spec", "w8a8", None),
            "spec-w8a8 + talker-w8a16": ("spec", "w8a8", "w8a16"), "spec-w8a8 + talker-w8a8": ("spec", "w8a8", "w8a8")}
REQUEST = dict(text="the quick brown fox jumps over the lazy dog, again and again", speaker="tiny",
               language="english", max_new_tokens=FRAMES + 1)  # the last c0 drawn is never decoded
SCHEMES = ("w8a16", "w8a8")


def run_once(tts, setting: str) -> dict:
    mode, weights, talker_weights = SETTINGS[setting]
    drafter = rvqspec.ReusedHeads() if mode else None
    handle = accelerate(tts, drafter=drafter, tree=rvqspec.default_tree(TREE_SIZE) if drafter else None,
                        weights=weights, talker_weights=talker_weights)
    timers = Timers(tts)
    timers.install()
    torch.manual_seed(0)
    try:
        start = time.perf_counter()
        wavs, _ = tts.generate_custom_voice(**REQUEST)
        seconds = time.perf_counter() - start
    finally:
        timers.remove()
        handle.undo()
    frames = len(wavs[0]) // 1920
    talker = seconds - timers.predictor - timers.decoder
    return {"frame_ms": 1e3 * seconds / frames, "talker_ms": 1e3 * talker / frames,
            "predictor_ms": 1e3 * timers.predictor / frames, "frames": frames,
            "tokens_per_step": handle.stats.tokens_per_step}


def speed(tts, threads: list[int], repeats: int, log) -> dict:
    out = {}
    for count in threads:
        torch.set_num_threads(count)
        runs = {setting: [] for setting in SETTINGS}
        run_once(tts, "spec-w8a8 + talker-w8a8")  # warm: oneDNN's layouts, the kernels
        for repeat in range(repeats):
            for setting in SETTINGS:
                runs[setting].append(run_once(tts, setting))
                log(f"{count}t repeat {repeat}: {setting}: {runs[setting][-1]['frame_ms']:.0f} ms/frame, talker "
                    f"{runs[setting][-1]['talker_ms']:.0f}")
        table = {setting: {key: statistics.median(r[key] for r in rs) for key in rs[0]} for setting, rs in runs.items()}
        for setting, row in table.items():
            row["frame_over_ar"] = table["ar"]["frame_ms"] / row["frame_ms"]  # x_over_y: y's time / x's time
        out[f"{count}t"] = table
    return out


@contextlib.contextmanager
def talker_at(talker, scheme: str):
    """The talker's linear layers at `scheme` inside the block ("bfloat16": as they are), swapped as
    `accelerate(talker_weights=)` swaps them."""
    swapped = quantize_linears(talker, scheme, (talker.code_predictor,)) if scheme in SCHEMES else []
    try:
        yield
    finally:
        restore_linears(swapped)


@torch.inference_mode()
def replay(talker, calls: list[dict]) -> tuple[torch.Tensor, list[float]]:
    """`talker` fed the recorded calls in order, on a cache of its own: its c0 logits [steps, 1, V], and the seconds
    of each step after the prefill (transformer + c0 head, one new position)."""
    from transformers import DynamicCache

    cache, rows, seconds = DynamicCache(), [], []
    for i, kwargs in enumerate(calls):
        start = time.perf_counter()
        hidden = talker.model(**kwargs, past_key_values=cache).last_hidden_state
        logits = talker.codec_head(hidden[:, -1])
        if i:
            seconds.append(time.perf_counter() - start)
        rows.append(logits.float())
    return torch.cat(rows)[:, None], seconds


def talker_steps(tts, calls: list[dict], threads: list[int], repeats: int, log) -> dict:
    """Median ms of one talker step per scheme and thread count."""
    talker, out = tts.model.talker, {}
    for count in threads:
        torch.set_num_threads(count)
        times = {scheme: [] for scheme in ("bfloat16", *SCHEMES)}
        for repeat in range(repeats + 1):  # the first warms up
            for scheme in times:
                with talker_at(talker, scheme):
                    seconds = replay(talker, calls)[1]
                times[scheme] += seconds if repeat else []
        table = {scheme: {"step_ms": 1e3 * statistics.median(values)} for scheme, values in times.items()}
        for row in table.values():
            row["over_bf16"] = table["bfloat16"]["step_ms"] / row["step_ms"]
        log(f"{count}t talker step: " + ", ".join(f"{k} {v['step_ms']:.1f} ms" for k, v in table.items()))
        out[f"{count}t"] = table
    return out


def standin_c0(log, sentences: list = SENTENCES) -> dict:
    """c0 of the stand-in's talker per scheme against bfloat16, teacher forced on codes it synthesized."""
    tts = load_standin(MODEL_DIR, torch.bfloat16)
    generator = torch.Generator().manual_seed(0)
    utts = [Utterance(str(i), lang, text, synthesize_codes(tts, text, lang, DEPLOYED, generator=generator).codes)
            for i, (lang, text) in enumerate(sentences)]
    c = tts.config
    allowed = torch.zeros(c.vocab_size, dtype=torch.bool)
    allowed[:c.num_codes], allowed[c.codec_eos_token_id] = True, True

    @torch.inference_mode()
    def logits(model: StandinTTS) -> torch.Tensor:  # [frames, 1, codes + eos]
        rows = []
        for utt in utts:
            batch = make_batch(model, [utt])
            hidden = talker_hidden(model, batch)[batch.frame_rows, batch.frame_positions]
            rows.append(model.talker.codec_head(hidden).float()[:, allowed])
        return torch.cat(rows)[:, None]

    reference, out = logits(tts), {"frames": sum(len(u.codes) for u in utts), "distances": {}}
    float32 = StandinTTS(copy.deepcopy(tts.talker).float(), copy.deepcopy(tts.predictor).float())
    out["distances"]["float32"] = distances(reference, logits(float32))
    for scheme in SCHEMES:
        talker = copy.deepcopy(tts.talker)
        quantize_linears(talker, scheme)
        out["distances"][scheme] = distances(reference, logits(StandinTTS(talker, tts.predictor)))
    log(f"stand-in c0: {out['frames']} frames")
    return out


def recorded_talker_calls(tts) -> list[dict]:
    """The keyword arguments of every call of the talker's transformer in one generate call (its cache aside)."""
    calls = []

    def record(module, args, kwargs):
        calls.append({k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()
                      if k != "past_key_values"})

    hook = tts.model.talker.model.register_forward_pre_hook(record, with_kwargs=True)
    handle = accelerate(tts)
    try:
        torch.manual_seed(0)
        tts.generate_custom_voice(**REQUEST)
    finally:
        handle.undo()
        hook.remove()
    return calls


def real_c0(tts, calls: list[dict], log) -> dict:
    talker = tts.model.talker
    reference, out = replay(talker, calls)[0], {"steps": len(calls), "distances": {}}
    for scheme in SCHEMES:
        with talker_at(talker, scheme):
            out["distances"][scheme] = distances(reference, replay(talker, calls)[0])
    log(f"0.6B c0: {len(calls)} talker steps")
    return out


def markdown(report: dict) -> str:
    lines = ["# The talker with int8 weights", "",
             f"`python benchmarks/talker_weights.py`: {machine_text(report['machine'])}. Upstream's Qwen3-TTS code "
             f"at the 0.6B sizes (random weights), bfloat16, {report['frames']} frames per call, "
             f"medians of {report['repeats']} interleaved repeats; see the script's docstring.", "",
             f"One talker step ({report['real']['steps'] - 1} steps after a prefill of the text prompt, median):", "",
             "| threads | weights | step ms | bfloat16 / this |", "|---|---|---|---|"]
    for threads, table in report["talker_step"].items():
        lines += [f"| {threads} | {scheme} | {r['step_ms']:.1f} | {r['over_bf16']:.2f}x |"
                  for scheme, r in table.items()]
    lines += ["", "Whole generate calls, per frame:", "",
              "| threads | setting | frame ms | talker ms/frame | predictor ms/frame | tokens/step | "
              "frame: AR / this |",
              "|---|---|---|---|---|---|---|"]
    for threads, table in report["speed"].items():
        for setting, r in table.items():
            lines.append(f"| {threads} | {setting} | {r['frame_ms']:.0f} | {r['talker_ms']:.0f} | "
                         f"{r['predictor_ms']:.0f} | {r['tokens_per_step']:.2f} | {r['frame_over_ar']:.2f}x |")
    lines += ["", "c0 against the bfloat16 talker, teacher forced (frame means; the stand-in's over its codes and "
              "eos):", "",
              "| talker | weights | KL (T=0.9) | TV (deployed) | top-1 agreement |", "|---|---|---|---|---|"]
    for name, section, count in (("stand-in (trained)", report["standin"], f"{report['standin']['frames']} frames"),
                                 ("0.6B (random)", report["real"], f"{report['real']['steps']} steps")):
        for scheme, d in section["distances"].items():
            lines.append(f"| {name}, {count} | {scheme} | {d['kl'][0]:.1e} | {d['tv'][0]:.3f} | "
                         f"{d['top1_agreement'][0]:.3f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    parser.add_argument("--threads", default=None, help="default 1,2 (--smoke: 1)")
    parser.add_argument("--repeats", type=int, default=None, help="default 3 (--smoke: 1)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    frames, sizes = (3, SIZES["smoke"]) if args.smoke else (FRAMES, SIZES["0.6b"])
    repeats, threads = args.repeats or (1 if args.smoke else 3), args.threads or ("1" if args.smoke else "1,2")
    REQUEST["max_new_tokens"] = frames + 1
    info, dtype = machine(), torch.bfloat16
    torch.set_num_threads(1)
    tts = system_tts(sizes, dtype)
    heads = controlled_heads(tts, sizes, dtype, print, TREE_SIZE, iterations=1 if args.smoke else 6)
    calls, threads = recorded_talker_calls(tts), [int(t) for t in threads.split(",")]
    report = {"heads": heads, "repeats": repeats, "frames": frames, "smoke": args.smoke,
              "standin": standin_c0(print, SENTENCES[:1] if args.smoke else SENTENCES),
              "real": real_c0(tts, calls, print)}
    report["talker_step"] = talker_steps(tts, calls, threads, repeats, print)
    report["speed"] = speed(tts, threads, repeats, print)
    torch.set_num_threads(1)
    report["machine"] = finish_machine(info)
    write_reports(report, report_folder(args.out, args.smoke), "talker-weights", markdown)
    print(markdown(report))


if __name__ == "__main__":
    main()
