"""KMock plus what leader election needs of a real API server, for Leases only.

KMock takes every patch. A real API server answers 409 Conflict to a write that names an older
resourceVersion than the object's (optimistic concurrency): without that, two candidates could
both take one Lease. The versions themselves come from VersionedKMock. Use it with
`pytestmark = pytest.mark.kmock(cls=LeaseKMock)`.
"""

from __future__ import annotations

import asyncio

import attrs
import kmock

from versioned_kmock import VersionedKMock

LEASES = kmock.resource("coordination.k8s.io", "v1", "leases")
LEASE_WRITES = (kmock.action.CREATE, kmock.action.UPDATE)


@attrs.define(kw_only=True)
class LeaseKMock(VersionedKMock):
    # Set to make every Lease request answer 500, as an API server in trouble would.
    failing: bool = False
    # Set to hold each Lease read until that many have arrived, so racing candidates all read
    # the same version before any of them writes.
    read_barrier: asyncio.Barrier | None = None
    # How many writes were refused with 409 Conflict.
    conflicts: int = 0
    _writes: asyncio.Lock = attrs.field(factory=asyncio.Lock, init=False)

    async def _handle(self, request: kmock.Request):
        if request.resource != LEASES:
            return await super()._handle(request)
        if self.failing:
            raise kmock.KubernetesError(status=500, reason="InternalError", message="injected failure")
        if request.action == kmock.action.FETCH and self.read_barrier is not None:
            await self.read_barrier.wait()
        if request.action not in LEASE_WRITES:
            return await super()._handle(request)
        async with self._writes:  # check and write as one step, as etcd's compare-and-swap does
            if request.action == kmock.action.CREATE:
                self._check_absent(request)
            else:
                self._check_version(request)
            return await super()._handle(request)

    def _check_absent(self, request: kmock.Request) -> None:
        name = (request.data.get("metadata") or {}).get("name")
        key = (LEASES, request.namespace, name)
        if key in self.objects and not self.objects[key].deleted:
            self.conflicts += 1
            raise kmock.KubernetesError(status=409, reason="AlreadyExists",
                                        message=f'leases.coordination.k8s.io "{name}" already exists')

    def _check_version(self, request: kmock.Request) -> None:
        wanted = (request.data.get("metadata") or {}).get("resourceVersion")
        key = (LEASES, request.namespace, request.name)
        if wanted is None or key not in self.objects or self.objects[key].deleted:
            return  # no precondition, or KMock answers 404 itself
        if wanted != self.objects[key].get("metadata", {}).get("resourceVersion"):
            self.conflicts += 1
            raise kmock.KubernetesError(
                status=409, reason="Conflict",
                message=f'Operation cannot be fulfilled on leases.coordination.k8s.io "{request.name}": '
                        "the object has been modified; please apply your changes to the latest version")
