"""Unit tests of the config, the MultiCodeDecoder (cache, masks, positions) and the checkpoint layout."""

import pytest
import torch

from rvqspec import QWEN3_TTS_0_6B, QWEN3_TTS_1_7B, MultiCodeDecoder, PredictorConfig, Sampler, decode_frame
from rvqspec.cli.inspect import parameter_counts
from rvqspec.core.checkpoint import TALKER_C0_TABLE, official_layout, official_state_dict
from rvqspec.core.config import config_from_upstream, load_config, upstream_config_dict
from rvqspec.core.errors import RvqspecError
from rvqspec.core.model import resolve_dtype

CONFIG = PredictorConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=8, vocab_size=16, num_code_groups=6, talker_hidden_size=32,
                         talker_vocab_size=20)
PROJECTED = PredictorConfig(**{**CONFIG.to_dict(), "talker_hidden_size": 24})


def random_model(config: PredictorConfig = CONFIG, seed: int = 0, dtype=torch.float64) -> MultiCodeDecoder:
    """Matrices ~ N(0, 0.3), norm gains and biases ~ 1 + N(0, 0.3): logits depend strongly on the inputs."""
    generator = torch.Generator().manual_seed(seed)
    model = MultiCodeDecoder(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=generator) * 0.3 + (1.0 if p.dim() == 1 else 0.0))
    return model.to(dtype)


def frames(config: PredictorConfig, n: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    codes = torch.randint(config.vocab_size, (n, config.num_code_groups), generator=generator)
    codes[:, 0] = torch.randint(config.talker_vocab_size, (n,), generator=generator)
    return torch.randn(n, config.talker_hidden_size, generator=generator, dtype=torch.float64), codes


def test_presets_are_the_real_sizes():
    """docs/design.md, section 1: the code predictor shared by 0.6B and 1.7B; only the talker width differs."""
    c = QWEN3_TTS_0_6B
    assert (c.hidden_size, c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads, c.head_dim,
            c.intermediate_size, c.vocab_size, c.num_code_groups, c.rope_theta, c.rms_norm_eps) == \
        (1024, 5, 16, 8, 128, 3072, 2048, 16, 1e6, 1e-6)
    assert (c.talker_hidden_size, c.talker_vocab_size, QWEN3_TTS_1_7B.talker_hidden_size) == (1024, 3072, 2048)
    assert QWEN3_TTS_1_7B.to_dict() | {"talker_hidden_size": 1024} == c.to_dict()


@pytest.mark.parametrize("config", [QWEN3_TTS_0_6B, QWEN3_TTS_1_7B])
def test_preset_shapes_and_official_keys(config):
    with torch.device("meta"):
        model = MultiCodeDecoder(config)
    counts = parameter_counts(model)
    assert model.heads.shape == (15, 2048, 1024)
    assert model.code_embed.weight.shape == (3072 + 15 * 2048, config.talker_hidden_size)
    assert counts["layers"] == 5 * (4096 * 1024 + 1024 * 2048 + 3 * 3072 * 1024 + 2 * 128 + 2 * 1024) + 1024
    has_projection = config.talker_hidden_size != config.hidden_size
    assert counts["projection"] == (2048 * 1024 + 1024 if has_projection else 0)
    keys = {name for _, parts in official_layout(config).values() for name, _ in parts}
    assert len(keys) == 5 * 11 + 1 + 15 + 15 + 1 + 2 * has_projection
    assert TALKER_C0_TABLE in keys and "talker.code_predictor.model.layers.4.self_attn.q_norm.weight" in keys


@pytest.mark.parametrize("config", [CONFIG, PROJECTED, QWEN3_TTS_0_6B, QWEN3_TTS_1_7B])
def test_config_round_trips_through_the_upstream_layout(config):
    upstream = upstream_config_dict(config, talker={"num_hidden_layers": 28})
    assert upstream["talker_config"]["num_hidden_layers"] == 28
    assert config_from_upstream(upstream) == config


def test_config_reads_upstream_json(tmp_path):
    (tmp_path / "config.json").write_text(
        '{"talker_config": {"hidden_size": 2048, "vocab_size": 3072, "code_predictor_config": '
        '{"hidden_size": 1024, "num_hidden_layers": 5, "rope_theta": 1000000, "num_code_groups": 16, '
        '"rope_scaling": null, "use_sliding_window": false, "layer_types": ["full_attention"], '
        '"num_key_value_heads": null, "model_type": "qwen3_tts_talker_code_predictor"}}}')
    assert load_config(tmp_path) == QWEN3_TTS_1_7B  # unknown fields ignored, null means the default


@pytest.mark.parametrize("change, message", [(dict(num_key_value_heads=3), "not a multiple"),
                                             (dict(num_code_groups=1), "num_code_groups must be >= 2"),
                                             (dict(hidden_act="gelu"), "unsupported depth decoder")])
def test_config_rejects_what_the_model_does_not_implement(change, message):
    with pytest.raises(RvqspecError, match=message):
        PredictorConfig(**{**CONFIG.to_dict(), **change})


@pytest.mark.parametrize("name, dtype", [("float32", torch.float32), ("bf16", torch.bfloat16),
                                         ("fp16", torch.float16), (torch.bfloat16, torch.bfloat16)])
def test_resolve_dtype(name, dtype):
    assert resolve_dtype(name) is dtype


@pytest.mark.parametrize("config", [CONFIG, PROJECTED])
def test_save_and_load_round_trip(tmp_path, config):
    model = random_model(config, dtype=torch.float32)
    model.save_pretrained(tmp_path)
    loaded = MultiCodeDecoder.from_pretrained(tmp_path)
    assert loaded.config == config and not loaded.training
    assert all(not p.requires_grad for p in loaded.parameters())
    mine, theirs = model.state_dict(), loaded.state_dict()
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)
    official = official_state_dict(model)
    expected = {name: shape for _, parts in official_layout(config).values() for name, shape in parts}
    assert {k: tuple(v.shape) for k, v in official.items()} == expected


@pytest.mark.parametrize("config", [CONFIG, PROJECTED])
def test_cached_steps_equal_the_causal_pass(config):
    """One token at a time through the static cache (as AR decoding runs) = one causal pass over the frame."""
    model = random_model(config)
    hidden, codes = frames(config, 1)
    expected = model.teacher_forced_hidden(hidden, codes)[0]
    groups = config.num_code_groups
    cache = model.new_cache(1, groups)
    slots = torch.arange(groups)
    x = torch.cat([model.embed_talker_hidden(hidden), model.embed_codes(codes[0, :-1], slots[:-1])])
    steps = [model(x[None, p:p + 1], slots[p:p + 1], (slots <= p)[None], cache, slots[p:p + 1])[0, 0]
             for p in range(groups)]
    torch.testing.assert_close(torch.stack(steps), expected, rtol=1e-6, atol=1e-6)  # float64, but RMSNorm rounds to float32 (as upstream)


def test_any_query_order_positions_and_slots():
    """A call's tokens may come in any order, at any cache slots: positions and the mask alone decide the
    result (what tree verification relies on). Here: the frame's tokens reversed, written to shuffled slots."""
    model = random_model()
    hidden, codes = frames(CONFIG, 1)
    expected = model.teacher_forced_hidden(hidden, codes)[0]
    groups = CONFIG.num_code_groups
    cache = model.new_cache(1, groups + 3)
    positions = torch.arange(groups)
    x = torch.cat([model.embed_talker_hidden(hidden), model.embed_codes(codes[0, :-1], positions[:-1])])
    order = positions.flip(0)
    slots = torch.randperm(groups + 3, generator=torch.Generator().manual_seed(0))[:groups]
    visible = torch.zeros(groups, groups + 3, dtype=torch.bool)  # slots[j] holds position j: seen from positions >= j
    visible[:, slots] = positions[None, :] <= order[:, None]
    out = model(x[order][None], order, visible, cache, slots[order])[0]
    torch.testing.assert_close(out, expected[order], rtol=1e-6, atol=1e-6)  # float64, but RMSNorm rounds to float32 (as upstream)


def test_greedy_ar_follows_the_teacher_forced_argmax():
    """decode_frame's greedy codes are the argmax of the teacher-forced logits along its own path."""
    model = random_model(PROJECTED)
    hidden, codes = frames(PROJECTED, 8)
    greedy = Sampler(do_sample=False)
    for i in range(8):
        result = decode_frame(model, hidden[i], codes[i, 0], greedy)
        assert result.calls == PROJECTED.num_residual_codes
        path = torch.cat([codes[i, :1], result.codes])[None]
        assert torch.equal(model.teacher_forced_logits(hidden[i:i + 1], path)[0].argmax(-1), result.codes)


def test_seeded_sampling_is_reproducible_and_in_range():
    model = random_model()
    hidden, codes = frames(CONFIG, 1)
    sampler = Sampler(temperature=0.9, top_k=5)
    draws = [decode_frame(model, hidden[0], codes[0, 0], sampler, torch.Generator().manual_seed(3)).codes
             for _ in range(2)]
    assert torch.equal(draws[0], draws[1]) and 0 <= draws[0].min() and draws[0].max() < CONFIG.vocab_size


def test_per_row_heads_grouped_and_gathered_agree():
    """Rows at different codebooks: the CPU path (grouped by codebook, packed weights) and the accelerator path
    (one gather of each row's head) give every row its own head's logits."""
    model = random_model()
    hidden = torch.randn(6, CONFIG.hidden_size, dtype=model.dtype, generator=torch.Generator().manual_seed(0))
    books = [3, 1, 3, 5, 2, 1]
    expected = torch.stack([model.heads[b - 1] @ h for h, b in zip(hidden, books)])
    torch.testing.assert_close(model.grouped_head_logits(hidden, books), expected)
    torch.testing.assert_close(model.gathered_head_logits(hidden, books), expected)
    torch.testing.assert_close(model.head_logits(hidden, books), expected)
    torch.testing.assert_close(model.head_logits(hidden, [4] * 6), hidden @ model.heads[3].T)


@pytest.mark.parametrize("write", ["data_copy", "load_state_dict", "lora_merge"])
def test_changed_weights_reach_the_packed_and_int8_copies(write):
    """The packed bfloat16 weights keyed on the version counter, which `.data.copy_()` does not bump: the core
    decoded with the old weights. Widths large enough to pack (>= 2^20 elements), bfloat16 (int8 drafts too)."""
    import copy

    from rvqspec import ReusedHeads, decode_frames, default_tree
    from rvqspec.core.device_path import packable

    if not packable(torch.bfloat16):
        pytest.skip("no oneDNN bfloat16 on this CPU: nothing is packed")
    config = PredictorConfig(hidden_size=1024, intermediate_size=1024, num_hidden_layers=1, num_attention_heads=8,
                             num_key_value_heads=4, head_dim=128, vocab_size=64, num_code_groups=5,
                             talker_hidden_size=1024, talker_vocab_size=70)
    torch.manual_seed(0)
    model = MultiCodeDecoder(config).eval().requires_grad_(False).to(torch.bfloat16)
    with torch.no_grad():
        model.heads.mul_(40)  # peaked: greedy codes depend on every weight
    changed = copy.deepcopy(model)
    with torch.no_grad():
        for p in changed.parameters():
            p.copy_(p[torch.randperm(len(p))] if p.dim() > 1 else p)
    hidden, c0 = torch.randn(4, 1024).to(torch.bfloat16) * 3, torch.tensor([1, 2, 3, 4])
    greedy, spec = Sampler(do_sample=False), dict(drafter=ReusedHeads(), tree=default_tree(8))
    before = decode_frames(model, hidden, c0, greedy, **spec).codes  # builds the packs and int8 heads
    with torch.no_grad():
        if write == "load_state_dict":
            model.load_state_dict(changed.state_dict())
        else:
            for mine, theirs in zip(model.parameters(), changed.parameters()):
                if write == "data_copy":
                    mine.data.copy_(theirs)
                else:
                    mine.add_(theirs - mine)  # W += delta in place, as a LoRA merge does
    expected = decode_frames(copy.deepcopy(changed), hidden, c0, greedy).codes
    assert not torch.equal(expected, before)  # the change shows in the codes
    assert torch.equal(decode_frames(model, hidden, c0, greedy).codes, expected)


def test_probes_stay_inside_weights_of_any_size():
    """Spread with float32 linspace, the last index of a 0.6B head tensor (31,457,280 elements) rounded past its end."""
    from rvqspec.integrations.tuned import PROBES, probe

    for size in (1, 2, 17, (1 << 24) + 3, 31457280):
        weight = torch.arange(size, dtype=torch.int32) if size < 100 else torch.empty(size, dtype=torch.int8)
        probed = probe(weight)
        assert len(probed) == PROBES
        if size < 100:
            assert probed[0] == 0 and probed[-1] == size - 1


def test_a_watch_follows_each_kind_of_write_and_nothing_else():
    """One mechanism for "the weights changed" (core/changes.py): a new tensor, an in-place write (version counter)
    and a write through `.data` (values) each call the update once; an unchanged set calls nothing; an update that
    raises is tried again; a copy starts empty."""
    import copy

    from rvqspec.core.changes import Watch

    weights = [torch.nn.Parameter(torch.randn(4, 8)), torch.nn.Parameter(torch.randn(3))]
    watch, updates = Watch(weights), []

    def follow() -> int:
        watch.follow(weights, lambda: updates.append(1))
        return len(updates)

    assert follow() == 0 and follow() == 0
    with torch.no_grad():
        weights[0].add_(1)  # in place: a LoRA merge, load_state_dict
    assert follow() == 1 and follow() == 1
    weights[1].data.copy_(torch.randn(3))  # through .data: no version bump
    assert follow() == 2 and follow() == 2
    weights[0] = torch.nn.Parameter(weights[0].detach().clone())  # a new tensor with the same values
    assert follow() == 3 and follow() == 3

    def failing() -> None:
        raise RuntimeError("copy failed")

    weights[1].data.mul_(2)
    with pytest.raises(RuntimeError):
        watch.follow(weights, failing)
    assert follow() == 4 and follow() == 4
    copy.deepcopy(watch).follow(weights, lambda: updates.append(1))
    assert len(updates) == 5
