"""`python -m gateway.tools.loadgen`: the load generator on its own, without the project CLI."""

from __future__ import annotations

import argparse
import sys

from gateway.tools.loadgen.cli import add_arguments, main

if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        prog="python -m gateway.tools.loadgen",
        description="Load generator: seeded short/long traffic, P50/P95/P99 per class.",
    )
    add_arguments(parser)
    sys.exit(main(parser.parse_args()))
