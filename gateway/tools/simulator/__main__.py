"""`python -m gateway.tools.simulator`: the simulator on its own, without the project CLI."""

from __future__ import annotations

import argparse
import sys

from gateway.tools.simulator.cli import add_arguments, main

if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        prog="python -m gateway.tools.simulator",
        description="Continuous-batching model server simulator",
    )
    add_arguments(parser)
    sys.exit(main(parser.parse_args()))
