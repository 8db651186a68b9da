"""`check-config` itself: the settings as they will run, with every secret masked, and
a warning for each place where two settings disagree or an environment variable sets
nothing (a typo). Nothing is contacted; `--probe` (`checks.probe`) does that."""

from __future__ import annotations

import json
import os
import sys

from gateway.admission.tokens import EncodingUnavailable, load_encoding
from gateway.config import LaneSettings, Settings, consistency_warnings, unrecognized_env_names
from gateway.fleet.store import mask_url_password
from gateway.scheduling.fitting import DEADLINE_OVER_FLOOR, WAIT_ALLOWANCE_OVER_FLOOR
from gateway.scheduling.headroom import TAIL_PROBABILITY, WAIT_PROBABILITY
from gateway.upstream.sizing import UNLEARNED_DEADLINE_S


def deadline_rule(lane: LaneSettings) -> str:
    """What a lane's queue deadline will be, from the config alone (`--probe` measures
    the engine and says the figure in force)."""
    configured = f"{lane.queue_timeout_s:g} s"
    if not lane.fit_timeout_to_engine:
        return f"{configured}, exact (configured; fit_timeout_to_engine off)"
    return (
        f"fitted at run time: {configured} or {DEADLINE_OVER_FLOOR:g}x the measured engine "
        "floor, whichever is "
        f"longer, and {UNLEARNED_DEADLINE_S:g} s while the engine's prefill is unmeasured "
        "(fit_timeout_to_engine is on, as it is by default while queue_timeout_s is unset; "
        "write queue_timeout_s to make it exact)"
    )


def headroom_rule(lane: LaneSettings) -> str:
    """What a lane's headroom (the slots the lanes below leave it) will follow, from the
    config alone: its measured demand, by the written probability or the adapted rule."""
    written = lane.headroom_wait_probability
    if written is not None:
        return (
            f"the slots with which at most {written:.0%} of its arrivals find every one busy, "
            "at its measured demand (configured: exact)"
        )
    return (
        f"adapted at run time: the slots with which at most {WAIT_PROBABILITY:.0%} of its "
        f"arrivals find every one busy and at most {TAIL_PROBABILITY:.0%} wait longer than "
        f"{WAIT_ALLOWANCE_OVER_FLOOR:g}x the measured engine floor, at its measured demand, "
        "where that leaves the lanes below a slot (write headroom_wait_probability to have "
        "that probability alone)"
    )


def check_config(settings: Settings) -> int:
    try:
        load_encoding(settings.tokenizer.encoding)
    except EncodingUnavailable as exc:
        print(f"config error: [tokenizer].encoding: {exc}", file=sys.stderr)
        return 2
    effective = settings.to_dict()  # fresh dicts: masking the secrets leaves settings be
    for api_key in effective["api_keys"]:
        api_key["key"] = "***"  # never print secrets
    for backend in effective["backends"]:
        if backend["api_key"] is not None:
            backend["api_key"] = "***"
    if effective["shadow"]["api_key"] is not None:
        effective["shadow"]["api_key"] = "***"
    effective["redis"]["url"] = mask_url_password(effective["redis"]["url"])
    effective["lane_slot_limits"] = {
        lane.name: settings.lane_slot_limit(lane) for lane in settings.lanes
    }
    effective["lane_deadlines"] = {lane.name: deadline_rule(lane) for lane in settings.lanes}
    effective["lane_headroom"] = {lane.name: headroom_rule(lane) for lane in settings.lanes}
    print(json.dumps(effective, indent=2))
    for lane in settings.lanes:
        print(f"note: lane '{lane.name}': queue deadline {deadline_rule(lane)}", file=sys.stderr)
    for warning in consistency_warnings(settings):
        print(f"warning: {warning}", file=sys.stderr)
    for name in unrecognized_env_names(os.environ):
        print(f"warning: environment variable {name} sets no setting (typo?)", file=sys.stderr)
    if not settings.backends:
        print(
            "note: no backend configured; `serve` will start the built-in simulator",
            file=sys.stderr,
        )
    return 0
