"""Real data loaders as ``stateful`` objects, with no user glue: grain and torchdata."""

import jax
import jax.numpy as jnp
import pytest

from jaxckpt import CheckpointManager, Every, RecoverConfig, StepInfo

STATE = {"w": jnp.zeros((4,), jnp.float32)}
LIKE = {"w": jax.ShapeDtypeStruct((4,), jnp.float32)}


def save_then_resume(tmp_path, make_iter, take):
    it = make_iter()
    consumed = [take(it) for _ in range(5)]
    with CheckpointManager(tmp_path, recover=RecoverConfig(every=Every(steps=1))) as mgr:
        mgr.save(StepInfo(0, 4, 4), STATE, stateful={"loader": it})
    expected = [take(it) for _ in range(6)]
    fresh = make_iter()
    with CheckpointManager(tmp_path) as mgr:
        mgr.recover(LIKE, stateful={"loader": fresh})
    resumed = [take(fresh) for _ in range(6)]
    return consumed, expected, resumed


def test_grain_dataset_iterator_resumes_exactly(tmp_path):
    grain = pytest.importorskip("grain")
    ds = grain.MapDataset.range(40).shuffle(seed=3).map(lambda x: x * 2).to_iter_dataset()
    _, expected, resumed = save_then_resume(tmp_path, lambda: iter(ds), next)
    assert resumed == expected


def test_grain_dataloader_iterator_with_bytes_state_resumes_exactly(tmp_path):
    grain = pytest.importorskip("grain")

    def make():
        sampler = grain.samplers.IndexSampler(30, shuffle=True, seed=1, num_epochs=1)
        return iter(grain.DataLoader(data_source=list(range(30)), sampler=sampler, worker_count=0))

    _, expected, resumed = save_then_resume(tmp_path, make, next)
    assert resumed == expected


def test_torchdata_stateful_dataloader_resumes_exactly(tmp_path):
    torch = pytest.importorskip("torch")
    sdl = pytest.importorskip("torchdata.stateful_dataloader")
    data = torch.arange(64, dtype=torch.float32).reshape(32, 2)

    class Wrapper:
        """Holds the loader and its live iterator, as a training loop does."""

        def __init__(self):
            torch.manual_seed(0)
            gen = torch.Generator().manual_seed(5)
            self.loader = sdl.StatefulDataLoader(data, batch_size=3, shuffle=True, generator=gen)
            self.it = iter(self.loader)

        def state_dict(self):
            return self.loader.state_dict()

        def load_state_dict(self, state):
            self.loader.load_state_dict(state)
            self.it = iter(self.loader)

    def take(w):
        return next(w.it).tolist()

    _, expected, resumed = save_then_resume(tmp_path, Wrapper, take)
    assert resumed == expected


def test_torchdata_stateful_dataloader_directly_as_stateful(tmp_path):
    torch = pytest.importorskip("torch")
    sdl = pytest.importorskip("torchdata.stateful_dataloader")
    data = torch.arange(40)
    loader = sdl.StatefulDataLoader(data, batch_size=4, shuffle=True,
                                    generator=torch.Generator().manual_seed(2))
    it = iter(loader)
    [next(it) for _ in range(3)]
    with CheckpointManager(tmp_path, recover=RecoverConfig(every=Every(steps=1))) as mgr:
        mgr.save(StepInfo(0, 2, 2), STATE, stateful={"loader": loader})
    expected = [next(it).tolist() for _ in range(4)]
    fresh = sdl.StatefulDataLoader(data, batch_size=4, shuffle=True,
                                   generator=torch.Generator().manual_seed(99))
    with CheckpointManager(tmp_path) as mgr:
        mgr.recover(LIKE, stateful={"loader": fresh})
    it2 = iter(fresh)
    assert [next(it2).tolist() for _ in range(4)] == expected
