"""The decoding policy: the distribution of a frame's calls, the batch's expected calls, latency tables, the choice."""

import functools
import json

import pytest
import torch

from rvqspec.core import cpu_class, policy as policy_module
from rvqspec.core.decode import decode_frames
from rvqspec.core.device_file import update_device_file
from rvqspec.core.drafters import ReusedHeads
from rvqspec.core.errors import RvqspecError
from rvqspec.core.policy import (LatencyTable, Policy, calls_distribution, expected_calls, find_latency_table,
                                   measured_distribution, setting_key, uniform_acceptance)
from rvqspec.core.sampling import Sampler
from rvqspec.core.tree import PRIOR_ACCEPTANCE, Tree, default_tree
from rvqspec.tuning.calibrate import predicted_calls

from helpers.tiny import random_frames, tiny_model

GROUPS = 16
SIZES = (4, 8, 16, 32, 64)


def acceptance(value: float) -> torch.Tensor:
    """Every draft of rank 0 wins with probability `value`, no other rank ever does."""
    pooled = torch.zeros(3, 4)
    pooled[:, 0] = value
    return uniform_acceptance(pooled, GROUPS)


def test_calls_distribution_extremes_and_mean():
    chain = Tree.chain(3)
    assert calls_distribution(chain, acceptance(1.0))[5] == pytest.approx(1.0)  # prefill + 4 rounds of 4 - ... = 5
    assert calls_distribution(chain, acceptance(0.0))[15] == pytest.approx(1.0)  # one code per call
    for n in SIZES:
        tree, per_position = default_tree(n), uniform_acceptance(PRIOR_ACCEPTANCE, GROUPS)
        distribution = calls_distribution(tree, per_position)
        assert sum(distribution) == pytest.approx(1.0)
        assert sum(c * p for c, p in enumerate(distribution)) == pytest.approx(predicted_calls(tree, per_position))


def test_expected_calls_of_a_batch_is_the_slowest_row():
    distribution = calls_distribution(default_tree(16), acceptance(0.6))
    mean = sum(c * p for c, p in enumerate(distribution))
    batches = [expected_calls(distribution, b) for b in (1, 2, 4, 8, 16)]
    assert batches[0] == pytest.approx(mean) and batches == sorted(batches) and batches[-1] < 15
    certain = calls_distribution(Tree.chain(3), acceptance(1.0))
    assert expected_calls(certain, 16) == pytest.approx(5.0)
    # By simulation: the max over rows of independent draws from the distribution.
    draws = torch.multinomial(torch.tensor(distribution), 8 * 20000, replacement=True,
                              generator=torch.Generator().manual_seed(0)).view(20000, 8)
    assert draws.max(1).values.double().mean().item() == pytest.approx(expected_calls(distribution, 8), abs=0.03)


def test_measured_distribution_is_the_histogram_of_frame_calls():
    distribution = measured_distribution([5, 6, 6, 15], GROUPS)
    assert len(distribution) == GROUPS and distribution[5] == 0.25 and distribution[6] == 0.5
    assert expected_calls(distribution, 1) == pytest.approx(8.0)
    assert expected_calls(distribution, 1000) == pytest.approx(15.0, abs=1e-6)  # some row surely takes 15


def test_a_calibration_folder_supplies_trees_and_frame_calls(tmp_path):
    model = tiny_model(groups=GROUPS)
    per_position = uniform_acceptance(PRIOR_ACCEPTANCE, GROUPS).tolist()
    rows = [{"budget": 4, "file": "tree-N4.json", "measured_frame_calls": [7, 8, 9]},
            {"budget": 8, "file": "tree-N8.json"}]  # a report from before frame calls were recorded
    for n in (4, 8):
        default_tree(n).save(tmp_path / f"tree-N{n}.json")
    (tmp_path / "report.json").write_text(json.dumps({"acceptance_per_position": per_position, "trees": rows}))
    chosen = Policy.for_model(model, tmp_path, table(1.0, {4: 1.0, 8: 1.0}))
    assert set(chosen.trees) == {4, 8} and chosen.calls[4] == measured_distribution([7, 8, 9], GROUPS)
    assert chosen.calls[8] == pytest.approx(calls_distribution(default_tree(8), torch.tensor(per_position)))
    (tmp_path / "report.json").write_text("{}")
    with pytest.raises(RvqspecError, match="not an `rvqspec calibrate` folder"):
        Policy.for_model(model, tmp_path)


def table(ar: float, round_ms: dict[int, float], batches=(1, 16)) -> LatencyTable:
    return LatencyTable({b: {0: ar * (1 + b / 100)} | {n: ms * b for n, ms in round_ms.items()} for b in batches},
                        "fake")


def policy(latency: LatencyTable, value: float = 0.7) -> Policy:
    model = tiny_model(groups=GROUPS)
    trees = {n: default_tree(n) for n in SIZES}
    return Policy.build(model, trees, {n: calls_distribution(trees[n], acceptance(value)) for n in SIZES}, latency)


def test_the_policy_picks_the_n_of_most_predicted_frames_per_second():
    latency = table(1.0, {4: 1.1, 8: 1.2, 16: 1.4, 32: 2.0, 64: 3.0})
    chosen = policy(latency)
    for batch in (1, 3, 16):
        best = max(SIZES, key=lambda n: batch / chosen.frame_ms(batch, n))
        assert chosen.choose(batch) in (best, 0)
    assert chosen.choose(1) == max(SIZES, key=lambda n: 1 / chosen.frame_ms(1, n)) > 0
    assert chosen.predicted_speedup(1, chosen.choose(1)) > 1.05
    assert chosen.choose(16) == 0  # rounds cost 16x at B=16 while AR steps barely grow: AR
    assert chosen.tree_for(16) is None and chosen.tree_for(1).size == chosen.choose(1)
    assert chosen.explain(16).startswith("AR: speculation predicted at best")
    shown = chosen.explain(16).split("(N=")[1].split(",")[0]  # the measured reason: the round's cost in AR steps
    assert f"a round of N={shown} costs {chosen.latency.at(16, int(shown)) / chosen.latency.at(16, 0):.2f} AR steps" \
        in chosen.explain(16)


def test_the_policy_chooses_ar_when_nothing_beats_it():
    assert policy(table(1.0, {n: 10.0 for n in SIZES})).choose(1) == 0  # rounds far dearer than steps
    assert policy(table(1.0, {n: 1.0 for n in SIZES}), value=0.0).choose(1) == 0  # no draft is ever accepted
    # Predicted 1.03x: within the margin, so AR.
    marginal = policy(table(1.0, {n: 1.0 for n in SIZES}), value=0.0)
    marginal.latency.ms[1] = {0: 1.0} | {n: (15 / 1.03 - 1) / 14 for n in SIZES}  # prefill + 14 rounds
    assert marginal.predicted_speedup(1, 4) == pytest.approx(1.03) and marginal.choose(1) == 0
    unmeasured = Policy.build(tiny_model(groups=GROUPS), {4: default_tree(4)},
                              {4: calls_distribution(default_tree(4), acceptance(0.9))}, None)
    unmeasured.latency = None
    assert unmeasured.choose(1) == 0 and "no call latency measured" in unmeasured.explain(1)


def test_latency_table_interpolates_and_extrapolates():
    latency = LatencyTable({1: {0: 1.0, 4: 2.0}, 4: {0: 4.0, 4: 8.0}}, "fake")
    assert latency.at(1, 4) == 2.0 and latency.at(2, 0) == pytest.approx(2.0) and latency.at(3, 4) == pytest.approx(6.0)
    assert latency.at(8, 0) == pytest.approx(8.0)  # past the largest batch: the per-row cost stays
    assert latency.sizes == [4]


def test_find_latency_table_prefers_this_device_then_nearest_threads(tmp_path, monkeypatch):
    monkeypatch.setenv("RVQSPEC_CACHE", str(tmp_path))
    model = tiny_model(groups=GROUPS, dtype=torch.float32)
    key = setting_key(model)
    assert key.startswith("cpu/float32/1t/h32-l2-v16-g16")
    assert find_latency_table(key) is None  # no device file, no built-in table for this tiny architecture
    other_threads = key.replace("/1t/", "/4t/")
    update_device_file({"latency": {other_threads: {"ms": {"1": {"0": 2.0, "4": 3.0}}}}})
    found = find_latency_table(key)
    assert found.ms == {1: {0: 2.0, 4: 3.0}} and "this device" in found.source
    update_device_file({"latency": {key: {"ms": {"1": {"0": 1.0, "4": 1.5}}}}})
    assert find_latency_table(key).ms == {1: {0: 1.0, 4: 1.5}}
    assert set(json.loads((tmp_path / "device.json").read_text())["latency"]) == {key, other_threads}


def test_built_in_tables_parse():
    from rvqspec.core.policy import DEFAULT_TABLES

    for key, entry in json.loads(DEFAULT_TABLES.read_text()).items():
        latency = LatencyTable.from_json(entry, key, 0.15)
        assert latency.sizes and all(0 in row for row in latency.ms.values())


@pytest.mark.parametrize("weights", ["float", "w8a8"])
@pytest.mark.parametrize("cls", ["amx", "avx512-vnni-bf16"])
def test_the_built_in_tables_cover_the_real_predictor_per_cpu_class(tmp_path, monkeypatch, weights, cls):
    """A machine of a measured class that never ran `rvqspec bench --batch` still gets its class's table for the 0.6B
    predictor, quantized too (until then, tree="auto" decoded a w8a8 model AR)."""
    from types import SimpleNamespace

    from rvqspec.core.config import QWEN3_TTS_0_6B

    monkeypatch.setenv("RVQSPEC_CACHE", str(tmp_path))  # no device file
    monkeypatch.setattr(cpu_class, "cpu_class", lambda: cls)
    model = SimpleNamespace(config=QWEN3_TTS_0_6B, device=torch.device("cpu"), dtype=torch.bfloat16, weights=weights)
    found = find_latency_table(setting_key(model))
    assert found is not None and "built-in" in found.source and found.margin == 0.15
    assert ("+w8a8" in found.source) == (weights == "w8a8") and f"/{cls} on " in found.source  # its class's own


def test_a_class_without_a_built_in_table_measures_its_own_once(tmp_path, monkeypatch):
    """Where the built-in tables hold a setting for other classes only, the policy measures a small table for this
    one on first use (one progress line per batch), keeps it in the device file and reads it from there after."""
    model = tiny_model(groups=GROUPS)
    monkeypatch.setenv("RVQSPEC_CACHE", str(tmp_path))
    monkeypatch.setattr(cpu_class, "cpu_class", lambda: "arm")
    amx_key = setting_key(model).rsplit("/", 1)[0] + "/amx"
    amx_table = {"ms": {"1": {"0": 1.0, "4": 1.01, "8": 1.02, "16": 1.03, "32": 1.04, "64": 1.05}}}
    monkeypatch.setattr(policy_module, "built_in_tables", lambda: {amx_key: amx_table})
    assert find_latency_table(setting_key(model)) is None  # the amx table is not borrowed
    lines = []
    monkeypatch.setattr(policy_module, "measure_first_use", functools.partial(policy_module.measure_first_use,
                                                                              log=lines.append))
    measured = Policy.for_model(model).latency
    assert len(lines) == len(policy_module.FIRST_USE_BATCHES) and "arm" in lines[0]
    assert sorted(measured.ms) == list(policy_module.FIRST_USE_BATCHES) and measured.ms[1] != amx_table["ms"]["1"]
    assert "first use" in measured.source and setting_key(model).endswith("/arm")
    again = Policy.for_model(model).latency  # from the device file now
    assert len(lines) == len(policy_module.FIRST_USE_BATCHES) and again.ms == measured.ms


def test_policy_choices_decode_the_same_codes():
    """Whatever N the policy picks per batch size, greedy codes are AR's."""
    model = tiny_model(groups=GROUPS)
    chosen = policy(table(1.0, {4: 1.1, 8: 1.2, 16: 1.4, 32: 2.0, 64: 3.0}), value=0.5)
    frames = random_frames(model, 6, seed=3)
    hidden, c0 = torch.stack([h for h, _ in frames]), torch.tensor([c for _, c in frames])
    greedy = Sampler(do_sample=False)
    ar = decode_frames(model, hidden, c0, greedy).codes
    for batch in (1, 6):
        tree = chosen.tree_for(batch)
        result = decode_frames(model, hidden[:batch], c0[:batch], greedy, drafter=ReusedHeads(model) if tree else None,
                               tree=tree)
        assert torch.equal(result.codes, ar[:batch])


KEY = "cpu/bfloat16/1t/h32-l2-v16-g16"


@pytest.mark.parametrize("entry, message", [
    ({"ms": {}}, "must hold a non-empty 'ms' table"),
    ({"ms": "fast"}, "must hold a non-empty 'ms' table"),
    ({"ms": {"1": ["0", 1.0]}}, "must map tree sizes N to ms"),
    ({"ms": {"0": {"0": 1.0}}}, r"batch '0' must be an integer in \[1, 65536\]"),
    ({"ms": {"1.5": {"0": 1.0}}}, r"batch '1.5' must be an integer in"),
    ({"ms": {"1": {"4": 1.0}}}, "with N = 0 \\(an AR step\\)"),
    ({"ms": {"1": {"0": "1.0"}}}, "must be a latency in ms"),
    ({"ms": {"1": {"0": float("nan")}}}, "must be a latency in ms"),
    ({"ms": {"1": {"0": float("inf")}}}, "must be a latency in ms"),
    ({"ms": {"1": {"0": 1.0, "4": -0.5}}}, "must be a latency in ms"),
    ({"ms": {"1": {"0": {"0": {"0": 1.0}}}}}, "must be a latency in ms"),
])
def test_a_damaged_device_file_is_refused_in_one_line(tmp_path, monkeypatch, entry, message):
    """Entries like these raised TypeError, KeyError, ZeroDivisionError or RecursionError, and a negative latency
    made the policy choose speculation "predicted -0.46x"."""
    monkeypatch.setenv("RVQSPEC_CACHE", str(tmp_path))
    (tmp_path / "device.json").write_text(json.dumps({"format": "rvqspec-device/1", "latency": {KEY: entry}}))
    with pytest.raises(RvqspecError, match=message):
        find_latency_table(KEY)


def test_a_damaged_device_file_key_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("RVQSPEC_CACHE", str(tmp_path))
    bad = "cpu/bfloat16/xt/h32-l2-v16-g16"
    (tmp_path / "device.json").write_text(json.dumps({"format": "rvqspec-device/1", "latency": {
        bad: {"ms": {"1": {"0": 1.0}}}}}))
    with pytest.raises(RvqspecError, match="is not a setting key"):
        find_latency_table(KEY)


@pytest.mark.parametrize("calls", [[16], [1.5], ["3"], [0, 0], []], ids=["too-many", "float", "string", "zero", "empty"])
def test_a_damaged_calibration_report_is_refused(tmp_path, calls):
    """measured_frame_calls >= G, float, string or zero raised IndexError, TypeError or ZeroDivisionError."""
    model = tiny_model()
    default_tree(4).save(tmp_path / "tree-N4.json")
    report = {"acceptance_per_position": torch.zeros(14, 3, 4).tolist(),
              "trees": [{"budget": 4, "file": "tree-N4.json", "measured_frame_calls": calls}]}
    (tmp_path / "report.json").write_text(json.dumps(report))
    with pytest.raises(RvqspecError, match=r"measured_frame_calls of the N=4 tree must be a non-empty list"):
        Policy.for_model(model, tmp_path)


def test_the_policy_weighs_the_sizes_between_powers_of_two_where_the_table_has_them():
    # A verify call costs one row's call up to its knee (7 rows here), then grows with its rows: N = 6 decodes as many
    # codes a call as N = 8 nearly, for less; a table measured before N = 6 was a size leaves it out.
    knee = {n: 1.0 + 0.12 * max(0, n + 1 - 7) for n in policy_module.SIZES}
    model = tiny_model(groups=GROUPS)
    assert 6 in policy_module.SIZES and 12 in policy_module.SIZES
    assert Policy.for_model(model, None, table(1.0, knee, batches=(1,))).choose(1) == 6
    older = {n: ms for n, ms in knee.items() if n in SIZES}
    assert Policy.for_model(model, None, table(1.0, older, batches=(1,))).choose(1) in SIZES
