"""Every `jaxckpt` command that takes a checkpoint root takes an s3:// or gs:// URL too:
export-hf from a URL root (to a local directory and to a URL, committed like exports on
object roots), import-hf and import-orbax into a URL root, bench --root on either store,
--storage-option reaching the client, and the exit codes (0 ok, 1 corrupt, 2 usage or
environment, 3 not a root) with nothing created locally. Against a moto server and a GCS
emulator this module starts on 127.0.0.1 (tests/support/s3_server.py,
tests/support/gcs_server.py), one of each."""

from __future__ import annotations

import os
import uuid

import numpy as np
import pytest

pytest.importorskip("boto3")
pytest.importorskip("moto")
pytest.importorskip("google.cloud.storage")
pytest.importorskip("gcp_storage_emulator")
jax = pytest.importorskip("jax")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
import jax.numpy as jnp  # noqa: E402
from safetensors.numpy import load_file  # noqa: E402

import jaxckpt  # noqa: E402
from jaxckpt.storage.url import parse_root  # noqa: E402
from jaxckpt.tools.cli import main  # noqa: E402

from support.gcs_server import PreconditionProxy, emulator  # noqa: E402
from support.models import tiny_hf_config  # noqa: E402
from support.s3_server import moto_s3, server_env  # noqa: E402

BUCKET = "jaxckpt-cli"
KINDS = ["s3", "gs"]


@pytest.fixture(scope="module")
def s3_options():
    with moto_s3(BUCKET) as options:
        yield options


@pytest.fixture(scope="module")
def gs_endpoint():
    # Behind the precondition proxy: the emulator alone ignores ifGenerationMatch, and a
    # command that writes refuses such a server (ConditionalWritesError).
    with emulator(BUCKET) as endpoint:
        proxy = PreconditionProxy(endpoint)
        try:
            yield proxy.url
        finally:
            proxy.close()


@pytest.fixture(params=KINDS)
def store(request, monkeypatch, tmp_path):
    """(kind, a fresh root URL, its storage_options): the environment points the CLI at
    the server, and the working directory is an empty one that must stay empty."""
    kind = request.param
    if kind == "s3":
        options = request.getfixturevalue("s3_options")
        for name, value in server_env(options, {}).items():
            monkeypatch.setenv(name, value)
    else:
        options = {"endpoint_url": request.getfixturevalue("gs_endpoint")}
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", options["endpoint_url"])
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    yield kind, f"{kind}://{BUCKET}/runs/{uuid.uuid4().hex}", options
    assert os.listdir(cwd) == []  # nothing local was created for a URL


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> str:
    """A tiny GPT-2 saved by transformers, every weight randomised."""
    directory = str(tmp_path_factory.mktemp("hf") / "gpt2")
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(tiny_hf_config("gpt2"))
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.2 * torch.randn_like(param))
    model.save_pretrained(directory)
    return directory


def tensors(directory: str) -> dict[str, np.ndarray]:
    return {name: array for file in sorted(os.listdir(directory)) if file.endswith(".safetensors")
            for name, array in load_file(os.path.join(directory, file)).items()}


def assert_same_tensors(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> None:
    assert sorted(got) == sorted(want)
    for name, array in want.items():
        assert got[name].dtype == array.dtype and got[name].tobytes() == array.tobytes(), name


def download(url: str, options: dict, into: str) -> list[str]:
    """Every object below ``url`` written below the local ``into``; their names."""
    _, storage = parse_root(url, options)
    names = sorted(storage.list_files(url))
    for name in names:
        os.makedirs(os.path.dirname(os.path.join(into, name)), exist_ok=True)
        with open(os.path.join(into, name), "wb") as out:
            out.write(storage.read(f"{url}/{name}"))
    return names


def test_import_hf_into_a_url_root_then_export_hf_to_a_directory_and_to_a_url(
        store, hf_dir, tmp_path, capsys):
    kind, root, options = store
    assert main(["import-hf", hf_dir, root, "--arch", "gpt2", "--step", "7",
                 "--no-progress"]) == 0
    checkpoint = f"{root}/recover/step_00000007"
    assert f"wrote {checkpoint}" in capsys.readouterr().out
    assert main(["verify", root]) == 0
    capsys.readouterr()

    local_out = str(tmp_path / "out")
    assert main(["export-hf", root, local_out, "--no-progress"]) == 0
    assert f"wrote {local_out}" in capsys.readouterr().out
    assert_same_tensors(tensors(local_out), tensors(hf_dir))
    transformers.AutoModelForCausalLM.from_pretrained(local_out)

    url_out = f"{root}-hf/model"
    assert main(["export-hf", checkpoint, url_out, "--no-progress",
                 "--max-shard-size", "20KB"]) == 0
    names = download(url_out, options, str(tmp_path / "fetched"))
    assert "COMMITTED" in names and "config.json" in names
    assert "model.safetensors.index.json" in names  # sharded, every shard uploaded
    assert_same_tensors(tensors(str(tmp_path / "fetched")), tensors(hf_dir))
    transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "fetched"))
    capsys.readouterr()
    # An export already there is kept unless --overwrite, as for a directory.
    assert main(["export-hf", root, url_out, "--no-progress"]) == 2
    assert "already holds objects" in capsys.readouterr().err
    assert main(["export-hf", root, url_out, "--no-progress", "--overwrite"]) == 0
    assert "model.safetensors.index.json" not in download(url_out, options,
                                                          str(tmp_path / "again"))


def small_state(seed: int) -> dict:
    rng = np.random.default_rng(seed)
    return {"w": jnp.asarray(rng.standard_normal((16, 8)), jnp.float32),
            "b": jnp.asarray(rng.standard_normal(8), jnp.bfloat16),
            "step": jnp.asarray(seed, jnp.int32)}


def test_import_orbax_into_a_url_root_restores_bit_exact(store, tmp_path, capsys):
    import orbax.checkpoint as ocp

    kind, root, options = store
    src = tmp_path / "orbax"
    saved = small_state(3)
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(src, saved)
    assert main(["import-orbax", str(src), root]) == 0
    assert f"wrote {root}/recover/step_00000000" in capsys.readouterr().out
    like = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), saved)
    with jaxckpt.CheckpointManager(root, storage_options=options,
                                   preemption_signals=()) as manager:
        restored = manager.restore(like).state
    for name, array in saved.items():
        assert np.asarray(restored[name]).tobytes() == np.asarray(array).tobytes(), name
    assert main(["import-orbax", str(src), root]) == 3  # that step is there already
    assert "already holds" in capsys.readouterr().err
    assert main(["import-orbax", f"{kind}://{BUCKET}/orbax", root]) == 2  # SRC is local
    assert "SRC must be a local directory" in capsys.readouterr().err


def test_exit_codes_of_export_and_import_on_urls(store, hf_dir, tmp_path, capsys):
    kind, root, options = store
    out = str(tmp_path / "out")
    assert main(["export-hf", root, out]) == 3  # nothing there
    assert "is not a jaxckpt checkpoint root" in capsys.readouterr().err
    with jaxckpt.CheckpointManager(root, storage_options=options,
                                   preemption_signals=()) as manager:
        manager.save(jaxckpt.StepInfo(0, 1, 1, None), {"w": jnp.arange(8.0)})
        checkpoint = manager.store.step_path(1)
        storage = manager.store.storage
    driver = f"{checkpoint}/driver.json"
    storage.write(driver, storage.read(driver).replace(b'"', b"'", 1))  # same size, damaged
    assert main(["export-hf", checkpoint, out, "--arch", "gpt2", "--config", hf_dir]) == 1
    assert "failed verification" in capsys.readouterr().err
    assert not os.path.exists(out)
    for command in (["export-hf", "ftp://host/run", out], ["export-hf", root, "ftp://h/o"],
                    ["import-hf", hf_dir, "ftp://host/run", "--arch", "gpt2"],
                    ["import-orbax", str(tmp_path), "ftp://host/run"]):
        assert main(command) == 2, command
        assert "ftp:// scheme is not supported" in capsys.readouterr().err
    # An endpoint that answers nothing: an environment error, named as such.
    dead = ["--storage-option", "endpoint_url=http://127.0.0.1:9",
            "--storage-option", "max_attempts=1", "--storage-option", "connect_timeout=2"]
    assert main(["export-hf", root, out, *dead]) == 2
    assert main(["import-hf", hf_dir, f"{root}-2", "--arch", "gpt2", "--no-progress",
                 *dead]) == 2
    assert "object storage request failed" in capsys.readouterr().err


def test_storage_options_flag_reaches_the_client_and_refuses_local_paths(store, monkeypatch,
                                                                         tmp_path, capsys):
    kind, root, options = store
    with jaxckpt.CheckpointManager(root, storage_options=options,
                                   preemption_signals=()) as manager:
        manager.save(jaxckpt.StepInfo(0, 2, 2, None), {"w": jnp.arange(4.0)})
    for name in ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY",
                 "STORAGE_EMULATOR_HOST"):
        monkeypatch.delenv(name, raising=False)
    flags = [arg for key, value in options.items()
             for arg in ("--storage-option", f"{key}={value}")]
    assert main(["ls", root, *flags]) == 0  # found the server through the flags alone
    assert "step_00000002" in capsys.readouterr().out
    assert main(["info", root, *flags, "--storage-option", "lease_s=60"]) == 0
    capsys.readouterr()
    assert main(["verify", root, *flags, "--storage-option", "no_such_key=1"]) == 2
    assert "no_such_key" in capsys.readouterr().err
    assert main(["ls", str(tmp_path), *flags]) == 2
    assert "applies to s3:// and gs:// paths only" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exited:
        main(["ls", root, "--storage-option", "no-equals-sign"])
    assert exited.value.code == 2
    assert "KEY=VALUE" in capsys.readouterr().err


def test_bench_root_on_either_store_with_the_client_from_storage_options(store, monkeypatch,
                                                                          capsys):
    import json

    kind, root, options = store
    for name in ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY",
                 "STORAGE_EMULATOR_HOST"):
        monkeypatch.delenv(name, raising=False)
    flags = [arg for key, value in options.items()
             for arg in ("--storage-option", f"{key}={value}")]
    assert main(["bench", "--root", root, "--quick", "--json", *flags]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["bytes"] == 4 << 20 and set(result["summary"]) == {"save", "restore"}
    _, storage = parse_root(root, options)
    assert storage.list_files(root) == {}  # both prefixes deleted
