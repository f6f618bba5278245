"""The stand-in TTS: talker shapes, official-layout save/load, KV-cached synthesis vs teacher forcing, training."""

import json

import pytest
import torch
from safetensors import safe_open

from rvqspec.decode import decode_frame
from rvqspec.drafters import ReusedHeads
from rvqspec.errors import RvqspecError
from rvqspec.model import MultiCodeDecoder
from rvqspec.sampling import Sampler
from rvqspec.standin.synth import synthesize_codes
from rvqspec.standin.talker import (StandinTTS, TalkerConfig, load_standin, new_standin, predictor_config_for,
                                    save_standin)
from rvqspec.corpus import Corpus, CorpusWriter
from rvqspec.standin.train import (Utterance, joint_loss, make_batch, predictor_confidence, predictor_loss,
                                   talker_hidden, teacher_forced_hidden, train_joint, train_predictor)
from rvqspec.tree import default_tree

GREEDY = Sampler(do_sample=False)
TINY = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
            head_dim=16)


def tiny_standin(seed: int = 0, std: float = 0.3, num_codes: int = 24) -> StandinTTS:
    """A random tiny stand-in; weights ~ N(0, std) (norm gains 1) so that greedy paths depend on the input."""
    torch.manual_seed(seed)
    talker = TalkerConfig(num_codes=num_codes, bytes_per_frame=(1.7, 2.3, 1.4, 2.9), **TINY)
    tts = new_standin(talker, predictor_config_for(talker, **TINY))
    with torch.no_grad():
        for name, p in tts.named_parameters():
            if "norm" not in name:
                p.normal_(std=std)
    return tts.eval()


def random_utterances(count: int, num_codes: int = 24, seed: int = 0) -> list[Utterance]:
    generator = torch.Generator().manual_seed(seed)
    texts = ["Guten Tag.", "Hello there, world!", "¿Qué tal?", "Привет."]
    return [Utterance(f"u{i}", ["de", "en", "es", "ru"][i % 4], texts[i % 4],
                      torch.randint(num_codes, (int(torch.randint(3, 9, (1,), generator=generator)), 16),
                                    generator=generator)) for i in range(count)]


def test_batch_shapes_and_targets():
    tts = tiny_standin()
    utts = random_utterances(3)
    batch = make_batch(tts, utts)
    lengths = [len(u.text.encode()) + 2 + len(u.codes) for u in utts]
    assert batch.inputs.shape == (3, max(lengths), 32)
    assert batch.frame_codes.shape == (sum(len(u.codes) for u in utts), 16)
    for row, utt in enumerate(utts):
        targets = batch.c0_targets[row]
        first = len(utt.text.encode()) + 1  # the bos position emits c0 of frame 0
        assert targets[first:first + len(utt.codes)].tolist() == utt.codes[:, 0].tolist()
        assert int(targets[first + len(utt.codes)]) == tts.config.codec_eos_token_id
        assert (targets[:first] == -100).all() and (targets[first + len(utt.codes) + 1:] == -100).all()
    hidden = talker_hidden(tts, batch)
    assert hidden.shape == batch.inputs.shape
    frame_hidden = hidden[batch.frame_rows, batch.frame_positions]
    c0_loss, residual_loss = joint_loss(tts, batch, 1.0, torch.Generator())
    torch.testing.assert_close(residual_loss, predictor_loss(tts.predictor, frame_hidden, batch.frame_codes))
    assert c0_loss.isfinite()


def test_frame_input_is_the_sum_of_the_shared_code_tables():
    tts = tiny_standin()
    codes = torch.randint(24, (16,))
    table = tts.predictor.code_embed.weight
    expected = sum(table[int(tts.predictor.table_offset[t]) + int(codes[t])] for t in range(16))
    torch.testing.assert_close(tts.frame_embed(codes), expected)
    # c0 goes through the talker's codec table, which is the predictor's table 0 (one tensor, not a copy)
    with torch.no_grad():
        table[int(codes[0])] += 1.0
    torch.testing.assert_close(tts.frame_embed(codes), expected + 1.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_save_load_round_trip_in_the_official_layout(tmp_path, dtype):
    tts = tiny_standin()
    save_standin(tts, tmp_path, dtype, extra={"codec": "test"})
    with safe_open(tmp_path / "model.safetensors", framework="pt") as f:
        keys = set(f.keys())
        assert f.get_tensor("talker.codec_head.weight").dtype == dtype
    assert {"talker.model.layers.1.self_attn.q_proj.weight", "talker.model.layers.0.mlp.down_proj.weight",
            "talker.model.norm.weight", "talker.model.text_embedding.weight", "talker.codec_head.weight",
            "talker.model.codec_embedding.weight", "talker.code_predictor.model.codec_embedding.14.weight",
            "talker.code_predictor.lm_head.0.weight"} <= keys
    config = json.loads((tmp_path / "config.json").read_text())["talker_config"]
    assert config["codec_eos_token_id"] == tts.config.codec_eos_token_id and config["stand_in"]["codec"] == "test"
    predictor = MultiCodeDecoder.from_pretrained(tmp_path)  # the loader of official checkpoints
    back = load_standin(tmp_path)
    for name, value in tts.state_dict().items():
        assert torch.equal(back.state_dict()[name], value.to(dtype).float()), name
    for name, value in tts.predictor.state_dict().items():
        assert torch.equal(predictor.state_dict()[name], value.to(dtype).float()), name


def test_load_refuses_a_plain_predictor_checkpoint(tmp_path):
    tts = tiny_standin()
    tts.predictor.save_pretrained(tmp_path)
    with pytest.raises(RvqspecError, match="standin build"):
        load_standin(tmp_path)


def test_cached_synthesis_matches_teacher_forcing():
    """Greedy synthesis through the KV cache gives the states a teacher-forced pass gives, and argmax c0."""
    tts = tiny_standin(seed=3).double()
    synthesis = synthesize_codes(tts, "Hallo Welt.", "de", sampler=GREEDY, talker_sampler=GREEDY, max_frames=6)
    assert synthesis.frames >= 2
    utt = Utterance("x", "de", "Hallo Welt.", synthesis.codes)
    hidden = teacher_forced_hidden(tts, utt)
    torch.testing.assert_close(synthesis.hidden.double(), hidden)
    logits = tts.talker.codec_head(hidden)[:, :tts.config.num_codes]
    assert logits.argmax(-1).tolist() == synthesis.codes[:, 0].tolist()
    for t in range(synthesis.frames):
        assert decode_frame(tts.predictor, hidden[t], synthesis.codes[t, 0], GREEDY).codes.tolist() \
            == synthesis.codes[t, 1:].tolist()


def test_speculative_synthesis_is_identical_when_greedy():
    tts = tiny_standin(seed=4)
    kwargs = dict(sampler=GREEDY, talker_sampler=GREEDY, max_frames=5)
    ar = synthesize_codes(tts, "Hello.", "en", **kwargs)
    spec = synthesize_codes(tts, "Hello.", "en", drafter=ReusedHeads(), tree=default_tree(8), **kwargs)
    assert torch.equal(ar.codes, spec.codes)
    assert ar.calls_per_frame == 15 and spec.calls_per_frame <= 15
    assert spec.tokens_per_step == pytest.approx(15 * spec.frames / spec.predictor_calls)


def test_synthesis_rejects_bad_input():
    tts = tiny_standin()
    with pytest.raises(RvqspecError, match="language 'xx'"):
        synthesize_codes(tts, "Hello.", "xx")
    with pytest.raises(RvqspecError, match="empty text"):
        synthesize_codes(tts, "  ", "en")


def write_corpus(tts: StandinTTS, utts: list[Utterance], path) -> Corpus:
    with CorpusWriter(path, tts.config.hidden_size, hidden_dtype=torch.float32) as writer:
        for utt in utts:
            writer.add(utt.id, utt.lang, utt.codes, teacher_forced_hidden(tts, utt))
    return Corpus(path, validation_fraction=0.0)


def test_joint_then_predictor_training_lower_the_losses(tmp_path):
    utts = random_utterances(4)
    tts = tiny_standin(std=0.02)
    batch = make_batch(tts, utts)
    with torch.no_grad():
        before = [float(x) for x in joint_loss(tts, batch, 1.0, torch.Generator())]
    report = train_joint(tts, utts, utts, steps=15, predictor_fraction=0.5, lr=2e-2, warmup=2, max_positions=10_000,
                         log=lambda _: None)
    with torch.no_grad():
        after = [float(x) for x in joint_loss(tts, make_batch(tts, utts), 1.0, torch.Generator())]
    assert report["steps"] == 15 and after[0] < before[0] - 0.5 and after[1] < before[1] - 0.5
    corpus = write_corpus(tts, utts, tmp_path / "corpus")
    codes, hidden = next(corpus.batches("train", 1000))
    table = tts.predictor.code_embed.weight.clone()
    with torch.no_grad():
        before = float(predictor_loss(tts.predictor, hidden, codes))
    report = train_predictor(tts.predictor, corpus, corpus, steps=15, lr=2e-2, batch_frames=8, warmup=2,
                             log=lambda _: None)
    with torch.no_grad():
        after = float(predictor_loss(tts.predictor, hidden, codes))
    assert report["steps"] == 15 and after < before - 0.5
    assert torch.equal(tts.predictor.code_embed.weight, table)  # shared with the talker: frozen in phase 3
    confidence = predictor_confidence(tts, corpus, Sampler())
    assert confidence["frames"] == sum(len(u.codes) for u in utts) and len(confidence["top1"]) == 15
    assert all(1 / 24 <= p <= 1 for p in confidence["top1"]) and 0 <= confidence["mean_entropy"] <= 3.2
