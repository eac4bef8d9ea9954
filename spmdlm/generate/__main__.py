import sys

from spmdlm.generate.cli import main

sys.exit(main())
