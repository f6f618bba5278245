"""Where an upstream checkpoint is (a folder, or a Hugging Face repo id already in the local cache: nothing is ever
downloaded), and the device and dtype it loads on by default."""

import re
from pathlib import Path

import torch

from rvqspec.core.errors import RvqspecError
from rvqspec.core.model import resolve_dtype

REPO_ID = re.compile(r"[\w.-]+/[\w.-]+")


def resolve_model(name: str) -> Path:
    """`name` if it is a folder, else the snapshot folder of Hugging Face repo `name` in the local cache (looked up
    with local files only: nothing is downloaded, and the process's environment is left as it is; the CLI runs its
    commands offline, `cli.main`)."""
    path = Path(name).expanduser()
    if path.is_dir():
        return path
    if not REPO_ID.fullmatch(name):
        raise RvqspecError(f"checkpoint folder {name} does not exist: pass a folder holding config.json, the "
                           "weights and speech_tokenizer/, or a Hugging Face repo id such as "
                           "Qwen/Qwen3-TTS-12Hz-0.6B-CustomVoice")
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        snapshot = Path(snapshot_download(name, local_files_only=True))
    except LocalEntryNotFoundError:
        snapshot = None
    if snapshot is None or not (snapshot / "config.json").is_file():
        raise RvqspecError(f"the weights of {name} are not on disk (no folder of that name, and no complete entry in "
                           f"the Hugging Face cache {constants.HF_HUB_CACHE}; rvqspec never downloads): fetch them "
                           f"once with `huggingface-cli download {name}`, or pass --model /path/to/checkpoint")
    return snapshot


def default_device(device: str | None) -> str:
    return device or ("cuda" if torch.cuda.is_available() else "cpu")


def default_dtype(dtype: str | None, device: str) -> torch.dtype:
    return resolve_dtype(dtype or ("bfloat16" if device.startswith("cuda") else "float32"))
