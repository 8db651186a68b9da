"""`python -m gateway.tools.analyze LOGFILE`: the analyzer on its own, without the project CLI."""

from __future__ import annotations

import sys

from gateway.tools.analyze.cli import build_parser, main

if __name__ == "__main__":
    sys.exit(main(build_parser().parse_args()))
