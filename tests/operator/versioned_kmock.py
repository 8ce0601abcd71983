"""KMock plus the resourceVersion a real API server gives every write.

KMock stores what it is sent and never changes `metadata.resourceVersion`. kopf needs it to tell
the watch event that echoes its own patch from the events written before it (its consistency
wait, settings.persistence.consistency_timeout): with one version for every state, it takes an
older body for the newest and runs a spec handler once more on it, which races with the writes
a test makes meanwhile. Here each create and patch is stored with the next number of one
counter, as etcd's revision is; nothing is refused for naming an older one (see lease_kmock).
"""

from __future__ import annotations

import itertools

import attrs
import kmock

WRITES = (kmock.action.CREATE, kmock.action.UPDATE)


@attrs.define(kw_only=True)
class VersionedKMock(kmock.KubernetesEmulator):
    _versions: itertools.count = attrs.field(factory=lambda: itertools.count(1), init=False)

    async def _handle(self, request: kmock.Request):
        if request.resource is not None and request.action in WRITES:
            self.stamp(request)
        return await super()._handle(request)

    def stamp(self, request: kmock.Request) -> None:
        """Give the write the next resourceVersion (what the client sent stays in `request.text`)."""
        version = str(next(self._versions))
        if isinstance(request.data, dict):
            request.data.setdefault("metadata", {})["resourceVersion"] = version
        elif isinstance(request.data, list):  # a JSON patch
            request.data.append({"op": "add", "path": "/metadata/resourceVersion", "value": version})
