"""Object stores that lack a feature jaxckpt relies on, made from the test servers (moto for
s3://, the GCS emulator behind its precondition proxy for gs://) by a fault proxy in front
(tests/support/fault_proxy.py) that strips the conditions of conditional writes, or answers
an operation with an error instead of forwarding it.

One test per server behaviour: a server that ignores conditional writes is refused at open
with a ``ConditionalWritesError`` naming it and the opt-in; the opt-in opens with a warning;
an honest server opens as before (after a probe of four requests that leaves nothing); a
server without ``ListMultipartUploads`` opens with one warning; a listing answered 500 after
its retries names the server and the request."""

from __future__ import annotations

import uuid
import warnings

import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import jaxckpt  # noqa: E402
from jaxckpt.errors import (  # noqa: E402
    CheckpointRootError,
    CheckpointWarning,
    ConditionalWritesError,
    ObjectStoreError,
)

from support.fault_proxy import CONDITIONS  # noqa: E402
from support.object_stores import KINDS, fault_proxy_before, object_store  # noqa: E402

BUCKET = "jaxckpt-features"
LEASE = {"lease_s": 3.0, "heartbeat_s": 0.5}
PROBE = ".tmp-write-probe."
SKIP_CHECK = {"conditional_writes": "unsafe_skip_check"}

pytestmark = pytest.mark.skipif(not KINDS, reason="no object-store client and server installed")
#: For a behaviour of S3 servers only (a test with no parameter left is skipped).
s3_only = pytest.mark.parametrize("store", [kind for kind in KINDS if kind == "s3"],
                                  indirect=True)


@pytest.fixture(scope="module", params=KINDS)
def store(request):
    with object_store(request.param, BUCKET) as running:
        yield running


@pytest.fixture
def proxy(store):
    with fault_proxy_before(store) as front:
        yield front


@pytest.fixture
def options(store, proxy):
    return {**store.storage_options, "endpoint_url": proxy.url, **LEASE}


@pytest.fixture
def root(store):
    if store.proxy is not None:
        store.proxy.requests.clear()
    return store.url(f"runs/{uuid.uuid4().hex}")


def manager(root, options):
    return jaxckpt.CheckpointManager(
        root, storage_options=options, preemption_signals=(),
        recover=jaxckpt.RecoverConfig(every=jaxckpt.Every(steps=1), keep_last_n=2))


def saves_and_restores(root, options) -> None:
    state = {"w": jnp.arange(6.0)}
    with manager(root, options) as mgr:
        mgr.save(jaxckpt.StepInfo(0, 1, 1), state)
        restored = mgr.restore({"w": jax.ShapeDtypeStruct((6,), jnp.float32)})
    assert np.asarray(restored.state["w"]).tobytes() == np.asarray(state["w"]).tobytes()


def objects_under(store, root) -> dict[str, int]:
    return store.storage(root).list_files(root)


def probe_requests(store, proxy) -> list[tuple[str, dict[str, str]]]:
    """(method, conditions sent) of each request on a probe object. A GCS upload names its
    object in its body: the precondition proxy behind the fault proxy reads it there."""
    if store.kind == "s3":
        return [(method, sent) for method, path, sent in proxy.requests if PROBE in path]
    return [(r.method, {k: v for k, v in r.query.items() if k in CONDITIONS})
            for r in store.proxy.requests if PROBE in r.name]


def test_a_server_that_ignores_conditional_writes_is_refused_at_open(store, proxy, options,
                                                                     root):
    """Both conditions stripped, as s3rver ignores them: the server overwrites. The open is
    refused before the lease or any directory is written, the probe object is gone, and the
    message names the server, what it did and the opt-in."""
    proxy.ignore_conditions = CONDITIONS
    with pytest.raises(ConditionalWritesError) as raised:
        manager(root, options)
    message = str(raised.value)
    assert isinstance(raised.value, CheckpointRootError)
    assert proxy.url in message and "does not honour conditional writes" in message
    wanted = ("If-None-Match: *", "If-Match") if store.kind == "s3" else (
        "ifGenerationMatch=0", "ifGenerationMatch with another generation")
    assert all(spelled in message for spelled in wanted), message
    assert "answered 200 and overwrote" in message
    assert "storage_options={'conditional_writes': 'unsafe_skip_check'}" in message
    assert objects_under(store, root) == {}  # no lease, no probe left


@s3_only  # GCS spells both conditions with one parameter
@pytest.mark.parametrize("ignored", ["If-Match", "If-None-Match"])
def test_a_server_that_ignores_one_condition_is_refused_naming_it(store, proxy, options, root,
                                                                  ignored):
    proxy.ignore_conditions = frozenset({ignored})
    with pytest.raises(ConditionalWritesError) as raised:
        manager(root, options)
    honoured = {"If-Match": "If-None-Match: *", "If-None-Match": "If-Match with"}[ignored]
    message = str(raised.value)
    assert ignored in message and honoured not in message, message


def test_the_unsafe_opt_in_opens_a_server_that_ignores_them_with_a_warning(store, proxy,
                                                                           options, root):
    proxy.ignore_conditions = CONDITIONS
    with pytest.warns(CheckpointWarning, match="one job per root at a time, on your honour"):
        saves_and_restores(root, {**options, **SKIP_CHECK})
    assert probe_requests(store, proxy) == []  # no probe was sent


def test_an_honest_server_opens_as_before_after_a_probe_of_four_requests(store, proxy,
                                                                         options, root):
    with warnings.catch_warnings():
        warnings.simplefilter("error", CheckpointWarning)
        saves_and_restores(root, options)
    # A plain write, a create-only one, one conditional on another version, the delete.
    condition = "If-None-Match" if store.kind == "s3" else "ifGenerationMatch"
    sent = probe_requests(store, proxy)
    assert [method for method, _ in sent] == (["PUT"] * 3 if store.kind == "s3" else
                                              ["POST"] * 3) + ["DELETE"], sent
    assert [list(conditions) for _, conditions in sent] == [
        [], [condition], ["If-Match" if store.kind == "s3" else condition], []], sent
    assert not [name for name in objects_under(store, root) if PROBE in name]


def test_a_bad_conditional_writes_value_is_refused_naming_the_choices(store, options, root):
    with pytest.raises(jaxckpt.ConfigError, match="'check'.*'unsafe_skip_check'"):
        manager(root, {**options, "conditional_writes": "skip"})


@s3_only  # multipart uploads are S3's
def test_a_server_without_multipart_listing_opens_with_one_warning(store, proxy, options, root):
    """s3rver answers ListMultipartUploads with 501 NotImplemented: every open failed on the
    bare ClientError. Now: no unfinished uploads to clean, said once per open."""
    proxy.answer = {"ListMultipartUploads": 501}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        saves_and_restores(root, options)
    said = [str(w.message) for w in caught if issubclass(w.category, CheckpointWarning)]
    assert len(said) == 1 and "does not implement ListMultipartUploads" in said[0], said
    assert proxy.url in said[0]


@s3_only
def test_a_listing_answered_500_names_the_server_and_the_request(store, proxy, options, root,
                                                                 capsys, monkeypatch, tmp_path):
    """A listing the server keeps failing (s3rver answers 500 to a truncated listing's next
    page) is retried like any 5xx, then raises ``ObjectStoreError`` naming the server, the
    request and the prefix; the CLI exits 2 with the same words. (On gs:// the client's own
    error already names the URL and the method.)"""
    with manager(root, options) as mgr:
        mgr.save(jaxckpt.StepInfo(0, 1, 1), {"w": jnp.arange(3.0)})
        mgr.wait()  # the save's retention lists too: done before the count starts
        proxy.answer = {"ListObjectsV2": 500}
        before = len(proxy.requests)
        with pytest.raises(ObjectStoreError) as raised:
            mgr.store.entries()
        lists = [path for _, path, _ in proxy.requests[before:] if "list-type=2" in path]
        proxy.answer = {}
    message = str(raised.value)
    assert proxy.url in message and "ListObjectsV2" in message and f"{root}/recover/" in message
    assert len(lists) == options["max_attempts"], lists  # retried as any 5xx
    from jaxckpt.tools.cli import main

    monkeypatch.chdir(tmp_path)
    proxy.answer = {"ListObjectsV2": 500}
    code = main(["ls", root, *(f"--storage-option={k}={v}" for k, v in options.items()
                               if k not in LEASE)])
    assert code == 2
    assert "ListObjectsV2" in capsys.readouterr().err


def test_import_orbax_into_a_root_on_a_server_that_ignores_them_exits_2(store, proxy, options,
                                                                         root, tmp_path,
                                                                         capsys):
    """The CLI commands that write open the root through a manager: refused the same way,
    exit 2 (the environment), naming the opt-in; with it, the import is written."""
    ocp = pytest.importorskip("orbax.checkpoint")
    from jaxckpt.tools.cli import main

    src = tmp_path / "orbax"
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(src, {"w": np.arange(4.0)})
    flags = [f"--storage-option={k}={v}" for k, v in options.items() if k not in LEASE]
    proxy.ignore_conditions = CONDITIONS
    assert main(["import-orbax", str(src), root, *flags]) == 2
    assert "conditional_writes=unsafe_skip_check" in capsys.readouterr().err
    assert objects_under(store, root) == {}
    with pytest.warns(CheckpointWarning, match="on your honour"):
        code = main(["import-orbax", str(src), root, *flags,
                     "--storage-option=conditional_writes=unsafe_skip_check"])
    assert code == 0 and f"wrote {root}/recover/step_00000000" in capsys.readouterr().out
