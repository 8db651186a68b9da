"""Was P99 slow in the gateway's queue or in the model? (`python -m gateway analyze LOGFILE`)

It reads the gateway's own per-request JSON log, so an on-call engineer needs
nothing else to choose between scheduling fixes (lanes, slots, fail-fast) and
capacity fixes. The parts: `fields` (what one line says, read defensively),
`analyzer` (plain functions over the log's records: reading, the tail, the
verdict), `engine` (the backend's time split into the engine's queue, prefill and
decode, and the max_concurrency a backend's in-flight counts support), `retries`
(retry storms: the share of retries over time and per client, who retried faster
than told, what the retries cost), `tenants` (what each tenant got, and whether
each lane's fair share between tenants held to the bound the gateway's scheduler
promises),
`report_text` and `report_html` (the two renderings; the HTML one needs
matplotlib, an optional extra) and `cli` (the flags, reading files, writing the
reports).
"""

from gateway.tools.analyze.analyzer import (
    ENGINE_QUEUE_TEXT,
    METRICS,
    PERCENTILES,
    PREDICTOR_FIELDS,
    PREDICTOR_HORIZON_S,
    QUEUE_BOUND_SHARE,
    TAIL_FRACTION,
    VERDICT_RULE,
    VERDICT_TEXT,
    analyze,
    breakdown,
    latency,
    load_records,
    parse_line,
    predictor_accuracy,
    queue_depth_series,
    slowest,
    tail_analysis,
    tail_size,
    tail_verdict,
    verdict,
)
from gateway.tools.analyze.cli import add_arguments, build_parser, main
from gateway.tools.analyze.engine import (
    ENGINE_FIELDS,
    ENGINE_QUEUE_CAUSES,
    backend_slots,
    band_splits,
    engine_parts,
    four_part_verdict,
)
from gateway.tools.analyze.fields import (
    NO_LANE,
    Record,
    arrival_s,
    dispatched_s,
    end_s,
    lane_of,
    number,
    outcome_of,
    was_served,
)
from gateway.tools.analyze.report_text import (
    band_lines,
    fairness_lines,
    fmt_ms,
    fmt_share,
    format_report,
    predictor_lines,
    retry_lines,
    tenant_lines,
    verdict_lines,
)
from gateway.tools.analyze.retries import (
    STORM_SHARE,
    STORM_WINDOW_S,
    client_of,
    is_retry,
    retry_analysis,
)
from gateway.tools.analyze.tenants import (
    BACKLOG_SHARE,
    FAIRNESS_WINDOW_S,
    NO_TENANT,
    charge_of,
    dispatch_s,
    jain_index,
    largest_gap,
    tenant_analysis,
    tenant_of,
    tenant_table,
)

__all__ = [
    "BACKLOG_SHARE",
    "ENGINE_FIELDS",
    "ENGINE_QUEUE_CAUSES",
    "ENGINE_QUEUE_TEXT",
    "STORM_SHARE",
    "STORM_WINDOW_S",
    "backend_slots",
    "band_lines",
    "band_splits",
    "client_of",
    "dispatched_s",
    "engine_parts",
    "four_part_verdict",
    "is_retry",
    "retry_analysis",
    "retry_lines",
    "FAIRNESS_WINDOW_S",
    "METRICS",
    "NO_LANE",
    "NO_TENANT",
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
    "charge_of",
    "dispatch_s",
    "end_s",
    "fairness_lines",
    "fmt_ms",
    "fmt_share",
    "format_report",
    "jain_index",
    "lane_of",
    "largest_gap",
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
    "tail_verdict",
    "tenant_analysis",
    "tenant_lines",
    "tenant_of",
    "tenant_table",
    "verdict",
    "verdict_lines",
    "was_served",
]
