"""A local S3-compatible server for tests (moto, which enforces If-None-Match / If-Match),
and a proxy in front of it that drops those headers: a store that ignores conditional
writes, as a misconfigured gateway or an old S3-compatible server would be, or one that
honours them only for puts that do not race (it checks, then writes). SeaweedFS too, open to
anyone or with an identities file (`-s3.config`), and S3 requests signed with any key (or
none) to find out what a store lets a caller do (`signed_s3_request`)."""

from __future__ import annotations

import re
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import quote, urlencode

import httpx
from botocore.auth import S3SigV4Auth
from botocore.awsrequest import AWSRequest
from botocore.credentials import Credentials

from tests.support.servers import free_port, wait_until

CONDITIONAL_HEADERS = ("if-none-match", "if-match")


def s3_options(url: str) -> dict[str, str]:
    """delta-rs storage options for a local S3-compatible server at `url`."""
    return {
        "AWS_ENDPOINT_URL": url,
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_REGION": "us-east-1",
        "AWS_ALLOW_HTTP": "true",
    }


def signed_s3_response(
    url: str,
    method: str,
    path: str,
    access_key: str | None = None,
    secret_key: str | None = None,
    body: bytes = b"",
    params: Mapping[str, str] | None = None,
    headers: Mapping[str, str] | None = None,
    region: str = "us-east-1",
) -> httpx.Response:
    """One S3 request to the server at `url` (e.g. http://127.0.0.1:8333): `method` on `path`
    ("/bucket", "/bucket/key"; the query in `params`, e.g. {"list-type": "2", "prefix":
    "lake/"}), signed with SigV4 as an S3 client signs it (botocore's S3SigV4Auth, which sends
    x-amz-content-sha256: plain SigV4Auth is refused on bodies), or unsigned (anonymous) when
    `access_key` is None. The query is sent exactly as it was signed (percent-encoded)."""
    query = urlencode(sorted((params or {}).items()), quote_via=quote, safe="-_.~")
    target = url.rstrip("/") + quote(path, safe="/-_.~") + (f"?{query}" if query else "")
    request = AWSRequest(method=method, url=target, data=body, headers=dict(headers or {}))
    if access_key is not None:
        credentials = Credentials(access_key, secret_key or "")
        S3SigV4Auth(credentials, "s3", region).add_auth(request)
    prepared = request.prepare()
    with httpx.Client(timeout=30) as client:
        sent = client.build_request(method, target, headers=dict(prepared.headers), content=body)
        return client.send(sent)


def signed_s3_request(
    url: str,
    method: str,
    path: str,
    access_key: str | None = None,
    secret_key: str | None = None,
    body: bytes = b"",
    params: Mapping[str, str] | None = None,
) -> int:
    """The HTTP status of `signed_s3_response(...)`: e.g. 200/204 let in, 403 refused. A
    multi-object delete (`POST /bucket?delete`) answers 200 even when every key was refused:
    read its body (`s3_error_codes`) for that one."""
    return signed_s3_response(url, method, path, access_key, secret_key, body, params).status_code


def s3_error_codes(response: httpx.Response) -> list[str]:
    """The <Code> elements of an S3 answer's XML body (e.g. ["AccessDenied"])."""
    return re.findall(r"<Code>([^<]+)</Code>", response.text)


def _answers(url: str) -> bool:
    try:
        httpx.get(url, timeout=1)
        return True
    except httpx.HTTPError:
        return False


@contextmanager
def moto_server(bucket: str = "claw-lake") -> Iterator[str]:
    """moto's S3 server on a free loopback port with one bucket; yields its URL."""
    moto = shutil.which("moto_server", path=str(Path(sys.executable).parent))
    port = free_port()
    proc = subprocess.Popen(
        [moto, "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: _answers(url), 30, what="moto server")
        httpx.put(f"{url}/{bucket}").raise_for_status()
        yield url
    finally:
        proc.terminate()
        proc.wait(10)


PRECONDITION_FAILED = (
    b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>PreconditionFailed</Code>'
    b"<Message>At least one of the pre-conditions you specified did not hold</Message></Error>"
)


@contextmanager
def header_dropping_proxy(target: str, check_then_put_s: float | None = None) -> Iterator[str]:
    """A proxy to `target` that forwards every request without its conditional headers.

    With `check_then_put_s`, an `If-None-Match: *` put is answered as a store that checks and
    writes in two steps would (seaweedfs#8800): 412 when the key exists, else the put goes on
    unconditionally `check_then_put_s` seconds later. One put after another is refused
    correctly; two racing puts both succeed."""
    client = httpx.Client(base_url=target, timeout=30)

    class Forward(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args) -> None:  # quiet
            pass

        def _answer(self, status: int, headers, content: bytes) -> None:
            self.send_response(status)
            for key, value in headers:
                if key.lower() not in ("content-length", "transfer-encoding", "connection"):
                    self.send_header(key, value)
            self.send_header("Content-Length", str(len(content)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(content)

        def _forward(self) -> None:
            length = int(self.headers.get("content-length") or 0)
            body = self.rfile.read(length) if length else b""
            headers = {
                k: v
                for k, v in self.headers.items()
                if k.lower() not in (*CONDITIONAL_HEADERS, "host", "content-length")
            }
            if (
                check_then_put_s is not None
                and self.command == "PUT"
                and self.headers.get("if-none-match") == "*"
            ):
                bucket, _, key = self.path.split("?", 1)[0].lstrip("/").partition("/")
                listed = client.get(f"/{bucket}", params={"list-type": "2", "prefix": key})
                if f"<Key>{key}</Key>" in listed.text:
                    self._answer(412, [("Content-Type", "application/xml")], PRECONDITION_FAILED)
                    return
                time.sleep(check_then_put_s)
            answer = client.request(self.command, self.path, content=body, headers=headers)
            self._answer(answer.status_code, answer.headers.items(), answer.content)

        do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _forward

    server = ThreadingHTTPServer(("127.0.0.1", 0), Forward)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        client.close()


def _free_pair() -> int:
    """A loopback port p with p + 10000 free too (SeaweedFS puts gRPC there)."""
    for _ in range(100):
        port = free_port()
        if port + 10000 > 65535:
            continue
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port + 10000))
            except OSError:
                continue
        return port
    raise RuntimeError("no free port pair")


def seaweed_ports(count: int) -> list[int]:
    """`count` loopback ports for SeaweedFS's listeners, each p with p + 10000 free (its gRPC
    port) and no two adjacent or 10000 apart."""
    ports: list[int] = []
    while len(ports) < count:
        port = _free_pair()
        if all(abs(port - p) > 1 and port != p + 10000 and p != port + 10000 for p in ports):
            ports.append(port)
    return ports


@contextmanager
def seaweed_server(root: Path, bucket: str = "claw-lake") -> Iterator[str]:
    """SeaweedFS (`weed server -s3`, master, volume and filer in one process) on loopback
    ports, data under `root`, with one bucket; yields its S3 URL. It enforces If-None-Match
    and commits ~4x faster than moto."""
    weed = shutil.which("weed", path=str(Path(sys.executable).parent))
    s3, master, volume, filer = seaweed_ports(4)
    (root / "data").mkdir(parents=True, exist_ok=True)
    log = (root / "weed.log").open("ab")
    proc = subprocess.Popen(
        [
            weed,
            "server",
            "-ip=127.0.0.1",
            "-ip.bind=127.0.0.1",
            f"-dir={root / 'data'}",
            "-s3",
            f"-s3.port={s3}",
            "-s3.port.iceberg=0",  # extra listeners on fixed ports: off
            "-s3.port.lance=0",
            f"-master.port={master}",
            f"-volume.port={volume}",
            f"-filer.port={filer}",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{s3}"

    def bucket_made() -> bool:
        if proc.poll() is not None:
            raise RuntimeError(f"weed exited: {(root / 'weed.log').read_text()[-1500:]}")
        try:
            return httpx.put(f"{url}/{bucket}", timeout=2).status_code in (200, 409)
        except httpx.HTTPError:
            return False

    try:
        wait_until(bucket_made, 60, interval=0.3, what="SeaweedFS S3")
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:  # it waits for its peers' shutdown: not needed here
            proc.kill()
            proc.wait(10)
        log.close()
