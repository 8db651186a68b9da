"""The API page for callers (`python -m gateway api-doc`) says what the code and config do.

The page is read back as Markdown, table by table, and held to the tables it is built
from: one row per error code in `ERRORS` (no more, no fewer), every lane of a config in
order with its bounds, the committed docs/api.md equal to the command's output. The
command itself runs as a real subprocess, as a caller's CI would run it.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

from gateway.apidoc import render
from gateway.app import build_app
from gateway.config import (
    BackendSettings,
    ModelLimits,
    ModelSettings,
    Settings,
    load_settings,
    validate,
)
from gateway.http.errors import CALLER_ADVICE, ERRORS, REFUSAL_HEADER, RETRY_AFTER_CODES
from tests.conftest import encoding

ROOT = Path(__file__).resolve().parent.parent
COMMITTED_PAGE = ROOT / "docs" / "api.md"
REGENERATE = "python -m gateway api-doc --output docs/api.md"

#: Three lanes, a lane name with a pipe in it (it must not break a table), reject mode,
#: client keys with lane rights and one allowed to choose its lane.
CUSTOM_CONFIG = """
[server]
port = 9123
sse_keepalive_s = 7.5

[limits]
max_prompt_tokens = 16000
default_max_tokens = 100
max_output_tokens = 2048
on_max_tokens_over = "reject"
context_window = 20000
max_n = 4

[[lanes]]
name = "chat"
max_prompt_tokens = 300
max_output_tokens = 64
queue_timeout_s = 2.5
max_queue_depth = 40

[[lanes]]
name = "rag|docs"
max_prompt_tokens = 6000
max_output_tokens = 512
queue_timeout_s = 12
max_queue_depth = 20
fit_timeout_to_engine = false

[[lanes]]
name = "batch"
queue_timeout_s = 90
max_queue_depth = 8
promote_after_s = 40
reject_predicted_wait = false
fit_timeout_to_engine = true

[[api_keys]]
name = "web"
key = "web-secret-0123456789"
lanes = ["chat"]

[[api_keys]]
name = "etl"
key = "etl-secret-0123456789"
allow_lane_override = true
"""


def run_api_doc(*args: str) -> subprocess.CompletedProcess[str]:
    """The command as a caller runs it, with no GATEWAY_* variable of this shell."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GATEWAY_")}
    return subprocess.run(
        [sys.executable, "-m", "gateway", "api-doc", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def section(page: str, heading: str) -> str:
    """The text under `heading` (any level) up to the next heading of the same level."""
    level = heading.split(" ", 1)[0]
    start = page.index(f"\n{heading}\n")
    end = page.find(f"\n{level} ", start + 1)
    return page[start : end if end != -1 else len(page)]


def tables(text: str) -> list[list[list[str]]]:
    """Every Markdown table in `text`: rows of cells, the header row first."""
    found: list[list[list[str]]] = []
    current: list[list[str]] = []
    for line in [*text.splitlines(), ""]:
        if line.startswith("|"):
            cells = re.split(r"(?<!\\)\|", line.strip()[1:-1])
            row = [c.strip().replace("\\|", "|") for c in cells]
            if not all(re.fullmatch(r"-+", c) for c in row):
                current.append(row)
        elif current:
            found.append(current)
            current = []
    return found


def table_under(page: str, heading: str, first_column: str) -> list[dict[str, str]]:
    """The rows, as dicts by header, of the table under `heading` that starts with
    `first_column`."""
    for rows in tables(section(page, heading)):
        header, *body = rows
        if header[0] == first_column:
            for row in body:
                assert len(row) == len(header), row
            return [dict(zip(header, row, strict=True)) for row in body]
    raise AssertionError(f"no table starting with {first_column!r} under {heading!r}")


def unquoted(text: str) -> str:
    return text.strip("`")


@pytest.fixture(scope="module")
def default_page() -> str:
    return render(Settings())


@pytest.fixture(scope="module")
def custom_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    config = tmp_path_factory.mktemp("api-doc") / "tmp.toml"
    config.write_text(CUSTOM_CONFIG)
    result = run_api_doc("--config", str(config))
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    return config, result.stdout


# --- the errors ---------------------------------------------------------------------------


def test_the_page_has_a_row_for_every_error_code_and_no_other(default_page: str) -> None:
    rows = table_under(default_page, "## Errors", "code")
    codes = [unquoted(row["code"]) for row in rows]
    assert sorted(codes) == sorted(ERRORS), "one row per code of ERRORS, none twice"
    for row in rows:
        kind = ERRORS[unquoted(row["code"])]
        assert int(row["status"]) == kind.status
        assert unquoted(row["type"]) == kind.type
        assert row["when"] == kind.situation
        assert row["what to do"] == CALLER_ADVICE[unquoted(row["code"])]
        assert (row["Retry-After"] == "yes") == (unquoted(row["code"]) in RETRY_AFTER_CODES)


def test_every_error_code_has_advice_for_callers_and_nothing_else_has() -> None:
    assert set(CALLER_ADVICE) == set(ERRORS)
    assert all(advice.strip() for advice in CALLER_ADVICE.values())


def test_every_code_with_retry_after_is_explained(default_page: str) -> None:
    retry = section(default_page, "## Retry-After")
    # Each bullet names its codes before the first colon, then says how the figure is made.
    named = " ".join(line.split(":", 1)[0] for line in retry.splitlines() if line.startswith("- "))
    for code in RETRY_AFTER_CODES:
        assert f"`{code}`" in named, code
    assert "5 s" in retry  # [health].interval_s: no_backend's Retry-After


def test_the_error_example_and_stream_events_are_the_codes_own(default_page: str) -> None:
    errors = section(default_page, "## Errors")
    example = re.search(r"```json\n(.*?)```", errors, re.DOTALL)
    assert example is not None
    body = msgspec.json.decode(example.group(1))["error"]
    assert body["code"] == "prompt_too_long"
    assert body["type"] == ERRORS["prompt_too_long"].type
    assert "32768" in body["message"]
    stream = section(default_page, "## Streaming")
    assert 'data: {"error":{"message":"…","type":"service_unavailable"' in stream
    assert 'data: {"error":"…","error_type":"queue_timeout","retry_after":5,' in stream
    assert '"code":"queue_timeout","retry_after":5,"queue_ms":' in stream
    assert f"`{REFUSAL_HEADER}`" in section(default_page, "## Headers")


# --- lanes, caps and keys from a custom config ---------------------------------------------


def test_every_lane_of_a_custom_config_appears_in_order_with_its_bounds(
    custom_run: tuple[Path, str],
) -> None:
    _, page = custom_run
    lanes = table_under(page, "## Lanes: which queue a request waits in", "order")
    assert [(row["order"], unquoted(row["lane"])) for row in lanes] == [
        ("1", "chat"),
        ("2", "rag|docs"),
        ("3", "batch"),
    ]
    chat, rag, batch = lanes
    assert (chat["prompt tokens"], chat["output budget"]) == ("≤ 300", "≤ 64")
    assert (rag["prompt tokens"], rag["output budget"]) == ("≤ 6,000", "≤ 512")
    assert (batch["prompt tokens"], batch["output budget"]) == ("any", "any")
    assert [row["queue deadline"] for row in lanes] == ["2.5 s", "12 s", "90 s"]
    assert [row["max queued"] for row in lanes] == ["40", "20", "8"]
    assert [row["promoted after"] for row in lanes] == ["never", "never", "40 s"]
    assert [row["open to"] for row in lanes] == ["`web`, `etl`", "`etl`", "`etl`"]

    deadlines = table_under(page, "## Deadlines and timeouts", "lane")
    assert [unquoted(row["lane"]) for row in deadlines] == ["chat", "rag|docs", "batch"]
    assert [row["configured queue deadline"] for row in deadlines] == ["2.5 s", "12 s", "90 s"]
    # A written deadline is exact, unless fitting is written too (batch's).
    assert deadlines[0]["fitted to the engine"].startswith("no: exact")
    assert deadlines[1]["fitted to the engine"].startswith("no: exact")
    assert deadlines[2]["fitted to the engine"].startswith("yes")
    assert "503 `queue_timeout`" in deadlines[2]["refused at arrival"]


def test_the_examples_follow_the_lanes_and_the_caps(custom_run: tuple[Path, str]) -> None:
    _, page = custom_run
    rows = table_under(page, "## Lanes: which queue a request waits in", "prompt tokens")
    got = {(r["prompt tokens"], r["max_tokens"], r["n"]): r["lane, or refusal"] for r in rows}
    assert got[("100", "not set", "1")] == "`rag|docs`, max_tokens 100"  # 100 > chat's 64
    assert got[("100", "64", "1")] == "`chat`, max_tokens 64"
    assert got[("100", "65", "1")] == "`rag|docs`, max_tokens 65"
    assert got[("100", "33", "2")] == "`rag|docs`, max_tokens 33"  # 2 x 33 > 64
    assert got[("6,001", "not set", "1")] == "`batch`, max_tokens 100"
    assert got[("16,001", "not set", "1")] == "413 `prompt_too_long`"
    assert got[("100", "4,096", "1")] == "400 `max_tokens_too_large`"  # reject mode


def test_caps_keys_and_keepalive_of_a_custom_config(custom_run: tuple[Path, str]) -> None:
    config, page = custom_run
    assert f"from `{config}`" in page
    caps = {row["what"]: row for row in table_under(page, "## Caps and defaults", "what")}
    assert caps["prompt tokens"]["limit"] == "16,000"
    assert caps["`max_tokens` when you leave it out"]["limit"] == "100"
    assert caps["`max_tokens` per choice"]["over it"] == "refused: 400 `max_tokens_too_large`"
    assert caps["prompt + `max_tokens`"]["limit"] == "20,000 tokens"
    assert caps["`n` (choices), TGI `best_of`"]["limit"] == "4"
    keys = table_under(page, "### Choosing a lane yourself: `X-Gateway-Lane`", "key")
    assert [(r["key"], r["lanes it may use"], r["may send X-Gateway-Lane"]) for r in keys] == [
        ("`web`", "`chat`", "no"),
        ("`etl`", "all", "yes"),
    ]
    assert "secret" not in page  # key names are shown, the keys never
    assert "every 7.5 s" in section(page, "## Streaming")
    assert "http://<gateway>:9123/v1" in page


def test_the_output_flag_writes_what_stdout_shows(
    custom_run: tuple[Path, str], tmp_path: Path
) -> None:
    config, page = custom_run
    target = tmp_path / "api.md"
    result = run_api_doc("--config", str(config), "--output", str(target))
    assert result.returncode == 0, result.stderr
    assert result.stdout == ""
    assert target.read_text(encoding="utf-8") == page


def test_a_bad_config_fails_with_one_line_and_no_page(tmp_path: Path) -> None:
    config = tmp_path / "bad.toml"
    config.write_text('[limits]\non_max_tokens_over = "truncate"\n')
    result = run_api_doc("--config", str(config))
    assert result.returncode == 2
    assert result.stdout == ""
    assert "[limits].on_max_tokens_over" in result.stderr


def test_keepalive_off_is_said_so() -> None:
    settings = load_settings(env={"GATEWAY_SERVER_SSE_KEEPALIVE_S": "0"})
    streaming = section(render(settings), "## Streaming")
    assert "Keepalive is off here" in streaming
    assert ": queued" not in streaming


# --- the endpoints and the committed page ------------------------------------------------


def test_every_route_a_caller_may_use_is_on_the_page(default_page: str) -> None:
    app = build_app(Settings(), encoding=encoding())
    routes = {
        f"{route.method} {route.resource.canonical}"
        for route in app.router.routes()
        if route.resource is not None
        and route.method != "HEAD"
        and not route.resource.canonical.startswith("/debug/")
    }
    listed = {unquoted(row["route"]) for row in table_under(default_page, "## Endpoints", "route")}
    assert routes <= listed


def test_docs_api_md_is_what_the_command_makes_for_the_default_config() -> None:
    result = run_api_doc()
    assert result.returncode == 0, result.stderr
    committed = COMMITTED_PAGE.read_text(encoding="utf-8") if COMMITTED_PAGE.exists() else ""
    assert committed == result.stdout, (
        f"docs/api.md is stale: regenerate it with `{REGENERATE}` "
        "(with no GATEWAY_* variable set) and commit it"
    )


def test_models_with_caps_of_their_own_are_listed_under_the_caps() -> None:
    settings = validate(
        Settings(
            backends=[BackendSettings(url="http://127.0.0.1:1", models=["small", "big"])],
            models=[
                ModelSettings(
                    name="small", limits=ModelLimits(max_prompt_tokens=4096, context_window=8192)
                ),
                ModelSettings(
                    name="fast", target="small", limits=ModelLimits(max_output_tokens=300)
                ),
            ],
        )
    )
    rows = table_under(render(settings), "## Caps and defaults", "model")
    assert [tuple(row.values()) for row in rows] == [
        ("`small`", "4,096", "256", "1,024", "8,192"),
        ("`fast` (→ `small`)", "4,096", "256", "300", "8,192"),
    ]
    assert "caps of their own" not in section(render(Settings()), "## Caps and defaults")
