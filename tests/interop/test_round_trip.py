"""Exports in the model's own language: chat logs whose ids come from a model's own tokenizer
folder (ChatML with Qwen2's tokenizer class, Llama 3, Mistral, named templates; built here)
are imported with `--tokenizer`, materialized and exported as SFT messages and preference
pairs: the messages come back exactly, the ids unchanged, decoded with the tokenizer the lake
kept (the folder itself is gone by then, as on another machine)."""

from __future__ import annotations

import json
import shutil

import pytest

from claw_pipelines.app.cli import main
from claw_pipelines.consume.dataset import open_dataset
from claw_pipelines.contracts.specs import CurationSpec
from claw_pipelines.contracts.tables import SILVER_STEPS
from claw_pipelines.interop.export import export
from claw_pipelines.lake.delta import Lake
from claw_pipelines.lake.prompts import read_steps
from claw_pipelines.lake.specs import save_spec
from claw_pipelines.lake.tokenizers import stored_fingerprints
from claw_pipelines.materialize.gold import build_partition
from claw_pipelines.materialize.silver import build_silver
from claw_pipelines.simulation.model_folders import tokenizer_folder
from claw_pipelines.tokenization import load_chat_tokenizer
from tests.support.lakes import feedback, land

EVERYTHING = CurationSpec(name="everything", reward_status=["final", "missing", "pending"])
PAIRS = CurationSpec(
    name="pairs", reward_status=["final", "missing", "pending"], select="best_and_worst"
)
FIRST = [{"role": "user", "content": "What is 2+2?"}]
# family, model_type (Qwen2's own tokenizer class for ChatML), whether the conversation has a
# system prompt (Mistral's template folds it into the last user turn: see the test below)
FAMILIES = [("chatml", "qwen2", True), ("llama3", None, True), ("mistral", None, False)]
FAMILIES += [("chatml-named", None, True)]


def logged(chat, trajectory: str, messages: list[dict], replies: list[str], **fields) -> dict:
    """One call as a server returning token ids logs it: the ids are the model's."""
    eos = chat.encode(chat.eos_token)
    choices = [
        {
            "index": i,
            "message": {"role": "assistant", "content": reply},
            "finish_reason": "stop",
            "token_ids": chat.encode(reply) + eos,
        }
        for i, reply in enumerate(replies)
    ]
    response = {"model": "tiny", "prompt_token_ids": chat.prompt_ids(messages), "choices": choices}
    return (
        {"trajectory_uid": trajectory, "request": {"messages": messages}}
        | {
            "response": response,
            "policy_version": 1,
            "is_last": True,
        }
        | fields
    )


def conversations(system: bool) -> tuple[list[dict], list[dict]]:
    """A two-turn conversation (maybe with a system prompt), and its second turn's prompt."""
    first = [{"role": "system", "content": "Be brief."}, *FIRST] if system else list(FIRST)
    second = [*first, {"role": "assistant", "content": "It is four."}]
    return first, [*second, {"role": "user", "content": "And 3 + 3, twice over?"}]


@pytest.mark.parametrize(("family", "model_type", "system"), FAMILIES)
def test_import_materialize_export_gives_the_messages_back(
    tmp_path, family, model_type, system, capsys
):
    folder = tokenizer_folder(tmp_path / family, family, "v5", model_type=model_type)
    chat = load_chat_tokenizer(str(folder))
    first, second = conversations(system)
    lines = [
        logged(chat, "t", first, ["It is four."], is_last=False),
        logged(chat, "t", second, ["Six, then twelve."]),
        logged(chat, "g", list(FIRST), ["Four.", "Five, surely."], prompt_uid="g"),
    ]
    log = tmp_path / "calls.jsonl"
    log.write_text("".join(json.dumps(line) + "\n" for line in lines))
    lake = Lake(str(tmp_path / "lake"))
    command = ["import", str(log), "--lake", lake.uri, "--create", "--tokenizer", str(folder)]
    assert main(command) == 0, capsys.readouterr().err
    assert stored_fingerprints(lake) == [chat.fingerprint]
    shutil.rmtree(folder)  # exports read the lake's copy, as on another machine
    land(lake, [feedback({"step_key": "g:0"}, "reward", 1.0, tenant="default")])
    land(lake, [feedback({"step_key": "g.c1:0"}, "reward", 0.0, tenant="default")])
    build_silver(lake)
    for spec in (EVERYTHING, PAIRS):
        save_spec(lake, spec)
        build_partition(lake, spec, 1)

    out = tmp_path / "sft.jsonl"
    assert export(open_dataset("everything", lake.uri), 1, "sft-messages", out) == 4
    records = {r["step_key"]: r for r in map(json.loads, out.read_text().splitlines())}
    silver = {r["step_key"]: r for r in read_steps(lake, SILVER_STEPS).to_dicts()}
    assert records["t:1"]["messages"] == [
        *second,
        {"role": "assistant", "content": "Six, then twelve."},
    ]
    assert records["t:0"]["messages"] == [*first, {"role": "assistant", "content": "It is four."}]
    assert records["g.c1:0"]["messages"] == [
        *FIRST,
        {"role": "assistant", "content": "Five, surely."},
    ]
    for key, record in records.items():
        assert record["prompt_ids"] == silver[key]["prompt_ids"]
        assert record["response_ids"] == silver[key]["response_ids"]
        assert record["decoded_with"]["fingerprint"] == chat.fingerprint
        assert all(m["role"] and m["content"] is not None for m in record["messages"])

    out = tmp_path / "pairs.jsonl"
    assert export(open_dataset("pairs", lake.uri), 1, "preference-pairs", out) == 1
    (pair,) = map(json.loads, out.read_text().splitlines())
    assert pair["prompt"] == FIRST
    assert pair["chosen"] == [{"role": "assistant", "content": "Four."}]
    assert pair["rejected"] == [{"role": "assistant", "content": "Five, surely."}]


def test_a_template_that_folds_turns_gives_them_back_from_the_kept_request(tmp_path):
    folder = tokenizer_folder(tmp_path / "mistral", "mistral", "v5")
    chat = load_chat_tokenizer(str(folder))
    first, _ = conversations(system=True)
    log = tmp_path / "calls.jsonl"
    log.write_text(json.dumps(logged(chat, "t", first, ["Four."])) + "\n")
    for keep, expected in (
        (True, first),  # as sent
        (False, [{"role": "user", "content": "Be brief.\n\nWhat is 2+2?"}]),  # as the model saw
    ):
        lake = Lake(str(tmp_path / f"lake-{keep}"))
        command = ["import", str(log), "--lake", lake.uri, "--create", "--tokenizer", str(folder)]
        assert main([*command, *(["--keep-request"] if keep else [])]) == 0
        build_silver(lake)
        save_spec(lake, EVERYTHING)
        build_partition(lake, EVERYTHING, 1)
        out = tmp_path / f"sft-{keep}.jsonl"
        export(open_dataset("everything", lake.uri), 1, "sft-messages", out)
        (record,) = map(json.loads, out.read_text().splitlines())
        assert record["messages"] == [*expected, {"role": "assistant", "content": "Four."}]
        assert record["decoded_with"]["via"] == ("recorded" if keep else "template")
        assert chat.prompt_ids(record["messages"][:-1]) == record["prompt_ids"]  # both exact
