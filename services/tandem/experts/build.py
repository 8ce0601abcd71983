"""`python -m tandem.experts.build [--require] [-v]`: build (or find) the native expert kernel now.

`make install` runs it so the first request does not pay for the compile. It never fails the
install: without a compiler the executor uses torch's kernels, and this says so. `--require`
(the container images' build) exits 1 instead.
"""

from __future__ import annotations

import logging
import sys

from tandem.experts.native import load_kernel, unavailable_reason


def main() -> int:
    logging.basicConfig(level=logging.INFO)
    kernel = load_kernel(verbose="-v" in sys.argv)
    if kernel is None:
        print(f"native expert kernel not built ({unavailable_reason()}); torch kernels will be used")
        return 1 if "--require" in sys.argv else 0
    print(f"native expert kernel ready: isa={kernel.isa()} supported={kernel.supported_isas()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
