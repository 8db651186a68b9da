"""One cell of the matrix: an engine, a traffic mix and a load, replayed three ways.

For every seed the same schedule goes straight to the engine (`direct`), through the
gateway's own code with its defaults, freshly started (`gateway`: `replay.runs`), and
through the ideal two-lane scheduler (`ideal`: `replay.ideal`). The cell's figures pool
the seeds' requests (a P99 over a few hundred short requests is one sample; over
several schedules it reads the scheduler, not one burst), and keep each seed's short
P99 beside them. Then the promises are checked (`CHECKS`):

- at most 80% load: short P99 TTFT at most 1.3x the engine floor and 1.1x the ideal's;
  where the ideal scheduler itself is over 1.3x the floor (the short requests' own
  demand queues them: the conversation mix on a CPU engine), no door reaches the floor
  promise without refusing, and the cell is held to the ideal's alone (`floor_reachable`
  false in its JSON, `*` in the table);
- over capacity: short P99 at most a tenth of direct's;
- wherever the short requests alone fit in the engines: at most 5% of them refused, or,
  where the ideal scheduler itself gives more than 5% of them their first token later
  than the lane's deadline (the gateway's own rule, `fitted_deadline_s`, on this
  engine's floor), no more than that share (`ideal_shorts_late` in the JSON). Refusing
  fewer there would only serve more of them past the deadline: a one-slot CPU engine
  queues a conversation's short turns behind each other, whatever the door;
- where at least `RETRY_SAMPLES` short requests were refused: their `Retry-After` at most
  `RETRY_AFTER_FACTOR` times, at the median, the time until the lane next admitted a
  short request (an upper bound of when a retry would have been admitted).

Long requests' figures are reported beside, and said where there is a trade-off.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec

from gateway.config import BackendSettings, Settings, load_settings
from gateway.outcomes import QueueTimeout
from gateway.scheduling.fitting import fitted_deadline_s
from gateway.tools.matrix.engines import BY_NAME, EngineProfile
from gateway.tools.matrix.physics import capacity_rps, engine_floor_s, floor_prompts
from gateway.tools.matrix.traffic import Scale, arrivals, sizes
from gateway.tools.replay.ideal import run_ideal
from gateway.tools.replay.runs import Result, classify, run_direct, run_gateway
from gateway.tools.replay.sources import Arrival
from gateway.tools.stats import percentile

#: The promises (see the module's docstring).
FLOOR_FACTOR = 1.3
IDEAL_FACTOR = 1.1
OVERLOAD_FACTOR = 0.1
MAX_SHORT_REFUSED = 0.05
#: At or below this load the floor and ideal promises apply; above 1, the overload one.
MODERATE_LOAD = 0.8
#: Short requests "fit alone" while their own demand is under this share of what the
#: engines serve of short requests alone.
SHORTS_FIT_BELOW = 0.9
#: Refusals of short requests with a retry time before Retry-After is judged, and how
#: far over the wait that followed their median may be.
RETRY_SAMPLES = 5
RETRY_AFTER_FACTOR = 2.0
#: Requests in the closed loop that measures capacity.
CAPACITY_REQUESTS = 400
#: The seed of the requests that measure a cell's capacity and floor: properties of the
#: engine and the mix, so the same whatever schedules are replayed (taken from the first
#: schedule's seed, the floor of a cell run on seeds 4-6 was another than on 1-5).
CAPACITY_SEED = 10_001


@dataclass(frozen=True, slots=True)
class Cell:
    engine: str
    mix: str
    load: float

    @property
    def name(self) -> str:
        return f"{self.engine} / {self.mix} / {self.load:.0%}"

    @property
    def profile(self) -> EngineProfile:
        return BY_NAME[self.engine]


@dataclass(slots=True)
class Figures:
    """One run kind's figures over all seeds (seconds)."""

    short_p99_s: float | None = None
    short_p50_s: float | None = None
    long_p99_s: float | None = None
    long_p50_s: float | None = None
    long_e2e_p99_s: float | None = None
    shorts: int = 0
    longs: int = 0
    short_refused: int = 0
    long_refused: int = 0
    #: Of those refused, the ones admitted to the queue that then timed out in it: a
    #: broken promise (refused at arrival is the gateway's answer; this is its failure).
    admitted_timed_out: int = 0
    short_p99_by_seed: list[float | None] = field(default_factory=list)
    #: Retry-After of the refused short requests, and when the lane would really have
    #: taken them (seconds after the refusal: the first short arrival admitted after it).
    retry_after_s: list[float] = field(default_factory=list)
    admitted_again_s: list[float] = field(default_factory=list)
    #: Preemptions ([preemption]), and the engine's prefill work per answered prompt
    #: token (1.0: each prompt prefilled once; None: not counted, the ideal run).
    preempted: int = 0
    prefill_work: float | None = None

    def to_json(self) -> dict[str, Any]:
        return {k: _rounded(v) for k, v in dataclasses.asdict(self).items()}


def _rounded(value: Any) -> Any:
    if isinstance(value, float):
        return round(value, 4)
    if isinstance(value, list):
        return [_rounded(v) for v in value]
    return value


def gateway_settings(profile: EngineProfile, config_path: str | None = None) -> Settings:
    """The gateway's defaults (or `config_path`'s) in front of one backend of `profile`,
    its `max_concurrency` as a user following the docs (docs/clusters.md) sets it."""
    settings = load_settings(config_path)
    backend = BackendSettings(
        url="http://matrix-0.invalid",
        name="matrix-0",
        max_concurrency=profile.configured_slots,
    )
    return msgspec.structs.replace(settings, backends=[backend])


def short_class(settings: Settings) -> str:
    return settings.lanes[0].name


def run_cell(
    cell: Cell,
    seeds: Sequence[int],
    count: int,
    config_path: str | None = None,
) -> dict[str, Any]:
    """The cell's figures and checks, as JSON."""
    profile = cell.profile
    settings = gateway_settings(profile, config_path)
    short = short_class(settings)
    scale = Scale(profile.prompt_scale, profile.output_scale)
    engines = [profile.engine]
    sample = sizes(cell.mix, CAPACITY_REQUESTS, CAPACITY_SEED, scale)
    capacity = capacity_rps(engines, sample)
    ratio = profile.config.token_ratio
    sample_classes = [classify(a, settings, ratio) for a in sample]
    shorts_only = [a for a, c in zip(sample, sample_classes, strict=True) if c == short]
    short_share = len(shorts_only) / len(sample)
    short_capacity = capacity_rps(engines, shorts_only) if shorts_only else 0.0
    long_tokens, own_tokens = floor_prompts(sample, shorts_only)
    long_outputs = sorted(a.max_tokens for a, c in zip(sample, sample_classes, strict=True)
                          if c != short) or [1]  # fmt: skip
    long = Arrival(0.0, long_tokens, long_outputs[len(long_outputs) // 2])
    floor = engine_floor_s(profile.engine, long, own_tokens)
    runs: dict[str, list[Result]] = {"direct": [], "gateway": [], "ideal": []}
    work = {kind: [0, 0] for kind in runs}  # engine prompt tokens, answered ones
    by_seed: dict[str, list[float | None]] = {kind: [] for kind in runs}
    rate = cell.load * capacity
    for seed in seeds:
        schedule = arrivals(cell.mix, rate, count, seed, scale)
        classes = [classify(a, settings, ratio) for a in schedule]
        done = {
            "direct": run_direct(schedule, classes, 1, engines),
            "gateway": run_gateway(schedule, classes, settings, engines),
            "ideal": run_ideal(schedule, classes, short, engines),
        }
        for kind, run in done.items():
            runs[kind] += run.results
            by_seed[kind].append(_p99([r for r in run.results if r.cls == short]))
            work[kind][0] += run.engine_prompt_tokens
            work[kind][1] += run.answered_prompt_tokens
    figures = {kind: _figures(results, short, by_seed[kind]) for kind, results in runs.items()}
    for kind, (engine_tokens, answered) in work.items():
        figures[kind].prefill_work = engine_tokens / answered if answered else None
    shorts_fit = short_share * rate < SHORTS_FIT_BELOW * short_capacity
    lane = settings.lanes[0]
    deadline = fitted_deadline_s(lane.queue_timeout_s, floor, lane.fit_timeout_to_engine)
    ideal_late = _share_later_than(runs["ideal"], short, deadline)
    result: dict[str, Any] = {
        "engine": cell.engine,
        "mix": cell.mix,
        "load": cell.load,
        "seeds": list(seeds),
        "requests_per_seed": count,
        "capacity_rps": round(capacity, 4),
        "floor_s": round(floor, 4),
        "floor_prompts": {"long": long_tokens, "short": own_tokens},
        "shorts_fit_alone": shorts_fit,
        "short_deadline_s": round(deadline, 4),
        "ideal_shorts_late": round(ideal_late, 4),
        "floor_reachable": floor_reachable(floor, figures),
        "runs": {kind: fig.to_json() for kind, fig in figures.items()},
    }
    result["checks"] = checks(cell, floor, figures, shorts_fit, ideal_late)
    return result


def _share_later_than(results: Sequence[Result], short: str, deadline_s: float) -> float:
    """The share of short requests whose first token came after `deadline_s` (or never)."""
    shorts = [r for r in results if r.cls == short]
    late = sum(1 for r in shorts if r.ttft_s is None or r.ttft_s > deadline_s)
    return late / len(shorts) if shorts else 0.0


def _p99(results: Sequence[Result]) -> float | None:
    return percentile([r.ttft_s for r in results if r.ttft_s is not None], 99)


def _figures(results: Sequence[Result], short: str, by_seed: list[float | None]) -> Figures:
    shorts = [r for r in results if r.cls == short]
    longs = [r for r in results if r.cls != short]
    short_ttft = [r.ttft_s for r in shorts if r.ttft_s is not None]
    long_ttft = [r.ttft_s for r in longs if r.ttft_s is not None]
    long_e2e = [r.end - r.arrival for r in longs if r.end is not None]
    figures = Figures(
        short_p99_s=percentile(short_ttft, 99),
        short_p50_s=percentile(short_ttft, 50),
        long_p99_s=percentile(long_ttft, 99),
        long_p50_s=percentile(long_ttft, 50),
        long_e2e_p99_s=percentile(long_e2e, 99),
        shorts=len(shorts),
        longs=len(longs),
        short_refused=sum(1 for r in shorts if r.refused is not None),
        long_refused=sum(1 for r in longs if r.refused is not None),
        admitted_timed_out=sum(1 for r in results if r.refused == QueueTimeout.code),
        short_p99_by_seed=by_seed,
        preempted=sum(r.preempted for r in results),
    )
    for index, refused in enumerate(shorts):
        if refused.refused is None or refused.retry_after_s is None:
            continue
        later = next((r for r in shorts[index + 1 :] if r.refused is None and
                      r.arrival > refused.arrival), None)  # fmt: skip
        if later is not None:
            figures.retry_after_s.append(refused.retry_after_s)
            figures.admitted_again_s.append(later.arrival - refused.arrival)
    return figures


def floor_reachable(floor: float, figures: dict[str, Figures]) -> bool:
    """The ideal scheduler keeps short requests within the floor promise here."""
    ideal = figures["ideal"].short_p99_s
    return ideal is None or ideal <= FLOOR_FACTOR * floor


def checks(
    cell: Cell,
    floor: float,
    figures: dict[str, Figures],
    shorts_fit: bool,
    ideal_late: float = 0.0,
) -> list[dict[str, Any]]:
    """The promises that apply to this cell: name, figure, bound, passed."""
    gateway, ideal, direct = figures["gateway"], figures["ideal"], figures["direct"]
    found: list[dict[str, Any]] = []

    def check(name: str, value: float | None, bound: float | None) -> None:
        passed = value is not None and bound is not None and value <= bound
        found.append({"check": name, "value": _rounded(value), "bound": _rounded(bound),
                      "passed": passed})  # fmt: skip

    short = gateway.short_p99_s
    if cell.load <= MODERATE_LOAD:
        if floor_reachable(floor, figures):
            check("short P99 <= 1.3x floor", short, FLOOR_FACTOR * floor)
        if ideal.short_p99_s is not None:
            check("short P99 <= 1.1x ideal", short, IDEAL_FACTOR * ideal.short_p99_s)
    if cell.load > 1.0 and direct.short_p99_s is not None:
        check("short P99 <= 1/10 direct", short, OVERLOAD_FACTOR * direct.short_p99_s)
    if shorts_fit and gateway.shorts:
        refused = gateway.short_refused / gateway.shorts
        if ideal_late <= MAX_SHORT_REFUSED:
            check("shorts refused <= 5%", refused, MAX_SHORT_REFUSED)
        else:
            check("shorts refused <= the ideal's late share", refused, ideal_late)
    if len(gateway.retry_after_s) >= RETRY_SAMPLES:
        check(
            "Retry-After <= 2x the wait that followed",
            statistics.median(gateway.retry_after_s),
            RETRY_AFTER_FACTOR * statistics.median(gateway.admitted_again_s),
        )
    return found
