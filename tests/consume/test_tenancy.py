"""Tenancy through the data path (docs/DESIGN.md §8, §9): a spec belongs to a tenant, its
dataset holds only that tenant's steps, and `Dataset`, `next_batch`, exports and the CLI read
for the caller's key, refusing another tenant's data by name, never with an empty result."""

from __future__ import annotations

import polars as pl
import pytest

from claw_pipelines.app.cli import main
from claw_pipelines.consume.dataset import Dataset, open_dataset
from claw_pipelines.contracts.access import Caller, KeyRing
from claw_pipelines.contracts.errors import Forbidden
from claw_pipelines.contracts.specs import CurationSpec
from claw_pipelines.contracts.tables import gold_rejection_table
from claw_pipelines.lake.catalog import dataset_tenants, gold_datasets
from tests.support.lakes import ACME_KEY, ADMIN_KEY, GLOBEX_KEY, TENANTS_KEYS_FILE, tenants_lake


@pytest.fixture(scope="module")
def lake(tmp_path_factory):
    return tenants_lake(tmp_path_factory.mktemp("tenants"))


@pytest.fixture
def keyed(tmp_path, monkeypatch, lake):
    """The process environment of a deployment with keys: the keys file (hashes only)."""
    keys = tmp_path / "api-keys"
    keys.write_text(TENANTS_KEYS_FILE)
    monkeypatch.setenv("CLAW_API_KEYS_FILE", str(keys))
    monkeypatch.setenv("CLAW_LAKE_URI", lake.uri)
    monkeypatch.delenv("CLAW_API_KEY", raising=False)
    monkeypatch.delenv("CLAW_API_KEYS", raising=False)
    return keys


def test_a_tenant_spec_curates_only_its_tenant_and_rejects_nothing_of_others(lake):
    for name, tenant in (("acme-train", "acme"), ("globex-train", "globex")):
        steps = Dataset(lake, name, caller=Caller.local()).steps()
        assert steps.height == 2 * 2 * 2  # two groups of two rollouts of two turns
        assert set(steps["trajectory_uid"].str.split("-").list.first()) == {tenant}
        rejected = (
            lake.read(gold_rejection_table(name))
            if lake.exists(gold_rejection_table(name))
            else pl.DataFrame({"step_key": []}, schema={"step_key": pl.String})
        )
        assert not rejected.filter(~pl.col("step_key").str.starts_with(tenant)).height
    shared = Dataset(lake, "everyone", caller=Caller.local()).steps()
    assert shared.height == 16
    assert dataset_tenants(lake) == {
        "acme-train": "acme",
        "globex-train": "globex",
        "everyone": None,
    }


def test_a_spec_of_one_tenant_cannot_name_another():
    with pytest.raises(ValueError, match="tenants: a spec of tenant 'acme'"):
        CurationSpec(name="x", tenant="acme", tenants=["globex"])
    assert CurationSpec(name="x", tenant="acme", tenants=["acme"]).tenant == "acme"
    # a spec without a tenant keeps the hash it always had
    assert (
        CurationSpec(name="x").canonical_json()
        == CurationSpec(name="x", tenant=None).canonical_json()
    )
    assert '"tenant"' not in CurationSpec(name="x").canonical_json()


def test_a_tenant_key_reads_its_dataset_and_is_refused_another_by_name(keyed):
    mine = open_dataset("acme-train", key=ACME_KEY)
    assert set(mine.steps()["trajectory_uid"].str.slice(0, 4)) == {"acme"}
    batch = mine.next_batch(groups=2, consumer="acme-run", timeout=5)
    assert batch.step_keys and all(key.startswith("acme-") for key in batch.step_keys)
    assert sorted(batch.groups) == ["1:acme-g0", "2:acme-g1"]
    with pytest.raises(Forbidden, match="dataset 'globex-train' belongs to tenant 'globex'"):
        open_dataset("globex-train", key=ACME_KEY)
    with pytest.raises(Forbidden, match="only an admin key reads it"):
        open_dataset("everyone", key=GLOBEX_KEY)
    with pytest.raises(Forbidden, match="may name another tenant"):
        open_dataset("acme-train", key=ACME_KEY, tenant="globex")


def test_no_key_or_a_wrong_key_is_refused_where_keys_are_configured(keyed, monkeypatch):
    with pytest.raises(Forbidden, match="need an API key: set CLAW_API_KEY"):
        open_dataset("acme-train")
    with pytest.raises(Forbidden, match="invalid API key"):
        open_dataset("acme-train", key="claw-not-a-key")
    monkeypatch.setenv("CLAW_API_KEY", GLOBEX_KEY)  # the trainer's environment
    assert open_dataset("globex-train").caller == Caller("globex")


def test_an_admin_reads_every_dataset_or_narrows_to_one_tenant(keyed, lake):
    for name in ("acme-train", "globex-train", "everyone"):
        assert open_dataset(name, key=ADMIN_KEY).steps().height
    scoped = open_dataset("globex-train", key=ADMIN_KEY, tenant="globex")
    assert scoped.caller == Caller("globex", admin=True)
    with pytest.raises(Forbidden, match="belongs to tenant 'acme'"):
        open_dataset("acme-train", key=ADMIN_KEY, tenant="globex")
    ring = KeyRing.from_settings(type("S", (), {"api_keys": None, "api_keys_file": keyed})())
    assert gold_datasets(lake, ring.caller_for(ACME_KEY)) == ["acme-train"]
    assert gold_datasets(lake, ring.caller_for(ADMIN_KEY)) == [
        "acme-train",
        "everyone",
        "globex-train",
    ]


def test_local_mode_without_keys_reads_every_tenant(lake, monkeypatch):
    monkeypatch.delenv("CLAW_API_KEYS_FILE", raising=False)
    monkeypatch.delenv("CLAW_API_KEYS", raising=False)
    assert open_dataset("globex-train", lake_uri=lake.uri).caller == Caller.local()


def _claw(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_the_cli_reads_for_the_callers_tenant(keyed, monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("CLAW_API_KEY", ACME_KEY)
    out = str(tmp_path / "x.jsonl")
    code, _, err = _claw(
        capsys, "export", "--dataset", "globex-train", "--policy-version", "1",
        "--format", "jsonl", "--out", out,
    )  # fmt: skip
    assert code == 1
    assert err == (
        "claw: error: dataset 'globex-train' belongs to tenant 'globex': "
        "this key is tenant 'acme''s\n"
    )
    code, printed, _ = _claw(
        capsys, "export", "--dataset", "acme-train", "--policy-version", "1",
        "--format", "jsonl", "--out", out,
    )  # fmt: skip
    assert code == 0 and "exported" in printed
    code, printed, _ = _claw(capsys, "ledger")
    assert code == 0 and "acme-train" in printed and "globex" not in printed
    assert "everyone" not in printed
    code, _, err = _claw(capsys, "ledger", "--dataset", "globex-train")
    assert code == 1 and "belongs to tenant 'globex'" in err
    for verb in ("check", "repair", "shards"):
        code, _, err = _claw(capsys, verb)
        assert code == 1
        assert err == (
            f"claw: error: claw {verb} reads every tenant's data: it needs an admin key, "
            "and this key is tenant 'acme''s\n"
        )
    code, _, err = _claw(capsys, "import", str(tmp_path / "none.jsonl"), "--tenant", "globex")
    assert code == 1 and "tenant 'globex' refused: this key belongs to tenant 'acme'" in err
    monkeypatch.setenv("CLAW_API_KEY", ADMIN_KEY)
    code, printed, _ = _claw(capsys, "ledger", "--tenant", "globex")
    assert code == 0 and "globex-train" in printed and "acme" not in printed
