"""Command line: ``python -m picklehooks {demo,inspect} ...``."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m picklehooks", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("demo", help="save a hooked model and watch its hook fire in another process")
    inspect_cmd = sub.add_parser(
        "inspect", help="list the hooks in a checkpoint or pickle without loading or executing it"
    )
    inspect_cmd.add_argument("file", help="a torch.save checkpoint, torch.package archive or pickle")
    args = parser.parse_args(argv)
    if args.command == "demo":
        from .demo import run

        return run()
    from .audit import main as audit_main

    return audit_main(args.file)


if __name__ == "__main__":
    sys.exit(main())
