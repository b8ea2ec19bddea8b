"""`claw`: the command line of the lakehouse (docs/DESIGN.md §9). Errors are one line, not a
traceback."""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from pathlib import Path

from pydantic import ValidationError

from claw_pipelines.contracts.errors import ClawError
from claw_pipelines.settings import ClawSettings


class CliError(ClawError):
    """An error to report to the user as one line."""


def _settings(args: argparse.Namespace) -> ClawSettings:
    return ClawSettings().with_overrides(lake_uri=getattr(args, "lake", None))


def _caller(args: argparse.Namespace, tenant: str | None = None):
    """Whose data this command may read: `CLAW_API_KEY` against the configured keys (local
    mode when none is configured), narrowed to `--tenant` (an admin key's scope)."""
    from claw_pipelines.contracts.access import caller_from_settings

    return caller_from_settings(_settings(args), tenant or getattr(args, "tenant", None))


def _cmd_gateway(args: argparse.Namespace) -> None:
    from claw_pipelines.lake.object_store import UnsafeStore
    from gateway.serve import GatewayRefused, serve_gateway

    try:
        serve_gateway(_settings(args), host=args.host, port=args.port)
    except (GatewayRefused, UnsafeStore) as exc:
        raise CliError(str(exc)) from None


def _cmd_sim_llm(args: argparse.Namespace) -> None:
    from claw_pipelines.simulation.llm import serve

    serve(args.host, args.port, args.seed, args.latency_ms, args.drift, not args.no_token_ids)


def _cmd_keys_create(args: argparse.Namespace) -> None:
    from claw_pipelines.contracts.access import create_key

    key, line = create_key(args.tenant, admin=args.admin)
    if args.file:
        with open(args.file, "a", encoding="utf-8") as handle:
            handle.write(line + "\n")
        role = " (admin: reads every tenant)" if args.admin else ""
        print(f"added tenant {args.tenant!r} to {args.file}{role}", file=sys.stderr)
    else:
        print(f"hash line for CLAW_API_KEYS_FILE: {line}", file=sys.stderr)
    print(key)


def _cmd_lake_secrets(args: argparse.Namespace) -> None:
    from claw_pipelines.lake.identities import create_bucket, write_lake_secrets

    settings = _settings(args)
    if args.create_bucket:
        done = create_bucket(settings.lake_uri, settings.storage_options)
        print(f"the bucket of {settings.lake_uri}: {done}", file=sys.stderr)
        return
    for component, minted in write_lake_secrets(Path(args.dir), settings.lake_uri).items():
        state = "a new key" if minted else "its key kept"
        print(f"{component}: {state} in {Path(args.dir) / component}", file=sys.stderr)


def _cmd_up(args: argparse.Namespace) -> None:
    from claw_pipelines.app.up import run_up

    run_up(
        _settings(args),
        host=args.host,
        port=args.port,
        dashboard_port=args.dashboard_port,
        dagster_port=args.dagster_port,
        demo_traffic=args.demo_traffic,
        materializers=args.materializers,
    )


def _cmd_demo(args: argparse.Namespace) -> None:
    if args.learn:
        from claw_pipelines.app.learn import LearnOptions, run_learn

        try:
            options = LearnOptions(seed=args.seed, max_versions=args.versions)
            run_learn(_settings(args), workdir=args.workdir, options=options)
        except ImportError as exc:
            raise CliError(
                f"claw demo --learn needs torch, transformers and accelerate ({exc.name} is "
                "missing): pip install 'claw-lakehouse[train]'"
            ) from None
        return
    from claw_pipelines.app.demo import run_demo

    run_demo(_settings(args), workdir=args.workdir, compact_every=args.compact_every)


def _cmd_materialize(args: argparse.Namespace) -> None:
    from claw_pipelines.app.materialize import follow, materialize

    if args.follow:
        import signal
        import threading

        stop = threading.Event()
        signal.signal(signal.SIGTERM, lambda *_: stop.set())
        try:
            follow(
                _settings(args),
                poll_s=args.poll_s,
                stop=stop,
                say=_say_now,
                datasets=args.dataset,
                shard=args.shard or _settings(args).resolved_shard,
            )
        except KeyboardInterrupt:
            stop.set()
        return

    if args.parallel is not None and args.parallel < 1:
        raise CliError(f"--parallel: give 1 or more processes, not {args.parallel}")
    if not args.create:
        _open_lake(args, hint="; --create makes one")
    try:
        report = materialize(
            _settings(args), args.select, args.dataset, args.policy_version, args.parallel
        )
    except LookupError as exc:
        raise CliError(str(exc)) from None
    for asset, meta in report.assets.items():
        fields = ("delta_version", "rows_written", "steps", "token_ratio")
        shown = ", ".join(f"{k}={meta[k]}" for k in fields if k in meta)
        print(f"materialized {asset}" + (f" ({shown})" if shown else ""))
    for check, passed in report.checks.items():
        note = f" ({report.notes[check]})" if check in report.notes else ""
        print(f"check {check}: {'passed' if passed else 'FAILED'}{note}")
    if not report.success:
        raise CliError("materialization failed: " + "\n  ".join(report.errors))


def _say_now(line: str) -> None:
    print(line, flush=True)


def _open_lake(args: argparse.Namespace, hint: str = ""):
    """The lake of `--lake` / `CLAW_LAKE_URI`; a local one must exist (readers never create)."""
    from claw_pipelines.lake.catalog import lake_exists
    from claw_pipelines.lake.delta import Lake

    settings = _settings(args)
    lake = Lake.from_settings(settings)
    if not lake_exists(lake):
        raise CliError(f"no lake at {lake.uri} (the directory does not exist{hint})")
    return lake


def _cmd_rescore(args: argparse.Namespace) -> None:
    from claw_pipelines.lake.specs import SpecError, load_spec
    from claw_pipelines.materialize.rescore import JudgeError, load_judge, rescore
    from claw_pipelines.materialize.silver import build_silver

    _caller(args).require_every_tenant("claw rescore")
    lake = _open_lake(args)
    try:
        judge = load_judge(args.judge, args.judge_version)
        spec = load_spec(lake, args.spec) if args.spec else None
        run = rescore(lake, judge, spec, full=args.full, tokenizer=args.tokenizer)
    except (JudgeError, SpecError, LookupError) as exc:
        raise CliError(str(exc)) from None
    print(
        f"judge {run.judge} v{run.version}: scored {run.scored} steps, {run.already_scored} "
        f"already scored, no opinion on {run.abstained} (of {run.candidates} "
        f"{'added since the last run' if run.incremental else 'in scope'}) in {run.seconds} s"
    )
    if run.scored and not args.no_silver:
        build_silver(lake)
        print("silver/feedback holds the new facts (a spec with reward_judge resolves them)")


def _cmd_check(args: argparse.Namespace) -> None:
    from claw_pipelines.ops.integrity import check_lake

    _caller(args).require_every_tenant("claw check")
    lake = _open_lake(args)
    problems = check_lake(lake)
    for problem in problems:
        print(problem)
    if problems and all(p.kind == "shards" for p in problems):
        raise CliError(
            f"{len(problems)} shard problem(s) in {lake.uri}: start their followers "
            "(`claw materialize --follow --shard i/N`); `claw shards` shows them"
        )
    if problems:
        raise CliError(f"{len(problems)} problem(s) in {lake.uri}; `claw repair` fixes them")
    print(f"{lake.uri}: no problem found (keys unique, watermark consistent, trees match)")


def _cmd_shards(args: argparse.Namespace) -> None:
    from claw_pipelines.lake.leases import ShardPlan
    from claw_pipelines.ops.shards import shard_statuses

    _caller(args).require_every_tenant("claw shards")
    lake = _open_lake(args)
    if args.count is not None:
        plan = ShardPlan.set(lake, args.count)
        was = "" if plan.previous is None else f" (was {plan.previous})"
        print(
            f"{lake.uri}: split {plan.count} way(s) from now on{was}; followers of another "
            "count stop, the new ones take over once their leases are gone"
        )
    plan = ShardPlan.read(lake)
    print(f"plan: {'not set' if plan is None else f'{plan.count} way(s) since {plan.set_at}'}")
    statuses = shard_statuses(lake)
    if not statuses:
        print("no shard has been followed yet (one follower: `claw materialize --follow`)")
        return
    for status in statuses:
        row = status.to_row()
        age = "" if row["lease age (s)"] is None else f", lease {row['lease age (s)']} s old"
        behind = row["behind (versions)"]
        print(
            f"shard {row['shard']}: {row['state']} by {row['owner'] or '-'} (token "
            f"{row['token']}{age}); silver at bronze v{row['silver at bronze']}, "
            f"{behind} version(s) behind"
            + (f"; PROBLEM: {status.problem}" if status.problem else "")
        )


def _cmd_repair(args: argparse.Namespace) -> None:
    from claw_pipelines.materialize.silver import SilverOptions
    from claw_pipelines.ops.integrity import repair_lake

    _caller(args).require_every_tenant("claw repair")
    lake = _open_lake(args)
    options = SilverOptions.from_settings(_settings(args))
    report = repair_lake(lake, options, progress=lambda line: print(line, file=sys.stderr))
    for problem in report.found:
        print(f"found {problem}")
    removed = ", ".join(f"{n} {what}" for what, n in report.silver_removed.items() if n)
    if removed:
        print(f"silver: removed {removed} (every acknowledged record kept once)")
    if report.bronze_reread:
        print("silver: read all of bronze again")
    if report.rebuilt:
        print(f"gold: rebuilt {len(report.rebuilt)} partition(s); lineage says why")
    if report.remaining:
        for problem in report.remaining:
            print(f"still wrong: {problem}")
        raise CliError(f"{len(report.remaining)} problem(s) could not be repaired")
    print("repaired: no problem left" if report.found else "nothing to repair")


def _cmd_policy_publish(args: argparse.Namespace) -> None:
    from claw_pipelines.lake.policy import publish_policy_version

    try:
        publish_policy_version(_open_lake(args), args.version, by=args.by, note=args.note)
    except ValueError as exc:
        raise CliError(str(exc)) from None
    print(f"published policy version {args.version}")


def _cmd_policy_show(args: argparse.Namespace) -> None:
    from claw_pipelines.lake.policy import published_versions

    versions = published_versions(_open_lake(args))
    if versions.is_empty():
        print("no policy version published yet")
    for row in versions.iter_rows(named=True):
        by = f" by {row['published_by']}" if row.get("published_by") else ""
        note = f": {row['note']}" if row.get("note") else ""
        print(f"v{row['policy_version']}  {row['published_at']:%Y-%m-%d %H:%M:%S}{by}{note}")


def _cmd_spec_list(args: argparse.Namespace) -> None:
    from claw_pipelines.contracts.specs import BUILTIN_SPECS
    from claw_pipelines.lake.specs import read_specs

    caller = _caller(args)
    shelf = read_specs(_open_lake(args))
    for name, spec in sorted(shelf.specs.items()):
        if caller.may_read(spec.tenant):
            owner = f"  tenant {spec.tenant}" if spec.tenant else ""
            print(f"{name}  {spec.spec_hash}  built{owner}  {spec.description}")
    if not caller.sees_every_tenant:  # the built-in specs curate every tenant's steps
        return
    for name in sorted(set(BUILTIN_SPECS) - set(shelf.specs) - set(shelf.errors)):
        print(
            f"{name}  {BUILTIN_SPECS[name].spec_hash}  built in, not added  "
            f"{BUILTIN_SPECS[name].description}"
        )
    for name, error in sorted(shelf.errors.items()):
        print(f"{name}  invalid: {error}")


def _cmd_spec_add(args: argparse.Namespace) -> None:
    from claw_pipelines.lake.specs import SpecError, add_builtin

    _caller(args).require_every_tenant("claw spec add (a built-in spec curates every tenant)")
    lake = _open_lake(args)
    try:
        spec = add_builtin(lake, args.name)
    except SpecError as exc:
        raise CliError(str(exc)) from None
    print(f"added {spec.name} (hash {spec.spec_hash}); `claw materialize` builds its dataset")


def _cmd_ledger(args: argparse.Namespace) -> None:
    import polars as pl

    from claw_pipelines.lake.catalog import dataset_tenants, gold_datasets
    from claw_pipelines.ops.ledger import waste_ledger

    caller = _caller(args)
    lake = _open_lake(args)
    every = gold_datasets(lake)
    known = gold_datasets(lake, caller)
    for name in args.dataset or []:
        if name in every and name not in known:
            caller.require(dataset_tenants(lake).get(name), f"dataset {name!r}")
    unknown = [name for name in args.dataset or [] if name not in known]
    if unknown:
        raise CliError(
            f"no gold dataset {unknown[0]!r} in {lake.uri} (datasets: {', '.join(known) or 'none'})"
        )
    ledger = waste_ledger(lake, args.dataset or known)
    if ledger.is_empty():
        print("no gold dataset yet: `claw materialize` builds them")
        return
    shown = ledger.with_columns(
        pl.col("reason").fill_null(""),
        pl.col("generation_s").round(2),
        pl.col("readmitted_by").list.join(","),
    )
    with pl.Config(tbl_rows=-1, tbl_cols=-1, tbl_width_chars=160, tbl_hide_dataframe_shape=True):
        print(shown)


def _cmd_dashboard(args: argparse.Namespace) -> None:
    import os

    import dashboards
    from dashboards.access import (
        LoginConfigError,
        UserMap,
        auth_section,
        bind_refusal,
        doors,
        secrets_files,
    )

    settings = _settings(args)
    try:  # a login that cannot work is refused here, in one line, before Streamlit starts
        found = doors(settings, auth_section(secrets_files(args.secrets)))
        UserMap.load(settings.dashboard_users_file)
    except (LoginConfigError, ValueError, OSError) as exc:
        raise CliError(str(exc)) from None
    if (why := bind_refusal(args.host, found)) is not None:
        raise CliError(why)
    app = Path(dashboards.__file__).parent / "streamlit_app.py"
    os.environ["CLAW_LAKE_URI"] = settings.lake_uri
    command = [sys.executable, "-m", "streamlit", "run", str(app)]
    command += ["--server.address", args.host, "--server.port", str(args.port)]
    if args.secrets is not None:
        command += ["--secrets.files", str(Path(args.secrets).resolve())]
    command += ["--server.headless", "true", "--browser.gatherUsageStats", "false"]
    # a served dashboard does not watch its sources: the watcher walks every imported
    # module after each first run (a second of a cold page's load on 2 cores)
    command += ["--server.fileWatcherType", "none"]
    os.execv(sys.executable, command)


def _cmd_export(args: argparse.Namespace) -> None:

    from claw_pipelines.consume.dataset import open_dataset
    from claw_pipelines.interop.export import export

    settings = _settings(args)
    try:
        dataset = open_dataset(args.dataset, settings.lake_uri, args.version, tenant=args.tenant)
        tokenizer = args.tokenizer or settings.tokenizer
        written = export(dataset, args.policy_version, args.format, Path(args.out), tokenizer)
    except LookupError as exc:
        raise CliError(str(exc)) from None
    except ValueError as exc:  # a --tokenizer folder that does not load
        raise CliError(f"--tokenizer: {exc}") from None
    what = "pairs" if args.format == "preference-pairs" else "steps"
    print(
        f"exported {written} {what} of {args.dataset} v{args.policy_version} "
        f"(dataset version {dataset.version}) to {args.out}"
    )


def _cmd_import(args: argparse.Namespace) -> None:
    from claw_pipelines.interop.chat_logs import ChatLogError, import_chat_log
    from claw_pipelines.lake.delta import Lake
    from claw_pipelines.tokenization import load_chat_tokenizer

    _caller(args, args.tenant)  # a tenant's key imports only for itself; an admin's for any
    lake = Lake.from_settings(_settings(args)) if args.create else _open_lake(args, "; --create")
    tokenizer = None
    if args.tokenizer is not None:
        try:
            tokenizer = load_chat_tokenizer(args.tokenizer)
        except (ValueError, OSError) as exc:
            raise CliError(f"--tokenizer: {exc}") from None
    try:
        landed = import_chat_log(lake, Path(args.file), args.tenant, args.keep_request, tokenizer)
    except (ChatLogError, OSError, UnicodeDecodeError) as exc:
        raise CliError(f"{args.file}: {exc}") from None
    if not landed.steps:
        print(f"{args.file}: its {landed.already} steps were imported before; nothing new")
        return
    print(
        f"imported {landed.steps} steps of {landed.trajectories} trajectories from {args.file} "
        f"into bronze (version {landed.bronze_version}); `claw materialize` builds them"
    )


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of every verb."""
    parser = argparse.ArgumentParser(prog="claw", description=__doc__)
    verbs = parser.add_subparsers(dest="verb", required=True, metavar="VERB")

    def verb(name: str, handler: Callable[[argparse.Namespace], None], help: str):
        sub = verbs.add_parser(name, help=help, description=help)
        sub.add_argument("--lake", help="lake URI (overrides CLAW_LAKE_URI)")
        sub.set_defaults(handler=handler)
        return sub

    gw = verb("gateway", _cmd_gateway, "run the ingestion gateway and OpenAI-compatible proxy")
    gw.add_argument("--host", default="127.0.0.1")
    gw.add_argument("--port", type=int, default=8080)

    sim = verb("sim-llm", _cmd_sim_llm, "run the bundled simulated OpenAI-compatible model")
    sim.add_argument("--host", default="127.0.0.1")
    sim.add_argument("--port", type=int, default=8000)
    sim.add_argument("--seed", type=int, default=0)
    sim.add_argument("--latency-ms", type=float, default=0.0)
    sim.add_argument(
        "--drift",
        type=float,
        default=0.0,
        metavar="SHARE",
        help="share of choices sampled with one token split in two (re-rendering drifts)",
    )
    sim.add_argument(
        "--no-token-ids",
        action="store_true",
        help="refuse vLLM's return_token_ids as OpenAI does (a server that returns no ids)",
    )

    mat = verb("materialize", _cmd_materialize, "materialize the Dagster assets in-process")
    mat.add_argument(
        "--select",
        action="append",
        metavar="SELECTION",
        help="asset key (silver/steps, silver/*) or Dagster selection (group:silver); repeatable",
    )
    mat.add_argument("--dataset", action="append", help="only these gold datasets; repeatable")
    mat.add_argument(
        "--policy-version", type=int, action="append", help="only these policy versions"
    )
    mat.add_argument(
        "--parallel",
        type=int,
        metavar="N",
        help="build each dataset's partitions as one Dagster run of N processes at once "
        "(gold_rebuild_job: a full rebuild or backfill split into N shares)",
    )
    mat.add_argument(
        "--follow",
        action="store_true",
        help="keep silver and every dataset up to date as bronze grows (increments, seconds "
        "after each acknowledged step) until Ctrl-C; reported to Dagster when DAGSTER_HOME is set",
    )
    mat.add_argument(
        "--poll-s", type=float, default=0.2, help="with --follow: how often bronze is looked at"
    )
    mat.add_argument(
        "--shard",
        metavar="I/N",
        help="with --follow: shard I of N's share only (its prompt groups), under a lease in "
        "the lake: N followers split the work; a second follower of one shard waits",
    )
    mat.add_argument(
        "--create",
        action="store_true",
        help="create the lake if it is missing (else a missing local lake is an error; "
        "--follow, a service beside the gateway, creates it as the gateway does)",
    )

    dash = verb("dashboard", _cmd_dashboard, "run the Streamlit dashboard on the lake")
    dash.add_argument(
        "--host",
        default="127.0.0.1",
        help="loopback by default; another address needs a login (keys, or [auth] secrets)",
    )
    dash.add_argument("--port", type=int, default=8501)
    dash.add_argument(
        "--secrets",
        default=None,
        help="the secrets.toml whose [auth] section configures the OpenID Connect login "
        "(default: ~/.streamlit/secrets.toml and ./.streamlit/secrets.toml, as Streamlit reads)",
    )

    exp = verb(
        "export",
        _cmd_export,
        "export a gold partition: verl-style Parquet or JSONL, SFT messages, preference pairs",
    )
    exp.add_argument("--dataset", required=True)
    exp.add_argument("--policy-version", type=int, required=True)
    exp.add_argument(
        "--format",
        choices=["verl-parquet", "jsonl", "sft-messages", "preference-pairs"],
        default="verl-parquet",
    )
    exp.add_argument("--out", required=True, help="file to write")
    exp.add_argument("--version", type=int, help="dataset Delta version (default: newest)")
    exp.add_argument(
        "--tenant",
        help="an admin key's scope: only this tenant's data (a tenant's key may name only itself)",
    )
    exp.add_argument(
        "--tokenizer",
        metavar="FOLDER",
        help="the model's tokenizer folder, for steps that name none (default CLAW_TOKENIZER); "
        "steps that name theirs are decoded with the one the lake keeps",
    )

    imp = verb(
        "import",
        _cmd_import,
        "import trajectories from an OpenAI-style chat log with token ids (JSON lines, one "
        "call each) into bronze, with their provenance",
    )
    imp.add_argument("file", help="the chat log (.jsonl)")
    imp.add_argument("--format", choices=["openai-chat"], default="openai-chat")
    imp.add_argument("--tenant", default="default", help="the tenant the steps belong to")
    imp.add_argument(
        "--keep-request", action="store_true", help="keep each call's request in its metadata"
    )
    imp.add_argument(
        "--tokenizer",
        metavar="FOLDER",
        help="the model's Hugging Face tokenizer folder the ids belong to (as the gateway's "
        "CLAW_TOKENIZER): kept in the lake and named on every step, so exports decode with it",
    )
    imp.add_argument("--create", action="store_true", help="create the lake if it is missing")

    judge = verb(
        "rescore",
        _cmd_rescore,
        "score stored steps with a versioned judge (a Python reward function); appends its "
        "reward facts, only for steps that judge version has not scored",
    )
    judge.add_argument("--judge", required=True, help="exact-match (built in), or module:function")
    judge.add_argument("--judge-version", help="default: the function's judge_version")
    judge.add_argument("--spec", help="only the steps this curation spec keeps")
    judge.add_argument(
        "--tokenizer",
        metavar="FOLDER",
        help="the model's tokenizer folder (or `bundled`), for steps that name none",
    )
    judge.add_argument(
        "--full",
        action="store_true",
        help="look at every step, not only those added since the last run (re-asks the steps "
        "the judge had no opinion on)",
    )
    judge.add_argument("--no-silver", action="store_true", help="do not run silver afterwards")

    verb("check", _cmd_check, "check a lake: keys held twice, watermarks, trees vs steps")
    shards = verb(
        "shards",
        _cmd_shards,
        "the materializer shards: owner, lease age, lag behind bronze, last error; --count sets "
        "how many ways the lake is split",
    )
    shards.add_argument(
        "--count",
        type=int,
        help="split the lake N ways from now on (followers of another count stop; 1: one "
        "follower, unsharded)",
    )
    verb(
        "repair",
        _cmd_repair,
        "repair what `claw check` finds, keeping every acknowledged record once",
    )

    policy = verbs.add_parser("policy", help="the policy versions a trainer publishes")
    policy_verbs = policy.add_subparsers(dest="policy_verb", required=True, metavar="ACTION")
    publish = policy_verbs.add_parser(
        "publish", help="record a newer policy version as current (the gateway stamps it)"
    )
    publish.add_argument("version", type=int)
    publish.add_argument("--by", help="who publishes it (e.g. the trainer run)")
    publish.add_argument("--note")
    publish.add_argument("--lake", help="lake URI (overrides CLAW_LAKE_URI)")
    publish.set_defaults(handler=_cmd_policy_publish)
    show = policy_verbs.add_parser("show", help="list the published versions")
    show.add_argument("--lake", help="lake URI (overrides CLAW_LAKE_URI)")
    show.set_defaults(handler=_cmd_policy_show)

    specs = verbs.add_parser("spec", help="the curation specs that define gold datasets")
    spec_verbs = specs.add_subparsers(dest="spec_verb", required=True, metavar="ACTION")
    listing = spec_verbs.add_parser("list", help="the lake's specs, and the built-in ones")
    listing.add_argument("--lake", help="lake URI (overrides CLAW_LAKE_URI)")
    listing.add_argument(
        "--tenant",
        help="an admin key's scope: only this tenant's data (a tenant's key may name only itself)",
    )
    listing.set_defaults(handler=_cmd_spec_list)
    add = spec_verbs.add_parser(
        "add", help="add a built-in spec (sft-successes, preference-pairs) to the lake"
    )
    add.add_argument("name")
    add.add_argument("--lake", help="lake URI (overrides CLAW_LAKE_URI)")
    add.set_defaults(handler=_cmd_spec_add)

    ledger = verb(
        "ledger",
        _cmd_ledger,
        "the waste ledger: per dataset and policy version, steps, tokens and generation time "
        "admitted, rejected by reason, and re-admitted by another dataset",
    )
    ledger.add_argument("--dataset", action="append", help="only these datasets; repeatable")
    ledger.add_argument(
        "--tenant",
        help="an admin key's scope: only this tenant's data (a tenant's key may name only itself)",
    )

    keys = verbs.add_parser("keys", help="manage gateway API keys")
    key_verbs = keys.add_subparsers(dest="keys_verb", required=True, metavar="ACTION")
    create = key_verbs.add_parser("create", help="mint a key for a tenant; prints it once")
    create.add_argument("--tenant", required=True)
    create.add_argument(
        "--admin",
        action="store_true",
        help="an admin key: reads every tenant's data (or one, naming it)",
    )
    create.add_argument("--file", help="append the key's hash to this keys file")
    create.set_defaults(handler=_cmd_keys_create)

    secrets = verb(
        "lake-secrets",
        _cmd_lake_secrets,
        "the S3 lake's identities, one per component with only what its job needs "
        "(docs/DESIGN.md §17): write them, or create the lake's bucket with the admin's",
    )
    secrets_job = secrets.add_mutually_exclusive_group(required=True)
    secrets_job.add_argument(
        "--dir",
        help="write <dir>/<component>/storage-options.json (keys kept when already there) "
        "and <dir>/seaweedfs/ (identities.json, security.toml) for the lake's bucket and prefix",
    )
    secrets_job.add_argument(
        "--create-bucket",
        action="store_true",
        help="create the lake's bucket with the key pair of CLAW_STORAGE_OPTIONS(_FILE), "
        "waiting for the store to answer (an existing bucket is fine)",
    )

    up = verb(
        "up",
        _cmd_up,
        "run the local stack (gateway, Dagster webserver + daemon, dashboard, and the "
        "simulated model when no upstream is set) until Ctrl-C",
    )
    up.add_argument("--host", default="127.0.0.1", help="the gateway's bind address")
    up.add_argument("--port", type=int, default=8080, help="the gateway's port")
    up.add_argument("--dashboard-port", type=int, default=8501, help="0: any free port")
    up.add_argument("--dagster-port", type=int, default=3000, help="0: any free port")
    up.add_argument(
        "--demo-traffic", action="store_true", help="keep simulated agents sending steps"
    )
    up.add_argument(
        "--materializers",
        type=int,
        default=1,
        metavar="N",
        help="followers splitting the work: N > 1 runs `materialize --follow --shard i/N` each",
    )

    demo = verb("demo", _cmd_demo, "one end-to-end run on simulated agents, then a summary")
    demo.add_argument(
        "--workdir", help="where to keep logs (and --learn's checkpoints; default: a temp dir)"
    )
    demo.add_argument(
        "--compact-every",
        type=int,
        metavar="N",
        help="the black-box agents compact their context: after every N calls they replace "
        "their earlier turns with a summary (silver records the trajectory's fragments)",
    )
    demo.add_argument(
        "--learn",
        action="store_true",
        help="instead: train a tiny model until its reward rises (transformers serve, the "
        "gateway, the live materializer, a GRPO trainer; needs the train extra)",
    )
    demo.add_argument("--seed", type=int, default=0, help="--learn: the run's seed")
    demo.add_argument(
        "--versions", type=int, default=40, help="--learn: policy versions to publish at most"
    )
    return parser


def log_traceback(exc: BaseException) -> Path:
    """Append `exc`'s traceback to the CLI's error log (`CLAW_ERROR_LOG`, default
    ~/.claw/errors.log); the path it went to."""
    path = Path(os.environ.get("CLAW_ERROR_LOG") or Path.home() / ".claw" / "errors.log")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a") as out:
            stamp = datetime.now(UTC).isoformat(timespec="seconds")
            out.write(f"--- {stamp} claw {' '.join(sys.argv[1:])}\n")
            out.write("".join(traceback.format_exception(exc)))
    except OSError:
        path = Path("<unwritable: " + str(path) + ">")
    return path


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `claw` console script."""
    args = build_parser().parse_args(argv)
    try:
        args.handler(args)
    except KeyboardInterrupt:
        return 130
    except ClawError as exc:  # the lakehouse said no (NotFound, SpecError, ...): one line
        print(f"claw: error: {exc}", file=sys.stderr)
        return 1
    except ValidationError as exc:  # settings from the environment
        first = exc.errors()[0]
        where = ".".join(str(part) for part in first["loc"])
        name = f"CLAW_{where.upper()}" if exc.title == "ClawSettings" else where
        print(f"claw: error: {name}: {first['msg']}", file=sys.stderr)
        return 1
    except ModuleNotFoundError as exc:
        if exc.name is None or exc.name.split(".")[0] not in STACK_MODULES:
            return _unexpected(exc)
        print(
            f"claw: error: `claw {args.verb}` needs the stack extra ({exc.name} is not "
            "installed): pip install 'claw-lakehouse[stack]'",
            file=sys.stderr,
        )
        return 1
    except Exception as exc:  # one clear line for users; the traceback goes to a log file
        return _unexpected(exc)
    return 0


STACK_MODULES = ("dagster", "dagster_webserver", "dagster_graphql", "streamlit")


def _unexpected(exc: Exception) -> int:
    """Report an error no verb expected in one line; its traceback goes to the error log."""
    where = log_traceback(exc)
    first = (str(exc).strip().splitlines() or [""])[0]
    print(f"claw: error: {type(exc).__name__}: {first} (traceback: {where})", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
