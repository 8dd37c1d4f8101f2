"""Command line: ``python -m picklehooks {demo,inspect,report} ...``."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m picklehooks", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("demo", help="save a hooked model and watch its hook fire in another process")
    inspect_cmd = sub.add_parser(
        "inspect",
        help="show every global a checkpoint or pickle would import or call, and its hooks' text, without loading it",
        epilog="exit status, bits added together: 0 safe and fully read; 1 can't audit the file; "
        "2 a hook name doesn't decode; 4 something is UNSAFE; 8 some part could not be read completely",
    )
    inspect_cmd.add_argument("file", help="a torch.save checkpoint, torch.package archive or pickle")
    report_cmd = sub.add_parser(
        "report", help="write a Markdown report (per-layer tables, non-finite values, figures) of a saved log"
    )
    report_cmd.add_argument("log", help="a directory written by picklehooks.Log.save()")
    report_cmd.add_argument("--out", required=True, metavar="DIR", help="where to write report.md and the figures")
    args = parser.parse_args(argv)
    if args.command == "demo":
        from .demo import run

        return run()
    if args.command == "report":
        from .diagnostics.report import main as report_main

        return report_main(args.log, args.out)
    from .audit import main as audit_main

    return audit_main(args.file)


if __name__ == "__main__":
    sys.exit(main())
