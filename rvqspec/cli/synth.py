"""`rvqspec synth` and `rvqspec corpus from-audio`: real Qwen3-TTS checkpoints, run through upstream qwen-tts.

synth: text -> upstream talker -> code predictor through rvqspec (speculative unless --no-spec) -> upstream
12 Hz speech tokenizer -> wav. corpus from-audio: recorded speech + transcripts -> 12 Hz codes -> the talker's
hidden state per frame by teacher forcing -> a code corpus (`rvqspec/corpus.py`) for `train-offsets`; with a
Sesame CSM checkpoint (transformers), its Mimi codes and the backbone's state instead.

--model is a checkpoint folder, or a Hugging Face repo id whose files are already in the local cache:
nothing is ever downloaded.
"""

import json
import os
import re
import time
from pathlib import Path

import torch

from rvqspec.checkpoint import atomic_write
from rvqspec.errors import RvqspecError
from rvqspec import flags
from rvqspec.model import resolve_dtype

AUDIO_SUFFIXES = (".wav", ".flac", ".mp3", ".ogg")
REPO_ID = re.compile(r"[\w.-]+/[\w.-]+")


def resolve_model(name: str) -> Path:
    """`name` if it is a folder, else the snapshot folder of Hugging Face repo `name` in the local cache.
    Puts huggingface_hub in offline mode for this process (HF_HUB_OFFLINE=1): loading never downloads."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    path = Path(name).expanduser()
    if path.is_dir():
        return path
    if not REPO_ID.fullmatch(name):
        raise RvqspecError(f"checkpoint folder {name} does not exist: pass a folder holding config.json, the "
                           "weights and speech_tokenizer/, or a Hugging Face repo id such as "
                           "Qwen/Qwen3-TTS-12Hz-0.6B-CustomVoice")
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        snapshot = Path(snapshot_download(name, local_files_only=True))
    except LocalEntryNotFoundError:
        snapshot = None
    if snapshot is None or not (snapshot / "config.json").is_file():
        raise RvqspecError(f"the weights of {name} are not on disk (no folder of that name, and no complete entry in "
                           f"the Hugging Face cache {constants.HF_HUB_CACHE}; rvqspec never downloads): fetch them "
                           f"once with `huggingface-cli download {name}`, or pass --model /path/to/checkpoint")
    return snapshot


def load_tts(folder: Path, device: str, dtype: torch.dtype):
    """Upstream's `Qwen3TTSModel` (talker, predictor, 12 Hz speech tokenizer, text processor) from `folder`."""
    from rvqspec.integrations.qwen_tts import import_qwen_tts

    from safetensors import SafetensorError

    qwen_tts = import_qwen_tts()
    try:
        return qwen_tts.Qwen3TTSModel.from_pretrained(str(folder), device_map=device, dtype=dtype)
    except (OSError, ValueError, KeyError, SafetensorError) as e:  # a truncated file: SafetensorError
        raise RvqspecError(f"qwen-tts cannot load {folder} ({type(e).__name__}: {e}): pass a complete Qwen3-TTS "
                           "12 Hz checkpoint folder") from None


def default_device(device: str | None) -> str:
    return device or ("cuda" if torch.cuda.is_available() else "cpu")


def default_dtype(dtype: str | None, device: str) -> torch.dtype:
    return resolve_dtype(dtype or ("bfloat16" if device.startswith("cuda") else "float32"))


def write_wav(path: str | Path, wav, sample_rate: int) -> None:
    import soundfile

    atomic_write(path, lambda tmp: soundfile.write(tmp, wav, sample_rate, format="WAV"))


def load_drafting(args):
    """(drafter, tree) from the flags, checked before any model is loaded; (None, None) for plain AR."""
    from rvqspec.drafters import Drafter, ReusedHeads
    from rvqspec.tree import Tree

    if args.no_spec:
        if args.drafter != "reused" or args.tree:
            raise RvqspecError("--no-spec decodes autoregressively: drop --drafter/--tree, or drop --no-spec")
        return None, None
    drafter = ReusedHeads() if args.drafter == "reused" else Drafter.load(args.drafter)
    return drafter, Tree.load(args.tree) if args.tree else "auto"


def synthesize(tts, handle, text: str, out: str | Path, **speech_args) -> dict:
    """Generate `text` with the accelerated `tts`, write `out`; a report of what the predictor did."""
    from rvqspec.integrations.qwen_tts import generate_speech

    handle.stats.reset()
    start = time.perf_counter()
    wavs, sample_rate = generate_speech(tts, text, **speech_args)
    seconds = time.perf_counter() - start
    write_wav(out, wavs[0], sample_rate)
    stats = handle.stats
    sizes = [n for n in stats.tree_sizes if n]
    return {"out": str(out), "audio_seconds": len(wavs[0]) / sample_rate, "sample_rate": sample_rate,
            "frames": stats.frames, "calls_per_frame": stats.calls_per_frame, "tokens_per_step": stats.tokens_per_step,
            "speculative": bool(sizes), "tree_nodes": max(sizes, default=0), "decoding": handle.explain(1),
            "wall_seconds": seconds}


def run_synth(args) -> int:
    from rvqspec.integrations.qwen_tts import accelerate

    drafter, tree = load_drafting(args)
    device = default_device(args.device)
    tts = load_tts(resolve_model(args.model), device, default_dtype(args.dtype, device))
    handle = accelerate(tts, drafter=drafter, tree=tree)
    torch.manual_seed(args.seed)
    report = synthesize(tts, handle, args.text, args.out, language=args.language, speaker=args.speaker,
                        instruct=args.instruct, ref_audio=args.ref_audio, ref_text=args.ref_text)
    mode = report["decoding"]
    print(f"wrote {report['out']}: {report['audio_seconds']:.2f} s of audio at {report['sample_rate']} Hz, "
          f"{report['frames']} frames in {report['wall_seconds']:.1f} s")
    print(f"code predictor ({mode}): {report['calls_per_frame']:.2f} calls/frame, "
          f"{report['tokens_per_step']:.2f} tokens/step")
    return 0


def audio_with_transcripts(folder: str | Path) -> list[tuple[Path, str]]:
    """(audio file, transcript) for every audio file under `folder`; each needs <name>.txt beside it."""
    folder = Path(folder)
    if not folder.is_dir():
        raise RvqspecError(f"audio folder {folder} does not exist")
    files = sorted(p for p in folder.rglob("*") if p.suffix.lower() in AUDIO_SUFFIXES and p.is_file())
    if not files:
        raise RvqspecError(f"no audio ({', '.join(AUDIO_SUFFIXES)}) under {folder}")
    missing = [p for p in files if not p.with_suffix(".txt").is_file()]
    if missing:
        raise RvqspecError(f"{len(missing)} of {len(files)} audio files have no transcript (e.g. {missing[0]} needs "
                           f"{missing[0].with_suffix('.txt').name} beside it): the talker is conditioned on the text, "
                           "so write each transcript to <name>.txt")
    return [(p, p.with_suffix(".txt").read_text(encoding="utf-8").strip()) for p in files]


def load_recording(path: Path, sample_rate: int | None = None):
    """(mono waveform, its sample rate), resampled to `sample_rate` if given; an undecodable file is named (the
    corpus being written is then not finished: its writer aborts)."""
    import librosa

    try:
        return librosa.load(path, sr=sample_rate, mono=True)
    except Exception as e:  # decoders raise many types
        raise RvqspecError(f"{path} cannot be decoded as audio ({type(e).__name__}): convert it to wav, or "
                           "remove it and its transcript") from None


def utterance_id(path: Path, folder: str | Path) -> str:
    """A recording's corpus id: its path under the audio folder, without suffix."""
    return path.relative_to(folder).with_suffix("").as_posix()


def corpus_from_audio(tts, folder: str | Path, out: str | Path, language: str = "Auto", speaker: str | None = None,
                      instruct: str | None = None, hidden_dtype: torch.dtype = torch.float16,
                      overwrite: bool = False, meta: dict | None = None) -> dict:
    """Write a code corpus from the audio under `folder`: per frame, the 12 Hz codes of the recording and
    the talker's hidden state for them under teacher forcing, conditioned as `generate_speech` would be
    (a Base model is conditioned on each recording's own x-vector)."""
    from rvqspec.corpus import CorpusWriter
    from rvqspec.integrations.qwen_tts import talker_prompt, teacher_forced_hidden

    items = audio_with_transcripts(folder)
    talker = tts.model.talker
    meta = {"source": "rvqspec corpus from-audio", "language": language, "speaker": speaker, **(meta or {})}
    frames = 0
    with CorpusWriter(out, talker.config.hidden_size, talker.config.num_code_groups, hidden_dtype=hidden_dtype,
                      meta=meta, overwrite=overwrite) as writer:
        for path, text in items:
            wav, sample_rate = load_recording(path)
            codes = tts.model.speech_tokenizer.encode(wav, sr=sample_rate).audio_codes[0]
            prompt = talker_prompt(tts, text, language=language, speaker=speaker, instruct=instruct,
                                   ref_audio=(wav, sample_rate))
            hidden = teacher_forced_hidden(talker, prompt, codes)
            writer.add(utterance_id(path, folder), language.lower(), codes.cpu(), hidden.float().cpu())
            frames += len(codes)
    return {"out": str(out), "utterances": len(items), "frames": frames}


def is_csm_checkpoint(folder: Path) -> bool:
    try:
        return json.loads((folder / "config.json").read_text()).get("model_type") == "csm"
    except (OSError, ValueError, AttributeError):
        return False


def csm_corpus_from_audio(args, folder: Path, recordings: list[tuple[Path, str]]) -> dict:
    """The CSM branch of `corpus from-audio`: transformers' model and processor from `folder`, the recordings
    encoded by its Mimi codec, the backbone's teacher-forced state per frame."""
    from rvqspec.integrations import csm

    try:
        from transformers import AutoProcessor, CsmForConditionalGeneration

        device = default_device(args.device)
        model = CsmForConditionalGeneration.from_pretrained(str(folder), device_map=device,
                                                            dtype=default_dtype(args.dtype, device)).eval()
        processor = AutoProcessor.from_pretrained(str(folder))
    except (OSError, ValueError, KeyError, ImportError) as e:
        raise RvqspecError(f"transformers cannot load the CSM model and processor in {folder} ({type(e).__name__}: "
                           f"{e}): pass a complete CSM checkpoint folder (e.g. sesame/csm-1b)") from None
    rate = processor.feature_extractor.sampling_rate
    loaded = ((utterance_id(path, args.audio), text, load_recording(path, rate)[0]) for path, text in recordings)
    items = csm.audio_items(model, processor, loaded, args.speaker or "0", args.language.lower())
    return csm.corpus_from_codes(model, items, args.out, resolve_dtype(args.hidden_dtype), args.overwrite,
                                 meta={"model": args.model, "speaker": args.speaker or "0"})


def run_from_audio(args) -> int:
    recordings = audio_with_transcripts(args.audio)  # fail on a bad folder before loading a model
    folder = resolve_model(args.model)
    if is_csm_checkpoint(folder):
        report = csm_corpus_from_audio(args, folder, recordings)
        print(f"wrote corpus {report['out']}: {report['utterances']} utterances, {report['frames']} frames")
        return 0
    device = default_device(args.device)
    tts = load_tts(folder, device, default_dtype(args.dtype, device))
    report = corpus_from_audio(tts, args.audio, args.out, args.language, args.speaker, args.instruct,
                               resolve_dtype(args.hidden_dtype), args.overwrite, meta={"model": args.model})
    print(f"wrote corpus {report['out']}: {report['utterances']} utterances, {report['frames']} frames")
    return 0


def add_model_args(p) -> None:
    p.add_argument("--language", default="Auto", help="language name as qwen-tts spells it (e.g. English), or Auto")
    p.add_argument("--speaker", help="CustomVoice models: one of the model's speakers; CSM: the speaker id (default 0)")
    p.add_argument("--instruct", help="VoiceDesign models: the voice description (CustomVoice 1.7B: a style)")
    p.add_argument("--device", type=flags.device, help="default: cuda if available, else cpu")
    p.add_argument("--dtype", help="default: bfloat16 on cuda, float32 on cpu")


def add_cli(subparsers) -> None:
    model = flags.model_flag(help="checkpoint folder, or a Hugging Face repo id already in the local cache")
    p = subparsers.add_parser("synth", help="text to wav with a Qwen3-TTS checkpoint through qwen-tts, "
                                            "code predictor decoded by rvqspec", parents=[model, flags.drafter_flag()])
    add_model_args(p)
    p.add_argument("--text", required=True)
    p.add_argument("--out", required=True, help="output .wav")
    p.add_argument("--ref-audio", help="Base (voice clone) models: reference recording")
    p.add_argument("--ref-text", help="Base models: its transcript (in-context cloning; without it, x-vector only)")
    p.add_argument("--no-spec", action="store_true", help="plain autoregressive decoding (15 calls a frame)")
    p.add_argument("--tree", help="tree JSON (rvqspec calibrate); default: the decoding policy chooses AR or a "
                                     "prior tree from this device's measured latencies")
    p.add_argument("--seed", type=flags.seed, default=0)
    p.set_defaults(run=run_synth)


def add_corpus_cli(corpus) -> None:
    """`rvqspec corpus from-audio`."""
    model = flags.model_flag(help="checkpoint folder, or a Hugging Face repo id already in the local cache")
    p = corpus.add_parser("from-audio", help="code corpus from recordings + transcripts, with a Qwen3-TTS or a "
                                             "Sesame CSM checkpoint (as saved by transformers)",
                          parents=[model])
    add_model_args(p)
    p.add_argument("--audio", required=True, help="folder of audio files, each with its transcript in <name>.txt")
    p.add_argument("--out", required=True, type=flags.out_folder, help="corpus folder to write")
    p.add_argument("--hidden-dtype", default="float16", help="storage of the hidden states: float16, bfloat16, float32")
    p.add_argument("--overwrite", action="store_true", help="replace a corpus already in --out")
    p.set_defaults(run=run_from_audio)
