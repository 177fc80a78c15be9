"""torchrun entry point: `torchrun --nproc-per-node 2 -m learners.main CONFIG [overrides]`."""

import sys

from asyncrl.launch.cli import main

if __name__ == "__main__":
    sys.exit(main(["learner", *sys.argv[1:]]))
