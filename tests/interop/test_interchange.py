"""Interchange: OpenAI-style chat logs with token ids land in bronze with provenance (once,
whole or not at all), and gold partitions export as SFT messages and preference pairs."""

from __future__ import annotations

import json
from pathlib import Path

import polars as pl
import pytest

from claw_pipelines.app.cli import main
from claw_pipelines.consume.dataset import open_dataset
from claw_pipelines.contracts.specs import PREFERENCE_PAIRS_SPEC, SFT_SUCCESSES_SPEC
from claw_pipelines.contracts.tables import BRONZE_EVENTS, SILVER_STEPS
from claw_pipelines.interop.chat_logs import ChatLogError, import_chat_log
from claw_pipelines.interop.export import export
from claw_pipelines.lake.decoding import Undecodable
from claw_pipelines.lake.delta import Lake
from claw_pipelines.lake.prompts import read_steps
from claw_pipelines.lake.specs import save_spec
from claw_pipelines.materialize.gold import build_partition
from claw_pipelines.materialize.silver import build_silver
from claw_pipelines.tokenization import IM_END, encode, encode_chat, load_chat_tokenizer

BUNDLED = load_chat_tokenizer()  # the tokenizer these logs' ids come from

SYSTEM = {"role": "system", "content": "You add numbers."}


def call(trajectory: str, messages: list[dict], replies: list[str], **fields) -> dict:
    """One logged chat completion, as a server returning token ids answers it."""
    choices = [
        {
            "index": i,
            "message": {"role": "assistant", "content": reply},
            "finish_reason": "stop",
            "token_ids": encode(reply + IM_END),
            "logprobs": {"content": [{"logprob": -0.25} for _ in encode(reply + IM_END)]},
        }
        for i, reply in enumerate(replies)
    ]
    response = {"model": "qwen-ish", "prompt_token_ids": encode_chat(messages), "choices": choices}
    record = {"trajectory_uid": trajectory, "request": {"messages": messages}}
    return record | {"response": response} | fields


def chat_log(path: Path) -> Path:
    """A two-turn trajectory (rewarded at its end) and a call with two choices (a group)."""
    first = [SYSTEM, {"role": "user", "content": "2 + 2?"}]
    second = [*first, {"role": "assistant", "content": "4"}, {"role": "user", "content": "+1?"}]
    lines = [
        call("chat-1", first, ["4"], policy_version=3),
        call("chat-1", second, ["5"], policy_version=3, reward=1.0, is_last=True),
        call("pair", [SYSTEM, {"role": "user", "content": "3 + 3?"}], ["6", "7"], policy_version=3),
    ]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


@pytest.fixture
def lake(tmp_path) -> Lake:
    return Lake(str(tmp_path / "lake"))


def test_a_chat_log_lands_once_with_its_provenance(lake, tmp_path):
    log = chat_log(tmp_path / "calls.jsonl")
    landed = import_chat_log(lake, log, tenant="acme")
    assert (landed.steps, landed.already, landed.trajectories) == (4, 0, 3)
    again = import_chat_log(lake, log, tenant="acme")
    assert (again.steps, again.already) == (0, 4)  # the same file lands nothing new
    assert lake.read(BRONZE_EVENTS).height == 4
    build_silver(lake)
    steps = read_steps(lake, SILVER_STEPS).sort("step_key")
    assert steps["step_key"].to_list() == ["chat-1:0", "chat-1:1", "pair.c1:0", "pair:0"]
    assert set(steps["prompt_uid"].drop_nulls()) == {"pair"}  # the two choices: one group
    assert set(steps["tenant"]) == {"acme"} and set(steps["policy_version"]) == {3}
    first = steps.row(0, named=True)
    assert first["prompt_ids"] == encode_chat([SYSTEM, {"role": "user", "content": "2 + 2?"}])
    assert first["rollout_log_probs"] == [-0.25] * len(first["response_ids"])
    provenance = json.loads(first["metadata"])["imported"]
    assert provenance["file"] == "calls.jsonl" and provenance["line"] == 1
    assert provenance["format"] == "openai-chat" and len(provenance["sha256"]) == 16


def test_a_bad_line_names_itself_and_lands_nothing(lake, tmp_path, capsys):
    log = chat_log(tmp_path / "calls.jsonl")
    broken = log.read_text().splitlines()
    line = json.loads(broken[1])
    del line["response"]["prompt_token_ids"]
    broken[1] = json.dumps(line)
    log.write_text("\n".join(broken) + "\n")
    with pytest.raises(ChatLogError, match=r"^line 2: response\.prompt_token_ids: required"):
        import_chat_log(lake, log)
    assert not lake.exists(BRONZE_EVENTS)
    line["response"]["prompt_token_ids"] = [1, -5]
    broken[1] = json.dumps(line)
    log.write_text("\n".join(broken) + "\n")
    assert main(["import", str(log), "--lake", lake.uri]) == 1
    assert "no lake at" in capsys.readouterr().err  # an import creates one only when asked
    assert main(["import", str(log), "--lake", lake.uri, "--create"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("claw: error: ") and "line 2: choices[0] -> prompt_ids.1:" in err
    assert err.count("\n") == 1 and not lake.exists(BRONZE_EVENTS)


def test_sft_messages_and_preference_pairs_export_exactly(lake, tmp_path):
    import_chat_log(lake, chat_log(tmp_path / "calls.jsonl"), tokenizer=BUNDLED)
    build_silver(lake)
    save_spec(lake, SFT_SUCCESSES_SPEC)
    build_partition(lake, SFT_SUCCESSES_SPEC, 3)
    out = tmp_path / "sft.jsonl"
    assert export(open_dataset("sft-successes", lake.uri), 3, "sft-messages", out) == 2
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["step_key"] for r in records] == ["chat-1:0", "chat-1:1"]
    assert records[1]["messages"] == [
        SYSTEM,
        {"role": "user", "content": "2 + 2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "+1?"},
        {"role": "assistant", "content": "5"},
    ]
    silver = (
        read_steps(lake, SILVER_STEPS).filter(pl.col("step_key") == "chat-1:1").row(0, named=True)
    )
    assert records[1]["prompt_ids"] == silver["prompt_ids"]
    assert records[1]["response_ids"] == silver["response_ids"]
    assert records[1]["decoded_with"] == {
        "name": "bundled",
        "fingerprint": BUNDLED.fingerprint,
        "via": "template",
    }

    # a group with different returns: the pair's choices, rewarded apart
    pairs_log = tmp_path / "pairs.jsonl"
    line = call("q", [SYSTEM, {"role": "user", "content": "1 + 1?"}], ["2", "3"], is_last=True)
    line["policy_version"] = 3
    pairs_log.write_text(json.dumps(line) + "\n")
    import_chat_log(lake, pairs_log, tokenizer=BUNDLED)
    build_silver(lake)
    spec = PREFERENCE_PAIRS_SPEC.model_copy(update={"reward_status": ["final", "missing"]})
    save_spec(lake, spec)
    part = build_partition(lake, spec, 3)
    assert part.steps.height == 0  # no step carries a reward yet: no pair differs
    bronze_reward(lake, "q:0", 1.0)
    bronze_reward(lake, "q.c1:0", 0.0)
    build_silver(lake)
    build_partition(lake, spec, 3)
    out = tmp_path / "pairs-out.jsonl"
    assert export(open_dataset("preference-pairs", lake.uri), 3, "preference-pairs", out) == 1
    (pair,) = [json.loads(x) for x in out.read_text().splitlines()]
    assert pair["prompt"] == [SYSTEM, {"role": "user", "content": "1 + 1?"}]
    assert pair["chosen"] == [{"role": "assistant", "content": "2"}]
    assert pair["rejected"] == [{"role": "assistant", "content": "3"}]
    assert pair["chosen_ids"] == encode("2" + IM_END)
    assert pair["rejected_ids"] == encode("3" + IM_END)
    assert (pair["chosen_return"], pair["rejected_return"]) == (1.0, 0.0)
    assert (pair["chosen_trajectory"], pair["rejected_trajectory"]) == ("q", "q.c1")


def test_steps_naming_no_tokenizer_export_their_kept_request_or_are_refused(lake, tmp_path, capsys):
    log = chat_log(tmp_path / "calls.jsonl")
    import_chat_log(lake, log)  # no --tokenizer, no --keep-request: the ids' language unknown
    build_silver(lake)
    save_spec(lake, SFT_SUCCESSES_SPEC)
    build_partition(lake, SFT_SUCCESSES_SPEC, 3)
    out = tmp_path / "sft.jsonl"
    with pytest.raises(Undecodable, match=r"^step chat-1:0 names no tokenizer"):
        export(open_dataset("sft-successes", lake.uri), 3, "sft-messages", out)
    command = ["export", "--lake", lake.uri, "--dataset", "sft-successes"]
    command += ["--policy-version", "3", "--format", "sft-messages", "--out", str(out)]
    assert main(command) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--tokenizer FOLDER" in err
    # the tokenizer given by hand decodes them
    assert main([*command, "--tokenizer", "bundled"]) == 0
    record = json.loads(out.read_text().splitlines()[1])
    assert record["messages"][-1] == {"role": "assistant", "content": "5"}

    kept = Lake(str(tmp_path / "kept"))
    import_chat_log(kept, log, keep_request=True)  # the request and reply kept instead
    build_silver(kept)
    save_spec(kept, SFT_SUCCESSES_SPEC)
    build_partition(kept, SFT_SUCCESSES_SPEC, 3)
    export(open_dataset("sft-successes", kept.uri), 3, "sft-messages", out)
    record = json.loads(out.read_text().splitlines()[1])
    assert record["messages"][0] == SYSTEM and record["messages"][-1]["content"] == "5"
    assert record["decoded_with"]["via"] == "recorded"


def bronze_reward(lake: Lake, step_key: str, value: float) -> None:
    """A human reward for one step, as the feedback route lands it."""
    from tests.support.lakes import feedback, land

    land(lake, [feedback({"step_key": step_key}, "reward", value, tenant="default")])
