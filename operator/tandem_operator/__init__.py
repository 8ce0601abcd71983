"""The Tandem operator: runs `HybridModel` resources on single-socket EPYC GPU nodes.

`kopf run -m tandem_operator` (or `tandem-operator`) imports this package, which registers the
handlers. Builders (`build_*`), the spec parser and the autoscaler's arithmetic are pure and
importable without a cluster.
"""

from . import handlers  # noqa: F401  (registers the kopf handlers on import)
