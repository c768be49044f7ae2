"""A Flax NNX training worker shaped like the NNX MNIST tutorial, for
tests/integration/test_nnx_live.py.

Run as ``python tests/support/nnx_worker.py --root R --log L --final F --steps N``. It trains a
small CNN (conv, batch norm, dropout, average pooling, linear layers) with
``nnx.Optimizer(model, optax.adamw(...), wrt=nnx.Param)`` and an
``nnx.MultiMetric(accuracy=..., loss=...)`` in an ``@nnx.jit`` train step with
``model.train()``, on a tiny synthetic image set (no downloads). A separate ``nnx.Rngs``
outside the model picks each step's batch and draws its augmentation noise, and the metrics
are computed and reset every few steps, so an exact resume needs every part of the live
state: params, batch stats, optimizer moments and step, the model's dropout RNG stream, the
outside RNG streams and the metric totals. The checkpoint is the live-object dict itself
(``maybe_save(step, lambda: live)``, ``recover(live)``), with CheckpointWarning turned into
an error: passing everything must not warn.

Stdout protocol (one ``os.write`` per line): ``FRESH`` | ``RESUMED {"step": S}``, then
``STEP n``, ``SAVING n`` (a recovery save started), ``REPORTED n`` (it committed), ``DONE``.
Log file: one JSON line per finished step, ``{"step": n, "loss": float.hex(loss)}`` and, at
metric resets, ``{"step": n, "metrics": {...hex...}}``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings
from functools import partial

import numpy as np
from worker_lines import claim_stdout, emit  # a sibling: workers run by path

IMAGE = 8
CLASSES = 10
SAMPLES = 64
BATCH = 8
STEPS_PER_EPOCH = SAMPLES // BATCH
METRICS_EVERY = 5



def build(seed: int):
    import optax
    from flax import nnx

    class CNN(nnx.Module):
        def __init__(self, *, rngs: nnx.Rngs):
            self.conv1 = nnx.Conv(1, 4, kernel_size=(3, 3), rngs=rngs)
            self.batch_norm1 = nnx.BatchNorm(4, rngs=rngs)
            self.dropout1 = nnx.Dropout(rate=0.1, rngs=rngs)
            self.conv2 = nnx.Conv(4, 8, kernel_size=(3, 3), rngs=rngs)
            self.avg_pool = partial(nnx.avg_pool, window_shape=(2, 2), strides=(2, 2))
            self.linear1 = nnx.Linear(2 * 2 * 8, 16, rngs=rngs)
            self.dropout2 = nnx.Dropout(rate=0.1, rngs=rngs)
            self.linear2 = nnx.Linear(16, CLASSES, rngs=rngs)

        def __call__(self, x):
            x = self.avg_pool(nnx.relu(self.batch_norm1(self.dropout1(self.conv1(x)))))
            x = self.avg_pool(nnx.relu(self.conv2(x)))
            x = x.reshape(x.shape[0], -1)
            x = self.dropout2(nnx.relu(self.linear1(x)))
            return self.linear2(x)

    model = CNN(rngs=nnx.Rngs(seed, dropout=seed + 1))
    optimizer = nnx.Optimizer(model, optax.adamw(0.005, 0.9), wrt=nnx.Param)
    metrics = nnx.MultiMetric(accuracy=nnx.metrics.Accuracy(),
                              loss=nnx.metrics.Average("loss"))
    rngs = nnx.Rngs(shuffle=seed + 2, augment=seed + 3)  # outside the model
    return model, optimizer, metrics, rngs


def make_train_step():
    import optax
    from flax import nnx

    def loss_fn(model, batch):
        logits = model(batch["image"])
        loss = optax.softmax_cross_entropy_with_integer_labels(
            logits=logits, labels=batch["label"]).mean()
        return loss, logits

    @nnx.jit
    def train_step(model, optimizer, metrics, batch):
        grad_fn = nnx.value_and_grad(loss_fn, has_aux=True)
        (loss, logits), grads = grad_fn(model, batch)
        metrics.update(loss=loss, logits=logits, labels=batch["label"])
        optimizer.update(model, grads)
        return loss

    return train_step


def dataset(seed: int):
    rng = np.random.default_rng(seed)
    images = rng.standard_normal((SAMPLES, IMAGE, IMAGE, 1)).astype(np.float32)
    labels = rng.integers(0, CLASSES, SAMPLES).astype(np.int32)
    return images, labels


def next_batch(rngs, images, labels):
    import jax

    picks = jax.random.choice(rngs.shuffle(), SAMPLES, (BATCH,), replace=False)
    noise = 0.05 * jax.random.normal(rngs.augment(), (BATCH, IMAGE, IMAGE, 1))
    return {"image": images[picks] + noise, "label": labels[picks]}


def final_arrays(live) -> dict[str, np.ndarray]:
    # The crash worker's flattening (typed keys as their key data), object by object; both
    # scripts run from tests/support, which is therefore first on sys.path.
    from crash_worker import final_arrays as arrays_of
    from flax import nnx

    return {name + key: value for name, obj in live.items()
            for key, value in arrays_of(nnx.state(obj)).items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--root", required=True)
    parser.add_argument("--log", required=True)
    parser.add_argument("--final", required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--save-every", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    opts = parser.parse_args(argv)

    import jaxckpt

    warnings.simplefilter("error", jaxckpt.CheckpointWarning)
    images, labels = dataset(opts.seed)
    model, optimizer, metrics, rngs = build(opts.seed)
    train_step = make_train_step()
    live = {"model": model, "optimizer": optimizer, "metrics": metrics, "rngs": rngs}

    mgr = jaxckpt.CheckpointManager(
        opts.root, recover=jaxckpt.RecoverConfig(every=jaxckpt.Every(steps=opts.save_every),
                                                 keep_last_n=2),
        mode="async", on_report=lambda report: emit(f"REPORTED {report.step}"),
        preemption_signals=())
    with mgr, open(opts.log, "a") as log:
        recovered = mgr.recover(live)
        if recovered is None:
            step, last = jaxckpt.StepInfo(0, 0, 0, STEPS_PER_EPOCH), None
            emit("FRESH")
        else:
            assert recovered.state["model"] is model and recovered.state["rngs"] is rngs
            last = recovered.step_info
            step = last.next()
            emit("RESUMED " + json.dumps({"step": last.global_step}))
        model.train()
        while step.global_step < opts.steps:
            batch = next_batch(rngs, images, labels)
            loss = float(train_step(model, optimizer, metrics, batch))
            entry = {"step": step.global_step, "loss": loss.hex()}
            if (step.global_step + 1) % METRICS_EVERY == 0:
                entry["metrics"] = {k: float(v).hex() for k, v in metrics.compute().items()}
                metrics.reset()
            log.write(json.dumps(entry) + "\n")
            log.flush()
            os.fsync(log.fileno())
            emit(f"STEP {step.global_step}")
            if any(r.kind == "recover" for r in mgr.maybe_save(step, lambda: live)):
                emit(f"SAVING {step.global_step}")
            last, step = step, step.next()
        if last is not None:
            mgr.save(last, live)  # no-op when that step was just saved or restored
    arrays = final_arrays(live)
    tmp = opts.final + ".partial"
    with open(tmp, "wb") as handle:
        np.savez(handle, **arrays)
    os.replace(tmp, opts.final)
    emit("DONE")
    return 0


if __name__ == "__main__":
    claim_stdout()
    sys.exit(main())
