"""Bad input: every case raises RvqspecError naming the problem (and the fix); the CLI prints one line, exit 2."""

import json
import math
import subprocess
import sys

import pytest
import torch

from rvqspec import MultiCodeDecoder, PredictorConfig, RvqspecError, Sampler, decode_frame
from rvqspec.checkpoint import official_state_dict, save_json, save_tensors
from rvqspec.cli import main

# talker_hidden != hidden: the checkpoint also carries the input projection.
CONFIG = PredictorConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=8, vocab_size=16, num_code_groups=4, talker_hidden_size=24,
                         talker_vocab_size=20)


@pytest.fixture(scope="module")
def model() -> MultiCodeDecoder:
    torch.manual_seed(0)
    return MultiCodeDecoder(CONFIG).eval()


@pytest.fixture
def folder(model, tmp_path):
    model.save_pretrained(tmp_path / "ckpt")
    return tmp_path / "ckpt"


def load(folder):
    return MultiCodeDecoder.from_pretrained(folder)


def rewrite_tensors(folder, change) -> None:
    """Rewrite model.safetensors with `change(tensors)` applied to the official-name tensors."""
    tensors = official_state_dict(load(folder))
    change(tensors)
    save_tensors(folder / "model.safetensors", tensors)


def test_folder_does_not_exist(tmp_path):
    with pytest.raises(RvqspecError, match=r"checkpoint folder .*nope does not exist: pass the folder"):
        load(tmp_path / "nope")


def test_path_is_a_file(folder):
    with pytest.raises(RvqspecError, match="is a file, not a folder"):
        load(folder / "config.json")


def test_folder_without_config(tmp_path):
    with pytest.raises(RvqspecError, match="no config.json in"):
        load(tmp_path)


def test_folder_without_safetensors(folder):
    (folder / "model.safetensors").unlink()
    with pytest.raises(RvqspecError, match=r"no \*\.safetensors in .*ckpt"):
        load(folder)


@pytest.mark.parametrize("text, message", [
    ("{not json", "is not valid JSON"),
    ("[1, 2]", "describes no known model.*expected Qwen3-TTS .* or Sesame CSM"),
    ('{"model_type": "llama", "hidden_size": 64}', "describes a 'llama' model, not a checkpoint rvqspec can load"),
    ('{"talker_config": {"hidden_size": 64}}', "no talker_config.code_predictor_config"),
    ('{"model_type": "csm"}', "model_type 'csm' but no depth_decoder_config"),
    ('{"model_type": "csm", "depth_decoder_config": {"mlp_bias": true}}', "mlp_bias=True"),
    ('{"model_type": "csm", "depth_decoder_config": {"rope_scaling": {"rope_type": "yarn"}}}',
     "unsupported RoPE scaling 'yarn'"),
    ('{"model_type": "csm", "depth_decoder_config": {"rope_scaling": {"rope_type": "llama3", "factor": 8}}}',
     "llama3 lacks low_freq_factor, high_freq_factor, original_max_position_embeddings"),
    ('{"model_type": "csm", "depth_decoder_config": {"rope_scaling": "llama3"}}', "rope_scaling must be dict"),
])
def test_config_of_an_unknown_or_unsupported_layout(folder, text, message):
    (folder / "config.json").write_text(text)
    with pytest.raises(RvqspecError, match=message):
        load(folder)


@pytest.mark.parametrize("field, value", [("hidden_size", "32"), ("rope_theta", "1e6"), ("num_hidden_layers", 1.5),
                                          ("head_dim", True)])
def test_config_field_of_the_wrong_type_is_named(folder, field, value):
    config = json.loads((folder / "config.json").read_text())
    config["talker_config"]["code_predictor_config"][field] = value
    save_json(folder / "config.json", config)
    with pytest.raises(RvqspecError, match=f"config.json: {field} must be"):
        load(folder)


def test_unsupported_predictor_is_refused(folder):
    config = json.loads((folder / "config.json").read_text())
    config["talker_config"]["code_predictor_config"]["rope_scaling"] = {"rope_type": "yarn", "factor": 4.0}
    save_json(folder / "config.json", config)
    with pytest.raises(RvqspecError, match="scaled RoPE"):
        load(folder)


def test_missing_tensors_are_named(folder):
    gone = ["talker.code_predictor.lm_head.2.weight", "talker.code_predictor.small_to_mtp_projection.bias"]
    rewrite_tensors(folder, lambda tensors: [tensors.pop(name) for name in gone])
    with pytest.raises(RvqspecError, match="lacks 2 tensor") as error:
        load(folder)
    assert all(name in str(error.value) for name in gone)


def test_many_missing_tensors_are_counted(folder):
    rewrite_tensors(folder, lambda tensors: [tensors.pop(name) for name in list(tensors) if "layers.0" in name])
    with pytest.raises(RvqspecError, match=r"lacks 11 tensor\(s\).*and 5 more"):
        load(folder)


def test_shape_mismatch_names_the_tensor_and_both_shapes(folder):
    name = "talker.code_predictor.lm_head.1.weight"
    rewrite_tensors(folder, lambda tensors: tensors.update({name: torch.zeros(17, 32)}))
    with pytest.raises(RvqspecError, match=rf"shape mismatch for {name}: checkpoint has \(17, 32\), config.json implies "
                                           r"\(16, 32\)"):
        load(folder)


def test_c0_table_of_another_size(folder):
    rewrite_tensors(folder, lambda tensors: tensors.update({"talker.model.codec_embedding.weight": torch.zeros(30, 24)}))
    with pytest.raises(RvqspecError, match=r"talker.model.codec_embedding.weight: checkpoint has \(30, 24\)"):
        load(folder)


def test_corrupt_or_truncated_safetensors(folder):
    data = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(data[:len(data) // 2])
    with pytest.raises(RvqspecError, match="model.safetensors is not a readable safetensors file"):
        load(folder)


@pytest.mark.parametrize("index, message", [
    ("{oops", "is not a safetensors index"),
    ('{"metadata": {}}', "is not a safetensors index"),
    ('{"weight_map": {"talker.model.codec_embedding.weight": "model-2.safetensors"}}', "lacks"),
])
def test_bad_shard_index(folder, index, message):
    (folder / "model.safetensors.index.json").write_text(index)
    with pytest.raises(RvqspecError, match=message):
        load(folder)


def test_index_names_a_missing_shard(folder):
    names = official_state_dict(load(folder))
    save_json(folder / "model.safetensors.index.json", {"weight_map": {name: "model-00002-of-00002.safetensors"
                                                                       for name in names}})
    with pytest.raises(RvqspecError, match="model-00002-of-00002.safetensors is listed in the index but missing"):
        load(folder)


@pytest.mark.parametrize("dtype", ["float8", "int8", torch.int64, torch.complex64, None])
def test_unknown_dtype(folder, dtype):
    with pytest.raises(RvqspecError, match="unknown dtype .*use one of float32, bfloat16, float16"):
        MultiCodeDecoder.from_pretrained(folder, dtype=dtype)


@pytest.mark.parametrize("hidden", [torch.zeros(32), torch.zeros(1, 25), torch.zeros(2, 24), torch.zeros(1, 1, 24),
                                    [0.0] * 24])
def test_talker_hidden_of_the_wrong_size(model, hidden):
    with pytest.raises(RvqspecError, match=r"talker_hidden must be \[24\] or \[1, 24\] \(the talker's hidden size\)"):
        decode_frame(model, hidden, 0, Sampler())


@pytest.mark.parametrize("c0", [20, -1, 1.5, torch.tensor([1, 2]), torch.tensor(3.0)])
def test_c0_out_of_range(model, c0):
    with pytest.raises(RvqspecError, match=r"c0 must be one integer code in \[0, 20\)"):
        decode_frame(model, torch.zeros(24), c0, Sampler())


def test_valid_edge_inputs_decode(model):
    """The checks above must not reject the edges of valid input."""
    for hidden, c0 in [(torch.zeros(24), 0), (torch.zeros(1, 24), 19), (torch.zeros(24), torch.tensor(5))]:
        assert decode_frame(model, hidden, c0, Sampler(do_sample=False)).codes.shape == (3,)


@pytest.mark.parametrize("settings, message", [
    (dict(temperature=0), "temperature must be > 0"),
    (dict(temperature=-0.5), "temperature must be > 0"),
    (dict(temperature=math.nan), "temperature must be > 0"),
    (dict(top_k=-1), "top_k must be an integer >= 0"),
    (dict(top_k=2.5), "top_k must be an integer >= 0"),
    (dict(top_k=None), "top_k must be an integer >= 0"),
    (dict(top_p=0.0), r"top_p must be in \(0, 1\]"),
    (dict(top_p=1.5), r"top_p must be in \(0, 1\]"),
    (dict(top_p=math.nan), r"top_p must be in \(0, 1\]"),
])
def test_bad_sampler_settings(settings, message):
    with pytest.raises(RvqspecError, match=message):
        Sampler(**settings)


def test_sampler_of_the_wrong_type(model):
    with pytest.raises(RvqspecError, match="sampler must be an rvqspec.Sampler, got str"):
        decode_frame(model, torch.zeros(24), 0, "greedy")


def test_cli_prints_one_line_and_exits_2(folder, capsys):
    (folder / "model.safetensors").write_bytes(b"\0" * 16)
    assert main(["inspect", "--model", str(folder)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1
    assert err.startswith("rvqspec inspect: error: ") and "is not a readable safetensors file" in err


def test_cli_process_exit_code_and_no_traceback(tmp_path):
    missing = tmp_path / "nonexistent"
    done = subprocess.run([sys.executable, "-m", "rvqspec.cli", "inspect", "--model", str(missing)], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr == f"rvqspec inspect: error: checkpoint folder {missing} does not exist: pass the folder that " \
                          "holds config.json and *.safetensors\n"


def test_cli_inspect_reports_the_checkpoint(folder, model, capsys):
    assert main(["inspect", "--model", str(folder), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["config"] == CONFIG.to_dict()
    assert report["parameters"]["total"] == sum(p.numel() for p in model.parameters())


def test_config_describing_a_smaller_model_than_the_weights_is_refused(tmp_path):
    """config.json with fewer layers or code groups than the weights would load a cut-down predictor silently."""
    from rvqspec.model import MultiCodeDecoder
    from tiny import tiny_model

    tiny_model(layers=2, dtype=torch.float32).save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    for field, value in (("num_hidden_layers", 1), ("num_code_groups", 3)):
        edited = json.loads(json.dumps(config))
        edited["talker_config"]["code_predictor_config"][field] = value
        (tmp_path / "config.json").write_text(json.dumps(edited))
        with pytest.raises(RvqspecError, match="config.json and the weights .* disagree"):
            MultiCodeDecoder.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert MultiCodeDecoder.from_pretrained(tmp_path).config.num_hidden_layers == 2


@pytest.mark.parametrize("argv, message", [
    (["results", "--results", "{tmp}/typo", "--out", "{tmp}/X.md"], "is not a folder"),
    (["results", "--calibration", "{tmp}/none.json", "--out", "{tmp}/X.md"], "does not exist"),
    (["standin", "build", "--from", "quality", "--to", "corpus", "--work", "{tmp}/w"], "comes after --to"),
    (["calibrate", "--model", "m", "--drafter", "reused", "--corpus", "c", "--out", "{tmp}/o", "--budgets", "100000"],
     "at most 1024"),
    (["demo", "--threads", "100000"], "--threads: 100000 is out of range"),
    (["eval", "--manifest", "{tmp}/X.md", "--out", "{tmp}/o", "--no-asr"], "is not a corpus manifest"),
])
def test_inputs_that_lost_data_or_hung_are_refused_first(argv, message, tmp_path, capsys):
    (tmp_path / "X.md").write_text("mine")
    assert main([a.format(tmp=tmp_path) for a in argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err
    assert (tmp_path / "X.md").read_text() == "mine"  # nothing of the user's was touched


def test_written_files_follow_the_umask_and_errors_name_the_target(tmp_path):
    import errno
    import os

    from rvqspec.checkpoint import atomic_write

    previous = os.umask(0o027)
    try:
        save_json(tmp_path / "a.json", {"x": 1})
    finally:
        os.umask(previous)
    assert (tmp_path / "a.json").stat().st_mode & 0o777 == 0o640

    def full_disk(tmp):
        raise OSError(errno.ENOSPC, "No space left on device", tmp)

    with pytest.raises(OSError) as raised:
        atomic_write(tmp_path / "b.json", full_disk)
    assert raised.value.filename == str(tmp_path / "b.json") and raised.value.errno == errno.ENOSPC
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.json"]  # no temporary file left behind


def test_refused_instead_of_accepted(tmp_path):
    """Inputs that used to be accepted silently: empty trees, a non-boolean do_sample, malformed tree files."""
    from rvqspec.tree import Tree, default_tree

    for make in (lambda: Tree.from_paths([]), lambda: default_tree(0), lambda: Tree.chain(0)):
        with pytest.raises(RvqspecError, match="at least one node"):
            make()
    with pytest.raises(RvqspecError, match="do_sample must be True or False"):
        Sampler(do_sample="no")
    for name, content in (("latin1.json", "\xff\xfe{".encode("latin-1")),
                          ("ints.json", json.dumps({"format": "rvqspec-tree/1", "paths": [5]}).encode())):
        (tmp_path / name).write_bytes(content)
        with pytest.raises(RvqspecError, match="not valid JSON|invalid tree paths"):
            Tree.load(tmp_path / name)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), 1e30])
def test_a_broken_talker_state_is_refused_by_row_and_spoils_nothing(value):
    from rvqspec.decode import decode_frames
    from tiny import random_frames, tiny_model

    model = tiny_model()
    frames = random_frames(model, 2)
    hidden, c0 = torch.stack([h for h, _ in frames]), torch.tensor([c for _, c in frames])
    before = decode_frames(model, hidden, c0, Sampler(do_sample=False)).codes
    broken = hidden.clone()
    broken[1, 3] = value
    with pytest.raises(RvqspecError, match="talker_hidden row 1 is not finite or out of range"):
        decode_frames(model, broken, c0, Sampler())
    assert torch.equal(decode_frames(model, hidden, c0, Sampler(do_sample=False)).codes, before)


def test_a_foreign_or_damaged_report_is_named_and_nothing_is_written(tmp_path, capsys):
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "eval.json").write_text(json.dumps({"something": "else"}))
    (tmp_path / "X.md").write_text("mine")
    assert main(["results", "--results", str(tmp_path / "results"), "--out", str(tmp_path / "X.md")]) == 2
    assert "is not one that rvqspec eval, bench or calibrate wrote" in capsys.readouterr().err
    assert (tmp_path / "X.md").read_text() == "mine"


def test_draft_depth_beyond_the_frame_is_refused(tmp_path, capsys):
    from rvqspec.drafters import make_drafter
    from tiny import tiny_model

    with pytest.raises(RvqspecError, match="draft depth 20 does not fit a frame of 15"):
        make_drafter("offsets", tiny_model(), depth=20)


def test_an_unwritable_out_folder_is_refused_before_the_work(tmp_path, capsys, monkeypatch):
    import os

    real = os.access
    monkeypatch.setattr(os, "access", lambda path, mode: False if str(path) == str(tmp_path) else real(path, mode))
    assert main(["demo", "--out", str(tmp_path / "new" / "wavs")]) == 2  # the nearest existing folder is checked
    assert f"cannot write into {tmp_path}" in capsys.readouterr().err
