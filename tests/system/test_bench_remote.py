"""``jaxckpt bench --root s3://...`` runs its object-store rows against a moto server this
module starts on 127.0.0.1 (quick sizes: it checks that the rows run and are reported, not
how fast they are), and cleans up what it wrote."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("boto3")
pytest.importorskip("moto")

from support.paths import REPO
from support.s3_server import moto_s3


def load_experiment(name: str):
    """A script of benchmarks/experiments/ (outside the package), loaded by its path."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        name, REPO / "benchmarks" / "experiments" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_bench_root_reports_save_and_restore_against_the_raw_transfers(capsys, monkeypatch):
    from jaxckpt.storage.s3.storage import s3_client
    from jaxckpt.tools.cli import main

    with moto_s3("bench") as options:
        for name, key in (("AWS_ENDPOINT_URL", "endpoint_url"), ("AWS_REGION", "region_name"),
                          ("AWS_ACCESS_KEY_ID", "aws_access_key_id"),
                          ("AWS_SECRET_ACCESS_KEY", "aws_secret_access_key")):
            monkeypatch.setenv(name, options[key])
        assert main(["bench", "--root", "s3://bench/run", "--quick", "--repeats", "2",
                     "--json"]) == 0
        result = json.loads(capsys.readouterr().out)
        left = s3_client(options).list_objects_v2(Bucket="bench").get("KeyCount")
    assert sorted(result["seconds"]) == ["raw_download", "raw_upload", "restore", "save"]
    assert all(len(times) == 2 and min(times) > 0 for times in result["seconds"].values())
    assert set(result["summary"]) == {"save", "restore"}
    assert result["bytes"] == 4 << 20
    assert not left  # both prefixes deleted


def test_bench_clients_moves_the_same_bytes_through_each_installed_client(capsys,
                                                                          monkeypatch):
    """``python benchmarks/experiments/bench_clients.py``: every installed client uploads
    and downloads the same objects (a row each, every round timed), and nothing is left."""
    from jaxckpt.storage.s3.storage import s3_client

    main = load_experiment("bench_clients").main

    with moto_s3("clients") as options:
        for name, key in (("AWS_ENDPOINT_URL", "endpoint_url"), ("AWS_REGION", "region_name"),
                          ("AWS_ACCESS_KEY_ID", "aws_access_key_id"),
                          ("AWS_SECRET_ACCESS_KEY", "aws_secret_access_key")):
            monkeypatch.setenv(name, options[key])
        assert main(["s3://clients/run", "--big-mib", "2", "--object-mib", "1", "--small",
                     "8", "--small-kib", "1", "--repeats", "1"]) == 0
        out = capsys.readouterr().out
        left = s3_client(options).list_objects_v2(Bucket="clients").get("KeyCount")
    import importlib.util

    clients = ["boto3"] + [name for name in ("tensorstore", "obstore", "s3fs")
                           if importlib.util.find_spec(name) is not None]
    for client in clients:
        for row in ("big_put", "big_get", "small_put", "small_get"):
            assert any(line.split()[:2] == [client, row] for line in out.splitlines()), out
    assert "2 MiB in 2 objects, 8 objects of 1 KiB" in out
    assert not left
