"""The Ray job's entry point from a checkout, as `python -m asyncrl.launch.deploy_ray driver` is from
anywhere asyncrl is installed (`asyncrl submit ray` submits the latter): see asyncrl/launch/deploy_ray.py."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository, on a shared filesystem

from asyncrl.launch.deploy_ray import driver_main  # noqa: E402

if __name__ == "__main__":
    sys.exit(driver_main())
