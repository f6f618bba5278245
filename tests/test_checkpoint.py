"""Bad checkpoints (`core/checkpoint.py`, `core/config.py`, `MultiCodeDecoder.from_pretrained`): every case raises
RvqspecError naming the problem and the fix; written files are atomic and follow the umask."""

import json

import pytest
import torch

from rvqspec import MultiCodeDecoder, RvqspecError
from rvqspec.core.checkpoint import official_state_dict, save_json, save_tensors

from helpers.checkpoints import load


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


def test_config_describing_a_smaller_model_than_the_weights_is_refused(tmp_path):
    """config.json with fewer layers or code groups than the weights would load a cut-down predictor silently."""
    from rvqspec.core.model import MultiCodeDecoder

    from helpers.tiny import tiny_model

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


def test_written_files_follow_the_umask_and_errors_name_the_target(tmp_path):
    import errno
    import os

    from rvqspec.core.checkpoint import atomic_write

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


@pytest.mark.parametrize("field, value, message", [
    ("rope_theta", 0, "rope_theta=0 is not physical"), ("rope_theta", -5.0, "rope_theta=-5.0 is not physical"),
    ("rms_norm_eps", -1e-6, "rms_norm_eps=-1e-06 is not physical"),
    ("num_key_value_heads", 0, r"num_key_value_heads=0 is out of range: it must be an integer in \[1, "),
    ("num_hidden_layers", 1000000, r"num_hidden_layers=1000000 is out of range"),
    ("num_code_groups", 10000000, r"num_code_groups=10000000 is out of range"),
])
def test_non_physical_configs_are_refused_before_anything_is_built(folder, field, value, message):
    """They used to load (greedy emitted zeros, sampling crashed), divide by zero, or allocate until memory ran out."""
    config = json.loads((folder / "config.json").read_text())
    config["talker_config"]["code_predictor_config"][field] = value
    save_json(folder / "config.json", config)
    with pytest.raises(RvqspecError, match=message):
        load(folder)


def test_a_nan_in_config_json_is_refused(folder):
    text = (folder / "config.json").read_text().replace('"rms_norm_eps": 1e-06', '"rms_norm_eps": NaN')
    assert "NaN" in text
    (folder / "config.json").write_text(text)
    with pytest.raises(RvqspecError, match="rms_norm_eps=nan is not physical"):
        load(folder)
