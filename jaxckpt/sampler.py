"""A data position that does not depend on the number of processes: ``IndexSampler``.

Owns: the order of every epoch, its global batches, each process's slice of each batch, and
the position (epoch, global batches consumed) as a JSON state that is the same on every
process, so a checkpoint of 4 processes resumes on 2 (or 2 on 4), each sample once, in the
uninterrupted order. An epoch's order is a function of ``(seed, epoch, num_samples)``
alone, by this module's own keyed Feistel permutation evaluated per position (not NumPy's
generators, whose streams may change across versions). Its state is global
(``jaxckpt_state_scope = "global"``: ``manager.driver_state`` restores the primary's copy).

Must not import: jax, orbax, torch (this module is part of the pure layer).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any, ClassVar

import numpy as np

from .errors import ConfigError

__all__ = ["SAMPLER_FORMAT", "IndexSampler"]

SAMPLER_FORMAT = "jaxckpt.index_sampler/1"

_M64 = (1 << 64) - 1
_ROUNDS = 6
# The fields that define the order of every epoch: a saved position means something only
# for a sampler made with the same values.
_ORDER_FIELDS = ("num_samples", "global_batch_size", "seed", "shuffle", "drop_last")


def _splitmix64(value: int) -> int:
    """One step of SplitMix64 on a Python int (exact, wraps at 64 bits)."""
    value = (value + 0x9E3779B97F4A7C15) & _M64
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & _M64
    return value ^ (value >> 31)


def _mix(values: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser on a uint64 array (array arithmetic wraps silently)."""
    values = values + np.uint64(0x9E3779B97F4A7C15)
    values = (values ^ (values >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    values = (values ^ (values >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return values ^ (values >> np.uint64(31))


class _EpochOrder:
    """The permutation of ``range(num_samples)`` of one (seed, epoch): position -> sample.

    A balanced Feistel network is a bijection of ``[0, 4**k)`` whatever its round function;
    re-applying it to the values that fall outside ``[0, num_samples)`` (cycle walking) makes
    it a bijection of ``[0, num_samples)``. The domain is less than 4x the samples, so a
    position takes a few walks on average. Immutable.
    """

    def __init__(self, num_samples: int, seed: int, epoch: int):
        bits = max(2, (num_samples - 1).bit_length())
        bits += bits % 2
        self._size = num_samples
        self._half = np.uint64(bits // 2)
        self._mask = np.uint64((1 << (bits // 2)) - 1)
        base = _splitmix64(_splitmix64(seed) ^ epoch)
        self._keys = [np.uint64(_splitmix64(base + round_)) for round_ in range(_ROUNDS)]

    def _encrypt(self, values: np.ndarray) -> np.ndarray:
        left, right = values >> self._half, values & self._mask
        for key in self._keys:
            left, right = right, left ^ (_mix(right ^ key) & self._mask)
        return (left << self._half) | right

    def __call__(self, positions: np.ndarray) -> np.ndarray:
        out = self._encrypt(positions.astype(np.uint64))
        outside = out >= np.uint64(self._size)
        while outside.any():
            out[outside] = self._encrypt(out[outside])
            outside = out >= np.uint64(self._size)
        return out.astype(np.int64)


def _check_int(name: str, value: Any, *, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ConfigError(f"IndexSampler {name} must be an int >= {minimum}, got {value!r}.")
    return int(value)


class IndexSampler:
    """This process's sample indices of each global batch, in an order fixed by
    ``(seed, epoch)`` and the global batch size, resumable under another process count.

    ``next(sampler)`` returns the indices (an int64 array of ``global_batch_size //
    process_count``) that this process reads for the next global batch: global batch ``b`` of
    an epoch is positions ``[b * global_batch_size, (b + 1) * global_batch_size)`` of the
    epoch's order, and process ``i`` takes the ``i``-th equal, contiguous slice of it (the rows
    a process contributes to a global array built with
    ``jax.make_array_from_process_local_data``). ``next`` goes on across epochs forever;
    ``for indices in sampler`` yields the rest of the current epoch and stops (what a torch
    ``DataLoader(batch_sampler=...)`` or an epoch loop expects); the next ``iter()`` starts
    the following epoch.

    End of an epoch: with ``drop_last=True`` (the default) the ``num_samples %
    global_batch_size`` samples of a partial last global batch are skipped in that epoch (every
    epoch has ``num_samples // global_batch_size`` batches; a new epoch reshuffles, so other
    samples are skipped next time). With ``drop_last=False`` the last global batch is filled up
    from the start of the same epoch's order, so every sample is read at least once and a few
    twice; batches keep their shape either way.

    State: ``state_dict()`` is ``{"format", "num_samples", "global_batch_size", "seed",
    "shuffle", "drop_last", "epoch", "position"}`` (JSON ints and bools; ``position`` is the
    number of global batches of ``epoch`` handed out). It holds nothing about processes, so it
    is the same on every process; ``load_state_dict`` accepts a state saved under any
    ``process_count`` and refuses, naming the field, one whose order differs (another dataset
    size, seed, batch size, shuffle or drop_last).

    Concurrency: not thread-safe; one sampler belongs to one consumer (the training loop or one
    loader). Across processes, every process makes its sampler with the same arguments except
    ``process_index`` and consumes batches in lockstep; across jobs, the state carries the
    position (the manager restores it on every process from the primary's copy).

    Args:
        num_samples: the dataset's size (>= 1).
        global_batch_size: samples per global batch, over all processes; a multiple of
            ``process_count``.
        seed: (keyword) the order's seed, an int of at most 64 bits.
        shuffle: (keyword) False: every epoch in index order.
        process_index: (keyword) this process's index, ``0 <= process_index < process_count``.
        process_count: (keyword) how many processes share each global batch.
        drop_last: (keyword) skip a partial last global batch (True) or fill it up from the
            start of the epoch's order (False).
    """

    #: Tells the manager that this state is the same on every process: it is restored from the
    #: primary's copy everywhere (jaxckpt.manager.driver_state), so new processes also get the
    #: position.
    jaxckpt_state_scope: ClassVar[str] = "global"

    def __init__(self, num_samples: int, global_batch_size: int, *, seed: int = 0,
                 shuffle: bool = True, process_index: int = 0, process_count: int = 1,
                 drop_last: bool = True):
        self.num_samples = _check_int("num_samples", num_samples, minimum=1)
        self.global_batch_size = _check_int("global_batch_size", global_batch_size, minimum=1)
        self.seed = _check_int("seed", seed, minimum=0)
        if self.seed > _M64:
            raise ConfigError(f"IndexSampler seed must fit in 64 bits, got {seed!r}.")
        self.process_count = _check_int("process_count", process_count, minimum=1)
        self.process_index = _check_int("process_index", process_index, minimum=0)
        for name, flag in (("shuffle", shuffle), ("drop_last", drop_last)):
            if not isinstance(flag, bool):
                raise ConfigError(f"IndexSampler {name} must be True or False, got {flag!r}.")
        self.shuffle, self.drop_last = shuffle, drop_last
        if self.process_index >= self.process_count:
            raise ConfigError(
                f"IndexSampler process_index={process_index} is out of range for "
                f"process_count={process_count}: it must be in [0, {self.process_count}).")
        if self.global_batch_size % self.process_count:
            raise ConfigError(
                f"IndexSampler global_batch_size={global_batch_size} is not divisible by "
                f"process_count={process_count}: every process takes an equal slice of each "
                f"global batch. Use a global batch size that is a multiple of {process_count}.")
        if drop_last and self.global_batch_size > self.num_samples:
            raise ConfigError(
                f"IndexSampler global_batch_size={global_batch_size} is larger than "
                f"num_samples={num_samples}: with drop_last=True an epoch would have no batch. "
                f"Use a smaller global batch, or drop_last=False to fill it up.")
        # Indices each process reads per global batch.
        self.batch_size = self.global_batch_size // self.process_count
        self._epoch = 0
        self._position = 0
        self._order: _EpochOrder | None = None  # a cache of the last epoch's order
        self._order_epoch = -1

    # ------------------------------------------------------------------------ the order

    @property
    def batches_per_epoch(self) -> int:
        """Global batches in one epoch (the same for every process count)."""
        if self.drop_last:
            return self.num_samples // self.global_batch_size
        return -(-self.num_samples // self.global_batch_size)

    def __len__(self) -> int:
        return self.batches_per_epoch

    def _order_of(self, epoch: int) -> _EpochOrder:
        if self._order is None or self._order_epoch != epoch:
            self._order, self._order_epoch = _EpochOrder(self.num_samples, self.seed, epoch), epoch
        return self._order

    def global_batch_indices(self, epoch: int, batch: int) -> np.ndarray:
        """Every process's indices of global batch ``batch`` of ``epoch``, in process order
        (``global_batch_size`` of them). Pure: the position does not move."""
        epoch, batch = self._check_batch(epoch, batch)
        return self._slice(epoch, batch * self.global_batch_size, self.global_batch_size)

    def batch_indices(self, epoch: int, batch: int) -> np.ndarray:
        """This process's indices of global batch ``batch`` of ``epoch`` (``batch_size`` of
        them). Pure: the position does not move (a read-ahead pipeline can use it)."""
        epoch, batch = self._check_batch(epoch, batch)
        start = batch * self.global_batch_size + self.process_index * self.batch_size
        return self._slice(epoch, start, self.batch_size)

    def _check_batch(self, epoch: int, batch: int) -> tuple[int, int]:
        epoch = _check_int("epoch", epoch, minimum=0)
        batch = _check_int("batch", batch, minimum=0)
        if batch >= self.batches_per_epoch:
            raise ConfigError(f"IndexSampler batch={batch} is out of range: an epoch has "
                              f"{self.batches_per_epoch} global batches.")
        return epoch, batch

    def _slice(self, epoch: int, start: int, count: int) -> np.ndarray:
        # Positions past the end exist only with drop_last=False: they wrap to the epoch's start.
        positions = np.arange(start, start + count, dtype=np.int64) % self.num_samples
        if not self.shuffle:
            return positions
        return self._order_of(epoch)(positions)

    # ------------------------------------------------------------------ the position

    @property
    def epoch(self) -> int:
        """The epoch of the batch handed out last (0 before the first)."""
        return self._epoch

    @property
    def position(self) -> int:
        """Global batches of :attr:`epoch` handed out so far."""
        return self._position

    @property
    def upcoming(self) -> tuple[int, int]:
        """``(epoch, batch)`` of the global batch the next ``next(sampler)`` returns."""
        if self._position >= self.batches_per_epoch:
            return self._epoch + 1, 0
        return self._epoch, self._position

    def __next__(self) -> np.ndarray:
        epoch, batch = self.upcoming
        indices = self.batch_indices(epoch, batch)
        self._epoch, self._position = epoch, batch + 1
        return indices

    def __iter__(self) -> Iterator[np.ndarray]:
        return self._rest_of_epoch()

    def _rest_of_epoch(self) -> Iterator[np.ndarray]:
        # A generator: the epoch is chosen at the first next(), not when iter() is called.
        epoch = self.upcoming[0]
        while self.upcoming[0] == epoch:
            yield next(self)

    # ------------------------------------------------------------------------ state

    def state_dict(self) -> dict[str, Any]:
        """The position, with the fields that define the order (JSON-safe; the same on every
        process)."""
        return {"format": SAMPLER_FORMAT, **{name: getattr(self, name) for name in _ORDER_FIELDS},
                "epoch": self._epoch, "position": self._position}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Move to a saved position, whatever ``process_count`` saved it. Raises
        ``ConfigError`` naming the field when the saved order differs from this sampler's."""
        if not isinstance(state, Mapping) or state.get("format") != SAMPLER_FORMAT:
            found = state.get("format") if isinstance(state, Mapping) else type(state).__name__
            raise ConfigError(
                f"IndexSampler.load_state_dict: expected a state with format "
                f"{SAMPLER_FORMAT!r} (from IndexSampler.state_dict()), got {found!r}.")
        for name in _ORDER_FIELDS:
            saved, mine = state.get(name), getattr(self, name)
            if saved != mine or type(saved) is not type(mine):
                raise ConfigError(
                    f"IndexSampler.load_state_dict: the saved {name} is {saved!r} but this "
                    f"sampler has {name}={mine!r}. The order of every epoch depends on {name}, "
                    f"so the saved position means nothing here. Make the sampler with "
                    f"{name}={saved!r}, or start a fresh sampler if the change is deliberate.")
        epoch = _check_int("state['epoch']", state.get("epoch"), minimum=0)
        position = _check_int("state['position']", state.get("position"), minimum=0)
        if position > self.batches_per_epoch:
            raise ConfigError(f"IndexSampler.load_state_dict: position={position} is past the "
                              f"end of an epoch ({self.batches_per_epoch} global batches).")
        self._epoch, self._position = epoch, position

    def __repr__(self) -> str:
        return (f"IndexSampler(num_samples={self.num_samples}, "
                f"global_batch_size={self.global_batch_size}, seed={self.seed}, "
                f"shuffle={self.shuffle}, process_index={self.process_index}, "
                f"process_count={self.process_count}, drop_last={self.drop_last})")
