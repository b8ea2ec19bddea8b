"""Benchmark: how many attempts get into a deployment of `deploy/compose.yaml`, tried as a
stranger on its network and as another tenant would.

Starts the compose file's services as local processes (tests/support/compose_local.py: the
one-shot that mints the lake's S3 identities, SeaweedFS with them, the bucket, three gateways,
the materializer, Dagster's code location, webservers and daemon, the dashboard), with a keys
file of two tenants (acme, globex) and an admin. Carries traffic with the components' own
credentials: each tenant's agent sends chat turns through a gateway with its key, each tenant
owns a curation spec, and the run waits until both tenants' steps are in their gold datasets.
Then counts the attempts that got in:

- S3, unsigned and with a wrong key: create a bucket, list, get, put, delete; on the lake's
  bucket and on a new one (a 2xx is "got in");
- every dashboard page opened without a login, in headless Chromium (got in: any step,
  trajectory or dataset of either tenant in the page or in a websocket message);
- cross-tenant reads through every surface: the gateway (another tenant's
  `previous_response_id`; a stranger's chat call and `/metrics`), `open_dataset` and
  `next_batch`, `claw export` and `claw ledger`, and the dashboard logged in as globex (got in:
  any acme step or dataset on any page);
- Dagster: every published Dagster port bound beyond loopback in the compose file as shipped,
  and mutations (launch a run, wipe an asset, stop the sensors) on the read-only webserver.

Baseline, in the same run: the same S3 attempts against SeaweedFS as compose shipped it before
(`server -s3` without identities), which lets them in; ratio = got in here / got in there.
Target: 0 of at least 25 attempts got in, and the components still carry traffic (both
tenants' chat turns reach their gold datasets). Prints one JSON line.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import openai

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.harness import emit  # noqa: E402
from claw_pipelines.contracts.access import create_key, is_loopback  # noqa: E402
from claw_pipelines.contracts.specs import CurationSpec  # noqa: E402
from claw_pipelines.contracts.tables import gold_dataset_table  # noqa: E402
from claw_pipelines.lake.delta import Lake  # noqa: E402
from claw_pipelines.lake.specs import save_spec  # noqa: E402
from tests.support.browser import PAGES, chromium  # noqa: E402
from tests.support.compose_local import COMPOSE, LocalCompose, load_compose  # noqa: E402
from tests.support.dagster_ui import REFUSED, repository, try_mutations  # noqa: E402
from tests.support.ingest import chat_trajectory  # noqa: E402
from tests.support.s3 import seaweed_server, signed_s3_request  # noqa: E402
from tests.support.servers import wait_until  # noqa: E402

MIN_ATTEMPTS = 25
REWARDS = ["final", "missing", "pending"]
MODEL = "claw-sim-llm"
TENANTS = ("acme", "globex")
BUCKET, ROOT = "claw-lake", "lake"
URI = f"s3://{BUCKET}/{ROOT}"
NEW_BUCKET = "intruder-bucket"
WRONG_KEY = ("AKIAINTRUDER00000000", "not-the-secret-of-anyone-here")


@dataclass
class Tally:
    """Every attempt, whether it got in, and what was seen."""

    attempts: list[dict] = field(default_factory=list)

    def attempt(self, surface: str, what: str, got_in: bool, seen: object = None) -> None:
        self.attempts.append({"surface": surface, "what": what, "got_in": bool(got_in)})
        mark = "GOT IN" if got_in else "refused"
        print(f"  {surface:<10} {what:<60} {mark} ({seen})", file=sys.stderr, flush=True)

    def by_surface(self) -> dict[str, dict[str, int]]:
        out: dict[str, dict[str, int]] = {}
        for a in self.attempts:
            row = out.setdefault(a["surface"], {"attempts": 0, "got_in": 0})
            row["attempts"] += 1
            row["got_in"] += a["got_in"]
        return out

    @property
    def got_in(self) -> int:
        return sum(a["got_in"] for a in self.attempts)


# -- S3 ------------------------------------------------------------------------------------


def s3_attempts(url: str, tally: Tally, surface: str = "s3") -> None:
    """Unsigned and wrong-key create/list/get/put/delete on the lake's bucket and a new one."""
    existing = f"/{BUCKET}/{ROOT}/bronze/events/_delta_log/00000000000000000000.json"
    for who, key in (("anonymous", (None, None)), ("wrong key", WRONG_KEY)):
        for bucket, target in ((BUCKET, existing), (NEW_BUCKET, f"/{NEW_BUCKET}/x.json")):
            tries = {  # op: (method, path, query, body)
                "create bucket": ("PUT", f"/{bucket}", None, b""),
                "list": ("GET", f"/{bucket}", {"list-type": "2", "prefix": ""}, b""),
                "get": ("GET", target, None, b""),
                "put": ("PUT", f"/{bucket}/{ROOT}/intruder.txt", None, b"x"),
                "delete": ("DELETE", target, None, b""),
            }
            for op, (method, path, query, body) in tries.items():
                status = signed_s3_request(url, method, path, *key, body=body, params=query)
                got_in = 200 <= status < 300
                tally.attempt(surface, f"{who}: {op} on {bucket}", got_in, status)


def open_store_baseline(workdir: Path) -> Tally:
    """The same S3 attempts on SeaweedFS without identities (as compose shipped it before),
    with one seeded object where the lake's first bronze commit would be."""
    baseline = Tally()
    with seaweed_server(workdir / "open-seaweed", bucket=BUCKET) as url:
        seed = f"/{BUCKET}/{ROOT}/bronze/events/_delta_log/00000000000000000000.json"
        signed_s3_request(url, "PUT", seed, "any", "any", body=b"{}")
        s3_attempts(url, baseline, "s3-open")
    return baseline


# -- traffic with the components' own credentials --------------------------------------------


def in_gold(reader: Lake, dataset: str, trajectory: str) -> bool:
    try:
        rows = reader.read(gold_dataset_table(dataset), columns=["trajectory_uid"])
    except Exception:  # not built yet
        return False
    return trajectory in set(rows["trajectory_uid"])


# -- cross-tenant and dashboard --------------------------------------------------------------


def trainer_env(stack: LocalCompose, keys_file: Path, key: str) -> dict[str, str]:
    """A trainer's (or an export's) environment on the host: the lake with the trainer's S3
    identity, the deployment's keys file, and its own API key."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("CLAW_")}
    return env | {
        "CLAW_LAKE_URI": URI,
        "CLAW_STORAGE_OPTIONS": json.dumps(stack.storage_options("trainer")),
        "CLAW_API_KEYS_FILE": str(keys_file),
        "CLAW_API_KEY": key,
        "PYTHONPATH": str(REPO),
    }


def claw(env: dict[str, str], *argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "claw_pipelines.app.cli", *argv],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
        cwd=REPO,
    )


def dataset_refused(env: dict[str, str], code: str) -> tuple[bool, str]:
    """Run `code` (a trainer's use of the consume API) in a process with `env`: whether it got
    in (no `Forbidden`), and the one line it said."""
    program = (
        "import sys\nfrom claw_pipelines.consume import open_dataset\n"
        "from claw_pipelines.contracts.errors import Forbidden\n"
        f"try:\n    {code}\nexcept Forbidden as exc:\n    print('refused:', exc); sys.exit(3)\n"
        "print('got in')\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", program], env=env, capture_output=True, text=True, timeout=180
    )
    said = (done.stdout + done.stderr).strip().splitlines()
    return done.returncode != 3, said[-1] if said else ""


def dashboard_leaks(
    stack: LocalCompose,
    tally: Tally,
    secrets: dict[str, list[str]],
    key: str | None = None,
    own: str | None = None,
) -> bool | None:
    """Every dashboard page, logged out (key None) or logged in with `key`: an attempt per page,
    got in when any of `secrets` (the strings of the tenant(s) this session must not see)
    reached the page's text or a websocket message. Logged in: whether `own` (a string of the
    session's own tenant) reached it (the control that the check can see data at all)."""
    url = stack.services["dashboard"].url()
    who = "no login" if key is None else "logged in as globex"
    forbidden = [s for strings in secrets.values() for s in strings]
    with chromium() as launched, launched.tab(url) as tab:
        for page in PAGES:
            if key is None:  # each page loaded fresh, a new session: the login page instead
                tab.page.goto(f"{url}/{PAGES[page]}")
                tab.wait("Log in")
            else:  # one session: logged in once, then each page by its sidebar link
                if page == next(iter(PAGES)):
                    tab.page.goto(f"{url}/{PAGES[page]}")
                    tab.wait("Log in")
                    tab.log_in_with_key(key)
                    tab.wait(page)
                else:
                    tab.open(page)
            time.sleep(1.0)  # the page's last messages
            text = tab.text()
            leaked = [s for s in forbidden if s in text or tab.was_sent(s)]
            tally.attempt("dashboard", f"{who}: page {page}", bool(leaked), leaked or "nothing")
        return None if own is None else (own in tab.text() or tab.was_sent(own))


def dagster_attempts(stack: LocalCompose, tally: Tally) -> None:
    """Dagster's published ports as the compose file ships them, and mutations on the
    read-only webserver."""
    shipped = load_compose(COMPOSE, {})
    for name, spec in shipped["services"].items():
        if not name.startswith("dagster"):
            continue
        for port in spec.get("ports") or ():
            host = str(port).rsplit(":", 2)[0] if str(port).count(":") == 2 else "0.0.0.0"
            tally.attempt(
                "dagster", f"{name} port {port} reachable beyond loopback", not is_loopback(host)
            )
    readonly = next(s for s in stack.services.values() if "--read-only" in s.argv).url()
    for name, answer in try_mutations(readonly, repository(readonly)).items():
        tally.attempt("dagster", f"read-only webserver: {name}", answer != REFUSED, answer)


# -- the run -----------------------------------------------------------------------------------


def main() -> None:
    started = time.monotonic()
    workdir = Path(tempfile.mkdtemp(prefix="claw-exposure-"))
    keys = {t: create_key(t) for t in TENANTS}
    admin_key, admin_line = create_key("ops", admin=True)
    keys_file = workdir / "api-keys"
    keys_file.write_text("\n".join([line for _, line in keys.values()] + [admin_line]) + "\n")
    print("baseline: the same S3 attempts on an open SeaweedFS", file=sys.stderr)
    baseline = open_store_baseline(workdir)
    tally = Tally()
    figures: dict[str, object] = {}
    with LocalCompose(workdir / "compose", binds={"./api-keys": keys_file}) as stack:
        stack.up(timeout=300)
        for name in ("gateway-1", "gateway-2"):
            wait_until(lambda n=name: stack.answers(n, "/readyz"), 120, what=f"{name} ready")
        up_s = time.monotonic() - started
        operator = Lake(URI, stack.storage_options("materializer"))
        for tenant in TENANTS:
            spec = CurationSpec(name=f"{tenant}-train", tenant=tenant, reward_status=REWARDS)
            save_spec(operator, spec)
        trajectories = {t: f"{t}-traj-{uuid.uuid4().hex[:8]}" for t in TENANTS}
        gateways = {"acme": "gateway-1", "globex": "gateway-2"}
        traffic_started = time.monotonic()
        for tenant, trajectory in trajectories.items():
            chat_trajectory(stack.services[gateways[tenant]].url(), keys[tenant][0], trajectory)
        reader = Lake(URI, stack.storage_options("dashboard"))
        for tenant, trajectory in trajectories.items():
            wait_until(
                lambda t=tenant, j=trajectory: in_gold(reader, f"{t}-train", j),
                240,
                interval=1,
                what=f"{tenant}'s trajectory in gold",
            )
        figures["traffic"] = {
            "chat_turns_per_tenant": 2,
            "reached_gold": True,
            "seconds_to_gold": round(time.monotonic() - traffic_started, 1),
        }
        print("attempts:", file=sys.stderr)
        s3_attempts(stack.s3_url(), tally)

        gateway = stack.services["gateway-1"].url()
        acme_key, globex_key = keys["acme"][0], keys["globex"][0]
        with openai.OpenAI(base_url=gateway + "/v1", api_key=acme_key, max_retries=2) as agent:
            first = agent.responses.create(model=MODEL, input="acme's secret: 41 + 1?")
        stolen = httpx.post(
            gateway + "/v1/responses",
            json={"model": MODEL, "previous_response_id": first.id, "input": "go on"},
            headers={"Authorization": f"Bearer {globex_key}"},
            timeout=60,
        )
        tally.attempt("gateway", "globex continues acme's previous_response_id",
                      stolen.is_success, stolen.status_code)  # fmt: skip
        stranger = httpx.post(
            gateway + "/v1/chat/completions",
            json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]},
            timeout=60,
        )
        tally.attempt("gateway", "a chat call without a key", stranger.is_success,
                      stranger.status_code)  # fmt: skip
        metrics = httpx.get(gateway + "/metrics", timeout=30)
        tally.attempt("gateway", "/metrics without a key", metrics.is_success, metrics.status_code)

        globex_env = trainer_env(stack, keys_file, globex_key)
        for what, code in (
            ("open_dataset of acme's dataset", "open_dataset('acme-train').steps()"),
            (
                "next_batch of acme's dataset",
                "open_dataset('acme-train').next_batch(consumer='globex-run', timeout=30)",
            ),
            (
                "open_dataset with no key",
                "import os; os.environ.pop('CLAW_API_KEY'); open_dataset('acme-train').steps()",
            ),
        ):
            got_in, said = dataset_refused(globex_env, code)
            tally.attempt("dataset", f"globex: {what}", got_in, said)
        export = claw(globex_env, "export", "--dataset", "acme-train", "--policy-version", "1",
                      "--format", "jsonl", "--out", str(workdir / "stolen.jsonl"))  # fmt: skip
        tally.attempt("export", "globex: claw export of acme's dataset",
                      export.returncode == 0, export.stderr.strip()[:100])  # fmt: skip
        ledger = claw(globex_env, "ledger", "--dataset", "acme-train")
        tally.attempt("export", "globex: claw ledger of acme's dataset",
                      ledger.returncode == 0, ledger.stderr.strip()[:100])  # fmt: skip

        every = {t: [trajectories[t], f"{t}-train"] for t in TENANTS}
        dashboard_leaks(stack, tally, every)
        figures["dashboard_shows_globex_its_own"] = dashboard_leaks(
            stack, tally, {"acme": every["acme"]}, key=globex_key, own=f"{TENANTS[1]}-train"
        )
        dagster_attempts(stack, tally)

        # the admin still reads both tenants' data (the control that the reads above can see)
        admin_env = trainer_env(stack, keys_file, admin_key)
        ok, said = dataset_refused(admin_env, "print(open_dataset('acme-train').steps().height)")
        figures["admin_reads_acme"] = ok
        for name in ("gateway-1", "gateway-2", "materializer", "dashboard"):
            if not stack.services[name].running:
                raise SystemExit(f"{name} died: {stack.tail(name)}")
        stack.down(timeout=10)

    got_in, attempts = tally.got_in, len(tally.attempts)
    controls = figures["admin_reads_acme"] and figures["dashboard_shows_globex_its_own"]
    met = got_in == 0 and attempts >= MIN_ATTEMPTS and bool(controls)
    emit(
        "exposure",
        target=f"0 of at least {MIN_ATTEMPTS} attempts get in (S3 unsigned and wrong-key, "
        "dashboard without login, cross-tenant reads through the gateway, Dataset, exports and "
        "the dashboard, Dagster beyond loopback and mutations on the read-only webserver), "
        "while both tenants' chat turns reach their gold datasets",
        targets={"got_in": 0, "attempts_at_least": MIN_ATTEMPTS},
        target_met=met,
        baseline={
            "open_seaweedfs_s3_got_in": baseline.got_in,
            "open_seaweedfs_s3_attempts": len(baseline.attempts),
        },
        ratio=round(tally.by_surface()["s3"]["got_in"] / max(1, baseline.got_in), 3),
        attempts=attempts,
        got_in=got_in,
        by_surface=tally.by_surface(),
        refused_examples=[a["what"] for a in tally.attempts[:3]],
        stack_up_s=round(up_s, 1),
        wall_s=round(time.monotonic() - started, 1),
        **figures,
    )


if __name__ == "__main__":
    main()
