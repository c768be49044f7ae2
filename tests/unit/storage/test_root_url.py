"""Roots are parsed in one place (jaxckpt/storage/url.py): a URL is never taken for a relative
path. Unknown schemes are refused up front naming the scheme; an s3:// root never creates
anything locally, for either manager."""

import os

import pytest

from jaxckpt import CheckpointManager, CheckpointRootError
from jaxckpt.storage.url import local_root, parse_root, root_scheme


@pytest.mark.parametrize("root", ["gcs://bucket/run", "hdfs://namenode/run", "AZ://b/r",
                                  "file:///tmp/run", "az://container/run"])
def test_other_schemes_are_refused_naming_the_scheme_and_what_is_supported(root):
    scheme = root.split("://")[0].lower()
    for call in (root_scheme, parse_root, local_root):
        with pytest.raises(CheckpointRootError, match=f"the {scheme}:// scheme is not "
                                                      f"supported.*s3://BUCKET/PREFIX and "
                                                      f"gs://BUCKET/PREFIX"):
            call(root)


@pytest.mark.parametrize("root", ["runs/a", "/abs/runs", "./s3:x", "relative/s3://not-a-url"])
def test_local_paths_are_local(root, tmp_path):
    assert root_scheme(root) == "local"
    assert parse_root(root) == ("local", root)
    assert parse_root(tmp_path) == ("local", str(tmp_path))  # os.PathLike
    assert local_root(root) == root


def test_storage_options_are_refused_for_a_local_root():
    with pytest.raises(CheckpointRootError, match="apply to s3:// and gs:// roots only"):
        parse_root("runs/a", {"endpoint_url": "http://127.0.0.1:1"})


def test_an_s3_root_becomes_an_s3_storage_of_its_bucket_and_prefix():
    pytest.importorskip("boto3")
    from jaxckpt.storage.s3.storage import S3Storage

    kind, storage = parse_root("s3://my-bucket/some/run/", {
        "endpoint_url": "http://127.0.0.1:1", "region_name": "us-east-1",
        "aws_access_key_id": "a", "aws_secret_access_key": "b"})
    assert kind == "s3" and isinstance(storage, S3Storage)
    assert (storage.bucket, storage.prefix) == ("my-bucket", "some/run")
    with pytest.raises(CheckpointRootError, match="give a prefix below the bucket"):
        parse_root("s3://my-bucket")
    with pytest.raises(ValueError, match="unknown keys"):
        parse_root("s3://my-bucket/run", {"endpont_url": "typo"})


def test_a_gs_root_becomes_a_gcs_storage_of_its_bucket_and_prefix(monkeypatch):
    pytest.importorskip("google.cloud.storage")
    from jaxckpt.storage.gcs.storage import GCSStorage

    # An emulator's endpoint: anonymous credentials, and no request is made to build it.
    kind, storage = parse_root("gs://my-bucket/some/run/", {"endpoint_url": "http://127.0.0.1:1"})
    assert kind == "gs" and isinstance(storage, GCSStorage)
    assert (storage.bucket_name, storage.prefix) == ("my-bucket", "some/run")
    assert storage.client.api_endpoint == "http://127.0.0.1:1"
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", "http://127.0.0.1:2")
    assert parse_root("GS://other/run")[1].client.api_endpoint == "http://127.0.0.1:2"
    with pytest.raises(CheckpointRootError, match="give a prefix below the bucket"):
        parse_root("gs://my-bucket")
    with pytest.raises(ValueError, match="unknown keys"):
        parse_root("gs://my-bucket/run", {"endpont_url": "typo"})


def test_checkpoint_manager_refuses_unknown_url_roots_and_creates_nothing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(CheckpointRootError, match="the az:// scheme is not supported"):
        CheckpointManager("az://bucket/run")
    assert os.listdir(tmp_path) == []  # no "az:" directory


def test_an_unreachable_s3_root_is_refused_naming_the_fix_and_creates_nothing(tmp_path,
                                                                             monkeypatch):
    # s3:// roots are written by the Orbax backend (tests/integration/test_s3_manager.py);
    # one whose endpoint does not answer is refused before anything is created anywhere.
    pytest.importorskip("boto3")
    monkeypatch.chdir(tmp_path)
    options = {"endpoint_url": "http://127.0.0.1:9", "region_name": "us-east-1",
               "aws_access_key_id": "a", "aws_secret_access_key": "b", "max_attempts": 1,
               "connect_timeout": 1}
    with pytest.raises(CheckpointRootError, match="listing it failed.*AWS_ENDPOINT_URL"):
        CheckpointManager("s3://bucket/run", storage_options=options)
    assert os.listdir(tmp_path) == []  # no "s3:" directory


def test_dcp_checkpoint_manager_refuses_an_unreachable_s3_root_and_creates_nothing(
        tmp_path, monkeypatch):
    # DCP writes s3:// roots too (tests/integration/test_dcp_object_storage.py); an endpoint
    # that does not answer is refused before anything is created anywhere.
    torch_bridge = pytest.importorskip("torch_bridge")
    pytest.importorskip("boto3")
    monkeypatch.chdir(tmp_path)
    options = {"endpoint_url": "http://127.0.0.1:9", "region_name": "us-east-1",
               "aws_access_key_id": "a", "aws_secret_access_key": "b", "max_attempts": 1,
               "connect_timeout": 1}
    with pytest.raises(CheckpointRootError, match="listing it failed.*AWS_ENDPOINT_URL"):
        torch_bridge.DcpCheckpointManager("s3://bucket/run", storage_options=options)
    assert os.listdir(tmp_path) == []
