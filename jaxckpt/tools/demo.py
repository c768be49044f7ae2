"""The crash-and-resume demo, and the training worker that it and the tests run.

Owns: a deterministic, stateful synthetic loader (``SyntheticLoader``), a small Flax NNX
training loop wired to ``CheckpointManager`` (``train``), the ``worker`` command (``python
-m jaxckpt.tools.demo worker --root R --steps N``; its stdout protocol and log format are
in ``_emit``), and ``run_demo``: train once uninterrupted, then on another root while
SIGKILLing the worker twice and resuming it, and show bit-identical losses and final state.

Must not import at module level: jax, flax, optax, torch (``train`` imports jax, flax and
optax).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import queue
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from jaxckpt.core.extras import check_extra

__all__ = ["SyntheticLoader", "train", "run_demo", "main", "save_final_npz", "compare_npz"]

_LOADER_FORMAT = 1


class SyntheticLoader:
    """Deterministic regression batches: ``y = sin(x @ w) + noise``, from a fixed NumPy seed.

    The dataset holds ``steps_per_epoch * batch_size`` samples; each epoch visits them in
    the order of a permutation drawn from a ``numpy`` Generator seeded with ``(seed, epoch)``,
    so the order never depends on how many batches were drawn before. ``state_dict()`` is
    ``{"format", "seed", "epoch", "position"}`` (JSON ints); after ``load_state_dict`` the
    next batch is exactly the one the saved loader would have produced next.

    Concurrency contract: not thread-safe; one consumer per loader.
    """

    def __init__(self, *, seed: int = 0, batch_size: int = 16, steps_per_epoch: int = 16,
                 in_dim: int = 8):
        for name, value in (("batch_size", batch_size), ("steps_per_epoch", steps_per_epoch),
                            ("in_dim", in_dim)):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"SyntheticLoader {name} must be a positive int, got {value!r}.")
        self.seed = int(seed)
        self.batch_size = batch_size
        self.steps_per_epoch = steps_per_epoch
        self.in_dim = in_dim
        data_rng = np.random.default_rng(self.seed)
        n = steps_per_epoch * batch_size
        self._x = data_rng.standard_normal((n, in_dim)).astype(np.float32)
        weights = data_rng.standard_normal((in_dim, 1)).astype(np.float32)
        noise = 0.1 * data_rng.standard_normal((n, 1)).astype(np.float32)
        self._y = (np.sin(self._x @ weights) + noise).astype(np.float32)
        self.epoch = 0
        self.position = 0  # batches of ``epoch`` already handed out
        self._order = self._permutation(0)

    def _permutation(self, epoch: int) -> np.ndarray:
        return np.random.default_rng((self.seed, epoch)).permutation(len(self._x))

    def next_batch(self) -> tuple[np.ndarray, np.ndarray]:
        """The next ``(x, y)`` batch; rolls over to a freshly shuffled epoch at the end."""
        if self.position == self.steps_per_epoch:
            self.epoch += 1
            self.position = 0
            self._order = self._permutation(self.epoch)
        rows = self._order[self.position * self.batch_size:(self.position + 1) * self.batch_size]
        self.position += 1
        return self._x[rows], self._y[rows]

    def __iter__(self) -> SyntheticLoader:
        return self

    def __next__(self) -> tuple[np.ndarray, np.ndarray]:
        return self.next_batch()

    def state_dict(self) -> dict[str, int]:
        return {"format": _LOADER_FORMAT, "seed": self.seed, "epoch": self.epoch,
                "position": self.position}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        missing = [k for k in ("seed", "epoch", "position") if k not in state]
        if missing:
            raise ValueError(f"SyntheticLoader state is missing {missing}; got {dict(state)!r}.")
        if int(state["seed"]) != self.seed:
            raise ValueError(
                f"SyntheticLoader state was saved with seed={state['seed']} but this loader "
                f"has seed={self.seed}: it would replay a different dataset. Build the loader "
                f"with the seed of the run being resumed.")
        epoch, position = int(state["epoch"]), int(state["position"])
        if epoch < 0 or not 0 <= position <= self.steps_per_epoch:
            raise ValueError(
                f"SyntheticLoader state epoch={epoch} position={position} is out of range "
                f"for steps_per_epoch={self.steps_per_epoch}.")
        self.epoch, self.position = epoch, position
        self._order = self._permutation(epoch)


# ----------------------------------------------------------------------------- training


def _emit(line: str) -> None:
    """Write one line of the worker's stdout protocol, flushed at once so a parent process
    can kill the worker at precise moments::

        RESUMED {"step": S, "path": P}   restored step S (training goes on at S+1)
        FRESH                            no valid checkpoint: training starts at step 0
        STEP n                           step n finished (its loss is already in the log)
        SAVING n                         maybe_save after step n started a recovery save
        REPORT {...}                     at the end: one save report (step, blocking_s, ...)
        DONE {...}                       at the end: the last step, the final .npz's path

    The log file gets one JSON line per finished step, ``{"step": n, "loss":
    float.hex(loss)}``, flushed and fsynced before ``STEP n``; hex floats compare bit for bit.
    """
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def _state_arrays(state: Any) -> dict[str, np.ndarray]:
    """Flatten an NNX state into ``{tree path: numpy array}``; typed PRNG keys become their
    raw key data (a uint32 array) under ``"<path>|key_data"``."""
    import jax

    out: dict[str, np.ndarray] = {}
    for key_path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
        name = jax.tree_util.keystr(key_path)
        if isinstance(leaf, jax.Array) and jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
            out[name + "|key_data"] = np.asarray(jax.random.key_data(leaf))
        else:
            out[name] = np.asarray(leaf)
    return out


def save_final_npz(state: Any, path: str) -> None:
    """Write ``state`` (an NNX state or any pytree of arrays) to ``path`` with ``np.savez``
    (no pickle), atomically: a reader sees either nothing or the whole file."""
    arrays = _state_arrays(state)
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "wb") as handle:
        # numpy's stub types **kwds like its allow_pickle flag; they are arrays by name.
        np.savez(handle, **arrays)  # type: ignore[arg-type]
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)


def compare_npz(expected_path: str, actual_path: str) -> list[str]:
    """Every difference between two .npz files, bit for bit (empty when identical)."""
    problems = []
    with np.load(expected_path, allow_pickle=False) as expected, \
            np.load(actual_path, allow_pickle=False) as actual:
        for name in sorted(set(expected.files) - set(actual.files)):
            problems.append(f"{name}: missing from {actual_path}")
        for name in sorted(set(actual.files) - set(expected.files)):
            problems.append(f"{name}: not in {expected_path}")
        for name in sorted(set(expected.files) & set(actual.files)):
            a, b = expected[name], actual[name]
            if a.dtype != b.dtype or a.shape != b.shape:
                problems.append(f"{name}: {a.dtype}{list(a.shape)} vs {b.dtype}{list(b.shape)}")
            elif a.tobytes() != b.tobytes():
                differing = int(np.count_nonzero(a.view(np.uint8) != b.view(np.uint8)))
                problems.append(f"{name}: {differing} differing bytes")
    return problems


def build_training(sizes: Sequence[int], *, seed: int, batch_size: int, steps_per_epoch: int,
                   learning_rate: float, dropout_rate: float = 0.1) -> tuple[Any, Any, Any, Any]:
    """The demo's training setup, shared with ``jaxckpt bench``'s training-loop rows:
    ``(loader, model, optimizer, train_step)`` where ``train_step(model, optimizer, x, y)``
    is a jitted Adam step on the mean squared error and returns the loss."""
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    from jaxckpt.models import MLP

    loader = SyntheticLoader(seed=seed, batch_size=batch_size, steps_per_epoch=steps_per_epoch,
                             in_dim=int(sizes[0]))
    model = MLP(sizes, rngs=nnx.Rngs(params=seed, dropout=seed + 1), dropout_rate=dropout_rate)
    optimizer = nnx.Optimizer(model, optax.adam(learning_rate), wrt=nnx.Param)

    @nnx.jit
    def train_step(model: MLP, optimizer: nnx.Optimizer, x: jax.Array, y: jax.Array) -> jax.Array:
        def loss_fn(model: MLP) -> jax.Array:
            return jnp.mean((model(x) - y) ** 2)

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        return loss

    return loader, model, optimizer, train_step


def _resume(mgr: Any, model: Any, optimizer: Any, loader: SyntheticLoader, *, batch_size: int,
            steps_per_epoch: int, emit: Callable[[str], None]) -> tuple[Any, Any, Any]:
    """Restore model, optimizer and loader from the latest valid checkpoint, if any, and say
    so. Returns (the ``Recovered`` or None, the last step done or None, the next step)."""
    from flax import nnx

    import jaxckpt

    recovered = mgr.recover(nnx.state((model, optimizer)), stateful={"loader": loader})
    if recovered is None:
        emit("FRESH")
        return None, None, jaxckpt.StepInfo(0, 0, 0, steps_per_epoch)
    nnx.update((model, optimizer), recovered.state)
    last = recovered.step_info
    emit("RESUMED " + json.dumps({"step": last.global_step, "path": recovered.path}))
    return recovered, last, last.next(tokens=batch_size)


def _report_fields(report: Any) -> dict[str, Any]:
    """What a ``REPORT`` line carries of a save report."""
    return {"step": report.step, "reason": report.reason, "mode": report.mode,
            "blocking_s": report.blocking_s, "total_s": report.total_s, "bytes": report.bytes}


def train(root: str | os.PathLike[str], *, total_steps: int, save_every: int,
          steps_per_epoch: int, mode: str = "async", log_path: str | None = None,
          final_path: str | None = None, seed: int = 0, batch_size: int = 16,
          sizes: Sequence[int] = (8, 32, 32, 1), learning_rate: float = 1e-2,
          dropout_rate: float = 0.1, keep_last_n: int = 2, hold_save_at: int | None = None,
          hold_save_s: float = 60.0, emit: Callable[[str], None] = _emit) -> dict[str, Any]:
    """Train the reference MLP on ``SyntheticLoader`` batches for ``total_steps`` global
    steps, resuming from the latest valid checkpoint under ``root`` when there is one.

    ``_emit`` describes the lines passed to ``emit`` and the log format. At the end:
    a forced save, ``close()``, and the final params + optimizer state (PRNG keys as key
    data) written to ``final_path`` (default: next to the log as ``<log stem>.final.npz``, or
    beside the root as ``{root}.final.npz``: never inside it, where jaxckpt writes alone).
    Returns a summary dict (also emitted as ``DONE``).
    ``hold_save_at=S`` (a test hook) keeps the save of step S uncommitted ``hold_save_s``
    seconds longer.
    """
    from flax import nnx

    import jaxckpt

    if total_steps < 1:
        raise ValueError(f"total_steps must be >= 1, got {total_steps!r}.")
    root = os.fspath(root)
    if final_path is None:
        final_path = (os.path.splitext(log_path)[0] + ".final.npz" if log_path
                      else os.path.normpath(root) + ".final.npz")

    loader, model, optimizer, train_step = build_training(
        sizes, seed=seed, batch_size=batch_size, steps_per_epoch=steps_per_epoch,
        learning_rate=learning_rate, dropout_rate=dropout_rate)

    backend = None
    if hold_save_at is not None:
        from .backend_hooks import HeldBackend

        backend = HeldBackend(hold_s=hold_save_s, at_step=hold_save_at)
    mgr = jaxckpt.CheckpointManager(
        root, recover=jaxckpt.RecoverConfig(every=jaxckpt.Every(steps=save_every),
                                            keep_last_n=keep_last_n),
        mode=mode, backend=backend)
    reports: list[Any] = []
    log_cm = open(log_path, "a") if log_path else contextlib.nullcontext()  # noqa: SIM115
    # The manager's context closes it (finishing in-flight saves) on the way out; on an
    # error it does not mask the error that is propagating.
    with mgr, log_cm as log_file:
        recovered, last, step = _resume(mgr, model, optimizer, loader, batch_size=batch_size,
                                        steps_per_epoch=steps_per_epoch, emit=emit)
        loss_value = None
        while step.global_step < total_steps:
            x, y = loader.next_batch()
            loss_value = float(train_step(model, optimizer, x, y))
            if log_file is not None:
                log_file.write(json.dumps({"step": step.global_step,
                                           "loss": loss_value.hex()}) + "\n")
                log_file.flush()
                os.fsync(log_file.fileno())
            emit(f"STEP {step.global_step}")
            if backend is not None:
                backend.current_step = step.global_step
            # A function: the state tree is only built on steps where a save is due.
            started = mgr.maybe_save(step, lambda: nnx.state((model, optimizer)),
                                     metrics={"loss": loss_value})
            reports.extend(started)
            if any(r.kind == "recover" for r in started):
                emit(f"SAVING {step.global_step}")
            last, step = step, step.next(tokens=batch_size)
        assert last is not None
        if loss_value is not None:  # else: resumed at the end; the last step is saved already
            final_report = mgr.save(last, nnx.state((model, optimizer)),
                                    metrics={"loss": loss_value})
            if all(final_report is not r for r in reports):
                reports.append(final_report)
    for report in reports:
        emit("REPORT " + json.dumps(_report_fields(report)))
    save_final_npz(nnx.state((model, optimizer)), final_path)
    summary = {"last_step": last.global_step, "final": final_path,
               "resumed_from": None if recovered is None else recovered.step_info.global_step}
    emit("DONE " + json.dumps(summary))
    return summary


# ------------------------------------------------------------------------ the demo itself


def _child_env() -> dict[str, str]:
    env = dict(os.environ)
    package_parent = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_parent, env.get("PYTHONPATH")) if p)
    env.setdefault("JAX_PLATFORMS", "cpu")
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    return env


class _Worker:
    """A ``worker`` subprocess in its own session, its stdout lines read by a thread."""

    def __init__(self, args: list[str], stderr_path: str):
        self._stderr = open(stderr_path, "wb")  # noqa: SIM115 - closed in finish()
        self.stderr_path = stderr_path
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "jaxckpt.tools.demo", "worker", *args], stdout=subprocess.PIPE,
            stderr=self._stderr, env=_child_env(), start_new_session=True, text=True)
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.seen: list[str] = []
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line.rstrip("\n"))
        self.lines.put(None)

    def next_line(self, deadline: float) -> str | None:
        """The next stdout line, or None at EOF; TimeoutError past ``deadline``."""
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError("worker produced no output in time")
        try:
            line = self.lines.get(timeout=remaining)
        except queue.Empty:
            raise TimeoutError("worker produced no output in time") from None
        if line is not None:
            self.seen.append(line)
        return line

    def kill(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def finish(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            self.proc.wait(timeout=10)
            raise
        finally:
            self._stderr.close()

    def stderr_tail(self, n: int = 2000) -> str:
        with open(self.stderr_path, "rb") as handle:
            return handle.read().decode(errors="replace")[-n:]


def _run_segment(args: list[str], stderr_path: str, *, kill_when: Callable[[str], bool] | None,
                 timeout: float = 120.0) -> tuple[list[str], bool]:
    """Run one worker; SIGKILL its process group as soon as ``kill_when(line)`` is true.
    Returns its stdout lines and whether it was killed."""
    worker = _Worker(args, stderr_path)
    deadline = time.monotonic() + timeout
    killed = False
    try:
        while True:
            line = worker.next_line(deadline)
            if line is None:
                break
            if kill_when is not None and kill_when(line):
                worker.kill()
                killed = True
                break
        code = worker.finish(max(1.0, deadline - time.monotonic()))
    except BaseException:
        worker.kill()
        raise
    if not killed and code != 0:
        raise RuntimeError(f"worker {' '.join(args)} exited with {code}:\n{worker.stderr_tail()}")
    return worker.seen, killed


def _read_log(path: str) -> dict[int, str]:
    out: dict[int, str] = {}
    if not os.path.exists(path):
        return out
    with open(path) as handle:
        for line in handle:
            if line.strip():
                entry = json.loads(line)
                out[int(entry["step"])] = entry["loss"]
    return out


def _tagged(lines: list[str], tag: str) -> list[str]:
    return [line[len(tag) + 1:] for line in lines if line.startswith(tag + " ") or line == tag]


def _crash_segments(tmp: str, args: Callable[[str, str], list[str]], rng: random.Random, *,
                    steps: int, save_every: int, first_kill: int,
                    out: Callable[[str], None]) -> list[dict[str, Any]]:
    """The interrupted run on root "crash": SIGKILLed after step ``first_kill``, resumed and
    SIGKILLed right after a SAVING line, resumed and run to the end. One dict per segment."""
    segments: list[dict[str, Any]] = []
    out(f"2) crash run: SIGKILL after step {first_kill} ...")
    lines, killed = _run_segment(args("crash", "crash-1.jsonl"), os.path.join(tmp, "c1.err"),
                                 kill_when=lambda line: line == f"STEP {first_kill}")
    segments.append({"lines": lines, "killed": killed, "log": "crash-1.jsonl",
                     "why": f"after STEP {first_kill}"})

    # The second kill lands right after the worker announced a save: the async write of
    # that checkpoint is still in flight (uncommitted) when the process dies.
    state: dict[str, int | None] = {"target": None}

    def kill_after_save(line: str) -> bool:
        if line.startswith("RESUMED ") or line == "FRESH":
            resumed = json.loads(line[8:])["step"] if line.startswith("RESUMED ") else -1
            candidates = [s for s in range(resumed + 1, steps - 1)
                          if (s + 1) % save_every == 0]
            state["target"] = rng.choice(candidates) if candidates else None
        return state["target"] is not None and line == f"SAVING {state['target']}"

    out("3) resume; SIGKILL right after a SAVING line (async save in flight) ...")
    lines, killed = _run_segment(args("crash", "crash-2.jsonl"), os.path.join(tmp, "c2.err"),
                                 kill_when=kill_after_save)
    segments.append({"lines": lines, "killed": killed, "log": "crash-2.jsonl",
                     "why": f"right after SAVING {state['target']}"})
    out("4) resume and run to the end ...")
    lines, _ = _run_segment(args("crash", "crash-3.jsonl"), os.path.join(tmp, "c3.err"),
                            kill_when=None)
    segments.append({"lines": lines, "killed": False, "log": "crash-3.jsonl", "why": ""})
    return segments


def _compare_segments(tmp: str, segments: list[dict[str, Any]], reference: dict[int, str],
                      steps: int, out: Callable[[str], None]) -> list[str]:
    """Say what each segment did; return every step whose loss differs from the reference
    run's (or that no segment logged)."""
    mismatches: list[str] = []
    covered: set[int] = set()
    for index, segment in enumerate(segments, start=1):
        log = _read_log(os.path.join(tmp, segment["log"]))
        resumed = _tagged(segment["lines"], "RESUMED")
        origin = (f"resumed from checkpoint step {json.loads(resumed[0])['step']}"
                  if resumed else "started from scratch (no valid checkpoint)")
        span = f"steps {min(log)}..{max(log)}" if log else "no steps"
        end = f"SIGKILLed {segment['why']}" if segment["killed"] else "ran to the end"
        saving = _tagged(segment["lines"], "SAVING")
        if segment["killed"] and saving and index < len(segments):
            after = _tagged(segments[index]["lines"], "RESUMED")
            next_from = json.loads(after[0])["step"] if after else -1
            if next_from < int(saving[-1]):
                end += f" (its save of step {saving[-1]} was in flight: never committed)"
        out(f"  segment {index}: {origin}; logged {span}; {end}")
        for step, loss in sorted(log.items()):
            covered.add(step)
            if reference.get(step) != loss:
                mismatches.append(f"step {step}: loss {loss} (segment {index}) vs "
                                  f"{reference.get(step)} (reference)")
    missing = sorted(set(range(steps)) - covered)
    if missing:
        mismatches.append(f"steps never logged by the interrupted run: {missing}")
    if set(reference) != set(range(steps)):
        mismatches.append("the reference run did not log every step")
    return mismatches


def _print_verdict(tmp: str, ref_lines: list[str], steps: int, mismatches: list[str],
                   state_problems: list[str], out: Callable[[str], None]) -> bool:
    """Print the reference run's save costs and whether losses and final state match;
    return whether they all do."""
    with np.load(os.path.join(tmp, "ref.final.npz")) as final:
        n_arrays, n_values = len(final.files), sum(final[k].size for k in final.files)
    blocking = [json.loads(r)["blocking_s"] for r in _tagged(ref_lines, "REPORT")]
    totals = [json.loads(r)["total_s"] or 0.0 for r in _tagged(ref_lines, "REPORT")]
    if blocking:
        out(f"  saves in the reference run: {len(blocking)}, training loop blocked "
            f"{1e3 * sum(blocking) / len(blocking):.1f} ms on average (max "
            f"{1e3 * max(blocking):.1f} ms), total per save "
            f"{1e3 * sum(totals) / len(totals):.1f} ms")
    if mismatches:
        out(f"  LOSSES DIFFER at {len(mismatches)} place(s):")
        for line in mismatches[:20]:
            out(f"    {line}")
    else:
        out(f"  losses: all {steps} steps bit-identical to the reference "
            f"(float.hex compare; steps redone after a resume included)")
    if state_problems:
        out(f"  FINAL STATE DIFFERS in {len(state_problems)} array(s):")
        for line in state_problems[:20]:
            out(f"    {line}")
    else:
        out(f"  final params + optimizer state + dropout PRNG key: {n_arrays} arrays, "
            f"{n_values} values, bit-identical")
    return not mismatches and not state_problems


def run_demo(*, steps: int = 80, save_every: int = 10, steps_per_epoch: int = 16,
             seed: int | None = None, mode: str = "async",
             out: Callable[[str], None] = print) -> int:
    """Crash a training run twice and resume it; show it ends bit-identical to a run that
    was never interrupted. Returns the process exit code (0 when identical)."""
    if steps < 4 * save_every or save_every < 2:
        raise ValueError(f"the demo needs steps >= 4 * save_every and save_every >= 2 (room "
                         f"for two kills), got steps={steps}, save_every={save_every}.")
    # The workers import these; check here, before starting them, so a missing extra is one
    # clear error and not three failed workers.
    check_extra("jax", "jaxckpt demo", ("jax", "orbax", "flax", "optax"))
    rng = random.Random(seed)
    first_kill = rng.randrange(2, steps // 2)  # any step, saved or not
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="jaxckpt-demo-") as tmp:
        common = ["--steps", str(steps), "--save-every", str(save_every),
                  "--steps-per-epoch", str(steps_per_epoch), "--mode", mode]

        def args(root: str, log: str) -> list[str]:
            return ["--root", os.path.join(tmp, root), "--log", os.path.join(tmp, log), *common]

        out(f"jaxckpt demo: {steps} steps of a small Flax NNX MLP (adam, dropout with a JAX "
            f"PRNG stream), data loader state, recovery checkpoint every {save_every} steps, "
            f"{mode} saves, keep_last_n=2")
        out("1) reference run, never interrupted ...")
        ref_lines, _ = _run_segment(args("ref", "ref.jsonl"), os.path.join(tmp, "ref.err"),
                                    kill_when=None)
        reference = _read_log(os.path.join(tmp, "ref.jsonl"))
        segments = _crash_segments(tmp, args, rng, steps=steps, save_every=save_every,
                                   first_kill=first_kill, out=out)
        out("")
        mismatches = _compare_segments(tmp, segments, reference, steps, out)
        state_problems = compare_npz(os.path.join(tmp, "ref.final.npz"),
                                     os.path.join(tmp, "crash-3.final.npz"))
        ok = _print_verdict(tmp, ref_lines, steps, mismatches, state_problems, out)
        out(f"{'OK' if ok else 'FAILED'}: resume is {'exact' if ok else 'NOT exact'} "
            f"({time.perf_counter() - started:.1f} s)")
        return 0 if ok else 1


# ---------------------------------------------------------------------------- commands


def _worker_command(opts: argparse.Namespace) -> int:
    train(opts.root, total_steps=opts.steps, save_every=opts.save_every,
          steps_per_epoch=opts.steps_per_epoch, mode=opts.mode, log_path=opts.log,
          final_path=opts.final, seed=opts.seed, batch_size=opts.batch_size,
          keep_last_n=opts.keep_last_n, hold_save_at=opts.hold_save_at,
          hold_save_s=opts.hold_save_s)
    return 0


def _demo_command(opts: argparse.Namespace) -> int:
    return run_demo(steps=opts.steps, save_every=opts.save_every, seed=opts.seed, mode=opts.mode)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m jaxckpt.tools.demo",
                                     description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command")

    worker = commands.add_parser("worker", help="run the training worker (used by the demo "
                                                "and the tests)")
    worker.add_argument("--root", required=True, help="checkpoint root")
    worker.add_argument("--steps", type=int, required=True, help="total global steps")
    worker.add_argument("--save-every", type=int, default=10)
    worker.add_argument("--steps-per-epoch", type=int, default=16)
    worker.add_argument("--mode", choices=("sync", "async", "auto"), default="async")
    worker.add_argument("--log", default=None, help="JSON-lines loss log (appended to)")
    worker.add_argument("--final", default=None, help="where to write the final state .npz")
    worker.add_argument("--seed", type=int, default=0)
    worker.add_argument("--batch-size", type=int, default=16)
    worker.add_argument("--keep-last-n", type=int, default=2)
    worker.add_argument("--hold-save-at", type=int, default=None, metavar="STEP",
                        help="test hook: keep the save of STEP uncommitted --hold-save-s longer")
    worker.add_argument("--hold-save-s", type=float, default=60.0)
    worker.set_defaults(handler=_worker_command)

    demo = commands.add_parser("demo", help="crash-and-resume demo (the default)")
    add_demo_arguments(demo)
    demo.set_defaults(handler=_demo_command)
    return parser


def add_demo_arguments(parser: argparse.ArgumentParser) -> None:
    """The demo's options (shared with ``jaxckpt demo``)."""
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--save-every", type=int, default=10)
    parser.add_argument("--seed", type=int, default=None,
                        help="seed of the random kill points (default: a fresh one)")
    parser.add_argument("--mode", choices=("sync", "async"), default="async")


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0].startswith("-") and argv[0] not in ("-h", "--help"):
        argv = ["demo", *argv]
    opts = build_parser().parse_args(argv)
    return opts.handler(opts)


if __name__ == "__main__":
    sys.exit(main())
