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
import pytest

from claw_pipelines.tokenization import encode, load_chat_tokenizer, render_chat
from tests.servers import REPO, GatewayProcess, wait_landed
from tests.upstreams import ScriptedUpstream, openai_answer, proxy_env

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
        "eos_token": {"content": "<|im_end|>", "special": True},
    }
    return tokenizer_dir(tmp_path / "model", config)


def test_the_directory_template_renders_with_its_special_tokens(model_dir):
    chat = load_chat_tokenizer(str(model_dir))
    text = chat.render(MESSAGES, tools=[{"type": "function", "function": {"name": "add"}}])
    assert text.startswith("<|endoftext|>[system]\nBe brief.<|im_end|>\n[user]\n")
    assert '[tools] [{"type": "function"' in text and text.endswith("[assistant]\n")
    assert chat.encode(text)[0] == encode("<|endoftext|>")[0]  # a special token, one id
    assert load_chat_tokenizer().render(MESSAGES) == render_chat(MESSAGES)  # bundled: ChatML


def test_calls_without_upstream_ids_are_tokenized_with_the_models_template(model_dir, tmp_path):
    with (
        ScriptedUpstream() as upstream,
        GatewayProcess(
            tmp_path / "lake", **proxy_env(upstream.url, KEY, "t", CLAW_TOKENIZER=str(model_dir))
        ) as gateway,
    ):
        key = f"k-{uuid.uuid4().hex}"
        answer = httpx.post(
            gateway.url + "/v1/chat/completions",
            json={"model": "plain", "messages": MESSAGES},
            headers={"Authorization": f"Bearer {KEY}", "Idempotency-Key": key},
            timeout=10,
        )
        assert answer.status_code == 200, answer.text
        row = wait_landed(gateway.lake, [key]).row(0, named=True)
    chat = load_chat_tokenizer(str(model_dir))
    reply = openai_answer()["choices"][0]["message"]["content"]
    assert row["token_source"] == "local"
    assert row["prompt_ids"] == chat.encode(chat.render(MESSAGES))
    assert row["response_ids"] == chat.encode(f"{reply}<|im_end|>")  # what follows the prompt


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
    assert f"CLAW_TOKENIZER: {bare}/tokenizer_config.json: has no chat_template" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1
