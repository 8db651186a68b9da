"""The rules across fields, which no single field's type can express: names filled in
and unique, lanes and keys naming what exists, `[[models]]` coherent with the backends
and each model's caps (`checked`, a ConfigError); and the settings that are valid but
contradict each other (`consistency_warnings`, printed by `check-config`).
"""

from __future__ import annotations

from urllib.parse import urlparse

from msgspec.structs import replace

from gateway.config.constraints import ConfigError
from gateway.config.models import model_limits
from gateway.config.settings import Settings


def _backend_name(url: str, dns: str, index: int) -> str:
    """A backend's name when the config gives none: its URL's host:port, its DNS name."""
    if dns:
        return dns.rpartition(":")[0]
    return urlparse(url).netloc or f"backend{index}"


def checked(settings: Settings) -> Settings:
    """Names filled in, then the checks no single field's type can express: every broken
    rule is said (one ConfigError, a line each), not only the first."""
    problems: list[str] = []
    s = replace(
        settings,
        backends=[
            b if b.name else replace(b, name=_backend_name(b.url, b.dns, index))
            for index, b in enumerate(settings.backends)
        ],
        api_keys=[
            k if k.name else replace(k, name=f"key{index + 1}")
            for index, k in enumerate(settings.api_keys)
        ],
    )
    if s.limits.default_max_tokens > s.limits.max_output_tokens:
        problems.append("[limits].default_max_tokens: must not exceed max_output_tokens")
    seen_backends: set[str] = set()
    for index, backend in enumerate(s.backends):
        where = f"[[backends]] #{index + 1}"
        if backend.name in seen_backends:
            problems.append(f"{where}.name: duplicate backend name {backend.name!r}")
        if not backend.url and not backend.dns:
            problems.append(f"{where}.url: must be set (or dns: a name whose records are servers)")
        elif backend.url and backend.dns:
            problems.append(f"{where}.dns: set url or dns, not both")
        if backend.models and backend.serves != "auto":
            problems.append(
                f"{where}.serves: only without models (with models, the config's list is "
                "what it serves)"
            )
        seen_backends.add(backend.name)
    seen_lanes: set[str] = set()
    for index, lane in enumerate(s.lanes):
        if lane.name in seen_lanes:
            problems.append(f"[[lanes]] #{index + 1}.name: duplicate lane name {lane.name!r}")
        seen_lanes.add(lane.name)
        unknown = sorted(set(lane.backends or ()) - seen_backends)
        if unknown and s.backends:
            problems.append(
                f"[[lanes]] {lane.name}.backends: no backend named {', '.join(unknown)} "
                f"(backends: {', '.join(sorted(seen_backends))})"
            )
    _check_models(s, problems)
    seen_keys: set[str] = set()
    for index, api_key in enumerate(s.api_keys):
        where = f"[[api_keys]] #{index + 1}"
        if api_key.key in seen_keys:
            problems.append(f"{where}.key: the same key twice")
        seen_keys.add(api_key.key)
        unknown_lanes = sorted(set(api_key.lanes or ()) - seen_lanes)
        if unknown_lanes:
            problems.append(f"{where}.lanes: no lane named {', '.join(unknown_lanes)}")
    if problems:
        raise ConfigError(*problems)
    return s


def _check_models(s: Settings, problems: list[str]) -> None:
    """[[models]]: unique names, one way to name targets, at most one default, and every
    target served by some backend when the backends say what they serve."""
    served = _named_models(s)
    catch_all = _has_catch_all(s)
    before = len(problems)
    seen: set[str] = set()
    defaults = []
    for index, model in enumerate(s.models):
        where = f"[[models]] #{index + 1}"
        if not model.name:
            problems.append(f"{where}.name: must be a non-empty name")
            continue
        if model.name in seen:
            problems.append(f"{where}.name: duplicate model name {model.name!r}")
        seen.add(model.name)
        if model.target is not None and model.targets is not None:
            problems.append(f"{where}: give target or targets, not both")
            continue
        if model.targets is not None and not model.targets:
            problems.append(f"{where}.targets: must list at least one target")
            continue
        if model.default:
            defaults.append(model.name)
        unserved = sorted({t for t, _ in model.weighted_targets()} - served)
        if unserved and not catch_all:
            problems.append(
                f"{where} {model.name}: no backend serves {', '.join(unserved)} "
                f"(served: {', '.join(sorted(served))})"
            )
    if len(defaults) > 1:
        problems.append(f"[[models]]: more than one default ({', '.join(defaults)})")
    if len(problems) == before:  # each model's caps follow its targets: only when sound
        _check_model_limits(s, problems)


def _named_models(s: Settings) -> set[str]:
    """The model names the backends say they serve."""
    return {m for b in s.backends for m in b.models}


def _has_catch_all(s: Settings) -> bool:
    """Some backend serves any name (it lists none, or none is configured: the simulator)."""
    return any(not b.models for b in s.backends) or not s.backends


def _check_model_limits(s: Settings, problems: list[str]) -> None:
    """Each model's caps in force obey the rule `[limits]` does, naming the entry."""
    for (name, target), limits in model_limits(s.models, s.limits).items():
        if limits.default_max_tokens > limits.max_output_tokens:
            via = "" if target == name else f", with {target}'s limits"
            problems.append(
                f"[[models]] {name}.limits.default_max_tokens: must not exceed "
                f"max_output_tokens ({limits.default_max_tokens} > {limits.max_output_tokens}{via})"
            )


def consistency_warnings(settings: Settings) -> list[str]:
    """Settings that are valid but contradict each other; `check-config` prints them."""
    s = settings
    warnings = []
    for lane in s.lanes:
        where = f"[[lanes]] {lane.name}"
        if lane.queue_timeout_s >= s.timeouts.total_s:
            warnings.append(
                f"{where}.queue_timeout_s ({lane.queue_timeout_s}) >= [timeouts].total_s "
                f"({s.timeouts.total_s}): a request could spend its whole time queued"
            )
        if lane.promote_after_s is not None and lane.promote_after_s >= lane.queue_timeout_s:
            warnings.append(
                f"{where}.promote_after_s ({lane.promote_after_s}) >= queue_timeout_s "
                f"({lane.queue_timeout_s}): requests time out before they are promoted"
            )
        if (
            lane.max_prompt_tokens is not None
            and lane.max_prompt_tokens > s.limits.max_prompt_tokens
        ):
            warnings.append(
                f"{where}.max_prompt_tokens ({lane.max_prompt_tokens}) > [limits].max_prompt_tokens "
                f"({s.limits.max_prompt_tokens}): the cap refuses those prompts first"
            )
    last = s.lanes[-1]
    if last.max_prompt_tokens is not None and last.max_prompt_tokens < s.limits.max_prompt_tokens:
        warnings.append(
            f"the last lane ({last.name}) admits prompts up to {last.max_prompt_tokens} tokens, "
            f"below [limits].max_prompt_tokens: larger prompts fit no lane and get 413"
        )
    if last.max_output_tokens is not None and last.max_output_tokens < s.limits.max_output_tokens:
        warnings.append(
            f"the last lane ({last.name}) admits outputs up to {last.max_output_tokens} tokens, "
            f"below [limits].max_output_tokens: larger budgets fit no lane"
        )
    for (name, _), limits in model_limits(s.models, s.limits).items():
        for key in ("max_prompt_tokens", "max_output_tokens"):
            cap, lane_cap = getattr(limits, key), getattr(last, key)
            if cap != getattr(s.limits, key) and lane_cap is not None and lane_cap < cap:
                warnings.append(
                    f"[[models]] {name}.limits.{key} ({cap}) > the last lane's ({last.name}, "
                    f"{lane_cap}): larger requests for it fit no lane"
                )
    if s.health.timeout_s >= s.health.interval_s:
        warnings.append("[health].timeout_s >= interval_s: health checks would overlap")
    if s.timeouts.first_token_s >= s.timeouts.total_s:
        warnings.append("[timeouts].first_token_s >= total_s: the first-token timeout never fires")
    if s.timeouts.pool_idle_s >= 5.0:
        warnings.append(
            "[timeouts].pool_idle_s >= 5: llama.cpp's server closes idle connections after 5 s; "
            "keep the pool's idle timeout below the backend's"
        )
    shadow_url = s.shadow.url.rstrip("/").lower()
    if shadow_url and shadow_url in {b.url.rstrip("/").lower() for b in s.backends}:
        warnings.append(
            "[shadow].url is also a [[backends]] url: the mirrors would compete with the "
            "primary's own requests on that engine; point it at the candidate"
        )
    unnamed = sorted(set(s.shadow.models) - _named_models(s) - {m.name for m in s.models})
    if unnamed and not _has_catch_all(s):
        warnings.append(
            f"[shadow].models: {', '.join(unnamed)} is named by no backend and no [[models]] "
            "entry: only an adapter a backend lists at run time can match it"
        )
    return warnings
