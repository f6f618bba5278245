"""What the benchmarks share: the machine's facts (its CPU class included), the report files (JSON, Markdown,
plot) and where a `--smoke` run writes them, a base commit's rvqspec run beside this tree's in processes of their own
(`sources_at`, `worker_result`), and a benchmark run once per CPU class this machine stands in for (`per_class`).
Clocks, medians and the per-call latency of the AR step and of speculative rounds are in
`rvqspec.core.latency`, where the decoding policy measures its tables too."""

import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from rvqspec.core import cpu_class
from rvqspec.core.checkpoint import save_json, save_text

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"  # a checkout's; absent from an install
SMOKE_HELP = "seconds, tiny sizes: checks that the script runs; reports go to a temporary folder, never to results/"


def report_folder(out: Path, smoke: bool) -> Path:
    """Where a run writes its reports: `out`, except that a `--smoke` run never writes into benchmarks/results/
    (it gets a fresh temporary folder instead)."""
    out = Path(out)
    if smoke and RESULTS in (out.resolve(), *out.resolve().parents):
        return Path(tempfile.mkdtemp(prefix="rvqspec-smoke-"))
    return out


def pin(cores: int) -> list[int]:
    """Every thread of this process onto the first `cores` CPUs it may use (threads made later inherit it)."""
    allowed = sorted(ALL_CPUS)[:cores]
    for task in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(task), allowed)
        except OSError:  # a thread that ended meanwhile
            pass
    return allowed


ALL_CPUS = os.sched_getaffinity(0)  # at import: what pin() chooses from


def machine() -> dict:
    return {"cpu": cpu_name(), "cpu_class": cpu_class.cpu_class(), "cores": os.cpu_count(), "torch": torch.__version__,
            "python": platform.python_version(),
            "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"), "load_before": os.getloadavg(),
            "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
            "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None}


def finish_machine(info: dict) -> dict:
    """`machine()`'s record, given the load average after the measurements (call it when they are done)."""
    info["load_after"] = os.getloadavg()
    return info


def machine_text(m: dict) -> str:
    """A report header's machine clause, from a `finish_machine` record."""
    return (f"{m['cpu']}, torch {m['torch']}, {m['date']}, load {m['load_before'][0]:.1f} before / "
            f"{m['load_after'][0]:.1f} after (a shared machine: compare within this run)")


def run_record(script: str, argv: list[str], info: dict) -> dict:
    """A report's common fields, once the measurements are done: the CPU, whether its ISA was capped (to stand in for
    another class) or native, `machine()`'s record `info` finished and its header clause, the command to rerun."""
    capped = "ONEDNN_MAX_CPU_ISA" in os.environ or "ATEN_CPU_CAPABILITY" in os.environ
    record = finish_machine(info)
    return {"cpu": cpu_name(), "native": "capped" if capped else "native", "machine": record,
            "machine_text": machine_text(record), "command": " ".join([f".venv/bin/python benchmarks/{script}", *argv])}


def cpu_name() -> str:
    """The CPU's model and class, caps included ("AMD EPYC: avx512-vnni-bf16"): every figure names its CPU class."""
    return cpu_class.describe()


def write_reports(report: dict, out: Path, name: str, to_markdown, to_plot=None, log=print) -> list[Path]:
    """{name}.json, {name}.md (`to_markdown(report)`) and {name}.png (`to_plot(report, path)`, if any) in `out`,
    atomically: the measurements first, then the plot, which is skipped with one line where it cannot be drawn (no
    matplotlib, the `bench` extra) rather than losing the run."""
    paths = [out / f"{name}.json", out / f"{name}.md", out / f"{name}.png"]
    save_json(paths[0], report)
    save_text(paths[1], to_markdown(report))
    if to_plot is None:
        return paths[:2]
    try:
        to_plot(report, paths[2])
    except ImportError:
        log(f"plot skipped: matplotlib is not installed (pip install 'rvqspec[bench]'); {paths[0]} and {paths[1]} "
            "hold the figures")
        return paths[:2]
    except (ValueError, KeyError, IndexError) as e:  # a run whose sizes the figure has no axis for
        log(f"plot skipped ({type(e).__name__}: {e}); {paths[0]} and {paths[1]} hold the figures")
        return paths[:2]
    return paths


@contextmanager
def sources_at(commit: str, repository: Path) -> Iterator[Path]:
    """A temporary folder holding `repository`'s rvqspec package as it was at `commit`."""
    with tempfile.TemporaryDirectory() as folder:
        archive = subprocess.run(["git", "archive", commit, "rvqspec"], cwd=repository, capture_output=True, check=True)
        subprocess.run(["tar", "-x", "-C", folder], input=archive.stdout, check=True)
        yield Path(folder)


def tree_commit(repository: Path) -> str:
    """`repository`'s HEAD (short hash), with " + changes" where its rvqspec/ differs from it: what the after side of a
    before/after benchmark ran."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=repository, capture_output=True, text=True).stdout

    changed = git("status", "--porcelain", "rvqspec")
    return git("rev-parse", "--short", "HEAD").strip() + (" + changes" if changed else "")


def worker_result(source: Path, argv: list[str], path: tuple[Path, ...] = (), env: dict | None = None) -> dict:
    """The JSON object on the last line `python argv` prints, run in `source` with its rvqspec first on the import
    path (then `path`), one OpenMP thread and `env`'s variables; its failure ends the benchmark with the end of its
    stderr."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(map(str, (source, *path))), OMP_NUM_THREADS="1", **(env or {}))
    out = subprocess.run([sys.executable, *argv], env=env, cwd=source, capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(f"the worker in {source} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


# The classes a benchmark measures here, as the caps that make this CPU stand in for them (read when torch loads).
CLASS_CAPS = {"native": {}, "avx2": {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"}}


def per_class(script: str, names: list[str], argv: list[str]) -> dict[str, dict]:
    """Per class name (`CLASS_CAPS`), the JSON object that `python script *argv --one FILE` writes into FILE, each in
    a process of its own under that class's caps, with OMP_WAIT_POLICY=PASSIVE."""
    env = {k: v for k, v in os.environ.items() if k not in ("ONEDNN_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY")}
    classes = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            out = Path(tmp) / f"{name}.json"
            subprocess.run([sys.executable, script, *argv, "--one", str(out)],
                           env=env | CLASS_CAPS[name] | {"OMP_WAIT_POLICY": "PASSIVE"}, check=True)
            classes[name] = json.loads(out.read_text())
    return classes
