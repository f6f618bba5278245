"""`rvqspec bench` on tiny stand-ins for the real architectures: report structure, arithmetic, device file, errors."""

import json
from pathlib import Path

import pytest
import torch

from rvqspec.bench import one_stream, report as bench_report
from rvqspec.cli.main import main
from rvqspec.core import cpu_class, device_file
from rvqspec.core.errors import RvqspecError
from rvqspec.core.policy import SIZES
from rvqspec.core.tree import default_tree

from helpers.tiny import tiny_config, tiny_csm_config, tiny_model

TINY_ARCHS = {"0.6b": tiny_config(vocab=64, hidden=32), "1.7b": tiny_config(vocab=64, hidden=32, talker_hidden=48),
              "csm-1b": tiny_csm_config(vocab=64, hidden=32, talker_hidden=48)}


@pytest.fixture(autouse=True)
def tiny(monkeypatch, tmp_path):
    monkeypatch.setattr(one_stream, "ARCHS", TINY_ARCHS)
    monkeypatch.setenv("RVQSPEC_CACHE", str(tmp_path / "cache"))


def small_plan(**changes) -> one_stream.Plan:
    plan = dict(archs=["0.6b", "1.7b"], dtypes=["float32"], threads=[1], sizes=[4, 16, 32], latency_rounds=3,
                controlled_sizes=(16, 32), controlled_archs=("0.6b",), calibration_iterations=3, frames=4)
    return one_stream.Plan(**(plan | changes))


def test_report_arithmetic_and_choice():
    plan = small_plan()
    report = one_stream.run_bench(plan, one_stream.load_trees(plan.sizes, None), None, None, "reused", None, log=lambda *a: None)
    assert [(s["model"], s["dtype"], s["threads"]) for s in report["settings"]] == [("0.6b", "float32", 1),
                                                                                   ("1.7b", "float32", 1)]
    for s in report["settings"]:
        latency = s["latency"]
        assert latency["ar"]["wall_ms"] > 0 and latency["ar"]["repeats"] == 3
        for n in plan.sizes:
            assert latency["spec"][n]["overhead"] == pytest.approx(latency["spec"][n]["wall_ms"] / latency["ar"]["wall_ms"] - 1)
        assert sorted(s["predicted_speedup"]) == [16, 32]  # the paper gives tokens/step at 16, 32, 64 only
        for n, speedup in s["predicted_speedup"].items():
            assert speedup == pytest.approx(one_stream.PAPER_ACCEPTANCE[n] / (1 + latency["spec"][n]["overhead"]))
    controlled = report["settings"][0]["controlled"]
    assert [r["tree_size"] for r in controlled] == [16, 32] and report["settings"][1]["controlled"] == []
    for row in controlled:
        assert row["frames"] == 4 and 1 <= row["tokens_per_step"] <= 3
        assert row["tokens_per_step"] == row["calibrated"]  # timed on the calibration's frames and draws
        assert row["realized_speedup"] == pytest.approx(row["ar_frame"]["wall_ms"] / row["spec_frame"]["wall_ms"])
    best = max(controlled, key=lambda r: r["realized_speedup"])
    assert report["speedup_at_paper_acceptance"] == best["realized_speedup"] == report["speedup"]
    assert report["tokens_per_step"] == best["tokens_per_step"] and report["stand_in_speedup"] is None
    chosen = report["chosen"]
    assert chosen["predicted_speedup"] == max(report["settings"][0]["predicted_speedup"].values())


def test_cli_json_reports_and_no_device_file(tmp_path, capsys):
    """The chosen N is reported; the device file holds only what the policy reads (`--batch`'s latency tables)."""
    assert device_file.read_device_file() is None
    code = main(["bench", "--archs", "0.6b", "--dtype", "float32", "--threads", "1", "--sizes", "4,32",
                     "--quick", "--out", str(tmp_path / "out"), "--json"])
    assert code == 0
    printed = json.loads(capsys.readouterr().out)
    for key in ("tokens_per_step", "calls_per_frame", "speedup", "speedup_at_paper_acceptance", "stand_in_speedup"):
        assert key in printed
    assert printed["calls_per_frame"] == pytest.approx(15 / printed["tokens_per_step"])
    assert printed["cpu_class"] == cpu_class.cpu_class()  # every figure names its CPU class
    assert {p.name for p in (tmp_path / "out").iterdir()} == {"bench-quick.json", "bench-quick.md", "bench-quick.png"}
    assert (tmp_path / "out" / "bench-quick.png").read_bytes()[:4] == b"\x89PNG"
    assert "| 0.6b float32 1t |" in (tmp_path / "out" / "bench-quick.md").read_text()
    assert printed["chosen"]["tree_size"] == 32 and printed["paper_acceptance"]["tree_size"] in (4, 32)
    assert printed["paper_acceptance"]["speedup"] == printed["speedup_at_paper_acceptance"]
    assert device_file.read_device_file() is None


def test_calibration_report_supplies_tokens_per_step(tmp_path):
    rows = [{"budget": n, "measured_tokens_per_step": 1.5 + n / 100} for n in (4, 16)]
    (tmp_path / "report.json").write_text(json.dumps({"trees": rows}))
    for n in (4, 16):
        default_tree(n).save(tmp_path / f"tree-N{n}.json")
    calibration = one_stream.load_calibration(str(tmp_path))
    tokens, source = one_stream.tokens_per_step_source(calibration)
    assert tokens == {4: 1.54, 16: 1.66} and "calibrate" in source
    trees = one_stream.load_trees([4, 16], str(tmp_path))
    assert trees[16].paths == default_tree(16).paths


def test_corrupt_device_file_is_an_error(tmp_path):
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "device.json").write_text("{not json")
    with pytest.raises(RvqspecError, match="rerun `rvqspec bench`"):
        device_file.read_device_file()


@pytest.mark.parametrize("args, problem", [
    (["--threads", "0"], "--threads must be >= 1"),
    (["--dtype", "float8"], "unknown dtype"),
    (["--sizes", "4,x"], "--sizes must be"),
    (["--archs", "7b"], "--archs must be"),
    (["--archs", ""], "nothing to benchmark"),
    (["--calibration", "/nonexistent/report.json"], "does not exist"),
    (["--model", "m", "--calibration", "c"], "bench them separately"),
    (["--trees", "/nonexistent"], "no tree-N4.json"),
])
def test_bad_arguments_are_one_line_errors(args, problem, capsys, tmp_path):
    assert main(["bench", "--out", str(tmp_path), *args]) == 2
    err = capsys.readouterr().err
    assert problem in err and len(err.strip().splitlines()) == 1


def test_a_checkpoint_is_benchmarked_as_the_stand_in(tmp_path, capsys):
    tiny_model(dtype=torch.float32).save_pretrained(tmp_path / "model")
    code = main(["bench", "--archs", "", "--model", str(tmp_path / "model"), "--dtype", "float32", "--threads",
                     "1", "--sizes", "4,16", "--quick", "--out", str(tmp_path / "out"), "--json"])
    assert code == 0
    printed = json.loads(capsys.readouterr().out)
    report = json.loads((tmp_path / "out" / "bench-quick.json").read_text())
    stand_in = report["settings"][0]["stand_in"]
    assert stand_in["tree_size"] == 16 and "random talker states" in stand_in["frames_from"]
    assert printed["stand_in_speedup"] == stand_in["realized_speedup"] == printed["speedup"]
    assert printed["speedup_at_paper_acceptance"] is None and printed["chosen"]["model"] == "stand-in"


@pytest.mark.parametrize("arch", ["0.6b", "csm-1b"])
def test_batch_bench_json_reports_and_device_latency(tmp_path, capsys, monkeypatch, arch):
    from rvqspec.bench import batched, controlled
    from rvqspec.core.policy import find_latency_table

    monkeypatch.setattr(batched, "ARCHITECTURES", TINY_ARCHS)
    monkeypatch.setattr(controlled, "QWEN3_TTS_0_6B", TINY_ARCHS["0.6b"])  # CSM's acceptance reference
    prepared, prepare = [], batched.device_path.prepare  # the kernel choices a loaded model has, at the bench's threads
    monkeypatch.setattr(batched.device_path, "prepare", lambda model, *a, **k: prepared.append(
        (model.dtype, torch.get_num_threads())) or prepare(model, *a, **k))
    code = main(["bench", "--batch", "1,3", "--archs", arch, "--dtype", "float32", "--threads", "1", "--quick",
                     "--rounds", "2", "--out", str(tmp_path / "out"), "--json"])
    assert code == 0 and prepared == [(torch.float32, 1)]
    printed = json.loads(capsys.readouterr().out)
    assert set(printed["batch_policy_speedup"]) == {"1", "3"}
    report = json.loads((tmp_path / "out" / "bench-batch-quick.json").read_text())
    setting = report["settings"][0]
    assert set(setting["latency_ms"]) == {"1", "3"}
    assert all(set(row) == {"0", *map(str, SIZES)} for row in setting["latency_ms"].values())
    # Every size is a candidate: the paper's at their own acceptance, the others at its headline's strength.
    assert set(setting["strengths"]) == set(map(str, SIZES))
    assert setting["strengths"]["6"]["strength"] == setting["strengths"]["32"]["strength"]
    for row in setting["frames"]:
        fps = row["frames_per_second"]
        assert row["policy_over_ar"] == pytest.approx(fps["policy"] / fps["ar"])
        assert printed["batch_policy_speedup"][str(row["batch"])] == row["policy_over_ar"]
        assert row["tree_size"] in (0, *SIZES) and set(fps) == {"ar", "policy", "upstream"}
        if row["tree_size"] == 0:  # AR chosen: the policy is our AR, timed once
            assert row["policy_over_ar"] == 1.0 and row["why"].startswith("AR")
    assert "| B | policy |" in (tmp_path / "out" / "bench-batch-quick.md").read_text()
    assert (tmp_path / "out" / "bench-batch-quick.png").read_bytes()[:4] == b"\x89PNG"
    latency = find_latency_table(setting["key"])  # the device file now holds this setting's table
    assert latency is not None and latency.ms[3][0] == setting["latency_ms"]["3"]["0"]
    assert setting["key"].split("/")[3].endswith(f"-g{TINY_ARCHS[arch].num_code_groups}") and \
        report["codes_per_frame"] == TINY_ARCHS[arch].num_residual_codes
    assert setting["key"].split("/")[4] == cpu_class.cpu_class()  # tables are per CPU class


@pytest.mark.parametrize("args, problem", [
    (["--batch", "0,2"], "--batch must be batch sizes >= 1"),
    (["--batch", "x"], "--batch must be a comma-separated list"),
    (["--batch", "1", "--model", "m"], "drop --model"),
    (["--batch", "1", "--archs", "0.6b,csm-1b"], "one architecture per run"),
    (["--device", "cuda:7"] if not torch.cuda.is_available() else ["--batch", "-1"], "cuda:7: this machine has|--batch must"),
])
def test_bad_batch_arguments_are_one_line_errors(args, problem, capsys, tmp_path):
    assert main(["bench", "--out", str(tmp_path), *args]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and any(p in err for p in problem.split("|"))


def test_a_calibration_report_works_from_any_folder(tmp_path, monkeypatch):
    """calibrate stores its inputs relative to the report's folder; bench resolves them there, whatever the cwd."""
    from rvqspec.tuning.calibrate import beside

    folder = tmp_path / "runs" / "trees"
    (tmp_path / "runs" / "offsets.safetensors").parent.mkdir(parents=True)
    (tmp_path / "runs" / "offsets.safetensors").write_bytes(b"x")
    (tmp_path / "corpus").mkdir()
    folder.mkdir()
    report = {"model": beside(tmp_path / "model", folder), "corpus": beside(tmp_path / "corpus", folder),
              "drafter": {"spec": beside(tmp_path / "runs" / "offsets.safetensors", folder)},
              "trees": [{"budget": 4, "measured_tokens_per_step": 1.5}]}
    assert report["corpus"] == "../../corpus"
    (folder / "report.json").write_text(json.dumps(report))
    monkeypatch.chdir(tmp_path / "corpus")  # another working directory
    loaded = one_stream.load_calibration(str(folder))
    assert Path(loaded["corpus"]).resolve() == (tmp_path / "corpus").resolve()
    assert Path(loaded["drafter"]["spec"]).resolve() == (tmp_path / "runs" / "offsets.safetensors").resolve()


def test_csm_runs_at_the_per_round_acceptance_of_the_paper_model():
    """csm-1b (31 codes per frame) is bisected to the drafts accepted per round that the 0.6B shows at the paper's
    tokens/step, so it reaches more tokens/step than the paper's on its longer frames."""
    plan = small_plan(archs=["0.6b", "csm-1b"], controlled_sizes=(32,), controlled_archs=("0.6b", "csm-1b"),
                      frames=6, calibration_iterations=6)
    report = one_stream.run_bench(plan, one_stream.load_trees(plan.sizes, None), None, None, "reused", None, log=lambda *a: None)
    (paper,), (csm,) = (s["controlled"] for s in report["settings"])
    assert paper["target"] == {"metric": "tokens_per_step", "value": 2.47} and csm["calls_per_frame"] > 1
    assert csm["target"] == {"metric": "round_acceptance", "value": paper["round_acceptance"]}
    assert csm["round_acceptance"] == csm["calibrated"]  # timed on the bisection's frames and draws
    assert csm["round_acceptance"] == pytest.approx(paper["round_acceptance"], abs=0.25)
    assert csm["tokens_per_step"] == pytest.approx(31 / csm["calls_per_frame"])
    assert report["csm_at_paper_acceptance"]["speedup"] == csm["realized_speedup"]
    assert "CSM-1B's depth decoder at the same per-round acceptance" in bench_report.markdown(report)


def test_without_matplotlib_the_reports_are_written_and_the_plot_skipped(tmp_path, capsys, monkeypatch):
    """The base install has no matplotlib: the whole benchmark ran, then died in the plot with nothing written."""
    import builtins

    real_import = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name.startswith("matplotlib"):
            raise ImportError("No module named 'matplotlib'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    code = main(["bench", "--archs", "0.6b", "--dtype", "float32", "--threads", "1", "--sizes", "4,8",
                 "--quick", "--out", str(tmp_path / "out")])
    assert code == 0
    out = capsys.readouterr().out
    assert "plot skipped: matplotlib is not installed (pip install 'rvqspec[bench]')" in out
    assert {p.name for p in (tmp_path / "out").iterdir()} == {"bench-quick.json", "bench-quick.md"}


def test_sizes_without_a_controlled_run_still_plot(tmp_path, capsys):
    """--sizes without 16/32/64 (and no calibration): no controlled rows, and the plot used to die after the run."""
    assert main(["bench", "--archs", "0.6b", "--dtype", "float32", "--threads", "1", "--sizes", "4,8", "--quick",
                 "--out", str(tmp_path / "out")]) == 0
    names = {p.name for p in (tmp_path / "out").iterdir()}
    assert {"bench-quick.json", "bench-quick.md"} <= names and "error" not in capsys.readouterr().err


def test_batched_bench_with_quantized_weights_writes_their_own_latency_tables(tmp_path, capsys, monkeypatch):
    """--batch --weights w8a8: the policy's tables for the quantized model, under a key of its own (dtype+w8a8)."""
    from rvqspec.bench import batched

    monkeypatch.setattr(batched, "ARCHITECTURES", TINY_ARCHS)
    arch = "0.6b"
    code = main(["bench", "--batch", "1,3", "--archs", arch, "--dtype", "float32", "--threads", "1", "--quick",
                 "--weights", "w8a8", "--out", str(tmp_path), "--json"])
    assert code == 0
    keys = list(device_file.read_device_file()["latency"])
    assert len(keys) == 1 and keys[0].startswith("cpu/float32+w8a8/1t/")
    report = json.loads((tmp_path / "bench-batch-quick.json").read_text())
    assert report["settings"][0]["weights"] == "w8a8"
    assert main(["bench", "--batch", "1", "--weights", "w8a8,w8a16", "--out", str(tmp_path)]) == 2
    assert "one scheme" in capsys.readouterr().err
