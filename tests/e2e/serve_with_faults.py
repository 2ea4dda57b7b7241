"""`pdserve serve` with test-only faults (pdserve/transfer/faults.py), for e2e tests that start real processes:

    python tests/e2e/serve_with_faults.py FAULTS_JSON MODEL [pdserve serve flags]

The faults reach the engine through the engine factory this hands `pdserve.server.cli.run` (the engine gives
them to the connector factory): no flag in `pdserve serve --help`, no environment variable.
helpers.Launcher.serve(..., faults=Faults(...)) starts this instead of `pdserve serve`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # this checkout's pdserve, as `-m pdserve.cli` finds it

from pdserve.engine.async_engine import AsyncEngine  # noqa: E402
from pdserve.server import cli  # noqa: E402
from pdserve.transfer.faults import Faults  # noqa: E402


def main(argv: list[str]) -> int:
    faults = Faults.from_json(argv[0])
    parser = argparse.ArgumentParser(prog="serve_with_faults.py FAULTS_JSON")
    cli.add_arguments(parser)
    return cli.run(parser.parse_args(argv[1:]), make_engine=lambda config: AsyncEngine(config, faults))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
