import sys

from partitioner.cli.main import main

sys.exit(main())
