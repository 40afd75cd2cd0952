import sys

from workbench.cli.command import main

sys.exit(main())
