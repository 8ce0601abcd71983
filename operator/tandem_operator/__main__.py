"""`python -m tandem_operator`: the same as `tandem-operator`."""

import sys

from .main import main

sys.exit(main())
