"""The runner of ``make gpu-check``: what is usable here, each part in a child process under
its own time limit, the table, the exit status.

Owns: the list of parts (:data:`PARTS`), finding GPUs (device files first, then a child that
asks jax and torch), running a part (``--part NAME``: the child side) and the command line
(:func:`main`). A part that raises, times out or dies becomes a FAIL row and the next part
runs; the exit status is 1 only when a part ran and failed. The runner's process imports
neither jax nor torch: a hung CUDA call in a part is ended with its process group.

Must not import at module level: jax, orbax, torch (the probe's child imports jax, torch).
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import importlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any

from .rows import Row, error_row, format_table, read_rows, short_error, write_rows

__all__ = ["PARTS", "Part", "PartContext", "main", "child_env"]

#: The whole run stays under 8 minutes on one GPU: the parts' limits add up to this budget
#: with the probe, and a part gets no more than what is left of it.
BUDGET_S = 450.0
NO_GPU_LINE = "gpu-check: no NVIDIA GPU on this machine; nothing to check (exit 0)."


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Part:
    """One part of the check.

    Args:
        name: the ``--part`` name.
        label: its name in the table.
        framework: "jax" or "torch": skipped when that framework cannot use a GPU here.
        function: "module:function" under this package, called with a :class:`PartContext`.
        limit_s: its time limit.
    """

    name: str
    """The ``--part`` name."""
    label: str
    """Its name in the table."""
    framework: str
    """"jax" or "torch"."""
    function: str
    """"module:function" under this package."""
    limit_s: float
    """Its time limit in seconds."""


PARTS = (
    Part(name="jax_roundtrip", label="1 jax round trip", framework="jax",
         function="jax_parts:roundtrip", limit_s=70),
    Part(name="jax_speed", label="2 jax async speed", framework="jax",
         function="jax_parts:speed", limit_s=110),
    Part(name="jax_kill", label="3 jax kill/resume", framework="jax",
         function="jax_parts:kill_resume", limit_s=110),
    Part(name="torch_dcp", label="4 torch DCP", framework="torch",
         function="torch_parts:dcp_roundtrip", limit_s=100),
    Part(name="torch_nccl", label="5 DCP with NCCL", framework="torch",
         function="torch_parts:two_ranks", limit_s=80),
)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class PartContext:
    """What a part gets in its child process.

    Args:
        cpu: run on CPU devices with tiny sizes (gloo instead of NCCL).
        workdir: its own directory (deleted afterwards).
        mib: the size of the state the speed rows measure.
        label: the part's name in the table.
        gpus: how many GPUs its framework sees (0 with ``cpu``).
    """

    cpu: bool
    """CPU devices and tiny sizes."""
    workdir: str
    """Its own directory."""
    mib: int
    """Size of the measured state in MiB."""
    label: str
    """Its name in the table."""
    gpus: int = 0
    """GPUs its framework sees."""


def child_env(cpu: bool) -> dict[str, str]:
    """The environment of every child: this checkout's jaxckpt importable, jax not taking
    75% of a GPU at start (the parts share one), and with ``cpu`` jax on 2 CPU devices."""
    env = dict(os.environ)
    parent = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (parent, env.get("PYTHONPATH")) if p)
    env.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    if cpu:
        env["JAX_PLATFORMS"] = "cpu"
        flags = env.get("XLA_FLAGS", "")
        if "xla_force_host_platform_device_count" not in flags:
            env["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count=2".strip()
    return env


def nvidia_present() -> bool:
    """An NVIDIA device or driver visible here, without loading a framework."""
    return bool(glob.glob("/dev/nvidia[0-9]*") or glob.glob("/proc/driver/nvidia/gpus/*")
                or shutil.which("nvidia-smi"))


def _run_child(argv: list[str], *, env: dict[str, str], log: str, limit_s: float) -> str:
    """Run a child in its own session; "" when it exited 0, else what went wrong (its
    whole group is killed at ``limit_s``)."""
    with open(log, "ab") as out:
        proc = subprocess.Popen([sys.executable, "-m", "jaxckpt.tools.gpu_check", *argv],
                                stdout=out, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
        limit_s = max(1.0, limit_s)
        try:
            code = proc.wait(timeout=limit_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return f"timed out after {limit_s:.0f} s (killed)"
        finally:
            # The group: DCP's checkpoint process or a rank a part started may outlive it.
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    return "" if code == 0 else f"exited with status {code}"


def _log_tail(log: str, limit: int = 400) -> str:
    try:
        with open(log, errors="replace") as handle:
            lines = [line for line in handle.read().splitlines() if line.strip()]
    except OSError:
        return ""
    return " / ".join(lines[-3:])[-limit:]


def probe(workdir: str, cpu: bool) -> dict[str, Any]:
    """{"jax": {"gpus": n, "why": ...}, "torch": {...}}: what each framework can use,
    asked in a child (which may take a while to load CUDA)."""
    if cpu:
        return {name: {"gpus": 0, "why": ""} for name in ("jax", "torch")}
    path = os.path.join(workdir, "probe.json")
    problem = _run_child(["--probe", path], env=child_env(False),
                         log=os.path.join(workdir, "probe.log"), limit_s=120)
    try:
        with open(path) as handle:
            return dict(json.load(handle))
    except (OSError, ValueError):
        why = problem or "wrote nothing"
        return {name: {"gpus": 0, "why": f"the probe {why}: "
                       f"{_log_tail(os.path.join(workdir, 'probe.log'))}"}
                for name in ("jax", "torch")}


def _probe_child(path: str) -> int:
    found: dict[str, Any] = {}
    try:
        import jax

        found["jax"] = {"gpus": len(jax.devices("gpu")), "why": ""}
    except Exception as error:  # noqa: BLE001 - no gpu backend installed is an answer
        found["jax"] = {"gpus": 0, "why": f"jax has no usable gpu backend ({short_error(error)})"}
    try:
        import torch

        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        found["torch"] = {"gpus": count, "why": "" if count else
                          f"torch {torch.__version__} sees no CUDA device "
                          f"(built for CUDA: {torch.version.cuda or 'no'})"}
    except Exception as error:  # noqa: BLE001
        found["torch"] = {"gpus": 0, "why": f"torch unusable ({short_error(error)})"}
    with open(path, "w") as handle:
        json.dump(found, handle)
    return 0


def _part_child(opts: argparse.Namespace) -> int:
    """The child side of ``--part``: run it, write its rows (a FAIL row on an error)."""
    part = next(part for part in PARTS if part.name == opts.part)
    context = PartContext(cpu=opts.cpu, workdir=opts.workdir, mib=opts.mib, label=part.label,
                          gpus=opts.gpus)
    module_name, function_name = part.function.split(":")
    try:
        module = importlib.import_module(f"{__package__}.{module_name}")
        rows = list(getattr(module, function_name)(context))
    except Exception as error:  # noqa: BLE001 - recorded; the runner goes on
        rows = [error_row(part.label, "the part raised", error)]
    write_rows(opts.result, rows)
    return 0


def run_part(part: Part, *, workdir: str, cpu: bool, mib: int, gpus: int,
             limit_s: float, logs_to: str) -> list[Row]:
    """Run one part in a child; its rows, or one FAIL row saying how the child ended. The
    log of a part that failed is copied into ``logs_to``."""
    result = os.path.join(workdir, f"{part.name}.json")
    log = os.path.join(workdir, f"{part.name}.log")
    own = os.path.join(workdir, part.name)
    os.makedirs(own, exist_ok=True)
    argv = ["--part", part.name, "--result", result, "--workdir", own, "--mib", str(mib),
            "--gpus", str(gpus), *(["--cpu"] if cpu else [])]
    started = time.monotonic()
    problem = _run_child(argv, env=child_env(cpu), log=log, limit_s=limit_s)
    rows = read_rows(result)
    shutil.rmtree(own, ignore_errors=True)
    if not rows:
        rows = [Row(part=part.label, what="the part's process", status="FAIL",
                    result=f"{problem or 'wrote no rows'}: {_log_tail(log)}",
                    figure=f"{time.monotonic() - started:.0f} s")]
    elif problem:
        rows.append(Row(part=part.label, what="the part's process", status="FAIL",
                        result=f"{problem} after writing its rows: {_log_tail(log)}"))
    if any(row.status == "FAIL" for row in rows):
        kept = os.path.join(logs_to, f"gpu-check-{part.name}.log")
        shutil.copyfile(log, kept)
        rows.append(Row(part=part.label, what="its log", result=kept, status="FAIL"))
    return rows


def run_all(*, cpu: bool, mib: int, workdir: str, logs_to: str, only: Sequence[str] = (),
            budget_s: float = BUDGET_S, say: Any = print) -> list[Row]:
    """Every part (or those named in ``only``) in turn, within ``budget_s`` in all; the
    logs of failed parts go to ``logs_to``."""
    deadline = time.monotonic() + budget_s
    found = probe(workdir, cpu)
    rows: list[Row] = []
    for part in PARTS:
        if only and part.name not in only:
            continue
        facts = found.get(part.framework, {"gpus": 0, "why": "not probed"})
        left = deadline - time.monotonic()
        if not cpu and not facts["gpus"]:
            rows.append(Row(part=part.label, what=f"{part.framework} on GPU", status="skipped",
                            result=f"skipped: {facts['why']}"))
        elif left < 10:
            rows.append(Row(part=part.label, what="time budget", status="skipped",
                            result=f"skipped: {budget_s:.0f} s budget spent"))
        else:
            say(f"gpu-check: {part.label} (at most {min(part.limit_s, left):.0f} s) ...")
            rows += run_part(part, workdir=workdir, cpu=cpu, mib=mib, gpus=int(facts["gpus"]),
                             limit_s=min(part.limit_s, left), logs_to=logs_to)
    return rows


def _heading(cpu: bool, mib: int, started: float) -> str:
    import platform

    where = "CPU devices (--cpu)" if cpu else "the GPUs found"
    return (f"`python -m jaxckpt.tools.gpu_check` on {platform.node()}, {where}, state "
            f"{mib} MiB, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime(started))}, "
            f"{time.time() - started:.0f} s in all.")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m jaxckpt.tools.gpu_check",
                                     description="Run the CUDA paths of jaxckpt and "
                                                 "torch_bridge on this machine's GPUs.")
    parser.add_argument("--out", default="gpu-check-results.md",
                        help="where the markdown table goes (default: %(default)s)")
    parser.add_argument("--cpu", action="store_true",
                        help="run the parts on CPU devices with tiny sizes (CI)")
    parser.add_argument("--mib", type=int, default=None,
                        help="size of the measured states (default 1024, 8 with --cpu)")
    parser.add_argument("--parts", default="", help="comma-separated part names (default all: "
                        + ", ".join(part.name for part in PARTS) + ")")
    parser.add_argument("--workdir", default=None,
                        help="where checkpoints go (default: a new directory under the "
                             "current one, removed afterwards)")
    # The child side (run by this command itself).
    parser.add_argument("--probe", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--part", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--result", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--gpus", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--rank-worker", default=None, help=argparse.SUPPRESS)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the check; 0 unless a part ran and failed (see the module docstring)."""
    opts = build_parser().parse_args(argv)
    if opts.probe:
        return _probe_child(opts.probe)
    if opts.part:
        return _part_child(opts)
    if opts.rank_worker:
        from .torch_parts import rank_worker

        return rank_worker(opts.rank_worker)
    if not opts.cpu and not nvidia_present():
        print(NO_GPU_LINE)
        return 0
    mib = opts.mib if opts.mib is not None else (8 if opts.cpu else 1024)
    only = [name for name in opts.parts.split(",") if name]
    unknown = sorted(set(only) - {part.name for part in PARTS})
    if unknown:
        print(f"gpu-check: unknown part(s) {unknown}; the parts are "
              f"{[part.name for part in PARTS]}.", file=sys.stderr)
        return 2
    started = time.time()
    workdir = opts.workdir or tempfile.mkdtemp(prefix=".gpu-check-", dir=os.getcwd())
    os.makedirs(workdir, exist_ok=True)
    try:
        rows = run_all(cpu=opts.cpu, mib=mib, workdir=workdir, only=only,
                       logs_to=os.path.dirname(os.path.abspath(opts.out)))
    finally:
        if opts.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)
    table = format_table(rows, heading=_heading(opts.cpu, mib, started))
    with open(opts.out, "w") as handle:
        handle.write(table)
    print(table, end="")
    print(f"gpu-check: table written to {opts.out}")
    return 1 if any(row.status == "FAIL" for row in rows) else 0
