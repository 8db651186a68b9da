"""Was P99 slow in the gateway's queue or in the model? (`python -m gateway analyze LOGFILE`)

It reads the gateway's own per-request JSON log, so an on-call engineer needs
nothing else to choose between scheduling fixes (lanes, slots, fail-fast) and
capacity fixes. The parts: `analyzer` (plain functions over the log's records:
reading, the tail, the verdict), `report_text` and `report_html` (the two
renderings; the HTML one needs matplotlib, an optional extra) and `cli` (the
flags, reading files, writing the reports).
"""

from gateway.tools.analyze.analyzer import (
    METRICS,
    NO_LANE,
    PERCENTILES,
    PREDICTOR_FIELDS,
    PREDICTOR_HORIZON_S,
    QUEUE_BOUND_SHARE,
    TAIL_FRACTION,
    VERDICT_RULE,
    VERDICT_TEXT,
    Record,
    analyze,
    arrival_s,
    breakdown,
    end_s,
    lane_of,
    latency,
    load_records,
    number,
    outcome_of,
    parse_line,
    predictor_accuracy,
    queue_depth_series,
    slowest,
    tail_analysis,
    tail_size,
    verdict,
)
from gateway.tools.analyze.cli import add_arguments, build_parser, main
from gateway.tools.analyze.report_text import (
    fmt_ms,
    fmt_share,
    format_report,
    predictor_lines,
    verdict_lines,
)

__all__ = [
    "METRICS",
    "NO_LANE",
    "PERCENTILES",
    "PREDICTOR_FIELDS",
    "PREDICTOR_HORIZON_S",
    "QUEUE_BOUND_SHARE",
    "TAIL_FRACTION",
    "VERDICT_RULE",
    "VERDICT_TEXT",
    "Record",
    "add_arguments",
    "analyze",
    "arrival_s",
    "breakdown",
    "build_parser",
    "end_s",
    "fmt_ms",
    "fmt_share",
    "format_report",
    "lane_of",
    "latency",
    "load_records",
    "main",
    "number",
    "outcome_of",
    "parse_line",
    "predictor_accuracy",
    "predictor_lines",
    "queue_depth_series",
    "slowest",
    "tail_analysis",
    "tail_size",
    "verdict",
    "verdict_lines",
]
