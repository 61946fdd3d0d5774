"""`python -m lmcache_loadback.cli`: the `loadback` console script without its launcher."""

import sys

from . import main

sys.exit(main())
