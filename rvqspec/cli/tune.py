"""`rvqspec tune --model CKPT --out runs/NAME`: the drafter, trees and latency table for one checkpoint, from the
model's own speech (rvqspec.tuning.tune). CKPT: a qwen-tts checkpoint (CustomVoice, VoiceDesign), a transformers
CSM checkpoint, or `standin` (the shipped stand-in; a stand-in folder also works)."""

import errno
import json
import os
import time
from pathlib import Path

import torch
from safetensors import SafetensorError

from rvqspec.cli import flags
from rvqspec.core.checkpoint import save_json
from rvqspec.core.model import MultiCodeDecoder
from rvqspec.integrations.hub import default_device, default_dtype, resolve_model
from rvqspec.tuning.recordings import is_csm_checkpoint
from rvqspec.tuning.train import OBJECTIVES
from rvqspec.tuning.tune import DEFAULT_MINUTES, STAGES, Subject, TuneSettings, tune

LATENCY_BATCHES = (1, 2, 4, 8)
LATENCY_ROUNDS = 5


def latency_bench(predictor: MultiCodeDecoder):
    """The bench stage: ms per call at (B, N) with the calibrated trees and the trained drafter, on this device."""

    def bench(out: Path) -> dict:
        from rvqspec.bench.timing import cpu_name
        from rvqspec.core.latency import call_latency, latency_row
        from rvqspec.core.policy import report_size, setting_key
        from rvqspec.core.sampling import Sampler
        from rvqspec.core.tree import Tree
        from rvqspec.integrations.tuned import LATENCY, TREES, tuned_drafter

        report = json.loads((out / TREES / "report.json").read_text())
        trees = {report_size(row): Tree.load(out / TREES / row["file"]) for row in report["trees"]}
        drafter = tuned_drafter(out, predictor)
        ms = {str(b): {str(n): v for n, v in latency_row(call_latency(predictor, drafter, trees, Sampler(),
                                                                      LATENCY_ROUNDS, batch=b)).items()}
              for b in LATENCY_BATCHES}
        entry = {"key": setting_key(predictor), "ms": ms,
                 "measured_on": f"{setting_key(predictor)} on {cpu_name()}, {time.strftime('%Y-%m-%d %H:%M')}"}
        save_json(out / LATENCY, entry)
        return entry

    return bench


def standin_subject(spec: str, seed: int) -> Subject:
    from rvqspec.standin.settings import ASSETS
    from rvqspec.standin.synthesis import self_synthesis
    from rvqspec.standin.talker import load_standin

    folder = ASSETS / "model" if spec == "standin" else Path(spec)
    tts = load_standin(folder)
    return Subject("standin", folder, tts.predictor, lambda: self_synthesis(tts, seed))


def qwen_tts_subject(folder: Path, device: str, dtype: torch.dtype, batch: int, seed: int) -> Subject:
    from rvqspec.integrations.qwen_tts import load_tts, predictor_from_upstream
    from rvqspec.tuning.self_synthesis import qwen_tts_utterances

    tts = load_tts(folder, device, dtype)
    if tts.model.tts_model_type == "base":  # refused before anything is written
        next(qwen_tts_utterances(tts))
    return Subject("qwen-tts", folder, predictor_from_upstream(tts.model.talker),
                   lambda: qwen_tts_utterances(tts, batch, seed))


def csm_subject(folder: Path, device: str, dtype: torch.dtype, seed: int) -> Subject:
    from rvqspec.integrations.csm import depth_decoder_from_transformers, load_model
    from rvqspec.tuning.self_synthesis import csm_utterances

    model, processor = load_model(folder, device, dtype)
    return Subject("csm", folder, depth_decoder_from_transformers(model), lambda: csm_utterances(model, processor,
                                                                                                 seed=seed))


def is_standin_folder(folder: Path) -> bool:
    try:
        return "stand_in" in json.loads((folder / "config.json").read_text()).get("talker_config", {})
    except (OSError, ValueError, AttributeError):
        return False


def subject_for(args) -> Subject:
    if args.model == "standin" or is_standin_folder(Path(args.model)):
        return standin_subject(args.model, args.seed)
    folder, device = resolve_model(args.model), default_device(args.device)
    dtype = default_dtype(args.dtype, device)
    if is_csm_checkpoint(folder):
        return csm_subject(folder, device, dtype, args.seed)
    return qwen_tts_subject(folder, device, dtype, args.batch, args.seed)


def run(args) -> int:
    subject = subject_for(args)
    if not args.no_bench:
        subject.bench = latency_bench(subject.predictor)
    settings = TuneSettings(minutes=args.minutes, epochs=args.epochs, seed=args.seed, offsets=args.offsets,
                            objective=args.objective, progress=not args.quiet)
    try:
        report = tune(subject, args.out, settings, args.force, log=print if not args.quiet else lambda _: None)
    except SafetensorError as e:  # a full disk under safetensors' own error: main's one line, exit 1
        if f"(os error {errno.ENOSPC})" not in str(e):
            raise
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)) from None
    best = max(report["trees"], key=lambda r: r["measured_tokens_per_step"] or 0)
    speedup = report["speedup"].get("1")
    predicted = (f", predicted {speedup['predicted_speedup']:.2f}x at batch 1" if speedup else "")
    print(f"tuned {args.out}: {report['corpus']['minutes']:.1f} min of self-synthesis, "
          f"{best['measured_tokens_per_step']:.2f} tokens/step on held-out frames (N={best['nodes']}){predicted}; "
          f"use it with accelerate(model, tuned=\"{args.out}\")")
    return 0


def add_cli(subparsers) -> None:
    p = subparsers.add_parser("tune", help="drafter, trees and latency table for your checkpoint, from its own "
                                           "speech (no recordings)",
                              parents=[flags.model_flag(help="qwen-tts or CSM checkpoint folder (or cached repo id), "
                                                             "or `standin`")])
    p.add_argument("--out", required=True, type=flags.out_folder, help="the tuned folder (resumed if it exists)")
    p.add_argument("--minutes", type=flags.positive_float, default=DEFAULT_MINUTES,
                   help=f"minutes of self-synthesis to train on (default {DEFAULT_MINUTES:g})")
    p.add_argument("--epochs", type=flags.positive_int, default=2, help="offset training epochs")
    p.add_argument("--offsets", choices=("shared", "per-position"), default="shared",
                   help="one offset per lookahead distance (the paper's), or one per start position and distance")
    p.add_argument("--objective", choices=OBJECTIVES, default=TuneSettings.objective,
                   help="offset training: codes (cross entropy of the synthesized codes) or acceptance "
                        "(-log P(the verifier draws the draft))")
    p.add_argument("--batch", type=flags.positive_int, default=4, help="qwen-tts: texts per generate call")
    p.add_argument("--force", choices=STAGES, help="redo this stage and the ones after it")
    p.add_argument("--no-bench", action="store_true", help="skip the latency table (the policy then uses this "
                                                           "device's `rvqspec bench --batch` table)")
    p.add_argument("--seed", type=flags.seed, default=0)
    p.add_argument("--device", type=flags.device, help="default: cuda if available, else cpu")
    p.add_argument("--dtype", help="default: bfloat16 on cuda, float32 on cpu")
    p.add_argument("--quiet", action="store_true", help="no progress bars or stage lines")
    p.set_defaults(run=run)

