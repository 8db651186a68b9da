"""What a reload applies and what it keeps for a restart (`gateway/reload.py`)."""

from __future__ import annotations

from msgspec.structs import replace

from gateway.config import LaneSettings, Settings, default_lanes, validate
from gateway.reload import changed_sections, kept_for_restart, settings_hash


def test_what_cannot_change_live_keeps_its_old_value_and_is_named() -> None:
    old = validate(Settings())
    new = replace(
        old,
        server=replace(old.server, port=9999, read_timeout_s=5.0),
        tokenizer=replace(old.tokenizer, offload_min_chars=10),
        health=replace(old.health, state_file="/elsewhere", interval_s=1.0),
        lanes=[replace(lane, queue_timeout_s=1.0) for lane in old.lanes],
    )
    applied, not_applied = kept_for_restart(old, new)
    assert not_applied == ["tokenizer", "server.port", "health.state_file"]
    assert applied.server.port == old.server.port and applied.server.read_timeout_s == 5.0
    assert applied.tokenizer == old.tokenizer
    assert applied.health.state_file == old.health.state_file
    assert applied.health.interval_s == 1.0
    assert [lane.queue_timeout_s for lane in applied.lanes] == [1.0, 1.0]
    assert changed_sections(old, applied) == ["server", "lanes", "health"]


def test_lanes_renamed_or_reordered_are_kept_as_they_were() -> None:
    old = validate(Settings())
    lanes = [*reversed(default_lanes()), LaneSettings(name="extra")]
    applied, not_applied = kept_for_restart(old, replace(old, lanes=lanes))
    assert not_applied == ["lanes (names and order)"]
    assert applied.lanes == old.lanes


def test_the_same_settings_have_the_same_digest() -> None:
    assert settings_hash(validate(Settings())) == settings_hash(validate(Settings()))
    other = validate(Settings(lanes=[LaneSettings(name="only")]))
    assert settings_hash(other) != settings_hash(validate(Settings()))
