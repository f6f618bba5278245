import sys

from rvqspec.cli.main import main

sys.exit(main())
