"""Ask a running Dagster webserver, over its GraphQL API, to build gold partitions (plain HTTP:
the dashboard never imports Dagster)."""

from __future__ import annotations

import httpx

from claw_pipelines.contracts.tables import GOLD_RUN_TABLES

LOCATION = "claw_pipelines.definitions"
REPOSITORY = "__repository__"
GOLD_ASSETS = [table.split("/") for table in GOLD_RUN_TABLES]  # a run selects the whole asset
_ADD = """
mutation Add($repo: RepositorySelector!, $name: String!, $key: String!) {
  addDynamicPartition(repositorySelector: $repo, partitionsDefName: $name, partitionKey: $key) {
    __typename
    ... on PythonError { message }
    ... on UnauthorizedError { message }
  }
}"""
_LAUNCH = """
mutation Launch($params: ExecutionParams!) {
  launchRun(executionParams: $params) {
    __typename
    ... on LaunchRunSuccess { run { runId } }
    ... on PythonError { message }
    ... on InvalidSubsetError { message }
    ... on UnauthorizedError { message }
    ... on PipelineNotFoundError { message }
  }
}"""
_STATUS = """
query Status($id: ID!) { runOrError(runId: $id) { __typename ... on Run { status } } }"""
_IN_FLIGHT = """
query InFlight($filter: RunsFilter!) {
  runsOrError(filter: $filter) {
    __typename
    ... on Runs { results { runId tags { key value } } }
    ... on PythonError { message }
  }
}"""
IN_FLIGHT = ["QUEUED", "NOT_STARTED", "STARTING", "STARTED"]


class DagsterUnavailable(Exception):
    """The webserver does not answer, or refused the request (the message says why)."""


def _call(url: str, query: str, variables: dict) -> dict:
    try:
        answer = httpx.post(
            url.rstrip("/") + "/graphql", json={"query": query, "variables": variables}, timeout=10
        )
        return answer.json()["data"]
    except (httpx.HTTPError, KeyError, ValueError) as exc:
        raise DagsterUnavailable(f"Dagster at {url} did not answer: {exc}") from None


def is_up(url: str | None) -> bool:
    """Whether a Dagster webserver answers at `url`."""
    if not url:
        return False
    try:
        return httpx.get(url.rstrip("/") + "/server_info", timeout=1.0).is_success
    except httpx.HTTPError:
        return False


def building(url: str, dataset: str) -> dict[int, str]:
    """The dataset's policy versions that a queued or running gold run builds: their run ids."""
    tags = [{"key": "dagster/partition/dataset", "value": dataset}]
    found = _call(url, _IN_FLIGHT, {"filter": {"statuses": IN_FLIGHT, "tags": tags}})
    runs = found["runsOrError"]
    if "results" not in runs:
        raise DagsterUnavailable(runs.get("message", runs["__typename"]))
    versions = {}
    for run in runs["results"]:
        tag = {t["key"]: t["value"] for t in run["tags"]}.get("dagster/partition/policy_version")
        if tag is not None:
            versions[int(tag)] = run["runId"]
    return versions


def launch_gold(url: str, dataset: str, policy_versions: list[int]) -> dict[int, str]:
    """Add the partitions and launch one gold run per policy version that no queued or
    running run builds already; the run id building each version (launched or found)."""
    repo = {"repositoryLocationName": LOCATION, "repositoryName": REPOSITORY}
    keys = [("gold_datasets", dataset)] + [("policy_versions", str(v)) for v in policy_versions]
    for name, key in keys:
        added = _call(url, _ADD, {"repo": repo, "name": name, "key": key})["addDynamicPartition"]
        if "message" in added:
            raise DagsterUnavailable(added["message"])
    runs = building(url, dataset)
    for version in policy_versions:
        if version in runs:
            continue  # coalesced: that run reads the newest silver when it starts
        params = {
            "selector": {
                **repo,
                "jobName": "gold_job",
                "assetSelection": [{"path": path} for path in GOLD_ASSETS],
            },
            "executionMetadata": {
                "tags": [
                    {"key": "dagster/partition", "value": f"{dataset}|{version}"},
                    {"key": "dagster/partition/dataset", "value": dataset},
                    {"key": "dagster/partition/policy_version", "value": str(version)},
                ]
            },
        }
        launched = _call(url, _LAUNCH, {"params": params})["launchRun"]
        if launched["__typename"] != "LaunchRunSuccess":
            raise DagsterUnavailable(launched.get("message", launched["__typename"]))
        runs[version] = launched["run"]["runId"]
    return {v: runs[v] for v in policy_versions}


def run_status(url: str, run_id: str) -> str | None:
    """A run's status (QUEUED, STARTED, SUCCESS, FAILURE, ...), None if unknown."""
    found = _call(url, _STATUS, {"id": run_id})["runOrError"]
    return found.get("status")
