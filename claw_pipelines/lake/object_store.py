"""The object store under a remote lake: the same storage options for every scheme we accept
(`s3://`, `gs://`, `az://` and their aliases), a check that the store enforces the
conditional writes Delta commits rely on, and small files (curation specs) beside the tables.

delta-rs 1.x commits a table version as one put of `_delta_log/<version>.json` with
`If-None-Match: *` (S3, Azure; a generation precondition on GCS): of two writers racing for a
version, the store must refuse the second. A store (or a proxy in front of it) that ignores
the condition lets both succeed and one commit is lost without any error, so a writer probes
the store once per process and refuses to write when it fails: a second conditional put of
the same key must be refused, and of two conditional puts of one fresh key racing each other
exactly one must succeed (a store may check existence and write in two steps, which only
concurrent puts catch: seaweedfs#8800). A store that refuses the probe's credentials is named
in the same one line: the access key, the lake, the store's answer (e.g. 403 AccessDenied),
and an S3-compatible endpoint given without a key pair is refused before any request (the
client would otherwise go looking for cloud credentials).
"""

from __future__ import annotations

import logging
import os
import re
import threading
import uuid
from collections.abc import Mapping
from functools import lru_cache

import obstore
from obstore.exceptions import AlreadyExistsError, NotFoundError
from obstore.store import from_url

from claw_pipelines.contracts.errors import UnsafeStore
from claw_pipelines.settings import REMOTE_SCHEMES, unsafe_storage_option

log = logging.getLogger(__name__)
PROBE_PREFIX = "_claw/conditional-put-probe"
# object_store's HTTP client settings (given as `AWS_ALLOW_HTTP` etc. to delta-rs)
_CLIENT_OPTIONS = {
    "allow_http",
    "allow_invalid_certificates",
    "connect_timeout",
    "default_content_type",
    "http1_only",
    "http2_only",
    "pool_idle_timeout",
    "pool_max_idle_per_host",
    "proxy_url",
    "timeout",
    "user_agent",
}
_PREFIXES = ("aws_", "google_", "azure_")
RACERS = 2  # conditional puts of one key raced against each other by the probe
_USE_INSTEAD = (
    "use a store that does: AWS S3, GCS, Azure, MinIO, SeaweedFS after 3.96, moto; not "
    "through a proxy that drops the header"
)
_verified: set[tuple[str, frozenset[tuple[str, str]]]] = set()
_verified_lock = threading.Lock()


def _split_options(options: Mapping[str, str]) -> tuple[dict[str, str], dict[str, str]]:
    """delta-rs storage options as object_store's (config, client options)."""
    config, client = {}, {}
    for key, value in options.items():
        lowered = key.lower()
        bare = next((lowered[len(p) :] for p in _PREFIXES if lowered.startswith(p)), lowered)
        if bare in _CLIENT_OPTIONS:
            client[bare] = value
        else:
            config[lowered] = value
    return config, client


def open_store(uri: str, options: Mapping[str, str]):
    """An object store rooted at `uri` (a remote lake), configured like delta-rs (one per
    lake and options: its client and connections are reused)."""
    return _store(uri, frozenset(options.items()))


@lru_cache(maxsize=32)
def _store(uri: str, options: frozenset[tuple[str, str]]):
    config, client = _split_options(dict(options))
    if uri.startswith("gcs://"):  # delta-rs's alias; object_store knows it as gs://
        uri = "gs://" + uri.removeprefix("gcs://")
    return from_url(uri, config=config or None, client_options=client or None)


def refuse_unsafe_options(options: Mapping[str, str]) -> None:
    """UnsafeStore naming the first storage option that would allow lost commits."""
    problem = unsafe_storage_option(options)
    if problem is not None:
        raise UnsafeStore(f"CLAW_STORAGE_OPTIONS: {problem}")


def _option(options: Mapping[str, str], name: str) -> str | None:
    """A storage option by its AWS_ name, in any case, with or without the prefix."""
    wanted = {name.lower(), name.lower().removeprefix("aws_")}
    return next((v for k, v in options.items() if k.lower() in wanted and v), None)


def refuse_missing_credentials(uri: str, options: Mapping[str, str]) -> None:
    """UnsafeStore when an s3 lake on an S3-compatible endpoint (AWS_ENDPOINT_URL) has no key
    pair, in its options or the environment: the client would look for cloud credentials
    (instance metadata) instead, and retry."""
    if not uri.startswith(("s3://", "s3a://")):
        return
    endpoint = _option(options, "AWS_ENDPOINT_URL") or _option(options, "AWS_ENDPOINT")
    if endpoint is None or _option(options, "AWS_SKIP_SIGNATURE") == "true":
        return
    missing = [
        name
        for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")
        if not (_option(options, name) or os.environ.get(name))
    ]
    if missing:
        raise UnsafeStore(
            f"{uri}: no {' or '.join(missing)} for the store at {endpoint} (give the "
            "component's key pair in CLAW_STORAGE_OPTIONS or CLAW_STORAGE_OPTIONS_FILE)"
        )


def _refusal(uri: str, options: Mapping[str, str], exc: BaseException) -> str | None:
    """One line for a store that answered the probe with a refusal (4xx): which key, which
    lake, what the store said; None for any other failure."""
    text = str(exc)
    status = re.search(r"status code: (4\d\d)", text)
    if status is None:
        return None
    code = re.search(r"<Code>([^<]+)</Code>", text)
    answer = f"{status[1]} {code[1] if code else 'refused'}"
    if code is not None and code[1] == "NoSuchBucket":
        return f"{uri}: the store has no such bucket ({answer}): create it first"
    key = _option(options, "AWS_ACCESS_KEY_ID") or os.environ.get("AWS_ACCESS_KEY_ID")
    who = f"access key {key}" if key else "the environment's credentials"
    return (
        f"{uri}: the store refused {who} ({answer} on a put under "
        f"{PROBE_PREFIX.split('/')[0]}/): this component's credentials (CLAW_STORAGE_OPTIONS, "
        "CLAW_STORAGE_OPTIONS_FILE) are wrong or not allowed to write the lake"
    )


def check_conditional_put(uri: str, options: Mapping[str, str]) -> None:
    """Put a probe object twice, both times only-if-absent: the second must be refused; then
    race two only-if-absent puts of another fresh key: exactly one may succeed (UnsafeStore
    otherwise, or when the store cannot be written at all)."""
    refuse_missing_credentials(uri, options)
    store = open_store(uri, options)
    _check_sequential_puts(store, uri, options)
    _check_racing_puts(store, uri)


def _probe_key() -> str:
    return f"{PROBE_PREFIX}-{uuid.uuid4().hex}"


def _delete_probe(store, uri: str, key: str) -> None:
    try:
        obstore.delete(store, key)
    except Exception as exc:  # a leftover probe object is harmless
        log.warning("could not delete the probe %s/%s: %s", uri, key, _first_line(exc))


def _check_sequential_puts(store, uri: str, options: Mapping[str, str] | None = None) -> None:
    key = _probe_key()
    try:
        obstore.put(store, key, b"first", mode="create")
    except Exception as exc:
        why = _refusal(uri, options or {}, exc)
        why = why or f"{uri}: cannot write to the lake's store: {_first_line(exc)}"
        raise UnsafeStore(why) from None
    try:
        obstore.put(store, key, b"second", mode="create")
    except AlreadyExistsError:
        return
    except Exception as exc:
        raise UnsafeStore(
            f"{uri}: the store's answer to a conditional put is not a refusal: {_first_line(exc)}"
        ) from None
    finally:
        _delete_probe(store, uri, key)
    raise UnsafeStore(
        f"{uri}: the store accepted a second If-None-Match put of the same key: it does not "
        "enforce conditional writes, so concurrent Delta commits would be lost silently "
        f"({_USE_INSTEAD})"
    )


def _check_racing_puts(store, uri: str) -> None:
    """Two threads put one fresh key only-if-absent at the same moment (a barrier)."""
    key = _probe_key()
    barrier = threading.Barrier(RACERS)
    outcomes: list[bool | BaseException | None] = [None] * RACERS

    def racer(index: int) -> None:
        try:
            barrier.wait(timeout=30)
            obstore.put(store, key, f"racer {index}".encode(), mode="create")
            outcomes[index] = True
        except AlreadyExistsError:
            outcomes[index] = False
        except BaseException as exc:  # reported below, in this thread
            outcomes[index] = exc

    threads = [threading.Thread(target=racer, args=(i,), daemon=True) for i in range(RACERS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    _delete_probe(store, uri, key)
    failed = [o for o in outcomes if isinstance(o, BaseException)]
    if failed:
        raise UnsafeStore(
            f"{uri}: a conditional put racing another failed: {_first_line(failed[0])}"
        )
    won = outcomes.count(True)
    if won != 1:
        raise UnsafeStore(
            f"{uri}: of {RACERS} concurrent If-None-Match puts of one new key, {won} succeeded "
            "(exactly one must): the store does not enforce conditional writes under "
            f"concurrency, so racing Delta commits would be lost silently ({_USE_INSTEAD})"
        )


def verify_lake_store(uri: str, options: Mapping[str, str]) -> None:
    """Once per process and lake: refuse unsafe options and stores that ignore conditional
    writes (local lakes need nothing: delta-rs commits with an atomic rename there)."""
    if not uri.startswith(REMOTE_SCHEMES):
        return
    key = (uri, frozenset(options.items()))
    with _verified_lock:
        if key in _verified:
            return
        refuse_unsafe_options(options)
        check_conditional_put(uri, options)
        _verified.add(key)


def write_bytes(uri: str, options: Mapping[str, str], path: str, data: bytes) -> None:
    """Write one object under `uri`."""
    obstore.put(open_store(uri, options), path, data)


def read_bytes(uri: str, options: Mapping[str, str], path: str) -> bytes | None:
    """One object under `uri`, or None when it does not exist."""
    try:
        return obstore.get(open_store(uri, options), path).bytes().to_bytes()
    except (NotFoundError, FileNotFoundError):
        return None


def list_names(uri: str, options: Mapping[str, str], folder: str) -> list[str]:
    """Names of the objects directly in `folder` under `uri`."""
    listing = obstore.list_with_delimiter(open_store(uri, options), folder.rstrip("/") + "/")
    return [entry["path"].rsplit("/", 1)[-1] for entry in listing["objects"]]


def list_folders(uri: str, options: Mapping[str, str], folder: str) -> list[str]:
    """Names of the folders (common prefixes) directly in `folder` under `uri`."""
    listing = obstore.list_with_delimiter(open_store(uri, options), folder.rstrip("/") + "/")
    return [prefix.rstrip("/").rsplit("/", 1)[-1] for prefix in listing["common_prefixes"]]


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
