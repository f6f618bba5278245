"""Where the stand-in's intelligibility is lost: Whisper WER of test sentences whose codes come partly
from the recording and partly from the model.

For each test sentence of one language, its recorded codes (the corpus encoded by the codec) are decoded
to speech in these versions and transcribed:

    codec                        all 16 recorded levels: the codec's own floor
    first L levels               only recorded c0..c{L-1}, the later levels left out: what the early levels carry
    recorded c0..c{L-1} + model  recorded c0..c{L-1}, the trained predictor draws the rest (deployed sampler,
                                 teacher-forced talker states): a perfect talker and L-1 perfect levels
    recorded c0, p of c1..c{L-1} + model   as above, but of c1..c{L-1} only a random share p is recorded
                                 and the predictor draws the others: a predictor right that often there
    model (AR)                   free synthesis by talker and predictor, as `rvqspec demo` does

beside the chance level (the model's transcripts scored against the next sentence). If recorded c0
plus the predictor scores near chance, no talker can make the stand-in intelligible: the words sit in
levels the predictor cannot supply. Run: `rvqspec standin diagnose --lang en --limit 10`.
"""

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from rvqspec.core.errors import RvqspecError
from rvqspec.core.model import MultiCodeDecoder
from rvqspec.core.sampling import Sampler

if TYPE_CHECKING:
    from rvqspec.standin.settings import Settings


@torch.no_grad()
def complete_levels(predictor: MultiCodeDecoder, hidden: Tensor, codes: Tensor, keep: int, sampler: Sampler,
                    generator: torch.Generator | None = None, fraction: float = 1.0) -> Tensor:
    """codes [T, G] with levels keep..G-1 drawn by the predictor, frame by frame as AR decoding does: each
    level conditioned on the talker state [T, H] and the levels before it. Of levels 1..keep-1 a random
    `fraction` of the recorded codes is kept and the predictor draws the others (a predictor that is right
    that often); c0 is always recorded."""
    if not 1 <= keep <= codes.shape[1]:
        raise ValueError(f"keep must be in 1..{codes.shape[1]} (c0 always comes from the recording), got {keep}")
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"fraction must be in [0, 1], got {fraction}")
    recorded, codes = codes, codes.clone()
    for level in range(1 if fraction < 1 else keep, codes.shape[1]):
        logits = predictor.teacher_forced_logits(hidden.to(predictor.dtype), codes)[:, level - 1]
        codes[:, level] = sampler.sample(logits.float(), generator)
        if level < keep:
            kept = torch.rand(len(codes), generator=generator) < fraction
            codes[kept, level] = recorded[kept, level]
    return codes


def recorded_levels(n: int) -> str:
    return "c0" if n == 1 else f"c0..c{n - 1}"


def diagnose(s: "Settings", lang: str = "en", limit: int | None = 10, levels: tuple[int, ...] = (1, 3, 6),
             fractions: tuple[float, ...] = (0.25, 0.5, 0.75)) -> dict:
    """WER of each version above for the first `limit` test sentences of `lang` (Settings `s`: work folder
    with the encoded corpus, shipped model and codec)."""
    from rvqspec.standin.quality import WhisperASR, codec_vocoder, wer
    from rvqspec.standin.settings import load_utterances
    from rvqspec.standin.synthesis import synthesize_codes
    from rvqspec.standin.talker import load_standin
    from rvqspec.standin.training import teacher_forced_hidden

    tts = load_standin(s.model_dir)
    utts = [u for u in load_utterances(s, "test") if u.lang == lang][:limit]
    if len(utts) < 2:
        raise RvqspecError(f"{len(utts)} test sentences of language {lang!r} in {s.codes_dir}: need 2 or more "
                           f"(the stand-in speaks {', '.join(tts.config.languages)})")
    vocoder, asr, generator = codec_vocoder(s.codec_file), WhisperASR(), torch.Generator().manual_seed(s.seed)
    sampler = Sampler()  # the deployed sampler, as in synthesis
    hidden = {u.id: teacher_forced_hidden(tts, u) for u in utts}  # the talker states, once per sentence
    versions = {"codec": lambda u: u.codes}
    versions |= {f"first {n} levels": (lambda u, n=n: u.codes[:, :n]) for n in levels}
    versions |= {f"recorded {recorded_levels(n)} + model": (lambda u, n=n: complete_levels(
        tts.predictor, hidden[u.id], u.codes, n, sampler, generator)) for n in levels}
    n = max(levels)
    versions |= {f"recorded c0, {f:.0%} of c1..c{n - 1} + model": (lambda u, f=f: complete_levels(
        tts.predictor, hidden[u.id], u.codes, n, sampler, generator, f)) for f in fractions}
    versions["model (AR)"] = lambda u: synthesize_codes(tts, u.text, lang, generator=generator).codes
    texts, figures = [u.text for u in utts], {"lang": lang, "sentences": len(utts), "wer": {}, "heard": {}}
    for name, codes_of in versions.items():
        heard = [asr(vocoder(codes), lang) if len(codes := codes_of(u)) else "" for u in utts]
        figures["wer"][name], figures["heard"][name] = round(wer(texts, heard), 4), heard[0]
        print(f"{lang} {name}: WER {figures['wer'][name]:.3f}", flush=True)
    figures["wer"]["chance"] = round(wer(texts[1:] + texts[:1], heard), 4)  # free synthesis vs another sentence
    figures["text"] = texts[0]
    return figures
