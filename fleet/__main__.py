import sys

from fleet.cli import main

sys.exit(main())
