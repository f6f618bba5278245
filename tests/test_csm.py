"""Sesame CSM through transformers: the depth decoder loaded from its checkpoint layout, compared with
transformers' own (teacher-forced logits, greedy generate, the sampled distribution), and `rvqspec.accelerate`."""

import itertools
import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_distribution import g_test

import rvqspec
from rvqspec import MultiCodeDecoder, ReusedHeads, RvqspecError, Sampler, Tree, default_tree
from rvqspec.core.checkpoint import CSM_TIED_TABLES
from rvqspec.core.config import load_config
from rvqspec.core.quantize import QuantizedLinear
from rvqspec.integrations.base import HANDLE

from helpers.csm_models import LLAMA3, prompts, tiny_csm
from helpers.tiny import random_medusa, random_offsets

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def csm():
    return tiny_csm()


@pytest.fixture(scope="module")
def saved(csm, tmp_path_factory):
    folder = tmp_path_factory.mktemp("csm")
    csm.save_pretrained(folder)
    return folder


def test_config_json_of_a_saved_csm_is_read_as_its_depth_decoder(saved):
    config = load_config(saved)
    assert (config.layout, config.num_code_groups, config.vocab_size, config.talker_vocab_size) == ("csm", 8, 35, 35)
    assert (config.hidden_size, config.talker_hidden_size, config.head_dim, config.num_hidden_layers) == (24, 32, 6, 2)
    assert not config.qk_norm and config.always_project and not config.projection_bias
    assert config.rope_scaling == LLAMA3 and config.rope_theta == 500000


@pytest.mark.parametrize("dtype, tolerance", [(torch.float64, 1e-10), (torch.float32, 2e-4)])
def test_teacher_forced_logits_match_transformers(csm, saved, dtype, tolerance):
    """Our logits for c1..c7 given the backbone state and c0..c6, against transformers' depth decoder forward
    (position 0 the backbone state, position p the code c_{p-1}, head p-1)."""
    ours = MultiCodeDecoder.from_pretrained(saved, dtype=dtype)
    reference = csm.depth_decoder.to(dtype)
    generator = torch.Generator().manual_seed(1)
    codes = torch.randint(0, 34, (6, 8), generator=generator)
    hidden = torch.randn(6, 32, generator=generator, dtype=torch.float64).to(dtype)
    inputs = torch.cat([torch.zeros_like(codes[:, :1]), codes[:, :-1]], dim=1)
    want = reference(input_ids=inputs, backbone_last_hidden_state=hidden).logits  # positions 1.. (0: no head)
    got = ours.teacher_forced_logits(hidden, codes)
    difference = (got.double() - want.double()).abs().max().item()
    print(f"{dtype}: max |logit difference| {difference:.3g} (logits up to {want.abs().max().item():.3g})")
    csm.depth_decoder.to(torch.float64)
    assert difference <= tolerance


def test_the_tied_code_table_is_read_under_the_backbones_name(saved, tmp_path):
    """transformers saves one of CSM's two tied audio tables; a checkpoint holding the backbone's loads too."""
    tensors = load_file(saved / "model.safetensors")
    depth_name, backbone_name = next(iter(CSM_TIED_TABLES.items()))
    tensors[backbone_name] = tensors.pop(depth_name)
    save_file(tensors, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text((saved / "config.json").read_text())
    a, b = MultiCodeDecoder.from_pretrained(saved), MultiCodeDecoder.from_pretrained(tmp_path)
    assert torch.equal(a.code_embed.weight, b.code_embed.weight)


def test_a_csm_decoder_saves_and_loads_in_its_own_layout(saved, tmp_path):
    model = MultiCodeDecoder.from_pretrained(saved, dtype=torch.float64)
    model.save_pretrained(tmp_path)
    again = MultiCodeDecoder.from_pretrained(tmp_path, dtype=torch.float64)
    assert again.config == model.config and json.loads((tmp_path / "config.json").read_text())["model_type"] == "csm"
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), again.state_dict().values()))


@pytest.mark.parametrize("change, message", [
    (lambda t: t.pop("depth_decoder.codebooks_head.weight"), "lacks 1 tensor.*codebooks_head"),
    (lambda t: t.update({"depth_decoder.model.layers.2.mlp.up_proj.weight": torch.zeros(48, 24)}),
     "not part of the model config.json describes"),
])
def test_csm_weights_that_disagree_with_config_json_are_refused(saved, tmp_path, change, message):
    tensors = load_file(saved / "model.safetensors")
    change(tensors)
    save_file(tensors, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text((saved / "config.json").read_text())
    with pytest.raises(RvqspecError, match=message):
        MultiCodeDecoder.from_pretrained(tmp_path)


def greedy(model, ids: torch.Tensor, frames: int) -> torch.Tensor:
    return model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=frames, do_sample=False,
                          depth_decoder_do_sample=False)


@pytest.mark.parametrize("codebooks, rows, frames", [(8, 4, 50), (32, 2, 12)])
def test_greedy_codes_equal_transformers_generate(codebooks, rows, frames):
    """The whole model's generate (backbone + depth decoder), greedy: the same codes accelerated, AR and
    speculative (three trees, three drafters: reused heads, offsets, Medusa), as upstream's own; upstream's depth
    decoder is not called."""
    model = tiny_csm(codebooks=codebooks, seed=codebooks)
    ids = prompts(rows, seed=codebooks)
    reference = greedy(model, ids, frames)
    assert reference.shape == (rows, frames, codebooks)
    decoder = rvqspec.integrations.csm.depth_decoder_from_transformers(model)
    for drafter, tree in [(None, None), (ReusedHeads(), default_tree(8)),
                          (random_offsets(decoder, 4, seed=1), Tree.chain(4)), (random_medusa(decoder), default_tree(6))]:
        handle = rvqspec.accelerate(model, drafter=drafter, tree=tree)
        upstream_calls = []
        handle.upstream_generate = lambda *a, **k: upstream_calls.append(1)
        codes = greedy(model, ids, frames)
        handle.undo()
        assert torch.equal(codes, reference) and not upstream_calls
        stats = handle.stats
        assert stats.frames == rows * frames and stats.codes == stats.frames * (codebooks - 1)
        if drafter is None:
            assert stats.calls == (codebooks - 1) * stats.steps
        else:
            assert stats.calls < (codebooks - 1) * stats.steps  # drafts were accepted
        print(f"{codebooks} codebooks, {drafter.kind if drafter else 'AR'}: {stats}")


def test_talker_weights_quantize_the_backbone_alone_and_keep_speculation_exact():
    """talker_weights="w8a8" on CSM: the backbone's layers and its c0 head become int8 (the depth decoder and the
    codec stay float); greedy speculative codes equal the AR codes of that model; undo() restores the layers."""
    model, ids = tiny_csm(codebooks=8, seed=3), prompts(2, seed=3)
    linears = {name: m for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    reference, codes = greedy(model, ids, 12), {}
    for name, drafter, tree in (("ar", None, None), ("spec", ReusedHeads(), default_tree(8))):
        handle = rvqspec.accelerate(model, drafter=drafter, tree=tree, talker_weights="w8a8")
        try:
            now = dict(model.named_modules())
            swapped = {n for n in linears if isinstance(now[n], QuantizedLinear)}
            assert swapped == {n for n in linears if not n.startswith(("depth_decoder.", "codec_model."))}
            assert "lm_head" in swapped and any(n.startswith("backbone_model.") for n in swapped)
            codes[name] = greedy(model, ids, 12)
        finally:
            handle.undo()
    assert torch.equal(codes["ar"], codes["spec"])
    assert all(dict(model.named_modules())[n] is m for n, m in linears.items())
    assert torch.equal(greedy(model, ids, 12), reference)


SAMPLER = dict(depth_decoder_do_sample=True, depth_decoder_temperature=0.9, depth_decoder_top_k=3)


@pytest.fixture(scope="module")
def small():
    """4 codebooks (c1..c3 drawn) of 5 codes: 125 outcomes, enumerated."""
    return tiny_csm(codebooks=4, vocab=5, seed=7)


@torch.no_grad()
def exact_joint(model, hidden: torch.Tensor, c0: int) -> torch.Tensor:
    """Probability of every (c1, c2, c3) under transformers' depth decoder and its own warpers (temperature 0.9,
    top-k 3), flattened as c1*25 + c2*5 + c3."""
    from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper

    outcomes = torch.tensor(list(itertools.product(range(5), repeat=3)))
    inputs = torch.cat([torch.zeros(len(outcomes), 1, dtype=torch.long), torch.full((len(outcomes), 1), c0),
                        outcomes[:, :-1]], dim=1)
    logits = model.depth_decoder(input_ids=inputs, backbone_last_hidden_state=hidden.expand(len(outcomes), -1)).logits
    logits = logits.reshape(-1, 5)  # positions 1..3 (transformers skips position 0)
    scores = TopKLogitsWarper(3)(None, TemperatureLogitsWarper(0.9)(None, logits))
    probs = scores.softmax(-1).reshape(len(outcomes), 3, 5)
    return probs.gather(-1, outcomes[..., None]).squeeze(-1).prod(-1)


def sampled_counts(model, hidden: torch.Tensor, c0: int, samples: int, seed: int) -> torch.Tensor:
    """Histogram of (c1, c2, c3) over `samples` frames of the depth decoder's (hooked) per-frame generate,
    in batches of 500 copies of one frame, with the settings CSM's generate gives it."""
    model.depth_decoder.generation_config.update(do_sample=True, temperature=0.9, top_k=3, max_new_tokens=3,
                                                 min_new_tokens=3)
    torch.manual_seed(seed)
    counts = torch.zeros(125, dtype=torch.long)
    for _ in range(samples // 500):
        ids = torch.tensor([[0, c0]]).expand(500, -1)
        codes = model.depth_decoder.generate(input_ids=ids, backbone_last_hidden_state=hidden.expand(500, -1))[:, 2:]
        counts += torch.bincount(codes[:, 0] * 25 + codes[:, 1] * 5 + codes[:, 2], minlength=125)
    return counts


@pytest.mark.parametrize("way", ["upstream", "AR", "speculative"])
def test_sampled_codes_follow_the_depth_decoders_distribution(small, way):
    hidden, c0 = torch.randn(1, 32, generator=torch.Generator().manual_seed(3), dtype=torch.float64), 2
    probs = exact_joint(small, hidden, c0)
    handle = None
    if way != "upstream":
        drafter, tree = (ReusedHeads(), Tree.from_paths([(0,), (1,), (0, 0), (0, 1), (1, 0)])) if way != "AR" \
            else (None, None)
        handle = rvqspec.accelerate(small, drafter=drafter, tree=tree)
    try:
        counts = sampled_counts(small, hidden, c0, samples=3000, seed=11)
    finally:
        if handle is not None:
            handle.undo()
    pvalue = g_test(counts, probs)
    stats = f", {handle.stats}" if handle else ""
    print(f"{way}: G-test p-value {pvalue:.3g} over 3000 frames{stats}")
    assert pvalue > 1e-3
    if way == "speculative":
        assert handle.stats.row_calls < 3 * handle.stats.frames  # rows accepted drafts (a batch waits for its slowest)


def test_unimplemented_settings_go_to_upstream_with_a_warning(csm):
    ids = prompts(2)
    reference = model_generate = greedy(csm, ids, 5)
    handle = rvqspec.accelerate(csm)
    try:
        with pytest.warns(UserWarning, match="repetition_penalty=1.5"):
            model_generate = csm.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=5,
                                          do_sample=False, depth_decoder_do_sample=False,
                                          depth_decoder_repetition_penalty=1.5)
        assert handle.stats.steps == 0 and handle.stats.upstream_steps == 5
    finally:
        handle.undo()
        csm.depth_decoder.generation_config.repetition_penalty = 1.0
    assert model_generate.shape == reference.shape


def test_accelerate_recognises_its_models_and_refuses_others(csm):
    handle = rvqspec.accelerate(csm)
    assert type(handle).__name__ == "CsmAcceleration" and getattr(csm, HANDLE) is handle
    with pytest.raises(RvqspecError, match="already accelerated"):
        rvqspec.accelerate(csm)
    rvqspec.deaccelerate(csm)
    assert "generate" not in vars(csm.depth_decoder)
    with pytest.raises(RvqspecError, match="not accelerated"):
        rvqspec.deaccelerate(csm)
    with pytest.raises(RvqspecError, match="neither a qwen-tts model nor a transformers CSM model"):
        rvqspec.accelerate(torch.nn.Linear(2, 2))


def test_teacher_forced_backbone_state_is_the_one_generate_passes(csm):
    """`corpus from-audio` rebuilds, from known codes, the backbone state CSM's generate gives the depth decoder."""
    from rvqspec.tuning.csm_corpus import teacher_forced_hidden

    ids, states = prompts(1, seed=4), []
    handle = rvqspec.accelerate(csm)
    decode = handle.decode
    handle.decode = lambda hidden, c0, sampler: states.append(hidden.clone()) or decode(hidden, c0, sampler)
    codes = greedy(csm, ids, 20)
    handle.undo()
    difference = (teacher_forced_hidden(csm, ids[0], codes[0]) - torch.cat(states)).abs().max().item()
    print(f"teacher-forced backbone state vs generate's: max |difference| {difference:.3g}")
    assert difference <= 1e-10


def test_offsets_train_and_trees_calibrate_for_csm(csm, saved, tmp_path):
    """A CSM code corpus (backbone states teacher forced on sampled codes) -> train-offsets -> calibrate, through
    the CLI on the saved CSM checkpoint: 32-codebook-style layouts go through the same tools."""
    from rvqspec.cli.main import main
    from rvqspec.tuning.csm_corpus import corpus_from_codes

    ids = prompts(12, seed=5)
    torch.manual_seed(0)
    codes = csm.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, do_sample=True,
                         depth_decoder_do_sample=True)
    items = [(f"u{i}", "en", ids[i], codes[i]) for i in range(len(ids))]
    report = corpus_from_codes(csm, items, tmp_path / "corpus")
    assert report == {"out": str(tmp_path / "corpus"), "utterances": 12, "frames": 12 * 16}
    assert main(["train-offsets", "--model", str(saved), "--corpus", str(tmp_path / "corpus"), "--out",
                 str(tmp_path / "offsets"), "--epochs", "2", "--batch-size", "16", "--validation-fraction", "0.25",
                 "--quiet"]) == 0
    drafter = rvqspec.Offsets.load(tmp_path / "offsets" / "offsets.safetensors")
    assert drafter.offsets.shape == (3, 24) and drafter.identity["num_code_groups"] == 8
    assert main(["calibrate", "--model", str(saved), "--drafter", str(tmp_path / "offsets" / "offsets.safetensors"),
                 "--corpus", str(tmp_path / "corpus"), "--budgets", "4,8", "--frames", "16", "--eval-frames", "8",
                 "--validation-fraction", "0.25", "--out", str(tmp_path / "cal")]) == 0
    tree = Tree.load(tmp_path / "cal" / "tree-N8.json")
    model = MultiCodeDecoder.from_pretrained(saved, dtype=torch.float64)
    hidden, c0 = torch.randn(3, 32, dtype=torch.float64), torch.tensor([1, 2, 3])
    greedy_sampler = Sampler(do_sample=False)
    assert torch.equal(rvqspec.decode_frames(model, hidden, c0, greedy_sampler, drafter=drafter.double(), tree=tree).codes,
                       rvqspec.decode_frames(model, hidden, c0, greedy_sampler).codes)


def test_corpus_from_audio_names_a_csm_folder_without_its_processor(saved, tmp_path, capsys):
    import numpy as np
    import soundfile

    from rvqspec.cli.main import main

    (tmp_path / "audio").mkdir()
    soundfile.write(tmp_path / "audio" / "a.wav", np.zeros(2400, dtype=np.float32), 24000)
    (tmp_path / "audio" / "a.txt").write_text("hello")
    assert main(["corpus", "from-audio", "--model", str(saved), "--audio", str(tmp_path / "audio"),
                 "--out", str(tmp_path / "corpus")]) == 2
    error = capsys.readouterr().err.strip()
    assert "cannot load the CSM model and processor" in error and len(error.splitlines()) == 1
    assert not (tmp_path / "corpus").exists()


def test_direct_depth_decoder_calls_take_their_own_settings(csm):
    """Called directly, as upstream's generate is: settings passed as arguments are honoured; a call that is
    not one frame (fewer codes) goes to upstream."""
    hidden, ids = torch.randn(3, 32, dtype=torch.float64), torch.tensor([[0, 4], [0, 9], [0, 2]])
    reference = csm.depth_decoder.generate(input_ids=ids, backbone_last_hidden_state=hidden, do_sample=False,
                                           max_new_tokens=7, min_new_tokens=7)
    short = csm.depth_decoder.generate(input_ids=ids, backbone_last_hidden_state=hidden, do_sample=False,
                                       max_new_tokens=3, min_new_tokens=3)
    handle = rvqspec.accelerate(csm, drafter=ReusedHeads(), tree=default_tree(8))
    try:
        assert torch.equal(csm.depth_decoder.generate(input_ids=ids, backbone_last_hidden_state=hidden,
                                                      do_sample=False, max_new_tokens=7), reference)
        assert handle.stats.steps == 1
        assert torch.equal(csm.depth_decoder.generate(input_ids=ids, backbone_last_hidden_state=hidden,
                                                      do_sample=False, max_new_tokens=3, min_new_tokens=3), short)
        assert handle.stats.steps == 1  # the short call went to upstream
    finally:
        handle.undo()
