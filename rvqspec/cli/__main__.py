import sys

from rvqspec.cli.main import entry

sys.exit(entry())
