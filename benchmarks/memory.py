"""Resident memory of an `rvqspec.Engine` at the real 0.6B and 1.7B sizes, bfloat16 and int8 (`weights="w8a8",
talker_weights="w8a8"`), and where it goes: peak and steady RSS (/proc/self/status: VmHWM, VmRSS) of a process
that builds upstream's model (random weights, `rvqspec.bench.systems`, as benchmarks/end_to_end.py builds it), then
the Engine, then decodes one short request; and the bytes each part holds (tensor storages by owner: upstream's
model, the speech decoder, the engine's talker and predictor, their int8 weights in each form held).

Each (size, setting) runs in a process of its own (RSS and its peak start clean), for this tree and, with
`--base COMMIT`, for that commit's rvqspec (before / after a change), one after the other.

    .venv/bin/python benchmarks/memory.py                    # 0.6B and 1.7B: ~10 minutes, ~9 GB at its peak
    .venv/bin/python benchmarks/memory.py --base main        # and main's rvqspec beside this tree's
    .venv/bin/python benchmarks/memory.py --smoke            # tiny sizes, seconds (a temporary folder)
    # they write benchmarks/results/memory.{json,md}
"""

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SETTINGS = {"bfloat16": {}, "w8a8": {"weights": "w8a8", "talker_weights": "w8a8"}}
FRAMES = 8
MB = 1e6
NEEDS_GB = {"0.6b": 6.0, "1.7b": 12.0}  # the most a run takes (main before this report, w8a8), with a margin


def room_for(needs: float, wait: float) -> float:
    """The GB available once `needs` are, or after `wait` seconds (the machine's other users come and go)."""
    deadline = time.monotonic() + wait
    while available_gb() < needs and time.monotonic() < deadline:
        time.sleep(5)
    return available_gb()


def available_gb() -> float:
    """The memory the system can give without swapping (/proc/meminfo: MemAvailable), GB."""
    fields = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
    return int(fields["MemAvailable"].split()[0]) * 1e3 / 1e9


def status() -> dict:
    """This process's resident memory now and at its peak so far, MB."""
    fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
    return {"rss_mb": int(fields["VmRSS"].split()[0]) * 1e3 / MB, "peak_mb": int(fields["VmHWM"].split()[0]) * 1e3 / MB}


def tensor_bytes(tensors, seen: set) -> int:
    """Bytes of the storages of `tensors` not in `seen` (oneDNN's prepacked tensors have none: their elements)."""
    total = 0
    for t in tensors:
        key = ("opaque", id(t)) if t.is_mkldnn else t.untyped_storage().data_ptr()
        if key not in seen:
            seen.add(key)
            total += t.numel() * t.element_size() if t.is_mkldnn else t.untyped_storage().nbytes()
    return total


def held(module, seen: set) -> dict:
    """MB a module holds that `seen` does not: its parameters and buffers, and each int8 form of its quantized
    matrices (`Int8Matmul.forms`)."""
    from rvqspec.core.quantize import QuantizedLinear
    tensors = list(module.parameters()) + list(module.buffers())
    parts = {"float": tensor_bytes(tensors, seen) / MB}
    matmuls = [m.matmul for m in module.modules() if isinstance(m, QuantizedLinear)]
    heads = getattr(module, "head_weights", None)
    for matmul in matmuls + (heads.matmuls if heads is not None else []):
        forms = getattr(matmul, "forms", None) or {**getattr(matmul, "packed", {}), "rows": (matmul.q, matmul.scale)}
        for form, packed in forms.items():
            packed = packed if isinstance(packed, tuple) else (packed,)
            parts[f"int8 {form}"] = parts.get(f"int8 {form}", 0.0) + tensor_bytes(packed, seen) / MB
    return parts


def worker(size: str, setting: str, smoke: bool) -> dict:
    """Build, then decode one request, in this process: RSS at each stage and the bytes by owner."""
    import torch

    import rvqspec
    from rvqspec.bench.systems import SIZES, SMOKE_SIZES, system_tts, utterance_request
    sizes = SIZES[SMOKE_SIZES[size] if smoke else size]
    stages = {"start": status()}
    tts = system_tts(sizes, torch.bfloat16)
    stages["upstream built"] = status()
    engine = rvqspec.Engine(tts, drafter=rvqspec.ReusedHeads(), tree="auto", seed=0, **SETTINGS[setting])
    stages["engine built"] = status()
    engine.generate_custom_voice(**utterance_request(FRAMES))
    stages["one request decoded"] = status()
    seen: set = set()
    owners = {"engine talker": held(engine.model.talker, seen), "engine predictor": held(engine.model.predictor, seen),
              "upstream talker (float)": held(tts.model.talker, seen),
              "speech decoder": held(tts.model.speech_tokenizer.model, seen)}
    engine.close()
    return {"size": size, "setting": setting, "stages": stages, "owners": owners}


def run(size: str, setting: str, smoke: bool, source: Path) -> dict:
    from rvqspec.bench.timing import worker_result
    argv = [str(Path(__file__).resolve()), "--worker", size, setting] + (["--smoke"] if smoke else [])
    return worker_result(source, argv)


def markdown(report: dict) -> str:
    lines = ["# Resident memory of an Engine (talker + predictor, and the speech decoder)", "",
             f"`{'`, then `'.join(report.get('commands', [report['command']]))}` on {report['machine_text']}; {report['cpu']} ({report['native']}). "
             f"Random weights at the real sizes (upstream's model as benchmarks/end_to_end.py builds it), one request "
             f"of {FRAMES} frames decoded; each row a process of its own. MB = 10^6 bytes.", "",
             "| code | size | setting | upstream built: RSS | engine built: RSS | after a request: RSS | peak RSS | "
             "engine talker | engine predictor | upstream talker (float) | speech decoder |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in sorted(report["runs"], key=lambda r: (r["size"], r["setting"], r["code"] == "this tree")):
        if "skipped" in row:
            lines.append(f"| {row['code']} | {row['size']} | {row['setting']} | skipped: {row['skipped']} |")
            continue
        s, o = row["stages"], row["owners"]
        parts = [" + ".join(f"{v:.0f} {k}" for k, v in o[name].items() if v >= 0.5) or "0" for name in
                 ("engine talker", "engine predictor", "upstream talker (float)", "speech decoder")]
        lines.append(f"| {row['code']} | {row['size']} | {row['setting']} | {s['upstream built']['rss_mb']:.0f} | "
                     f"{s['engine built']['rss_mb']:.0f} | {s['one request decoded']['rss_mb']:.0f} | "
                     f"{s['one request decoded']['peak_mb']:.0f} | " + " | ".join(parts) + " |")
    lines += ["", "Owners: the MB of tensor storages each holds that the ones before it do not (the engine's talker "
              "shares its norms and, in bfloat16, its single matrices with upstream's; q/k/v and gate/up are "
              "concatenated copies). `int8 <form>`: the quantized matrices in each layout held (`vnni`, `avx2`, "
              "`onednn`: a kernel's packed weights; `rows`: plain int8 rows).", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", help="default: 0.6b,1.7b (--smoke: 0.6b's tiny one)")
    parser.add_argument("--settings", help=f"default: {','.join(SETTINGS)} (--smoke: w8a8)")
    parser.add_argument("--base", help="a commit whose rvqspec runs too, after this tree's (e.g. main: before a change)")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes (a temporary folder)")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    parser.add_argument("--needs-gb", type=float, help="run only with this much memory available (default: NEEDS_GB)")
    parser.add_argument("--wait", type=float, default=0.0, help="seconds to wait for that memory before skipping a run")
    parser.add_argument("--append", action="store_true", help="keep the report's other runs, replacing the ones "
                        "measured now")
    parser.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(*args.worker, args.smoke)))
        return
    sys.path.insert(0, str(ROOT))
    from rvqspec.bench.timing import machine, report_folder, run_record, sources_at, write_reports
    info, runs = machine(), []
    codes = ["this tree"] + ([args.base] if args.base else [])
    sizes = (args.sizes or ("0.6b" if args.smoke else "0.6b,1.7b")).split(",")
    settings = (args.settings or ("w8a8" if args.smoke else ",".join(SETTINGS))).split(",")
    for size in sizes:
        for code in codes:
            for setting in settings:
                needs = args.needs_gb or (NEEDS_GB[size] if not args.smoke else 1.0)
                room = room_for(needs, args.wait)
                if room < needs:  # a shared machine: never push another user's processes out of memory
                    row = {"size": size, "setting": setting, "skipped": f"{room:.1f} GB available, needs ~{needs} GB"}
                elif code == "this tree":
                    row = run(size, setting, args.smoke, ROOT)
                else:
                    with sources_at(code, ROOT) as source:
                        row = run(size, setting, args.smoke, source)
                runs.append({"code": code, **row})
                print(json.dumps(runs[-1]), flush=True)
    out = report_folder(args.out, args.smoke)
    commands = []
    if args.append and (out / "memory.json").is_file():
        key = lambda r: (r["code"], r["size"], r["setting"])  # noqa: E731
        measured, now = {key(r) for r in runs if "skipped" not in r}, {key(r) for r in runs}
        before = json.loads((out / "memory.json").read_text())
        commands = before.get("commands", [before["command"]])
        kept = [r for r in before["runs"]
                if key(r) not in measured and not ("skipped" in r and key(r) in now)]
        runs = kept + [r for r in runs if "skipped" not in r or key(r) not in {key(k) for k in kept}]
    report = {**run_record("memory.py", argv if argv is not None else sys.argv[1:], info), "frames": FRAMES,
              "runs": runs}
    report["commands"] = commands + [report["command"]]
    write_reports(report, out, "memory", markdown)


if __name__ == "__main__":
    main()
