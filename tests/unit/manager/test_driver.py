"""Driver state: stateful adapters, global RNG capture/restore, old-format tolerance."""

import random
import warnings

import numpy as np
import pytest

from jaxckpt import CheckpointWarning, ConfigError, StepInfo
from jaxckpt.manager import driver_state as drv


class Loader:
    # Not support.loaders.Loader: its state holds a tuple the codec must bring back as one.
    def __init__(self):
        self.position = 0

    def state_dict(self):
        return {"position": self.position, "order": (3, 1, 2)}

    def load_state_dict(self, state):
        assert state["order"] == (3, 1, 2)  # tuples survive
        self.position = state["position"]


class GrainLike:
    def __init__(self):
        self.state = b'{"next_index": 0}'

    def get_state(self):
        return self.state

    def set_state(self, state):
        self.state = state


def test_stateful_objects_of_every_protocol_round_trip():
    loader, grain_it = Loader(), GrainLike()
    gen, pyrng = np.random.default_rng(1), random.Random(2)
    loader.position, grain_it.state = 17, b'{"next_index": 5}'
    gen.random(3)
    pyrng.random()
    saved = drv.capture_stateful({"loader": loader, "grain": grain_it, "gen": gen, "py": pyrng})
    expected = (gen.random(), pyrng.random())
    fresh = {"loader": Loader(), "grain": GrainLike(), "gen": np.random.default_rng(99),
             "py": random.Random(99)}
    drv.restore_stateful(fresh, saved, "step_1")
    assert fresh["loader"].position == 17
    assert fresh["grain"].state == b'{"next_index": 5}'
    assert (fresh["gen"].random(), fresh["py"].random()) == expected


def test_snapshot_is_taken_at_capture_time():
    loader = Loader()
    loader.position = 3
    saved = drv.capture_stateful({"loader": loader})
    loader.position = 4
    fresh = Loader()
    drv.restore_stateful({"loader": fresh}, saved, "x")
    assert fresh.position == 3


def test_object_without_state_protocol_is_refused_by_name():
    with pytest.raises(ConfigError, match=r"stateful\['evaluator'\].*state_dict"):
        drv.capture_stateful({"evaluator": object()})


def test_wrong_kind_of_object_on_restore_is_refused():
    saved = drv.capture_stateful({"rng": np.random.default_rng(0)})
    with pytest.raises(ConfigError, match=r"stateful\['rng'\].*numpy.Generator"):
        drv.restore_stateful({"rng": Loader()}, saved, "x")


def test_missing_and_extra_stateful_entries_warn_not_raise():
    saved = drv.capture_stateful({"old": Loader()})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        drv.restore_stateful({"new": Loader()}, saved, "step_3")
    messages = [str(w.message) for w in caught if issubclass(w.category, CheckpointWarning)]
    assert any("stateful['new'] has no saved state in step_3" in m for m in messages)
    assert any("['old']" in m for m in messages)


def test_global_rng_round_trip():
    random.seed(1)
    np.random.seed(2)
    saved = drv.capture_global_rng()
    expected = (random.random(), np.random.rand())
    random.seed(7)
    np.random.seed(7)
    drv.restore_global_rng(saved, "x")
    assert (random.random(), np.random.rand()) == expected


def test_rng_entry_missing_from_older_checkpoint_warns_and_keeps_state():
    with pytest.warns(CheckpointWarning, match="no NumPy RNG state"):
        drv.restore_global_rng({"python": drv.capture_global_rng()["python"]}, "old")


def test_driver_records_versions_counters_and_metrics():
    body = drv.build_driver(kind="recover", reason="steps",
                            step=StepInfo(1, 2, 7, 5, tokens_seen=9),
                            backend_name="orbax", backend_versions={"jax": "x"}, process_count=1,
                            metrics={"loss": np.float32(0.5)}, local={}, saved_at=0.0)
    assert body["versions"]["jaxckpt"] and body["versions"]["jax"] == "x"
    assert body["metrics"] == {"loss": 0.5}
    assert StepInfo.from_json(body["step_info"]).tokens_seen == 9


def test_non_numeric_metric_names_the_key():
    from jaxckpt import CodecError

    with pytest.raises(CodecError, match=r"metrics\['note'\]"):
        drv.clean_metrics({"note": "hello"})
