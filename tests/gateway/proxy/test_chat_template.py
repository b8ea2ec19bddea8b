"""The model's own chat template: `CLAW_TOKENIZER` names a Hugging Face tokenizer directory
(tokenizer.json, tokenizer_config.json with its Jinja `chat_template` and special tokens),
and calls an upstream cannot give ids for are rendered and tokenized with it; ChatML stays
the bundled tokenizer's. A directory without a template is refused when the gateway starts."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import uuid
from importlib import resources
from pathlib import Path

import httpx
import polars as pl
import pytest

from claw_pipelines.tokenization import encode, load_chat_tokenizer, render_chat
from tests.support.servers import REPO, GatewayProcess, bronze, free_port, wait_landed, wait_until
from tests.support.upstreams import ScriptedUpstream, openai_answer, proxy_env

KEY = "template-test-key"
# a Llama-3-like layout over the bundled vocabulary's special tokens
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}[{{ m.role }}]\n{{ m.content }}{{ eos_token }}\n"
    "{% endfor %}{% if tools %}[tools] {{ tools | tojson }}\n{% endif %}"
    "{% if add_generation_prompt %}[assistant]\n{% endif %}"
)
MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Say hello."},
]


def tokenizer_dir(root: Path, config: dict) -> Path:
    """A Hugging Face tokenizer directory: the bundled tokenizer.json and `config`."""
    root.mkdir(parents=True)
    bundled = resources.files("claw_pipelines").joinpath("bundled_tokenizer", "tokenizer.json")
    shutil.copy(str(bundled), root / "tokenizer.json")
    (root / "tokenizer_config.json").write_text(json.dumps(config))
    return root


@pytest.fixture
def model_dir(tmp_path) -> Path:
    config = {
        "chat_template": TEMPLATE,
        "bos_token": "<|endoftext|>",
        "eos_token": {"__type": "AddedToken", "content": "<|im_end|>", "special": True},
    }
    return tokenizer_dir(tmp_path / "model", config)


def test_the_directory_template_renders_with_its_special_tokens(model_dir):
    chat = load_chat_tokenizer(str(model_dir))
    text = chat.render(MESSAGES, tools=[{"type": "function", "function": {"name": "add"}}])
    assert text.startswith("<|endoftext|>[system]\nBe brief.<|im_end|>\n[user]\n")
    assert '[tools] [{"type": "function"' in text and text.endswith("[assistant]\n")
    assert chat.encode(text)[0] == encode("<|endoftext|>")[0]  # a special token, one id
    assert load_chat_tokenizer().render(MESSAGES) == render_chat(MESSAGES)  # bundled: ChatML


def _chat(gateway: GatewayProcess, key: str) -> httpx.Response:
    """One chat call through the gateway, with an idempotency key."""
    return httpx.post(
        gateway.url + "/v1/chat/completions",
        json={"model": "plain", "messages": MESSAGES},
        headers={"Authorization": f"Bearer {KEY}", "Idempotency-Key": key},
        timeout=10,
    )


def _one_call(upstream: ScriptedUpstream, model_dir: Path, lake: Path) -> dict:
    """One chat call through a gateway with the folder's tokenizer: its bronze row."""
    env = proxy_env(upstream.url, KEY, "t", CLAW_TOKENIZER=str(model_dir))
    with GatewayProcess(lake, **env) as gateway:
        key = f"k-{uuid.uuid4().hex}"
        answer = _chat(gateway, key)
        assert answer.status_code == 200, answer.text
        return wait_landed(gateway.lake, [key]).row(0, named=True)


def test_calls_without_upstream_ids_are_tokenized_with_the_models_template(model_dir, tmp_path):
    chat = load_chat_tokenizer(str(model_dir))
    reply = openai_answer()["choices"][0]["message"]["content"]
    prompt_ids = chat.encode(chat.render(MESSAGES))
    response_ids = chat.encode(f"{reply}<|im_end|>")  # what follows the prompt
    counts = (len(prompt_ids), len(response_ids))
    with ScriptedUpstream(usage=counts) as upstream:
        row = _one_call(upstream, model_dir, tmp_path / "lake")
    assert row["prompt_ids"] == prompt_ids and row["response_ids"] == response_ids
    assert row["token_source"] == "local"  # computed here, and the server's counts agree
    metadata = json.loads(row["payload"])["metadata"]
    assert metadata["token_check"] == {
        "prompt_tokens": [counts[0], counts[0]],
        "completion_tokens": [counts[1], counts[1]],
    }
    assert metadata["tokenizer"] == {"name": str(model_dir), "fingerprint": chat.fingerprint}
    assert metadata["log_probs"] is False  # the upstream gave none
    # its test call at start showed it returns no ids: calls do not ask again
    (call,) = [r for r in upstream.requests if r["body"]["model"] == "plain"]
    assert "return_token_ids" not in call["body"]


@pytest.mark.parametrize("usage", [(3, 2), None], ids=["counts-disagree", "no-usage"])
def test_local_ids_the_server_counts_contradict_are_flagged_unverified(model_dir, tmp_path, usage):
    with ScriptedUpstream(usage=usage) as upstream:
        row = _one_call(upstream, model_dir, tmp_path / "lake")
    assert row["token_source"] == "local_unverified"
    check = json.loads(row["payload"])["metadata"]["token_check"]
    server = usage or (None, None)
    assert check["prompt_tokens"] == [len(row["prompt_ids"]), server[0]]
    assert check["completion_tokens"] == [len(row["response_ids"]), server[1]]


def test_an_upstream_without_token_ids_needs_a_tokenizer_to_start(tmp_path):
    with ScriptedUpstream() as upstream:
        done = subprocess.run(
            [sys.executable, "-m", "claw_pipelines.app.cli", "gateway", "--port", "0"],
            cwd=REPO,
            env={
                "CLAW_UPSTREAM_URL": upstream.url,
                "CLAW_LAKE_URI": str(tmp_path / "lake"),
                "PATH": "",
            },
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert done.returncode != 0
    (line,) = done.stderr.strip().splitlines()
    assert "the upstream returns no token ids" in line and "set CLAW_TOKENIZER" in line


def test_a_tokenizer_directory_without_a_chat_template_is_refused_at_start(tmp_path):
    bare = tokenizer_dir(tmp_path / "bare", {"bos_token": "<|endoftext|>"})
    done = subprocess.run(
        [sys.executable, "-m", "claw_pipelines.app.cli", "gateway", "--port", "0"],
        cwd=REPO,
        env={"CLAW_TOKENIZER": str(bare), "CLAW_LAKE_URI": str(tmp_path / "lake"), "PATH": ""},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode != 0
    assert f"CLAW_TOKENIZER: {bare}: has no chat_template" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1


def test_without_ids_or_tokenizer_a_choice_lands_as_an_event_never_a_step(tmp_path):
    port = free_port()  # nothing listens there yet: the gateway cannot ask it at start
    url = f"http://127.0.0.1:{port}/v1"
    with GatewayProcess(tmp_path / "lake", **proxy_env(url, KEY, "t")) as gateway:
        capture = httpx.get(gateway.url + "/readyz", timeout=5).json()["capture"]
        assert capture["upstream_returns_ids"] is None and capture["tokenizer"] is None
        assert capture["probe"].startswith("unreachable")
        with ScriptedUpstream(usage=(3, 4), port=port):
            answer = _chat(gateway, f"k-{uuid.uuid4().hex}")
        assert answer.status_code == 200  # the agent gets its answer
        assert answer.headers["X-Claw-Step-Keys"] == ""  # and no step was made up

        def uncaptured():
            events = bronze(gateway.lake).filter(pl.col("kind") == "event")
            found = [json.loads(p) for p in events["payload"]]
            found = [e for e in found if e["type"] == "uncaptured_call"]
            return found or None

        (event,) = wait_until(uncaptured, 20, interval=0.1, what="the uncaptured_call event")
        assert "CLAW_TOKENIZER is unset" in event["payload"]["reason"]
        assert (
            event["payload"]["output"]["content"]
            == openai_answer()["choices"][0]["message"]["content"]
        )
        kinds = set(bronze(gateway.lake)["kind"])
        assert "chat_completion" not in kinds
