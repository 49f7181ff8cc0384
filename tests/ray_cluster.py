"""One local Ray cluster per test module, on 127.0.0.1 only, always shut down."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

TESTS = Path(__file__).resolve().parent


@contextlib.contextmanager
def local_cluster(*paths: Path) -> Iterator[None]:
    """Ray on this node (2 CPUs, no dashboard); workers import ``tests/`` and ``paths``."""
    import ray

    os.environ.update(
        RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0",  # every server binds to 127.0.0.1
        RAY_AUTH_MODE="disabled",  # no token written to ~/.ray
        RAY_USAGE_STATS_ENABLED="0",
        # Workers import test modules, conftest and the examples' modules by name.
        PYTHONPATH=os.pathsep.join(
            [str(TESTS), *map(str, paths), os.environ.get("PYTHONPATH", "")]
        ),
    )
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        yield
    finally:
        ray.shutdown()
