"""The `opsd` command line: one subcommand per job, each a thin shim over a module."""

from __future__ import annotations

import argparse
import sys

from opsd import __version__


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="opsd", description="On-Policy Self-Distillation for language models."
    )
    parser.add_argument("--version", action="version", version=f"opsd {__version__}")
    parser.add_subparsers(dest="command", metavar="COMMAND")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "run", None) is None:
        parser.print_help()
        return 0
    return int(args.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
