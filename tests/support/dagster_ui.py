"""A Dagster webserver's GraphQL as a viewer or an intruder uses it: a query, and the
mutations a read-only webserver must refuse (valid ones, so only its permissions can)."""

from __future__ import annotations

import httpx

REPOSITORY = """
{ repositoriesOrError { ... on RepositoryConnection { nodes {
    name location { name } jobs { name } sensors { name sensorState { id status } } } } } }
"""
REFUSED = "UnauthorizedError"  # what a mutation without the permission answers


def graphql(url: str, query: str, variables: dict | None = None) -> dict:
    """The `data` of a GraphQL answer from the webserver at `url` (an error is a failure)."""
    answer = httpx.post(
        url + "/graphql", json={"query": query, "variables": variables or {}}, timeout=60
    )
    answer.raise_for_status()
    body = answer.json()
    assert "errors" not in body, body
    return body["data"]


def repository(url: str) -> dict:
    """The one repository the webserver serves: its name, location, jobs and sensors."""
    (found,) = graphql(url, REPOSITORY)["repositoriesOrError"]["nodes"]
    return found


def mutations(repo: dict) -> dict[str, tuple[str, dict | None]]:
    """By name: launch a run of a job, wipe an asset, stop a sensor, reload the workspace."""
    job = next(j["name"] for j in repo["jobs"] if not j["name"].startswith("__"))
    selector = {
        "repositoryLocationName": repo["location"]["name"],
        "repositoryName": repo["name"],
        "jobName": job,
    }
    return {
        "launchRun": (
            "mutation($params: ExecutionParams!) { launchRun(executionParams: $params) {"
            " __typename } }",
            {"params": {"selector": selector, "runConfigData": {}}},
        ),
        "wipeAssets": (
            'mutation { wipeAssets(assetPartitionRanges: [{assetKey: {path: ["silver",'
            ' "steps"]}}]) { __typename } }',
            None,
        ),
        "stopSensor": (
            "mutation($id: String!) { stopSensor(id: $id) { __typename } }",
            {"id": repo["sensors"][0]["sensorState"]["id"]},
        ),
        "reloadWorkspace": ("mutation { reloadWorkspace { __typename } }", None),
    }


def try_mutations(url: str, repo: dict) -> dict[str, str]:
    """Each mutation sent to the webserver at `url`: the `__typename` it answered."""
    return {
        name: graphql(url, mutation, variables)[name]["__typename"]
        for name, (mutation, variables) in mutations(repo).items()
    }
