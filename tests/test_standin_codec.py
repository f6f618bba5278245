"""The stand-in mel-RVQ codec on tiny synthetic signals (no corpus, no network)."""

import math

import pytest
import torch

from rvqspec.standin import codec as C

SR = 16000


def tone_sweep(seconds: float, seed: int = 0) -> torch.Tensor:
    """Harmonic tones whose pitch and loudness wander, plus a little noise: speech-like enough for mels."""
    g = torch.Generator().manual_seed(seed)
    t = torch.arange(int(seconds * SR)) / SR
    f0 = 120 + 80 * torch.sin(2 * math.pi * 0.3 * t) + 40 * torch.sin(2 * math.pi * 1.7 * t)
    phase = 2 * math.pi * torch.cumsum(f0, 0) / SR
    wav = sum(torch.sin(k * phase) / k for k in range(1, 6))
    env = 0.5 + 0.5 * torch.sin(2 * math.pi * 2.3 * t).abs()
    return 0.2 * env * wav + 0.01 * torch.randn(len(t), generator=g)


@pytest.fixture(scope="module")
def small_codec() -> C.MelRVQCodec:
    pytest.importorskip("faiss")
    cfg = C.CodecConfig(num_codebooks=4, codebook_size=16, dim=12)
    frames = C.stacked_log_mel(tone_sweep(24.0), cfg)
    return C.fit_codec(frames, cfg, niter=10)


def test_mel_frames_align_with_hops_and_code_frames():
    cfg = C.CodecConfig()
    assert cfg.samples_per_frame == 1280 and cfg.frame_rate == 12.5
    wav = tone_sweep(1.0)[: 3 * 1280]
    assert C.log_mel(wav, cfg.mel).shape == (3 * 8, 80)  # one mel frame per 160-sample hop
    feats = C.stacked_log_mel(tone_sweep(1.0)[: 3 * 1280 + 100], cfg)  # a partial frame is padded
    assert feats.shape == (4, 8 * 80)
    # the first 3 code frames see the same samples in both calls, except the edge of the last one
    assert torch.allclose(feats[:2], C.log_mel(wav, cfg.mel).reshape(3, 640)[:2], atol=1e-5)


def test_filterbank_matches_librosa():
    """Reference values from librosa.filters.mel(sr=16000, n_fft=640, n_mels=80, fmin=0, fmax=8000)."""
    fb = C.mel_filterbank(C.MelConfig())
    assert fb.shape == (80, 321)
    for row, (first, last, total, col, value) in {0: (1, 2, 0.035679184, 2, 0.017651534),
                                                 20: (30, 32, 0.039440323, 31, 0.021788789),
                                                 79: (297, 319, 0.04001759, 308, 0.0033656927)}.items():
        nz = torch.nonzero(fb[row]).flatten()
        assert (int(nz.min()), int(nz.max())) == (first, last)
        assert fb[row].sum().item() == pytest.approx(total, rel=1e-5)
        assert fb[row, col].item() == pytest.approx(value, rel=1e-5)


def test_encode_decode_shapes(small_codec, monkeypatch):
    monkeypatch.setattr(C, "hifigan", lambda: None)  # Griffin-Lim path: fast, no vocoder package needed
    wav = tone_sweep(0.5, seed=1)  # 8000 samples -> 7 code frames (6.25 rounded up)
    codes = small_codec.encode(wav)
    assert codes.dtype == torch.long and codes.shape == (7, 4)
    assert int(codes.min()) >= 0 and int(codes.max()) < 16
    assert small_codec.codes_to_mel(codes).shape == (7 * 8, 80)
    with pytest.warns(UserWarning, match="Griffin-Lim"):
        out = small_codec.decode(codes)
    assert out.shape == (7 * 1280,) and torch.isfinite(out).all()


def test_error_decreases_with_more_codebooks(small_codec):
    frames = C.stacked_log_mel(tone_sweep(24.0), small_codec.cfg)
    z = small_codec.to_latent(frames)
    codes = small_codec.quantize(z)
    errors = [float(((small_codec.dequantize(codes[:, :n]) - z) ** 2).mean()) for n in range(1, 5)]
    assert all(a > b for a, b in zip(errors, errors[1:])), errors
    assert torch.equal(small_codec.quantize(z, levels=2), codes[:, :2])  # greedy: a prefix is a prefix


def test_save_load_round_trip(small_codec, tmp_path):
    path = tmp_path / "codec.safetensors"
    small_codec.save(path)
    assert not (tmp_path / "codec.safetensors.tmp").exists()
    loaded = C.MelRVQCodec.load(path)
    assert loaded.cfg == small_codec.cfg
    assert torch.equal(loaded.codebooks, small_codec.codebooks)  # fitted codebooks are float16-exact
    wav = tone_sweep(1.0, seed=2)
    assert torch.equal(loaded.encode(wav), small_codec.encode(wav))


def test_missing_codec_file_names_the_fix(tmp_path):
    from rvqspec.core.errors import RvqspecError

    with pytest.raises(RvqspecError, match="rvqspec standin build --from codec --to codec"):
        C.MelRVQCodec.load(tmp_path / "nope.safetensors")
