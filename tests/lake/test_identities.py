"""`claw lake-secrets` (claw_pipelines.lake.identities, docs/DESIGN.md §17): one key pair per
component, minted once and kept; SeaweedFS's identities scoped to the lake's prefix; files only
their owner reads; and CLAW_STORAGE_OPTIONS_FILE, through which a process takes its pair. The
identities are tried against a real store in tests/system/test_lake_identities.py."""

from __future__ import annotations

import json
import stat

import pytest
from pydantic import ValidationError

from claw_pipelines.app.cli import main
from claw_pipelines.lake.identities import (
    COMPONENTS,
    GRANTS,
    IDENTITIES_FILE,
    OPTIONS_FILE,
    SEAWEEDFS,
    SECURITY_FILE,
    TOKENIZERS,
    LakeSecretsError,
    create_bucket,
    identity_actions,
    split_lake_uri,
)
from claw_pipelines.lake.tokenizers import TOKENIZER_FOLDER
from claw_pipelines.settings import ClawSettings


def test_the_verb_mints_a_key_pair_per_component_once_and_keeps_it(tmp_path, capsys):
    assert main(["lake-secrets", "--dir", str(tmp_path), "--lake", "s3://claw-lake/lake"]) == 0
    first = {c: json.loads((tmp_path / c / OPTIONS_FILE).read_text()) for c in COMPONENTS}
    assert {"admin", "gateway", "materializer", "dagster", "trainer", "dashboard"} == set(first)
    for component, options in first.items():
        assert set(options) == {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"}
        assert options["AWS_ACCESS_KEY_ID"].startswith(component + "-")  # named in errors
        assert len(options["AWS_SECRET_ACCESS_KEY"]) >= 40
        assert stat.S_IMODE((tmp_path / component).stat().st_mode) == 0o700
        assert stat.S_IMODE((tmp_path / component / OPTIONS_FILE).stat().st_mode) == 0o600
    secrets = {o["AWS_SECRET_ACCESS_KEY"] for o in first.values()}
    assert len(secrets) == len(COMPONENTS)
    signing = (tmp_path / SEAWEEDFS / SECURITY_FILE).read_text()
    assert "[jwt.filer_signing]" in signing

    (tmp_path / "trainer" / OPTIONS_FILE).unlink()  # one lost: minted again, the others kept
    assert main(["lake-secrets", "--dir", str(tmp_path), "--lake", "s3://claw-lake/lake"]) == 0
    again = {c: json.loads((tmp_path / c / OPTIONS_FILE).read_text()) for c in COMPONENTS}
    assert {c: o for c, o in again.items() if c != "trainer"} == {
        c: o for c, o in first.items() if c != "trainer"
    }
    assert again["trainer"] != first["trainer"]
    assert (tmp_path / SEAWEEDFS / SECURITY_FILE).read_text() == signing
    said = capsys.readouterr().err
    assert "trainer: a new key" in said and "gateway: its key kept" in said

    document = json.loads((tmp_path / SEAWEEDFS / IDENTITIES_FILE).read_text())
    by_name = {identity["name"]: identity for identity in document["identities"]}
    for component, options in again.items():
        (credential,) = by_name[component]["credentials"]
        assert credential == {
            "accessKey": options["AWS_ACCESS_KEY_ID"],
            "secretKey": options["AWS_SECRET_ACCESS_KEY"],
        }
    assert stat.S_IMODE((tmp_path / SEAWEEDFS / IDENTITIES_FILE).stat().st_mode) == 0o600


def test_actions_are_scoped_to_the_lakes_prefix():
    gateway = identity_actions(GRANTS["gateway"], "claw-lake", "lake")
    assert "Write:claw-lake/lake/bronze/events/*" in gateway
    assert "Read:claw-lake/lake/gold/policy_versions/*" in gateway
    assert not any(a.startswith(("Admin", "Write:claw-lake/lake/silver")) for a in gateway)
    assert identity_actions(GRANTS["dashboard"], "b", "") == [
        "Read:b/*",
        "List:b/*",
        "Write:b/specs/*",
    ]
    assert identity_actions(GRANTS["admin"], "b", "x/y") == ["Admin:b"]
    for component, grant in GRANTS.items():  # no action without a bucket and a prefix
        for action in identity_actions(grant, "claw-lake", "lake"):
            verb, _, scope = action.partition(":")
            assert verb in ("Read", "List", "Write", "Admin") and scope, (component, action)
            assert verb == "Admin" or scope.startswith("claw-lake/lake/"), (component, action)
    assert TOKENIZERS == TOKENIZER_FOLDER


def test_only_s3_lakes_and_whole_options_are_accepted():
    assert split_lake_uri("s3://bucket/a/b/") == ("bucket", "a/b")
    assert split_lake_uri("s3a://bucket") == ("bucket", "")
    with pytest.raises(LakeSecretsError, match="s3:// lake"):
        split_lake_uri("./lake")
    with pytest.raises(LakeSecretsError, match="AWS_ACCESS_KEY_ID"):
        create_bucket("s3://bucket/lake", {"AWS_ENDPOINT_URL": "http://127.0.0.1:1"})
    assert main(["lake-secrets", "--dir", "x", "--lake", "gs://bucket/lake"]) == 1


def test_a_process_takes_its_key_pair_from_the_options_file(tmp_path, monkeypatch):
    """CLAW_STORAGE_OPTIONS_FILE is merged under CLAW_STORAGE_OPTIONS (whose keys win); a child
    process is given the file's name, never its secrets; a missing file or one that is not an
    object of strings stops the settings, naming it."""
    path = tmp_path / OPTIONS_FILE
    path.write_text(json.dumps({"AWS_ACCESS_KEY_ID": "k", "AWS_SECRET_ACCESS_KEY": "s3cret"}))
    for name in ("CLAW_STORAGE_OPTIONS", "CLAW_STORAGE_OPTIONS_FILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("CLAW_STORAGE_OPTIONS_FILE", str(path))
    monkeypatch.setenv("CLAW_STORAGE_OPTIONS", '{"AWS_REGION": "r", "AWS_ACCESS_KEY_ID": "env"}')
    settings = ClawSettings(_env_file=None)
    assert settings.storage_options == {
        "AWS_ACCESS_KEY_ID": "env",
        "AWS_SECRET_ACCESS_KEY": "s3cret",
        "AWS_REGION": "r",
    }
    child = settings.to_env()
    assert child["CLAW_STORAGE_OPTIONS_FILE"] == str(path)
    assert "s3cret" not in json.dumps(child)
    monkeypatch.setenv("CLAW_STORAGE_OPTIONS", "{}")
    assert ClawSettings(_env_file=None).storage_options["AWS_ACCESS_KEY_ID"] == "k"
    path.write_text('["not", "an", "object"]')
    with pytest.raises(ValidationError, match="not a JSON object of strings"):
        ClawSettings(_env_file=None)
    monkeypatch.setenv("CLAW_STORAGE_OPTIONS_FILE", str(tmp_path / "missing.json"))
    with pytest.raises(ValidationError, match=r"missing\.json: no such file"):
        ClawSettings(_env_file=None)
