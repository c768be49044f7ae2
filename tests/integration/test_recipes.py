"""The recipes in docs/recipes.md, run as written (small sizes)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxckpt


def test_linen_train_state_recipe(tmp_path):
    import flax.linen as nn
    from flax.training import train_state

    class Model(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(1)(nn.relu(nn.Dense(16)(x)))

    def create_state(seed):
        model = Model()
        params = model.init(jax.random.key(seed), jnp.ones((1, 4)))["params"]
        return train_state.TrainState.create(apply_fn=model.apply, params=params,
                                             tx=optax.adamw(1e-2))

    @jax.jit
    def train_step(state, x, y):
        def loss_fn(params):
            return jnp.mean((state.apply_fn({"params": params}, x) - y) ** 2)

        loss, grads = jax.value_and_grad(loss_fn)(state.params)
        return state.apply_gradients(grads=grads), loss

    x = jax.random.normal(jax.random.key(1), (32, 4))
    y = x.sum(axis=1, keepdims=True)

    def run(total, root, kill_after=None):
        state = create_state(0)
        with jaxckpt.CheckpointManager(
                root, recover=jaxckpt.RecoverConfig(every=jaxckpt.Every(steps=5))) as mgr:
            # `like` can be the freshly created state itself: only shapes/dtypes/shardings are used.
            recovered = mgr.recover(state)
            step = jaxckpt.StepInfo() if recovered is None else recovered.step_info.next()
            if recovered is not None:
                state = recovered.state
            losses = {}
            while step.global_step < total:
                state, loss = train_step(state, x, y)
                losses[step.global_step] = float(loss)
                mgr.maybe_save(step, state)
                if kill_after is not None and step.global_step == kill_after:
                    return state, losses  # "crash": no final save
                step = step.next()
        return state, losses

    reference, ref_losses = run(20, tmp_path / "a")
    run(20, tmp_path / "b", kill_after=12)  # checkpoint at step 9 survives
    resumed, losses = run(20, tmp_path / "b")
    assert min(losses) == 10 and all(losses[g] == ref_losses[g] for g in losses)
    assert int(resumed.step) == int(reference.step) == 20
    for a, b in zip(jax.tree.leaves(reference), jax.tree.leaves(resumed), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_linen_step_restored_into_a_fresh_train_state_is_the_saved_array(tmp_path):
    # A kill right after the final save: the rerun restores into TrainState.create(...)
    # (step=0, a Python int) and trains no step, so the step it ends with is what restore
    # placed. It must be the saved int32 array, as the uninterrupted run ends with.
    import flax.linen as nn
    from flax.training import train_state

    model = nn.Dense(1)
    params = model.init(jax.random.key(0), jnp.ones((1, 4)))["params"]

    def fresh():
        return train_state.TrainState.create(apply_fn=model.apply, params=params,
                                             tx=optax.adamw(1e-2))

    trained = jax.jit(lambda s: s.apply_gradients(grads=jax.tree.map(jnp.ones_like,
                                                                      s.params)))(fresh())
    assert isinstance(trained.step, jax.Array) and trained.step.dtype == jnp.int32
    with jaxckpt.CheckpointManager(tmp_path / "root") as mgr:
        mgr.save(jaxckpt.StepInfo(), trained, mode="sync")
    with jaxckpt.CheckpointManager(tmp_path / "root") as mgr:
        recovered = mgr.recover(fresh())

    step = recovered.state.step
    assert isinstance(step, jax.Array), f"step came back as {type(step).__name__}"
    assert (step.dtype, step.shape) == (jnp.int32, ())
    assert int(step) == 1
    for got, want in zip(jax.tree.leaves(recovered.state), jax.tree.leaves(trained),
                         strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
