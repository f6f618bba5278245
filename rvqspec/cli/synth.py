"""`rvqspec synth` and `rvqspec corpus from-audio`: real Qwen3-TTS checkpoints, run through upstream qwen-tts.

synth: text -> upstream talker -> code predictor through rvqspec (speculative unless --no-spec) -> upstream
12 Hz speech tokenizer -> wav. `--text -` reads the text from stdin; with --stream, as it arrives (an LLM's output
piped in), spoken by `rvqspec.Engine` from its first word on (upstream's dual-track prompt: docs/live-speech.md). corpus from-audio: recorded speech + transcripts -> 12 Hz codes -> the talker's
hidden state per frame by teacher forcing -> a code corpus (`rvqspec.tuning.corpus`) for `train-offsets`; with a
Sesame CSM checkpoint (transformers), its Mimi codes and the backbone's state instead.

--model is a checkpoint folder, or a Hugging Face repo id whose files are already in the local cache:
nothing is ever downloaded.
"""

import codecs
import errno
import os
import sys
import time
from collections.abc import Iterator
from contextlib import closing, contextmanager
from pathlib import Path

import numpy as np
import torch

from rvqspec.cli import flags
from rvqspec.cli.tune import is_standin_folder
from rvqspec.core.checkpoint import atomic_write
from rvqspec.core.errors import RvqspecError
from rvqspec.core.frame_loop import CHUNK_FRAMES
from rvqspec.core.model import resolve_dtype
from rvqspec.core.quantize import SCHEMES
from rvqspec.integrations import csm
from rvqspec.integrations.hub import default_device, default_dtype, resolve_model
from rvqspec.integrations.qwen_tts import accelerate, generate_speech, load_tts, speech_request, upstream_refusals
from rvqspec.integrations.tuned import IDENTITY
from rvqspec.tuning import csm_corpus, qwen_tts_corpus
from rvqspec.tuning.recordings import audio_with_transcripts, is_csm_checkpoint


SF_ERR_SYSTEM = 2  # libsndfile's error code for a failed system call (a full disk, the file size limit)


@contextmanager
def wav_errors():
    """A failed libsndfile write raised as the OSError it is. libsndfile says only "System error" for a full disk or
    a file over the size limit; the cause is the C errno of its last call, which cffi keeps per thread."""
    import soundfile

    try:
        yield
    except soundfile.LibsndfileError as e:
        code = soundfile._ffi.errno if e.code == SF_ERR_SYSTEM else 0
        raise OSError(code or errno.EIO, os.strerror(code) if code else f"libsndfile: {e}") from None


def write_wav(path: str | Path, wav, sample_rate: int) -> None:
    import soundfile

    def write(tmp: str) -> None:
        with wav_errors():
            soundfile.write(tmp, wav, sample_rate, format="WAV")

    atomic_write(path, write)


def load_drafting(args):
    """(drafter, tree) from the flags, checked before any model is loaded; (None, None) for plain AR (or --tuned,
    whose folder brings its own)."""
    from rvqspec.core.drafters import Drafter, ReusedHeads
    from rvqspec.core.tree import Tree

    if args.tuned:
        if args.no_spec or args.drafter != "reused" or args.tree:
            raise RvqspecError("--tuned brings its own drafter and trees: drop --drafter/--tree/--no-spec")
        return None, "auto"
    if args.no_spec:
        if args.drafter != "reused" or args.tree:
            raise RvqspecError("--no-spec decodes autoregressively: drop --drafter/--tree, or drop --no-spec")
        return None, None
    drafter = ReusedHeads() if args.drafter == "reused" else Drafter.load(args.drafter)
    return drafter, Tree.load(args.tree) if args.tree else "auto"


def qwen_tts_folder(name: str) -> Path:
    """The checkpoint folder --model names. A folder rvqspec knows is no qwen-tts checkpoint (a tuned folder, the
    stand-in) is refused in one line naming what to pass, before transformers answers with its list of every model
    type it knows."""
    if name == "standin" or is_standin_folder(Path(name)):
        raise RvqspecError(f"{name} is the stand-in, not a qwen-tts checkpoint (it has no speech tokenizer or text "
                           "model): `rvqspec demo` speaks with it, `rvqspec inspect --model standin` shows it")
    folder = resolve_model(name)
    if (folder / IDENTITY).is_file():
        raise RvqspecError(f"{name} is a folder `rvqspec tune` wrote, not a checkpoint: pass it as --tuned {name}, "
                           "with --model the checkpoint it was tuned for")
    return folder


def synthesize(tts, handle, texts: list[str], out: str | Path, limit: int | None, **speech_args) -> dict:
    """Generate `texts` (the sentences of a long text, or the one text) in turn with the accelerated `tts`, write
    their audio to `out`; a report of what the predictor did."""
    handle.stats.reset()
    start, wavs, cut = time.perf_counter(), [], []
    for index, text in enumerate(texts):
        with frame_budget(tts, handle, text, limit, index, cut) as budget:
            (wav,), sample_rate = generate_speech(tts, text, max_new_tokens=budget, **speech_args)
        wavs.append(wav)
    seconds = time.perf_counter() - start
    audio = np.concatenate(wavs)
    write_wav(out, audio, sample_rate)
    stats = handle.stats
    sizes = [n for n in stats.tree_sizes if n]
    return {"out": str(out), "audio_seconds": len(audio) / sample_rate, "sample_rate": sample_rate,
            "frames": stats.frames, "calls_per_frame": stats.calls_per_frame, "tokens_per_step": stats.tokens_per_step,
            "speculative": bool(sizes), "tree_nodes": max(sizes, default=0), "decoding": handle.explain(1),
            "wall_seconds": seconds, "sentences": len(texts), "cut": cut}


@contextmanager
def frame_budget(tts, handle, text: str, limit: int | None, index: int, cut: list) -> Iterator[int]:
    """The frame budget of one text (`limit`, else its text's: runtime/qwen_tts.py), held while upstream's loop
    speaks it; (index, budget) goes into `cut` when the loop spent it (its last c0 draw is never decoded)."""
    from rvqspec.runtime.qwen_tts import upstream_text_budget

    budget, before = limit or upstream_text_budget(tts, text), handle.stats.frames
    yield budget
    if handle.stats.frames - before >= budget - 1:
        cut.append((index, budget))


def write_progressively(out: str | Path, chunks, sample_rate: int) -> tuple[int, float | None]:
    """Write the audio chunks into a partial file beside `out` (`.<name>.<random>.part.wav`, created anew: never a
    file of the user's), a valid wav after every chunk (for a player to follow), renamed onto `out` at the end;
    removed if anything stops the stream (Ctrl-C, a full disk). The stream is closed, its worker joined, before
    this returns or raises: a worker still running when the process exits aborts it ("terminate called without an
    active exception"). (samples written, seconds to the first chunk)."""
    import soundfile

    start, first, samples = time.perf_counter(), None, 0

    def write(part: str) -> None:
        nonlocal first, samples
        with wav_errors(), soundfile.SoundFile(part, "w", samplerate=sample_rate, channels=1, format="WAV") as wav:
            for audio, _ in chunks:
                first = time.perf_counter() - start if first is None else first
                wav.write(audio)
                wav.flush()  # the header now counts these samples: a valid file
                samples += len(audio)

    with closing(chunks):
        atomic_write(out, write, suffix=".part.wav")
    return samples, first


def stream_synth(tts, handle, args, texts: list[str]) -> dict:
    sample_rate = int(tts.model.speech_tokenizer.get_output_sample_rate())
    handle.stats.reset()
    start, cut = time.perf_counter(), []

    def chunks() -> Iterator[tuple]:
        for index, text in enumerate(texts):
            entry_point, arguments = speech_request(tts, text, args.language, args.speaker, args.instruct,
                                                    args.ref_audio, args.ref_text)
            with frame_budget(tts, handle, text, args.max_new_tokens, index, cut) as budget:
                with closing(getattr(handle, f"stream_{entry_point}")(**arguments, chunk_frames=args.chunk_frames,
                                                                       max_new_tokens=budget)) as sentence:
                    yield from sentence

    with upstream_refusals():
        samples, first = write_progressively(args.out, chunks(), sample_rate)
    seconds = time.perf_counter() - start
    return {"out": str(args.out), "audio_seconds": samples / sample_rate, "sample_rate": sample_rate,
            "frames": handle.stats.frames, "wall_seconds": seconds, "first_audio_seconds": first,
            "real_time_factor": seconds / max(samples / sample_rate, 1e-9), "decoding": handle.explain(1),
            "calls_per_frame": handle.stats.calls_per_frame, "tokens_per_step": handle.stats.tokens_per_step,
            "sentences": len(texts), "cut": cut}


def stdin_pieces(fd: int | None = None) -> Iterator[str]:
    """Standard input's text as it arrives (each read's whole characters), until its end."""
    fd = sys.stdin.fileno() if fd is None else fd
    decoder = codecs.getincrementaldecoder("utf-8")()
    try:
        while data := os.read(fd, 4096):
            if piece := decoder.decode(data):
                yield piece
        if tail := decoder.decode(b"", final=True):
            yield tail
    except UnicodeDecodeError as e:
        raise RvqspecError(f"standard input is not UTF-8 text ({e.reason}): pipe text into --text -") from None


def live_synth(tts, drafter, tree, args) -> dict:
    """--text - --stream: stdin's text spoken as it arrives, by the engine (text token t at frame t)."""
    from rvqspec.runtime import Engine

    if args.tuned:
        raise RvqspecError("--text - --stream decodes with rvqspec.Engine: drop --tuned (or give the text whole)")
    entry_point, arguments = speech_request(tts, stdin_pieces(), args.language, args.speaker, args.instruct,
                                            args.ref_audio, args.ref_text)
    start = time.perf_counter()
    with Engine(tts, drafter=drafter, tree=tree, weights=args.weights, talker_weights=args.talker_weights,
                chunk_frames=args.chunk_frames) as engine, upstream_refusals():
        chunks = getattr(engine, f"stream_{entry_point}")(**arguments, seed=args.seed)
        samples, first = write_progressively(args.out, chunks, engine.sample_rate)
        status, decoding = engine.status(), engine.explain(1)
    seconds = time.perf_counter() - start
    return {"out": str(args.out), "audio_seconds": samples / engine.sample_rate, "sample_rate": engine.sample_rate,
            "frames": status["frames"], "wall_seconds": seconds, "first_audio_seconds": first,
            "real_time_factor": seconds / max(samples / engine.sample_rate, 1e-9), "decoding": decoding,
            "tokens_per_step": status["tokens_per_step"], "sentences": 1, "cut": []}


def run_synth(args) -> int:
    drafter, tree = load_drafting(args)
    if args.stream:
        flags.require_extra("rvqspec synth --stream", "demo", "soundfile")
    live = args.text == "-" and args.stream
    if args.text == "-" and not live:
        args.text = sys.stdin.read()
    device = default_device(args.device)
    tts = load_tts(qwen_tts_folder(args.model), device, default_dtype(args.dtype, device))
    if live:
        return print_report(live_synth(tts, drafter, tree, args), args)
    handle = accelerate(tts, drafter=drafter, tree=tree, weights=args.weights, tuned=args.tuned,
                        talker_weights=args.talker_weights)
    torch.manual_seed(args.seed)  # once: the sentences of a long text carry the seed on
    texts = sentences_of(args.text, args.sentences)
    if args.stream:
        report = stream_synth(tts, handle, args, texts)
    else:
        report = synthesize(tts, handle, texts, args.out, args.max_new_tokens, language=args.language,
                            speaker=args.speaker, instruct=args.instruct, ref_audio=args.ref_audio,
                            ref_text=args.ref_text)
    return print_report(report, args)


def print_report(report: dict, args) -> int:
    mode = report["decoding"]
    print(f"wrote {report['out']}: {report['audio_seconds']:.2f} s of audio at {report['sample_rate']} Hz, "
          f"{report['frames']} frames in {report['wall_seconds']:.1f} s")
    if args.stream:
        print(f"streamed: first audio after {report['first_audio_seconds']:.2f} s, real-time factor "
              f"{report['real_time_factor']:.2f} (synthesis time / audio time)")
    calls = f"{report['calls_per_frame']:.2f} calls/frame, " if "calls_per_frame" in report else ""
    print(f"code predictor ({mode}): {calls}{report['tokens_per_step']:.2f} tokens/step")
    if report["sentences"] > 1:
        print(f"spoken sentence by sentence: {report['sentences']} sentences (--sentences off: one utterance)")
    for index, budget in report["cut"]:
        which = f"sentence {index + 1}" if report["sentences"] > 1 else "the text"
        print(f"{which} cut at its frame budget ({budget} frames, end reason: length): the model did not end the "
              "speech; pass a larger --max-new-tokens if the text needs it")
    return 0


def sentences_of(text: str, mode: str) -> list[str]:
    """The texts synth speaks in turn: the sentences of `text` (--sentences on, or auto past LONG_TEXT bytes), else
    the text whole, as upstream speaks it."""
    from rvqspec.runtime.sentences import is_long, split_sentences

    split = mode == "on" or (mode == "auto" and is_long(text))
    return (split_sentences(text) if split else []) or [text]


def run_from_audio(args) -> int:
    audio_with_transcripts(args.audio)  # fail on a bad folder before loading a model
    folder, device = resolve_model(args.model), default_device(args.device)
    dtype, hidden_dtype, meta = default_dtype(args.dtype, device), resolve_dtype(args.hidden_dtype), {"model": args.model}
    if is_csm_checkpoint(folder):
        model, processor = csm.load_model(folder, device, dtype)
        report = csm_corpus.corpus_from_audio(model, processor, args.audio, args.out, args.speaker or "0",
                                              args.language.lower(), hidden_dtype, args.overwrite, meta)
    else:
        report = qwen_tts_corpus.corpus_from_audio(load_tts(folder, device, dtype), args.audio, args.out,
                                                   args.language, args.speaker, args.instruct, hidden_dtype,
                                                   args.overwrite, meta)
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
    p.add_argument("--text", required=True, help="the text; '-': read it from stdin (with --stream: spoken as it "
                   "arrives, e.g. an LLM's output piped in)")
    p.add_argument("--out", required=True, type=flags.out_file, help="output .wav (a symlink: written through to "
                                                                     "its target)")
    p.add_argument("--ref-audio", help="Base (voice clone) models: reference recording")
    p.add_argument("--ref-text", help="Base models: its transcript (in-context cloning; without it, x-vector only)")
    p.add_argument("--no-spec", action="store_true", help="plain autoregressive decoding (15 calls a frame)")
    p.add_argument("--tree", help="tree JSON (rvqspec calibrate); default: the decoding policy chooses AR or a "
                                     "prior tree from this device's measured latencies")
    p.add_argument("--weights", choices=SCHEMES, help="decode the code predictor with int8 weights (rvqspec.quantize, "
                                                      "CPU): a different model than the checkpoint's, opt-in")
    p.add_argument("--talker-weights", choices=SCHEMES, help="the talker's layers with int8 weights too (CPU; "
                                                             "lossy, opt-in: docs/RESULTS.md gives its cost on c0)")
    p.add_argument("--tuned", help="a folder `rvqspec tune` wrote for this checkpoint (drafter, trees, latency table)")
    p.add_argument("--seed", type=flags.seed, default=0)
    p.add_argument("--max-new-tokens", type=flags.positive_int, help="frames at most (12.5 a second; default: "
                   "a budget from the text, docs/limits.md: 8 per text token, at least 125)")
    p.add_argument("--sentences", choices=("auto", "on", "off"), default="auto", help="speak the text sentence by "
                   "sentence, one after another (auto: past 200 bytes of UTF-8; docs/limits.md)")
    p.add_argument("--stream", action="store_true", help="write the wav while it is generated (into a hidden "
                   ".<name>.<random>.part.wav beside it, a valid file after every chunk), print time to first audio")
    p.add_argument("--chunk-frames", type=flags.chunk_frames, default=CHUNK_FRAMES,
                   help=f"with --stream: frames per chunk (default {CHUNK_FRAMES}; 12.5 frames a second)")
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
