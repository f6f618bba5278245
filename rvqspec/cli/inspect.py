"""`rvqspec inspect MODEL_DIR`: the depth decoder a checkpoint folder holds (Qwen3-TTS's code predictor or CSM's
depth decoder), its config and parameter counts.

Loading the predictor checks the whole folder (config, every tensor the predictor needs and its shape),
so this is also the quick way to validate a checkpoint before a long job.
"""

import json
from pathlib import Path

from rvqspec.cli import flags
from rvqspec.engine.model import MultiCodeDecoder
from rvqspec.integrations.hub import REPO_ID, resolve_model


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


def run(args) -> int:
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
    model = flags.model_flag(help="checkpoint folder (config.json + *.safetensors), a Hugging Face repo id already "
                                  "in the local cache, or `standin`")
    p = subparsers.add_parser("inspect", help="load a checkpoint's depth decoder (Qwen3-TTS or CSM); print its config and sizes",
                              parents=[model])
    p.add_argument("--dtype", default="float32", help="float32, bfloat16 or float16")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(run=run)
