"""`pdserve` command line: one subcommand per job; each lives beside the code it drives."""

from __future__ import annotations

import argparse
import importlib
import sys
from importlib.metadata import PackageNotFoundError, version

from pdserve.arg_types import document_defaults

# subcommand -> module exposing add_arguments(parser) and run(args) -> int
SUBCOMMANDS = {
    "generate": ("pdserve.engine.cli", "offline greedy/sampled generation with the engine"),
    "serve": ("pdserve.server.cli", "run one engine instance behind an OpenAI-compatible HTTP API"),
    "proxy": ("pdserve.router.cli", "run the P/D router (or, colocated, a load balancer) in front of instances"),
    "bench": ("pdserve.bench.cli_bench", "load-test any OpenAI-compatible server"),
    "sweep": (
        "pdserve.bench.cli_sweep",
        "run a push vs pull (vs colocated) sweep over request rates and input lengths, with goodput at SLOs",
    ),
    "plot": ("pdserve.bench.cli_plot", "plot a sweep's results"),
    "timeline": ("pdserve.bench.cli_timeline", "draw per-request timelines from server timestamps"),
    "demo": ("pdserve.demo", "1P1D + router on the built-in model, a push-vs-pull comparison and plots"),
}


def package_version() -> str:
    try:
        return version("pdserve")
    except PackageNotFoundError:  # run from a checkout that was never installed
        return "unknown (not installed)"


def add_subcommand_arguments(parser: argparse.ArgumentParser, name: str) -> None:
    """Subcommand `name`'s flags, each --help line ending with its default."""
    importlib.import_module(SUBCOMMANDS[name][0]).add_arguments(parser)
    document_defaults(parser)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pdserve", description=__doc__)
    parser.add_argument("--version", action="version", version=f"pdserve {package_version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    argv = sys.argv[1:] if argv is None else argv
    wanted = argv[0] if argv and not argv[0].startswith("-") else None
    for name, (_, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if name == wanted:  # import only the module that runs (torch is slow to import)
            add_subcommand_arguments(p, name)
    args = parser.parse_args(argv)
    module = importlib.import_module(SUBCOMMANDS[args.command][0])
    return int(module.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
