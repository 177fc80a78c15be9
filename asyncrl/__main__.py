import sys

from asyncrl.launch.cli import main

sys.exit(main())
