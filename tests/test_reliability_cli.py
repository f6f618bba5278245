"""Issue 36, part C and case 15: what the CLI writes never replaces or loses what is there (a user's file beside
the output, a device node, a missing folder, a full disk), and --model names the same things in every command.

synth runs in-process on a tiny qwen-tts checkpoint (random weights, greedy, 10 frames); a full disk is a file
size limit (RLIMIT_FSIZE, SIGXFSZ ignored: writes fail with EFBIG), which binds root and non-root alike."""

import contextlib
import os
import resource
import signal
import stat

import pytest

from rvqspec.cli.main import main

from helpers.cli import assert_refused_first
from helpers.upstream_models import upstream_available

if not upstream_available():
    pytest.skip("qwen-tts reference not installed: run `make install`", allow_module_level=True)

import soundfile  # noqa: E402  (qwen-tts brings it)

from helpers.upstream_tts import save_checkpoint, tiny_qwen3_tts  # noqa: E402
from test_streaming import worker_threads  # noqa: E402

STREAM = ["--stream", "--chunk-frames", "2"]  # chunks of 2 frames, 7,680 bytes each
LIMIT = 10_000  # bytes: the header and the first chunk fit, the second does not


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_checkpoint(tiny_qwen3_tts(seed=1), tmp_path_factory.mktemp("checkpoint"),
                           {"max_new_tokens": 10, "do_sample": False, "subtalker_dosample": False})


def synth(checkpoint, out, *extra: str) -> list[str]:
    return ["synth", "--model", str(checkpoint), "--text", "a short line", "--speaker", "tiny", "--language",
            "English", "--device", "cpu", "--out", str(out), *extra]


@contextlib.contextmanager
def file_size_limit(limit: int):
    """Writes past `limit` bytes fail with EFBIG, as on a full disk (ENOSPC) in libsndfile and Python alike."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, handler)


def test_a_stream_never_touches_the_users_part_file(checkpoint, tmp_path, monkeypatch):
    """Case 7: `synth --stream --out mine.wav` overwrote the user's mine.part.wav and renamed it away."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    (tmp_path / "mine.part.wav").write_bytes(b"the user's own file")
    partial, real_write = [], soundfile.SoundFile.write

    def write(self, data):
        partial.append(self.name)
        real_write(self, data)

    monkeypatch.setattr(soundfile.SoundFile, "write", write)
    assert main(synth(checkpoint, tmp_path / "mine.wav", *STREAM)) == 0
    assert (tmp_path / "mine.part.wav").read_bytes() == b"the user's own file"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine.part.wav", "mine.wav"]
    assert len(set(partial)) == 1 and os.path.dirname(partial[0]) == str(tmp_path)
    assert os.path.basename(partial[0]) not in ("mine.part.wav", "mine.wav")
    assert soundfile.info(tmp_path / "mine.wav").frames > 0


@pytest.mark.parametrize("make, message", [
    (lambda path: path.mkdir(), "is a folder"),
    (lambda path: os.mkfifo(path), "is not a regular file (a device, FIFO or socket)"),
])
def test_out_must_be_a_regular_file_or_nothing(make, message, tmp_path, capsys):
    """Case 8: the atomic rename replaced whatever --out named; now refused at parse time, before any work (the
    model folder does not even exist)."""
    make(tmp_path / "out.wav")
    argv = ["synth", "--model", "{tmp}/no-model", "--text", "hi", "--out", "{tmp}/out.wav"]
    for mode in ([], STREAM):
        assert_refused_first(main, argv + mode, message, tmp_path, capsys)
    assert (tmp_path / "out.wav").exists() and not (tmp_path / "out.wav").is_file()


def test_a_device_node_is_refused_and_kept(tmp_path, capsys):
    """Case 8 as reported: `synth --out /dev/full`, run as root, replaced the device with a WAV file (here
    /dev/null, a character device on every Linux system)."""
    argv = ["synth", "--model", "{tmp}/no-model", "--text", "hi", "--out", "/dev/null"]
    assert_refused_first(main, argv, "/dev/null is not a regular file", tmp_path, capsys)
    assert stat.S_ISCHR(os.stat("/dev/null").st_mode)


@pytest.mark.parametrize("mode", [[], STREAM], ids=["plain", "stream"])
def test_a_symlink_is_written_through_and_a_missing_folder_made(mode, checkpoint, tmp_path, monkeypatch):
    """Case 9: `synth --stream` into a folder that does not exist was a LibsndfileError traceback. A symlinked
    --out keeps its link: the wav goes to the target, here in a folder that does not exist yet."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    (tmp_path / "link.wav").symlink_to(tmp_path / "new" / "deeper" / "target.wav")
    assert main(synth(checkpoint, tmp_path / "link.wav", *mode)) == 0
    assert (tmp_path / "link.wav").is_symlink() and soundfile.info(tmp_path / "link.wav").frames > 0
    assert os.listdir(tmp_path / "new" / "deeper") == ["target.wav"]
    assert main(synth(checkpoint, tmp_path / "other" / "out.wav", *mode)) == 0
    assert os.listdir(tmp_path / "other") == ["out.wav"]


@pytest.mark.parametrize("mode", [[], STREAM], ids=["plain", "stream"])
def test_a_full_disk_is_one_line_and_exit_1(mode, checkpoint, tmp_path, monkeypatch, capsys):
    """Case 10: a LibsndfileError traceback (plain) or an abort (stream, exit 134): now one line naming the file,
    exit 1, no partial file, the stream's worker joined."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    capsys.readouterr()
    with file_size_limit(LIMIT):
        assert main(synth(checkpoint, tmp_path / "out.wav", *mode)) == 1
    err = capsys.readouterr().err.splitlines()[-1]
    assert err == f"rvqspec synth: error: File too large: {tmp_path / 'out.wav'}: free some space, or write elsewhere"
    assert not os.listdir(tmp_path) and not worker_threads()


def test_a_full_disk_mid_stream_joins_the_worker_before_the_error_leaves(checkpoint, tmp_path, monkeypatch):
    """Case 10 as reported, exit 134 ("terminate called without an active exception"): the error left the writer
    with the stream still open, its frame kept by the traceback, so the worker still ran torch code when the process
    exited. Now the stream is closed before the error leaves: no worker while the error is still held."""
    from rvqspec.cli.main import build_parser
    from rvqspec.cli.synth import run_synth

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    args = build_parser().parse_args(synth(checkpoint, tmp_path / "out.wav", "--stream", "--chunk-frames", "1"))
    with file_size_limit(LIMIT), pytest.raises(OSError) as raised:  # 10 chunks: more than the stream queues
        run_synth(args)
    assert raised.value.filename == str(tmp_path / "out.wav") and not worker_threads()
    assert not os.listdir(tmp_path)


def test_synth_names_a_tuned_folder_passed_as_the_model(tmp_path, capsys):
    """Case 15: transformers answered with its 3,000-character list of model types."""
    (tmp_path / "tuned").mkdir()
    (tmp_path / "tuned" / "tune.json").write_text("{}")
    argv = ["synth", "--model", "{tmp}/tuned", "--text", "hi", "--out", "{tmp}/o.wav"]
    assert_refused_first(main, argv, f"pass it as --tuned {tmp_path / 'tuned'}", tmp_path, capsys)
    assert not (tmp_path / "o.wav").exists()


def test_synth_names_the_standin_passed_as_the_model(tmp_path, capsys):
    argv = ["synth", "--model", "standin", "--text", "hi", "--out", "{tmp}/o.wav"]
    assert_refused_first(main, argv, "not a qwen-tts checkpoint (it has no speech tokenizer or text model): "
                                     "`rvqspec demo` speaks with it", tmp_path, capsys)


def test_inspect_reads_the_model_as_synth_and_tune_do(folder, model, tmp_path, monkeypatch, capsys):
    """Case 15: `inspect --model standin` was refused; a cached repo id is read as synth reads it."""
    import json
    import shutil

    import huggingface_hub.constants

    from rvqspec.standin.settings import MODEL_DIR

    assert main(["inspect", "--model", "standin", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["folder"] == str(MODEL_DIR)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    repo = tmp_path / "models--Org--tiny"
    shutil.copytree(folder, repo / "snapshots" / "abc123")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc123")
    assert main(["inspect", "--model", "Org/tiny", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["folder"] == str(repo / "snapshots" / "abc123")
    assert report["parameters"]["total"] == sum(p.numel() for p in model.parameters())
