"""``jaxckpt bench --root s3://...`` runs its object-store rows against a moto server this
module starts on 127.0.0.1 (quick sizes: it checks that the rows run and are reported, not
how fast they are), and cleans up what it wrote."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("boto3")
pytest.importorskip("moto")

from support.s3_server import moto_s3


def test_bench_root_reports_save_and_restore_against_the_raw_transfers(capsys, monkeypatch):
    from jaxckpt.s3_storage import s3_client
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
