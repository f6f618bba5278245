"""Several utterances' streaming 12 Hz codecs decoded together (`decode_together`, what the Engine's codec workers use
for qwen-tts requests with chunks due at once): each row's audio is what its own codec's `decode` gives."""

import pytest
import torch

from rvqspec.integrations import qwen_tts_audio
from rvqspec.integrations.qwen_tts_audio import RowsDecoder, StreamingCodec, decode_together

from helpers.upstream_models import upstream_available

if not upstream_available():
    pytest.skip("qwen-tts reference not installed: run `make install`", allow_module_level=True)

from helpers.upstream_tts import CODEBOOK, tiny_speech_tokenizer  # noqa: E402

# utterance: (frames decoded alone before, the step it joins at, its chunks from then on)
PLAN = {"fresh, 3-frame chunks": (0, 0, [3] * 6),
        "across the 300-frame restart": (291, 0, [3] * 6),  # 294, 297, 300 (then a restart due), 303, ...
        "joins late, a first lone frame": (0, 2, [1, 12, 12, 12]),
        "past the window, cancelled": (80, 0, [12] * 5)}  # leaves after its fifth chunk


def streamed(decoder, codes: dict, together: bool) -> dict:
    """Each utterance's audio over the plan's steps: the rows of a step decoded together or each on its own."""
    codecs = {name: StreamingCodec(decoder) for name in PLAN}
    audio = {name: [codecs[name].decode(codes[name][:before])] for name, (before, _, _) in PLAN.items()}
    sent = {name: before for name, (before, _, _) in PLAN.items()}
    for step in range(max(start + len(chunks) for _, start, chunks in PLAN.values())):
        names = [name for name, (_, start, chunks) in PLAN.items() if start <= step < start + len(chunks)]
        chunks = []
        for name in names:
            frames = PLAN[name][2][step - PLAN[name][1]]
            chunks.append(codes[name][sent[name]:sent[name] + frames])
            sent[name] += frames
        rows = [codecs[name] for name in names]
        out = decode_together(rows, chunks) if together else [row.decode(c) for row, c in zip(rows, chunks)]
        for name, samples in zip(names, out):
            audio[name].append(samples)
    return {name: torch.cat(pieces) for name, pieces in audio.items()}


@pytest.fixture(scope="module")
def codes():
    generator = torch.Generator().manual_seed(0)
    return {name: torch.randint(0, CODEBOOK, (320, 16), generator=generator) for name in PLAN}


@pytest.mark.parametrize("dtype, atol", [(torch.float64, 1e-12), (torch.float32, 1e-4)], ids=["float64", "float32"])
def test_rows_decoded_together_get_the_audio_each_gets_alone(codes, dtype, atol, monkeypatch):
    """Different positions (a fresh start, past the attention window, across a restart), chunk sizes, a row joining
    late and one leaving: each row's audio equals its one-by-one audio (float64: to rounding; float32: the random
    tiny decoder amplifies a different summation order's rounding, as in tests/test_streaming.py), and most rows
    were decoded in shared forwards."""
    tokenizer = tiny_speech_tokenizer()
    decoder = tokenizer.model.decoder.to(dtype)
    batched_rows, run = [], RowsDecoder.run
    monkeypatch.setattr(RowsDecoder, "run", lambda self, c: batched_rows.append(len(c)) or run(self, c))
    alone = streamed(decoder, codes, together=False)
    assert not batched_rows
    together = streamed(decoder, codes, together=True)
    for name in PLAN:
        assert together[name].shape == alone[name].shape and alone[name].std() > 0.05, name
        torch.testing.assert_close(together[name], alone[name], atol=atol, rtol=0, msg=name)
    # pairs: 3-frame chunks at steps 0-2, 4, 5 (at step 3 a restart is due), 12-frame ones at steps 3, 4
    assert batched_rows == [2] * 7


def test_rows_of_one_length_share_a_forward_and_the_rest_go_alone(monkeypatch):
    """Only chunks of one frame count that need no restart share a forward, of at most MOST_FRAMES_TOGETHER frames;
    an empty chunk gives no audio."""
    monkeypatch.setattr(qwen_tts_audio, "MOST_FRAMES_TOGETHER", 4)  # 2 rows of 2 frames
    forwards, run = [], RowsDecoder.run
    monkeypatch.setattr(RowsDecoder, "run", lambda self, c: forwards.append(len(c)) or run(self, c))
    decoder = tiny_speech_tokenizer().model.decoder
    codecs = [StreamingCodec(decoder) for _ in range(6)]
    codecs[4].frames = 300  # a restart due before its next frame
    codecs[4].recent = [torch.zeros(25, 16, dtype=torch.long)]
    chunks = [torch.zeros(frames, 16, dtype=torch.long) for frames in (2, 2, 2, 0, 2, 1)]
    audio = decode_together(codecs, chunks)
    assert [len(a) for a in audio] == [2 * 1920, 2 * 1920, 2 * 1920, 0, 2 * 1920, 1920]
    assert forwards == [2]  # rows 0 and 1; row 2 left over, 4 restarting and 5 (1 frame) on their own
    assert [codec.frames for codec in codecs] == [2, 2, 2, 0, 302, 1]
    assert [codec.position for codec in codecs] == [2, 2, 2, 0, 27, 1]  # the restart: 25 frames of context, then 2
