import sys

from kda.cli import main

sys.exit(main())
