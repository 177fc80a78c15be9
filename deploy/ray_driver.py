"""The Ray job's entry point (`asyncrl submit ray` submits it): see asyncrl/launch/deploy_ray.py."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository, on a shared filesystem

from asyncrl.launch.deploy_ray import driver_main  # noqa: E402

if __name__ == "__main__":
    sys.exit(driver_main())
