"""`check-config` itself: the settings as they will run, with every secret masked, and
a warning for each place where two settings disagree or an environment variable sets
nothing (a typo). Nothing is contacted; `--probe` (`checks.probe`) does that."""

from __future__ import annotations

import json
import os
import sys

from gateway.admission.tokens import EncodingUnavailable, load_encoding
from gateway.config import Settings, consistency_warnings, unrecognized_env_names
from gateway.fleet.store import mask_url_password


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
    print(json.dumps(effective, indent=2))
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
