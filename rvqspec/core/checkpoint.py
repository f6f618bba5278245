"""The official Qwen3-TTS checkpoint layout (official keys <-> our MultiCodeDecoder's), reading just the
predictor's tensors from safetensors, and atomic file writes (safetensors, JSON, anything).

A leaf module: it builds no model (`MultiCodeDecoder.from_official` does), so everything that writes files
can import it. Only the predictor's tensors (and the talker's c0 table) are read, tensor by tensor, so
loading the predictor of a full 0.6B/1.7B checkpoint never materialises the talker.
"""

import json
import os
import tempfile
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save, save_file

from rvqspec.core.config import PredictorConfig, upstream_config_dict
from rvqspec.core.errors import RvqspecError

PREDICTOR = "talker.code_predictor."
TALKER_C0_TABLE = "talker.model.codec_embedding.weight"
CSM_DEPTH = "depth_decoder."
# CSM ties its depth decoder's code table to the backbone's audio table; transformers saves one of the two.
CSM_TIED_TABLES = {"depth_decoder.model.embed_tokens.weight": "backbone_model.embed_tokens.embed_audio_tokens.weight"}

Layout = dict[str, tuple[str, list[tuple[str, tuple[int, ...]]]]]


def official_layout(c: PredictorConfig) -> Layout:
    """native key -> (how to combine: cat, stack or transpose, [(official key, expected shape), ...])."""
    return csm_layout(c) if c.layout == "csm" else qwen3_tts_layout(c)


def predictor_prefix(c: PredictorConfig) -> str:
    """The key prefix under which every tensor of the depth decoder lies."""
    return CSM_DEPTH if c.layout == "csm" else PREDICTOR


def layers_layout(c: PredictorConfig, prefix: str) -> Layout:
    """The decoder layers under `prefix` (…layers.{i}.self_attn.q_proj.weight, …): the same keys in both layouts."""
    H, hd = c.hidden_size, c.head_dim
    layout: Layout = {}
    for i in range(c.num_hidden_layers):
        src = f"{prefix}layers.{i}."
        dst = f"layers.{i}."
        layout[dst + "attn.wqkv.weight"] = ("cat", [
            (src + "self_attn.q_proj.weight", (c.num_attention_heads * hd, H)),
            (src + "self_attn.k_proj.weight", (c.num_key_value_heads * hd, H)),
            (src + "self_attn.v_proj.weight", (c.num_key_value_heads * hd, H))])
        layout[dst + "attn.wo.weight"] = ("cat", [(src + "self_attn.o_proj.weight", (H, c.num_attention_heads * hd))])
        if c.qk_norm:
            layout[dst + "attn.q_norm.weight"] = ("cat", [(src + "self_attn.q_norm.weight", (hd,))])
            layout[dst + "attn.k_norm.weight"] = ("cat", [(src + "self_attn.k_norm.weight", (hd,))])
        layout[dst + "attn_norm.weight"] = ("cat", [(src + "input_layernorm.weight", (H,))])
        layout[dst + "mlp_norm.weight"] = ("cat", [(src + "post_attention_layernorm.weight", (H,))])
        layout[dst + "mlp.w_gate_up.weight"] = ("cat", [(src + "mlp.gate_proj.weight", (c.intermediate_size, H)),
                                                        (src + "mlp.up_proj.weight", (c.intermediate_size, H))])
        layout[dst + "mlp.w_down.weight"] = ("cat", [(src + "mlp.down_proj.weight", (H, c.intermediate_size))])
    layout["norm.weight"] = ("cat", [(prefix + "norm.weight", (H,))])
    return layout


def qwen3_tts_layout(c: PredictorConfig) -> Layout:
    H, Ht = c.hidden_size, c.talker_hidden_size
    layout = layers_layout(c, PREDICTOR + "model.")
    layout["code_embed.weight"] = ("cat", [(TALKER_C0_TABLE, (c.talker_vocab_size, Ht))] + [
        (f"{PREDICTOR}model.codec_embedding.{t}.weight", (c.vocab_size, Ht)) for t in range(c.num_residual_codes)])
    layout["heads"] = ("stack", [(f"{PREDICTOR}lm_head.{t}.weight", (c.vocab_size, H))
                                 for t in range(c.num_residual_codes)])
    if c.projects:
        layout["project.weight"] = ("cat", [(PREDICTOR + "small_to_mtp_projection.weight", (H, Ht))])
        if c.projection_bias:
            layout["project.bias"] = ("cat", [(PREDICTOR + "small_to_mtp_projection.bias", (H,))])
    return layout


def csm_layout(c: PredictorConfig) -> Layout:
    """transformers' CsmForConditionalGeneration: the depth decoder under `depth_decoder.`."""
    H, Ht = c.hidden_size, c.talker_hidden_size
    layout = layers_layout(c, CSM_DEPTH + "model.")
    layout["code_embed.weight"] = ("cat", [(CSM_DEPTH + "model.embed_tokens.weight",
                                            (c.num_code_groups * c.vocab_size, Ht))])
    layout["heads"] = ("transpose", [(CSM_DEPTH + "codebooks_head.weight", (c.num_residual_codes, H, c.vocab_size))])
    layout["project.weight"] = ("cat", [(CSM_DEPTH + "model.inputs_embeds_projector.weight", (H, Ht))])
    if c.projection_bias:
        layout["project.bias"] = ("cat", [(CSM_DEPTH + "model.inputs_embeds_projector.bias", (H,))])
    return layout


def combine(how: str, pieces: list[torch.Tensor]) -> torch.Tensor:
    """One native tensor from its official pieces."""
    if how == "transpose":
        return pieces[0].transpose(1, 2).contiguous()
    return torch.stack(pieces) if how == "stack" else torch.cat(pieces)


def split(how: str, tensor: torch.Tensor, parts: list[tuple[str, tuple[int, ...]]]) -> dict[str, torch.Tensor]:
    """The inverse of `combine`: official name -> piece."""
    if how == "transpose":
        pieces = [tensor.transpose(1, 2)]
    else:
        pieces = tensor.unbind(0) if how == "stack" else tensor.split([shape[0] for _, shape in parts])
    return {name: piece.contiguous() for (name, _), piece in zip(parts, pieces)}


def tensor_files(folder: Path) -> dict[str, Path]:
    """Map every tensor name to the safetensors file that holds it (single file or sharded)."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            return {name: folder / file for name, file in weight_map.items()}
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise RvqspecError(f"{index} is not a safetensors index (a JSON object with a weight_map; "
                               f"{type(e).__name__}: {e}): re-download the checkpoint") from None
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise RvqspecError(f"no *.safetensors in {folder}: pass the checkpoint folder (config.json + model*.safetensors)")
    names: dict[str, Path] = {}
    for file in files:
        with open_safetensors(file) as f:
            names.update({name: file for name in f.keys()})
    return names


def open_safetensors(file: Path):
    """safe_open, with a corrupt or truncated file reported as an RvqspecError that names it."""
    try:
        return safe_open(file, framework="pt")
    except SafetensorError as e:
        raise RvqspecError(f"{file} is not a readable safetensors file ({e}): re-download or rebuild the checkpoint") from None


def shown(names: list[str], limit: int = 6) -> str:
    return ", ".join(names[:limit]) + (f" and {len(names) - limit} more" if len(names) > limit else "")


def read_tensors(folder: Path, wanted: dict[str, tuple[int, ...]], dtype: torch.dtype,
                 all_of: str | None = None) -> dict[str, torch.Tensor]:
    """Read just the `wanted` tensors, checking their shapes; errors name every missing tensor. With `all_of`
    (a key prefix), every tensor under it must be wanted: one left over means config.json describes a smaller
    model than the weights (fewer layers or code groups), which would load silently cut down. A tied table that
    was saved under its twin's name (CSM_TIED_TABLES) is read from there."""
    files = tensor_files(folder)
    stored = {name: CSM_TIED_TABLES[name] if name not in files and CSM_TIED_TABLES.get(name) in files else name
              for name in wanted}
    files.update({name: files[source] for name, source in stored.items() if source != name})
    missing = [name for name in wanted if name not in files]
    if missing:
        raise RvqspecError(f"checkpoint {folder} lacks {len(missing)} tensor(s) the depth decoder needs: "
                           f"{shown(missing)}")
    unused = sorted(name for name in files if all_of and name.startswith(all_of) and name not in wanted)
    if unused:
        raise RvqspecError(f"config.json and the weights in {folder} disagree: {len(unused)} code-predictor tensor(s) "
                           f"are not part of the model config.json describes ({shown(unused, 3)}): fix config.json "
                           "(num_hidden_layers, num_code_groups, ...) or use the config.json these weights came with")
    out: dict[str, torch.Tensor] = {}
    by_file: dict[Path, list[str]] = {}
    for name in wanted:
        by_file.setdefault(files[name], []).append(name)
    for file, names in by_file.items():
        if not file.is_file():
            raise RvqspecError(f"{file} is listed in the index but missing: re-download the checkpoint")
        with open_safetensors(file) as f:
            for name in names:
                shape = tuple(f.get_slice(stored[name]).get_shape())
                if shape != wanted[name]:
                    raise RvqspecError(f"shape mismatch for {name}: checkpoint has {shape}, config.json implies "
                                       f"{wanted[name]} (config.json and weights come from different models?)")
                out[name] = f.get_tensor(stored[name]).to(dtype)
    return out


def official_state_dict(model, layout: Layout | None = None) -> dict[str, torch.Tensor]:
    """The model's tensors under official key names (the inverse of `MultiCodeDecoder.from_pretrained`), by its
    config's layout or the given one."""
    state, out = model.state_dict(), {}
    for native, (how, parts) in (layout or official_layout(model.config)).items():
        out.update(split(how, state[native], parts))
    return out


def atomic_write(path: str | Path, write, suffix: str = ".tmp") -> None:
    """Call write(tmp_path), then rename over `path`: a crash never leaves a half-written file. The temporary file
    (`.<name>.<random><suffix>` beside `path`) is created anew, so it is never a file of the user's. The file gets
    the permissions the umask gives a new file (not the temporary file's 0600), and an error names `path`, not the
    hidden temporary file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=suffix)
    os.close(fd)
    try:
        write(tmp)
        os.chmod(tmp, 0o666 & ~current_umask())
        os.replace(tmp, path)
    except OSError as e:
        raise OSError(e.errno, e.strerror, str(path)) from None  # the errno picks the subclass (PermissionError...)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def current_umask() -> int:
    mask = os.umask(0o022)  # reading the umask means setting it: put it straight back
    os.umask(mask)
    return mask


def relative_path(path: str | Path) -> Path:
    """`path` relative to the working directory when it lies below it, for reports (readable on another machine)."""
    try:
        return Path(path).resolve().relative_to(Path.cwd().resolve())
    except ValueError:
        return Path(path)


def save_tensors(path: str | Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> None:
    """A safetensors file, written atomically, whose bytes depend on its contents alone. safetensors writes the
    metadata in the order of a Rust HashMap, seeded anew in every process: the same drafter saved by a `tune` killed
    and resumed and by an uninterrupted one made different files. With metadata, the header is written here, its
    metadata sorted."""
    tensors = {k: v.contiguous() for k, v in tensors.items()}
    if not metadata:
        atomic_write(path, lambda tmp: save_file(tensors, tmp))
        return
    data = save(tensors, metadata)
    length = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + length])
    header["__metadata__"] = dict(sorted(header["__metadata__"].items()))
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data stays 8-byte aligned, as safetensors pads it
    atomic_write(path, lambda tmp: Path(tmp).write_bytes(len(text).to_bytes(8, "little") + text + data[8 + length:]))


def save_text(path: str | Path, text: str) -> None:
    """Write `text` to `path` atomically (`atomic_write`)."""
    atomic_write(path, lambda tmp: Path(tmp).write_text(text))


def save_json(path: str | Path, obj) -> None:
    save_text(path, json.dumps(obj, indent=2) + "\n")


def save_predictor(model, folder: str | Path, talker_config: dict | None = None,
                   extra_tensors: dict[str, torch.Tensor] | None = None) -> None:
    """config.json (upstream nested layout) + model.safetensors (official keys, plus `extra_tensors`)."""
    folder = Path(folder)
    tensors = official_state_dict(model)
    tensors.update(extra_tensors or {})
    save_tensors(folder / "model.safetensors", tensors)
    save_json(folder / "config.json", upstream_config_dict(model.config, talker_config))
