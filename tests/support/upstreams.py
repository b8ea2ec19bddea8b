"""Upstreams for proxy tests: `claw sim-llm` as a real process, a scripted misbehaving server
(timeouts, 5xx, 4xx, no token ids) on a loopback port, and `transformers serve`
(`claw_pipelines.app.processes.TransformersServe`: the launcher starts it for `claw demo
--learn`)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx

from gateway.proxy.capture_mode import PROBE_MODEL
from tests.support.servers import REPO, free_port, wait_until

# the calculator tool of the sim-llm tests, in the chat completions shape
CALCULATOR = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression.",
        "parameters": {
            "type": "object",
            "properties": {
                "expression": {"type": "string"},
                "precision": {"type": "integer"},
                "exact": {"type": "boolean"},
                "unit": {"type": "string", "enum": ["none", "cm"]},
                "note": {"type": "string"},
            },
            "required": ["expression", "precision", "exact", "unit"],
        },
    },
}


def proxy_env(upstream_url: str, api_key: str, tenant: str, **extra: str) -> dict[str, str]:
    """Environment of a test gateway proxying to `upstream_url`, with one API key."""
    return {
        "CLAW_UPSTREAM_URL": upstream_url,
        "CLAW_API_KEYS": f"{api_key}={tenant}",
        "CLAW_FLUSH_INTERVAL_MS": "50",
        **extra,
    }


class SimProcess:
    """`claw sim-llm` as a subprocess; can be killed and started again on the same port."""

    def __init__(
        self,
        log_dir: Path,
        latency_ms: float = 0.0,
        port: int | None = None,
        drift: float = 0.0,
        token_ids: bool = True,
    ) -> None:
        self.port = port or free_port()
        self.latency_ms = latency_ms
        self.drift = drift
        self.token_ids = token_ids
        self.url = f"http://127.0.0.1:{self.port}/v1"
        self.log_path = log_dir / f"sim-{self.port}.log"
        self.proc: subprocess.Popen | None = None

    def start(self) -> SimProcess:
        """Start and wait until /health answers."""
        command = [
            sys.executable,
            "-m",
            "claw_pipelines.app.cli",
            "sim-llm",
            "--port",
            str(self.port),
        ]
        command += ["--latency-ms", str(self.latency_ms), "--drift", str(self.drift)]
        if not self.token_ids:
            command.append("--no-token-ids")
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)

        def up() -> bool:
            if self.proc.poll() is not None:
                raise RuntimeError(f"sim-llm exited: {self.log_path.read_text()[-2000:]}")
            try:
                return httpx.get(self.url.removesuffix("/v1") + "/health", timeout=1).is_success
            except httpx.HTTPError:
                return False

        wait_until(up, 30, what="sim-llm")
        return self

    def kill(self) -> None:
        """SIGKILL."""
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        """SIGTERM and wait."""
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)

    def __enter__(self) -> SimProcess:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def openai_answer(
    content: str = "Hello from the scripted upstream.", usage: tuple[int, int] | None = None
) -> dict:
    """A chat completion the way a server without vLLM extensions answers (no token ids);
    `usage`: the (prompt, completion) token counts it reports, if any."""
    answer = {
        "id": "chatcmpl-scripted",
        "object": "chat.completion",
        "created": 1,
        "model": "scripted",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": content},
                "logprobs": None,
                "finish_reason": "stop",
            }
        ],
    }
    if usage is not None:
        prompt, completion = usage
        answer["usage"] = {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
        }
    return answer


# error bodies of servers that do not speak OpenAI's error envelope, by the `model` asking
FOREIGN_ERRORS = {
    "detail": (
        400,
        "application/json",
        b"{\"detail\": \"Server is pinned to 'm'; requested 'detail'.\"}",
    ),
    "detail-list": (
        422,
        "application/json",
        b'{"detail": [{"loc": ["body", "max_tokens"], "msg": "Input should be a valid integer"}]}',
    ),
    "flat": (
        400,
        "application/json",
        b'{"object": "error", "message": "prompt is too long", "type": "BadRequestError", '
        b'"code": 400}',
    ),
    "text": (404, "text/plain", b"Not Found"),
    "html": (
        403,
        "text/html",
        b"<html><head><title>403 Forbidden</title></head><body><h1>403</h1></body></html>",
    ),
}


class ScriptedUpstream:
    """An OpenAI-shaped server whose behaviour is chosen by the request's `model`: `hang`
    never answers in time, `boom` answers 500, `bad` answers 400, `busy` answers 429 with
    Retry-After, `strict` refuses vLLM's `return_token_ids` like OpenAI does, the names of
    FOREIGN_ERRORS answer those bodies; anything else answers without token ids, reporting
    `usage` (prompt, completion) when given. `probe_status`: the status the gateway's
    start-up test call gets (its model `claw-probe`) instead, so it cannot tell."""

    def __init__(
        self, usage: tuple[int, int] | None = None, port: int = 0, probe_status: int | None = None
    ) -> None:
        self.requests: list[dict] = []
        self.release = threading.Event()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:  # quiet
                pass

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                outer.requests.append({"body": body, "headers": dict(self.headers)})
                model = body.get("model")
                if model == PROBE_MODEL and probe_status is not None:
                    return self._send(probe_status, {"error": {"message": "not now"}})
                if model == "hang":
                    outer.release.wait(10)
                    return self._send(200, openai_answer(usage=usage))
                if model == "boom":
                    return self._send(500, {"error": {"message": "the GPU caught fire"}})
                if model == "busy":
                    error = {"message": "slow down", "type": "rate_limit_error"}
                    return self._send(429, {"error": error}, {"Retry-After": "7"})
                if model == "bad" or (model == "strict" and "return_token_ids" in body):
                    message = "Unrecognized request argument supplied: return_token_ids"
                    if model == "bad":
                        message = "model 'bad' does not exist"
                    error = {"message": message, "type": "invalid_request_error"}
                    return self._send(400, {"error": error})
                if model in FOREIGN_ERRORS:
                    return self._send_raw(*FOREIGN_ERRORS[model])
                return self._send(200, openai_answer(usage=usage))

            def _send_raw(self, status: int, content_type: str, data: bytes) -> None:
                self.send_response(status)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _send(self, status: int, payload: dict, headers: dict | None = None) -> None:
                data = json.dumps(payload).encode()
                self.send_response(status)
                for name, value in (headers or {}).items():
                    self.send_header(name, value)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> ScriptedUpstream:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.release.set()
        time.sleep(0.05)
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(5)
