"""Test-side access to KMock over plain HTTP (not through the operator's own client)."""

from __future__ import annotations

import asyncio
import inspect
import json
from pathlib import Path
from typing import Any, Awaitable, Callable

import aiohttp
import jsonschema
import yaml

REPO = Path(__file__).resolve().parents[2]
CRD_PATH = REPO / "charts" / "tandem" / "crds" / "hybridmodels.tandem.dev.yaml"
NS = "models"


def load_crd() -> dict:
    return yaml.safe_load(CRD_PATH.read_text())


def crd_schema() -> dict:
    return load_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def model_path(name: str | None = None, subresource: str | None = None, ns: str = NS) -> str:
    path = f"/apis/tandem.dev/v1alpha1/namespaces/{ns}/hybridmodels"
    return path + (f"/{name}" if name else "") + (f"/{subresource}" if subresource else "")


def core_path(plural: str, name: str | None = None, ns: str = NS, group: str = "", version: str = "v1") -> str:
    base = f"/apis/{group}/{version}" if group else f"/api/{version}"
    return f"{base}/namespaces/{ns}/{plural}" + (f"/{name}" if name else "")


DEPLOYMENT = lambda name: core_path("deployments", name, group="apps")  # noqa: E731
SERVICE = lambda name: core_path("services", name)  # noqa: E731
PDB = lambda name: core_path("poddisruptionbudgets", name, group="policy")  # noqa: E731


class Cluster:
    """HTTP calls to the KMock API server, and polling until something becomes true."""

    def __init__(self, url: str, session: aiohttp.ClientSession, kmock: Any = None):
        self.url = url.rstrip("/")
        self.session = session
        self.kmock = kmock

    async def request(self, method: str, path: str, body: Any = None,
                      content_type: str = "application/merge-patch+json") -> tuple[int, Any]:
        headers = {"Content-Type": content_type if method == "PATCH" else "application/json"}
        data = None if body is None else json.dumps(body)
        async with self.session.request(method, self.url + path, data=data, headers=headers) as response:
            text = await response.text()
            return response.status, (json.loads(text) if text else None)

    async def get(self, path: str) -> dict | None:
        status, body = await self.request("GET", path)
        return body if status == 200 else None

    async def create(self, path: str, body: dict) -> dict:
        status, reply = await self.request("POST", path, body)
        assert status in (200, 201), (status, reply)
        return reply

    async def patch(self, path: str, body: dict) -> dict:
        status, reply = await self.request("PATCH", path, body)
        assert status == 200, (status, reply)
        return reply

    async def delete(self, path: str) -> None:
        status, reply = await self.request("DELETE", path)
        assert status == 200, (status, reply)

    async def create_model(self, body: dict, validate: bool = True) -> dict:
        """POST a HybridModel, validated against the CRD's schema first as an API server would."""
        if validate:
            jsonschema.Draft4Validator(crd_schema()).validate(body)
        return await self.create(model_path(), body)

    async def events(self, reason: str) -> list[dict]:
        """Events posted with `reason`, from the server's request log.

        Not from the stored objects: KMock keys objects by name and kopf's events have only a
        generateName, so KMock keeps just the first one.
        """
        posted = [r.data for r in list(self.kmock)
                  if str(r.method).upper().endswith("POST") and r.url.path.endswith("/events")]
        return [e for e in posted if isinstance(e, dict) and e.get("reason") == reason]


async def wait_for(check: Callable[[], Any | Awaitable[Any]], timeout: float = 10.0, what: str = "") -> Any:
    """Poll `check` until it returns something truthy; fail with its last value after `timeout`."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    last: Any = None
    while loop.time() < deadline:
        last = check()
        if inspect.isawaitable(last):
            last = await last
        if last:
            return last
        await asyncio.sleep(0.02)  # a polling step, not a wait for a guessed duration
    raise AssertionError(f"timed out after {timeout}s waiting for {what or check}: last {last!r}")


async def wait_for_phase(cluster: Cluster, name: str, phase: str) -> dict:
    """The HybridModel `name` once its status.phase is `phase`."""
    async def reached():
        model = await cluster.get(model_path(name))
        return model if (model.get("status") or {}).get("phase") == phase else None

    return await wait_for(reached, what=f"phase {phase}")


def hybrid_model(name: str, uid: str | None = None, **spec: Any) -> dict:
    """A HybridModel body with a small valid spec, overridden by `spec`."""
    body_spec = {
        "model": {"path": "mixtral-demo", "volume": {"persistentVolumeClaim": {"claimName": "models"}}},
        "image": "ghcr.io/example/tandem:0.1.0",
        "replicas": 1,
        "experts": {"cpus": 4, "memory": "16Gi"},
    }
    body_spec.update(spec)
    return {
        "apiVersion": "tandem.dev/v1alpha1",
        "kind": "HybridModel",
        # KMock assigns no uid or generation: set them (VersionedKMock gives the resourceVersion).
        "metadata": {"name": name, "namespace": NS, "uid": uid or f"uid-{name}", "generation": 1},
        "spec": body_spec,
    }
