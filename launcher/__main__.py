"""`python -m launcher`: the same as the `bucketserve` command."""

import sys

from launcher.cli import bucketserve

sys.exit(bucketserve())
