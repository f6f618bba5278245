"""`rvqspec bench`: the one-stream benchmark, or the batched one with --batch."""

import json
from pathlib import Path

import torch

from rvqspec.bench import one_stream, weights
from rvqspec.bench.one_stream import REFERENCE_ARCH, Plan, load_calibration, load_trees, quick_plan, run_bench
from rvqspec.bench.report import batch_markdown, batch_plot, markdown, plot
from rvqspec.bench.timing import write_reports
from rvqspec.cli import flags
from rvqspec.core.errors import RvqspecError
from rvqspec.core.model import resolve_dtype
from rvqspec.core.policy import SIZES
from rvqspec.core.quantize import SCHEMES


def parse_list(text: str, kind, allowed=None, what: str = "value") -> list:
    try:
        values = [kind(v.strip()) for v in text.split(",") if v.strip()]
    except ValueError:
        values = []
    if not values or (allowed is not None and any(v not in allowed for v in values)):
        choices = f" from {', '.join(map(str, allowed))}" if allowed is not None else ""
        raise RvqspecError(f"--{what} must be a comma-separated list{choices}, got {text!r}")
    return values


def command_line(args) -> str:
    """The invocation, for the report (options at their values, flags when set; --batch runs name theirs)."""
    words = ["rvqspec bench"]
    names = ("weights", "threads") if args.weights and not args.batch else \
        ("batch", "archs", "dtype", "threads", "device", "rounds", "weights") \
        if args.batch else ("archs", "model", "calibration", "trees", "drafter", "corpus", "sizes", "dtype", "threads",
                            "rounds", "device")
    for name in names:
        value = getattr(args, name)
        if value is not None:
            words.append(f"--{name} {value if value != '' else repr(value)}")
    return " ".join(words + ["--quick"] * args.quick)


def run_batch(args, dtypes: list[str], threads: list[int]) -> int:
    from rvqspec.bench import batched

    batches = parse_list(args.batch, int, None, "batch")
    if any(b < 1 for b in batches):
        raise RvqspecError(f"--batch must be batch sizes >= 1, got {args.batch!r}")
    if args.model or args.calibration or args.trees:
        raise RvqspecError("--batch benchmarks a real architecture at the paper's acceptance: drop --model, "
                           "--calibration and --trees")
    archs = parse_list(args.archs or REFERENCE_ARCH, str.lower, one_stream.ARCHS, "archs")
    if len(archs) != 1:
        raise RvqspecError(f"--batch benchmarks one architecture per run (its latency tables), got --archs {args.archs}")
    weights = None
    if args.weights:
        schemes = parse_list(args.weights, str, SCHEMES, "weights")
        if len(schemes) != 1:
            raise RvqspecError(f"--batch --weights takes one scheme of {', '.join(SCHEMES)} per run (its latency "
                               f"tables), got {args.weights}")
        weights = schemes[0]
    plan = (batched.quick_batch_plan if args.quick else batched.BatchPlan)(batches, dtypes, threads, args.device,
                                                                           arch=archs[0], weights=weights)
    if args.rounds:
        plan = batched.BatchPlan(**(plan.__dict__ | {"latency_rounds": args.rounds}))
    report = batched.run_batch_bench(plan, (lambda *a, **k: None) if args.json else print)
    report["command"] = command_line(args)
    device = None if args.no_device_file else batched.write_device_latency(report)  # before the plot: it may fail
    paths = write_reports(report, Path(args.out), "bench-batch-quick" if args.quick else "bench-batch",
                          batch_markdown, batch_plot, log=(lambda *a: None) if args.json else print)
    if args.json:
        print(json.dumps({"batch_policy_speedup": report["batch_policy_speedup"],
                          "batch_policy_speedup_by_setting": report["batch_policy_speedup_by_setting"],
                          "switch_to_ar_at": {f"{s['dtype']}/{s['threads']}t": s["switch_to_ar_at"]
                                              for s in report["settings"]}, "report": str(paths[0])}))
        return 0
    print(f"wrote {', '.join(map(str, paths))}" + (f"; latency tables -> {device}" if device else ""))
    return 0


def run_weights(args, threads: list[int]) -> int:
    schemes = weights.check_schemes(parse_list(args.weights, str, None, "weights"))
    if args.model or args.calibration:
        raise RvqspecError("--weights benchmarks the real 0.6B architecture at the paper's acceptance: drop --model "
                           "and --calibration")
    plan = (weights.quick_weights_plan if args.quick else weights.WeightsPlan)(schemes, threads)
    report = weights.run_weights_bench(plan, (lambda *a, **k: None) if args.json else print)
    report["command"] = command_line(args)
    paths = write_reports(report, Path(args.out), "bench-weights-quick" if args.quick else "bench-weights",
                          weights.weights_markdown)
    if args.json:
        print(json.dumps({"weights": report["weights"], "report": str(paths[0])}))
    else:
        print(f"wrote {paths[0]} and {paths[1]}")
    return 0


def run(args) -> int:
    dtypes = parse_list(args.dtype, str, None, "dtype")
    for dtype in dtypes:
        resolve_dtype(dtype)
    threads = parse_list(args.threads, int, None, "threads")
    if any(t < 1 for t in threads):
        raise RvqspecError(f"--threads must be >= 1, got {args.threads!r}")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise RvqspecError(f"--device {args.device}: no CUDA device is available here (use --device cpu)")
    if args.weights and not args.batch:
        return run_weights(args, threads)
    if args.batch:
        return run_batch(args, dtypes, threads)
    text = "0.6b,1.7b" if args.archs is None else args.archs
    archs = parse_list(text, str.lower, one_stream.ARCHS, "archs") if text else []
    archs.sort(key=lambda arch: arch != REFERENCE_ARCH)  # its rows give the other frame lengths their target
    sizes = parse_list(args.sizes, int, None, "sizes")
    if any(n < 1 for n in sizes):
        raise RvqspecError(f"--sizes must be tree sizes >= 1, got {args.sizes!r}")
    if not archs and not args.model:
        raise RvqspecError("nothing to benchmark: pass --archs and/or --model")
    if archs and args.model and args.calibration:  # one tokens/step table per report: it would mix the two
        raise RvqspecError("--calibration measures --model's acceptance, the real architectures run at the paper's: "
                           "bench them separately (`rvqspec bench` and `rvqspec bench --archs '' --model M "
                           "--calibration C`)")
    calibration = load_calibration(args.calibration)
    trees_dir = args.trees or (str(Path(calibration["path"]).parent) if calibration and args.model else None)
    trees = load_trees(sizes, trees_dir)
    plan = (quick_plan if args.quick else Plan)(archs, dtypes, threads, sizes)
    if args.rounds:
        plan = Plan(**(plan.__dict__ | {"latency_rounds": args.rounds}))
    drafter = args.drafter or ((calibration or {}).get("drafter") or {}).get("spec", "reused")
    log = (lambda *a, **k: None) if args.json else print
    report = run_bench(plan, trees, calibration, args.model, drafter, args.corpus, log, args.device)
    report["trees"] = trees_dir or "default_tree(N)"
    report["command"] = command_line(args)
    paths = write_reports(report, Path(args.out), "bench-quick" if args.quick else "bench", markdown, plot,
                          log=(lambda *a: None) if args.json else print)
    if args.json:
        print(json.dumps({k: report[k] for k in ("tokens_per_step", "calls_per_frame", "speedup",
                                                 "speedup_at_paper_acceptance", "stand_in_speedup", "chosen",
                                                 "paper_acceptance", "csm_at_paper_acceptance")}
                         | {"cpu_class": report["machine"].get("cpu_class"), "report": str(paths[0])}))
        return 0
    chosen = report["chosen"]
    print(f"wrote {', '.join(map(str, paths))}" + (f"; chosen N = {chosen['tree_size']}" if chosen else ""))
    return 0


def add_cli(subparsers) -> None:
    p = subparsers.add_parser("bench", help="per-call latency sweep, speed-up vs tree size, acceptance-controlled "
                                            "runs; reports the best tree size N for this device",
                              parents=[flags.model_flag(required=False, help="also benchmark this checkpoint folder (e.g. "
                                                  "the stand-in; with --calibration: alone)"),
                                       flags.drafter_flag(default=None, help="drafter for --model: 'reused' or a trained "
                                                    "file (default: the calibration's, else reused)")])
    p.add_argument("--archs", help="real architectures (random weights): 0.6b, 1.7b, csm-1b (Sesame CSM-1B's depth "
                                   "decoder), or ''; default 0.6b,1.7b (--batch: one of them, default 0.6b)")
    p.add_argument("--calibration", help="`rvqspec calibrate` report.json (or its folder): tokens/step per N "
                                         "instead of the paper's acceptance; its trees, drafter and corpus for --model")
    p.add_argument("--trees", help="folder of tree-N{N}.json (default: default_tree(N))")
    p.add_argument("--corpus", help="code corpus whose validation frames --model decodes")
    p.add_argument("--sizes", default=",".join(map(str, SIZES)), help="tree sizes N")
    p.add_argument("--dtype", default="bfloat16,float32", help="comma-separated dtypes (--quick: the first)")
    p.add_argument("--threads", default="1,2", help="comma-separated torch thread counts (--quick: the first)")
    p.add_argument("--rounds", type=flags.positive_int, help="latency rounds (default 20, quick 5; --batch: 10, quick 4)")
    p.add_argument("--batch", help="batched decoding instead: comma-separated batch sizes (e.g. 1,2,4,8,16); frames/s "
                                   "of our AR, the decoding policy and upstream, latency tables for the policy")
    p.add_argument("--weights", help="weights schemes instead: comma-separated, bfloat16 and rvqspec.quantize schemes "
                                     "(w8a16, w8a8); AR and speculative frames of the 0.6B at the paper's acceptance")
    p.add_argument("--device", type=flags.device, default="cpu", help="cpu or cuda (--batch, and the real architectures)")
    p.add_argument("--quick", action="store_true", help="one dtype/thread setting, fewer repeats (< 3 minutes)")
    p.add_argument("--out", type=flags.out_folder, default="benchmarks/results", help="folder for bench.{json,md,png}")
    p.add_argument("--no-device-file", action="store_true", help="--batch: do not write the latency tables to the "
                                                                 "device file")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(run=run)
