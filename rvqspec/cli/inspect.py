"""`rvqspec inspect --model MODEL_DIR`: the depth decoder a checkpoint folder holds (Qwen3-TTS's code predictor or
CSM's depth decoder), its config and parameter counts. `rvqspec inspect --device`: this CPU's class and the kernel
choices the core measured for it (`core/device_path.py`), with the figures behind them.

Loading the predictor checks the whole folder (config, every tensor the predictor needs and its shape),
so this is also the quick way to validate a checkpoint before a long job.
"""

import json
from pathlib import Path

import torch

from rvqspec.bench.floor import one_row_steps
from rvqspec.cli import flags
from rvqspec.core import cpu_class, device_path, fused
from rvqspec.core.errors import RvqspecError
from rvqspec.core.model import MultiCodeDecoder
from rvqspec.core.quantize import w8a8_kernel
from rvqspec.integrations.hub import REPO_ID, resolve_model


STEP_REPEATS = 15  # the weights schemes' interleaved repeats: 7 left a w8a8 figure at 2 threads that moved by 10
# points between runs on a shared machine


def parameter_counts(model: MultiCodeDecoder) -> dict[str, int]:
    """Parameters by part, and how many of them one single-token call reads (`per_token_call`): the layers,
    the final norm, the input projection, one head and one embedding row."""
    c = model.config
    layers = sum(p.numel() for p in model.layers.parameters()) + model.norm.weight.numel()
    projection = sum(p.numel() for p in model.project.parameters())
    head = c.vocab_size * c.hidden_size
    return {"layers": layers, "projection": projection, "code_tables": model.code_embed.weight.numel(),
            "heads": model.heads.numel(), "total": sum(p.numel() for p in model.parameters()),
            "per_token_call": layers + projection + head + c.talker_hidden_size}


def predictor_folder(name: str) -> Path:
    """The folder --model names, read as `synth` and `tune` read it: `standin` (the shipped stand-in), a folder, or a
    Hugging Face repo id whose files are in the local cache."""
    if name == "standin":
        from rvqspec.standin.settings import MODEL_DIR

        return MODEL_DIR
    return resolve_model(name) if REPO_ID.fullmatch(name) and not Path(name).exists() else Path(name)


def device_report() -> dict:
    """The CPU class and, per measured dtype, the kernel choices and their figures (measured now if not cached)."""
    with torch.inference_mode():
        choices = {str(dtype).removeprefix("torch."): device_path.decided(dtype, "rvqspec inspect --device")
                   for dtype in device_path.MEASURED_DTYPES}
    return {"cpu": cpu_class.describe(), "cpu_class": cpu_class.cpu_class(), "int8_dot_products": cpu_class.has_int8_dot(),
            "w8a8": "runs (exact integer GEMM)" if w8a8_kernel() else "refused: no int8 dot products, no AVX2 kernel",
            "fused_kernels_cflags": fused.cflags(), "cache_key": device_path.cache_key(), "choices": choices,
            "weights": one_row_steps(repeats=STEP_REPEATS, log=lambda line: None)}


def print_device(report: dict) -> None:
    print(f"CPU {report['cpu']} (class {report['cpu_class']}); w8a8 {report['w8a8']}")
    print(f"  fused kernels compiled with {' '.join(report['fused_kernels_cflags'])}")
    for dtype, choice in report["choices"].items():
        m = choice["matmul"]
        matmuls = "rvqspec's bfloat16 kernel for every row count (no padding); else " if m["bf16_kernel"] else ""
        print(f"  {dtype}: matmuls {matmuls}{'packed' if m['packed_one'] else 'plain'} for one row, "
              f"{'packed' if m['packed_many'] else 'plain'} for more; rows padded to {m['pad_rows']} (matmuls) and "
              f"{m['attention_rows']} (attention queries); int8 draft heads {'on' if choice['int8_drafts'] else 'off'}")
        for what, figures in choice["figures"].items():
            print(f"    {what}: {json.dumps(figures)}")
    steps = report["weights"]
    print(f"  weights schemes, one row through the {steps['arch']} predictor's decoder stack as the engine runs it (a "
          f"cached step of a random model; {steps['threads']} thread(s); floor = a copy moving the layer matrices' "
          "bytes on huge pages, as the packed weights lie, timed between the calls, each right after one of itself):")
    for scheme, kernel in steps["kernels"].items():
        r = steps["schemes"][scheme]
        print(f"    {scheme}: {kernel}: {r.get('refused') or scheme_figures(r)}")


def scheme_figures(r: dict) -> str:
    """One scheme's stack figures, then its matrices' called one by one (labelled)."""
    rows = ", ".join(f"{n} rows {x:.2f}x" for n, x in r["rows_over_one"].items())
    return (f"{r['path']}: {r['ms']['1']:.2f} ms, {r['of_floor']:.0%} of the floor ({r['floor_ms']:.2f} ms, "
            f"{r['bandwidth_gb_s']:.1f} GB/s); {rows}; the layer matrices alone, one call each: "
            f"{r['matrices_ms']['1']:.2f} ms, {r['matrices_of_floor']:.0%} of the floor")


def run(args) -> int:
    if args.device:
        report = device_report()
        print(json.dumps(report)) if args.json else print_device(report)
        return 0
    if args.model is None:
        raise RvqspecError("inspect needs --model (a checkpoint folder, a cached repo id or `standin`) or --device")
    folder = predictor_folder(args.model)
    model = MultiCodeDecoder.from_pretrained(folder, dtype=args.dtype)
    report = {"folder": str(folder), "dtype": str(model.dtype).removeprefix("torch."),
              "config": model.config.to_dict(), "parameters": parameter_counts(model)}
    if args.json:
        print(json.dumps(report))
        return 0
    print(f"depth decoder in {report['folder']} ({model.config.layout} layout, {report['dtype']})")
    for name, value in report["config"].items():
        print(f"  {name:26s} {value}")
    for name, value in report["parameters"].items():
        print(f"  parameters.{name:15s} {value:,}")
    return 0


def add_cli(subparsers) -> None:
    model = flags.model_flag(required=False, help="checkpoint folder (config.json + *.safetensors), a Hugging Face repo id already "
                                  "in the local cache, or `standin`")
    p = subparsers.add_parser("inspect", help="load a checkpoint's depth decoder (Qwen3-TTS or CSM); print its config and sizes",
                              parents=[model])
    p.add_argument("--dtype", default="float32", help="float32, bfloat16 or float16")
    p.add_argument("--device", action="store_true", help="instead: this CPU's class and the kernel choices measured "
                                                         "for it, with their figures")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(run=run)
