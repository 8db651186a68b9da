"""`python -m gateway analyze LOGFILE`: the flags, reading the log, and writing the reports.

Input may be stdin, a text file or a rotated `.gz`; output is the text report,
and on request JSON (for scripts) and a self-contained HTML page (for incident
write-ups). The HTML report needs matplotlib, an optional extra, so its absence
is a clear usage error rather than a traceback.
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import sys
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TextIO

from gateway.tools.analyze.analyzer import TAIL_FRACTION, analyze, load_records
from gateway.tools.analyze.report_text import format_report
from gateway.tools.analyze.retries import STORM_SHARE, STORM_WINDOW_S
from gateway.tools.analyze.said import sizing_warnings
from gateway.tools.analyze.sources.detect import read_sources
from gateway.tools.analyze.sources.verdicts import format_sources, source_analysis
from gateway.tools.analyze.tenants import FAIRNESS_WINDOW_S

#: What to run when matplotlib is missing. The package is not on any index, so
#: `pip install 'llm-tail-gateway[report]'` cannot work; in a clone this does.
REPORT_INSTALL = "make install-report (in a clone; or: .venv/bin/pip install -e '.[report]')"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The `analyze` subcommand's arguments (also used by `python -m gateway.tools.analyze`)."""
    parser.add_argument(
        "logfile",
        nargs="*",
        default=["-"],
        help="the gateway's JSON log (stdout of `serve`), or TGI's, vLLM's or nginx's "
        "(detected per line; files may be mixed); '-' or nothing reads stdin; .gz is ok",
    )
    parser.add_argument(
        "--json", metavar="FILE", help="also write the numbers as JSON ('-': stdout, no text)"
    )
    parser.add_argument(
        "--html",
        metavar="FILE",
        help="also write a self-contained HTML report with plots (needs matplotlib)",
    )
    parser.add_argument(
        "--tail-percent",
        type=float,
        default=100 * TAIL_FRACTION,
        metavar="P",
        help="the slowest P%% of each lane decide the verdict (default 1)",
    )
    parser.add_argument(
        "--fairness-window",
        type=float,
        default=FAIRNESS_WINDOW_S,
        metavar="S",
        help="tenants' fair share is judged in windows of S seconds "
        f"(default {FAIRNESS_WINDOW_S:g})",
    )
    parser.add_argument(
        "--storm-window",
        type=float,
        default=STORM_WINDOW_S,
        metavar="S",
        help=f"retries are counted in windows of S seconds (default {STORM_WINDOW_S:g})",
    )
    parser.add_argument(
        "--storm-percent",
        type=float,
        default=100 * STORM_SHARE,
        metavar="P",
        help="a window where more than P%% of the requests were retries is a retry storm "
        f"(default {100 * STORM_SHARE:g})",
    )


def main(args: argparse.Namespace) -> int:
    """Run the analysis; 0 on success, 1 when the input has no request line, 2 on usage errors."""
    if not 0 < args.tail_percent <= 100:
        print("analyze: --tail-percent must be in (0, 100]", file=sys.stderr)
        return 2
    if not (math.isfinite(args.fairness_window) and args.fairness_window > 0):
        print("analyze: --fairness-window must be a positive number of seconds", file=sys.stderr)
        return 2
    if not (math.isfinite(args.storm_window) and args.storm_window > 0):
        print("analyze: --storm-window must be a positive number of seconds", file=sys.stderr)
        return 2
    if not 0 <= args.storm_percent < 100:
        print("analyze: --storm-percent must be in [0, 100)", file=sys.stderr)
        return 2
    if args.html:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            print(f"analyze: --html needs matplotlib: {REPORT_INSTALL}", file=sys.stderr)
            return 2
    paths = [args.logfile] if isinstance(args.logfile, str) else list(args.logfile or ["-"])
    lines: list[str] = []
    for path in paths:
        try:
            with _open(path) as stream:
                lines.extend(stream)
        except OSError as exc:
            print(f"analyze: cannot read {path}: {exc}", file=sys.stderr)
            return 2
    records, skipped = load_records(lines)
    found, unknown = read_sources(lines)
    if any(found.values()):
        return _main_sources(args, records, skipped, found, unknown)
    analysis = analyze(
        records,
        skipped=skipped,
        said=sizing_warnings(lines),
        tail_fraction=args.tail_percent / 100,
        fairness_window_s=args.fairness_window,
        storm_window_s=args.storm_window,
        storm_share=args.storm_percent / 100,
    )
    if args.json != "-":
        sys.stdout.write(format_report(analysis))
    if args.json:
        text = json.dumps(analysis, indent=2, ensure_ascii=False) + "\n"
        if args.json == "-":
            sys.stdout.write(text)
        else:
            Path(args.json).write_text(text, encoding="utf-8")
    if args.html:
        from gateway.tools.analyze.report_html import render

        source = "stdin" if paths == ["-"] else ", ".join(paths)
        Path(args.html).write_text(render(analysis, records, source=source), encoding="utf-8")
    return 0 if records else 1


def _main_sources(
    args: argparse.Namespace,
    records: list[dict[str, Any]],
    skipped: int,
    found: dict[str, list[dict[str, Any]]],
    unknown: int,
) -> int:
    """Other servers' lines were in the input: their verdicts, after ours when ours are there.

    Lines of other sources are not 'skipped' for our part of the report; the
    ones no reader knew are counted once, in the sources part.
    """
    other = sum(len(v) for v in found.values())
    sources = source_analysis(found, unknown)
    analysis: dict[str, Any] = {}
    text = ""
    if records:
        analysis = analyze(
            records,
            skipped=max(0, skipped - other),
            tail_fraction=args.tail_percent / 100,
            fairness_window_s=args.fairness_window,
            storm_window_s=args.storm_window,
            storm_share=args.storm_percent / 100,
        )
        text = format_report(analysis) + "\n"
    analysis["sources"] = sources
    text += format_sources(sources)
    if args.json != "-":
        sys.stdout.write(text)
    if args.json:
        out = json.dumps(analysis, indent=2, ensure_ascii=False) + "\n"
        if args.json == "-":
            sys.stdout.write(out)
        else:
            Path(args.json).write_text(out, encoding="utf-8")
    if args.html and not records:
        print("analyze: --html needs the gateway's own log lines; none were found", file=sys.stderr)
        return 2
    if args.html:
        from gateway.tools.analyze.report_html import render

        Path(args.html).write_text(
            render(analysis, records, source=", ".join(args.logfile)), encoding="utf-8"
        )
    return 0


@contextmanager
def _open(path: str) -> Iterator[Iterable[str]]:
    """Lines of stdin ('-'), a gzip file (rotated logs) or a text file."""
    if path == "-":
        yield sys.stdin
        return
    stream: TextIO
    if path.endswith(".gz"):
        stream = gzip.open(path, "rt", encoding="utf-8", errors="replace")
    else:
        stream = open(path, encoding="utf-8", errors="replace")
    with stream:
        yield stream


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m gateway.tools.analyze",
        description="Was P99 slow in the gateway's queue or in the model? Reads the JSON log.",
    )
    add_arguments(parser)
    return parser
