"""The lanes, what puts a request in each, and the caps: the page's sizing sections.

The examples are not written by hand: each is a request shape run through `admit`,
the very function the gateway admits requests with, so a changed bound or cap shows
on the page as the gateway would now decide.
"""

from __future__ import annotations

from gateway.admission.admit import RequestShape, admit
from gateway.apidoc.markdown import code, count, seconds, table
from gateway.config import LaneSettings, Settings, model_limits
from gateway.http.errors import ERRORS
from gateway.outcomes import Refusal

#: A prompt the examples call short (or the smallest lane's bound, when smaller).
SHORT_PROMPT_TOKENS = 100


def _open_to(settings: Settings, lane: LaneSettings) -> str:
    if not settings.api_keys:
        return "every caller"
    names = [k.name for k in settings.api_keys if k.lanes is None or lane.name in k.lanes]
    return ", ".join(code(n) for n in names) if names else "no key"


def lanes_section(settings: Settings) -> list[str]:
    """The lanes in priority order, with worked examples: callers size requests by them."""
    limits = settings.limits
    rows = []
    for order, lane in enumerate(settings.lanes, 1):
        prompt = "any" if lane.max_prompt_tokens is None else f"≤ {count(lane.max_prompt_tokens)}"
        output = "any" if lane.max_output_tokens is None else f"≤ {count(lane.max_output_tokens)}"
        promoted = "never" if lane.promote_after_s is None else seconds(lane.promote_after_s)
        rows.append(
            (
                order,
                code(lane.name),
                prompt,
                output,
                seconds(lane.queue_timeout_s),
                count(lane.max_queue_depth),
                promoted,
                _open_to(settings, lane),
            )
        )
    first = settings.lanes[0].name
    return [
        "## Lanes: which queue a request waits in",
        "",
        "A short request should not wait behind a long one, so requests are sorted into "
        "lanes by their size *before* they queue. A request goes into the **first lane, in "
        "this order, whose bounds admit both** its prompt tokens and its output budget. "
        f"Prompt tokens are counted by the gateway (tiktoken `{settings.tokenizer.encoding}`, "
        "scaled to the model's tokens once it has learned the ratio from the backends' "
        "`usage`); the output budget is `max_tokens` × `n` × the number of prompts, with "
        f"`max_tokens` = {count(limits.default_max_tokens)} when you leave it out. A free "
        f"slot goes to the oldest request of the highest lane (`{first}` first); a request "
        "of a lower lane that has waited its lane's *promoted after* time goes before "
        "them, so no lane starves.",
        "",
        *table(
            (
                "order",
                "lane",
                "prompt tokens",
                "output budget",
                "queue deadline",
                "max queued",
                "promoted after",
                "open to",
            ),
            rows,
        ),
        "",
        "A request no lane admits gets 413 `prompt_too_long`. The queue deadline is the "
        "configured figure; see [Deadlines](#deadlines-and-timeouts) for how it may be "
        "fitted to the engine. What some requests get, worked out by the gateway's own "
        "admission code:",
        "",
        *_examples(settings),
        "",
        *_lane_override(settings),
    ]


def _example_cases(settings: Settings) -> list[tuple[int, int | None, int]]:
    """(prompt tokens, max_tokens or None, n): one short request, each lane's edges, the caps."""
    limits = settings.limits
    bounds = [lane.max_prompt_tokens for lane in settings.lanes if lane.max_prompt_tokens]
    short = min([SHORT_PROMPT_TOKENS, *bounds])
    cases: list[tuple[int, int | None, int]] = [(short, None, 1)]
    for lane in settings.lanes:
        if lane.max_prompt_tokens is not None:
            cases += [(lane.max_prompt_tokens, None, 1), (lane.max_prompt_tokens + 1, None, 1)]
        if lane.max_output_tokens is not None:
            out = lane.max_output_tokens
            cases += [(short, out, 1), (short, out + 1, 1)]
            if limits.max_n >= 2:
                cases.append((short, out // 2 + 1, 2))
    cases += [(limits.max_prompt_tokens + 1, None, 1), (short, limits.max_output_tokens * 2, 1)]
    return list(dict.fromkeys(cases))


def _examples(settings: Settings) -> list[str]:
    rows = []
    for prompt_tokens, max_tokens, n in _example_cases(settings):
        shape = RequestShape(
            body={},
            prompt_param="messages",
            model=None,
            stream=False,
            prompt_tokens=prompt_tokens,
            longest_prompt_tokens=prompt_tokens,
            requested_max_tokens=max_tokens,
            max_tokens_fields=("max_tokens",) if max_tokens is not None else (),
            n=n,
            prompt_count=1,
            client_wants_usage=False,
        )
        try:
            admission = admit(shape, settings)
        except Refusal as refusal:
            result = f"{ERRORS[refusal.code].status} {code(refusal.code)}"
        else:
            budget = admission.budget
            result = f"{code(admission.lane.name)}, max_tokens {count(budget.max_tokens)}"
            if budget.clamped:
                result += " (clamped)"
        asked = "not set" if max_tokens is None else count(max_tokens)
        rows.append((count(prompt_tokens), asked, n, result))
    return table(("prompt tokens", "max_tokens", "n", "lane, or refusal"), rows)


def _lane_override(settings: Settings) -> list[str]:
    lines = [
        "### Choosing a lane yourself: `X-Gateway-Lane`",
        "",
        "For the rare job that must get through whatever its size (a long-context summary "
        "that would otherwise be refused), an API key allowed to choose its lane may send "
        "`X-Gateway-Lane: <lane>`: the request goes in that lane, skipping the lanes' size "
        "bounds but not the caps below. A lane name that does not exist gets 400 "
        "`invalid_lane`. From any other caller the header is ignored (and logged).",
        "",
    ]
    if not settings.api_keys:
        lines.append(
            "**Here:** no API keys are configured, so no `Authorization` header is needed, "
            "every lane is open to every caller, and nobody may choose a lane."
        )
        return lines
    rows = [
        (
            code(k.name),
            "all" if k.lanes is None else ", ".join(code(n) for n in k.lanes) or "none",
            "yes" if k.allow_lane_override else "no",
        )
        for k in settings.api_keys
    ]
    lines += [
        "**Here:** API keys are configured: every generation request needs "
        "`Authorization: Bearer <key>` (401 `invalid_api_key` otherwise). A key limited to "
        "some lanes gets 403 `lane_not_allowed` for a request whose size puts it in "
        "another lane.",
        "",
        *table(("key", "lanes it may use", "may send X-Gateway-Lane"), rows),
    ]
    return lines


def caps_section(settings: Settings) -> list[str]:
    """The caps and what happens over each, so callers trim before they are refused."""
    limits, server = settings.limits, settings.server
    cap = count(limits.max_output_tokens)
    if limits.on_max_tokens_over == "clamp":
        over = (
            f"lowered to {cap}, and the answer says so: `x-gateway-max-tokens: "
            f"{limits.max_output_tokens}`, `x-gateway-max-tokens-clamped-from: <yours>`"
        )
    else:
        over = "refused: 400 `max_tokens_too_large`"
    window = (
        "not configured: taken from the backends when they report one (llama.cpp, TGI, vLLM)"
        if limits.context_window == 0
        else f"{count(limits.context_window)} tokens"
    )
    rows = [
        ("prompt tokens", count(limits.max_prompt_tokens), "413 `prompt_too_long`"),
        (
            "`max_tokens` when you leave it out",
            count(limits.default_max_tokens),
            "(a default, so that no request may generate up to the context window)",
        ),
        ("`max_tokens` per choice", cap, over),
        (
            "prompt + `max_tokens`",
            window,
            "400 `context_length_exceeded`; a default or clamped `max_tokens` is lowered to fit",
        ),
        ("`n` (choices), TGI `best_of`", count(limits.max_n), "400 `invalid_request`"),
        ("request body", f"{count(server.max_body_bytes)} bytes", "413 `body_too_large`"),
        (
            "time for the body to arrive",
            seconds(server.read_timeout_s),
            "408 `request_timeout`",
        ),
    ]
    return [
        "## Caps and defaults",
        "",
        *table(("what", "limit", "over it"), rows),
        "",
        "`max_tokens` means the output cap of each API: `max_tokens` or "
        "`max_completion_tokens` on chat (the smaller counts; the backend gets the capped "
        "value in both), `max_tokens` on completions, `parameters.max_new_tokens` on TGI. "
        "Token counts are in the model's tokens, as the gateway estimates them. The "
        "gateway may tighten these caps at run time to what its backends accept (their "
        "context window, their largest input); `x-gateway-max-tokens` always shows the "
        "value in force. Long tasks: split or summarize the input rather than raising "
        "`max_tokens` — a long request waits in a slower lane and holds a slot longer.",
        *_model_caps(settings),
    ]


def _model_caps(settings: Settings) -> list[str]:
    """The models whose caps differ from the table above (`[[models]] limits`)."""
    rows = []
    for (name, target), limits in model_limits(settings.models, settings.limits).items():
        window = count(limits.context_window) if limits.context_window else "from the backends"
        rows.append(
            (
                code(name) if target == name else f"{code(name)} (→ {code(target)})",
                count(limits.max_prompt_tokens),
                count(limits.default_max_tokens),
                count(limits.max_output_tokens),
                window,
            )
        )
    if not rows:
        return []
    header = ("model", "prompt tokens", "default `max_tokens`", "`max_tokens` per choice")
    return [
        "",
        "These models have caps of their own (the refusals are the same, with their numbers):",
        "",
        *table((*header, "context window"), rows),
    ]
