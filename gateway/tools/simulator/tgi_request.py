"""What a TGI request asks for: its body read as serde reads it, then TGI's router validation.

TGI refuses a body in two different ways, and a gateway in front of it has to
relay both: axum's `Json` extractor rejects a body that does not deserialize
with plain text (400/415/422) before any handler runs, and the router's
validation rejects a well-typed request that asks for something impossible
with `{"error", "error_type": "validation"}` and a 422. This module reproduces
both, in TGI's order and with its messages, and settles the request's size
with the simulator's tokenizer. It renders nothing: `tgi_api` does.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from gateway.tools.simulator.config import SimulatorConfig
from gateway.tools.simulator.errors import TgiRejection, tgi_validation
from gateway.tools.simulator.prefix_cache import PromptBlocks
from gateway.tools.simulator.tokens import PromptCounter, completion_prompt_parts

TGI_PIPELINE_TAG = "text-generation"
#: TGI launcher defaults, enforced where the simulator can (and reported by /info).
TGI_MAX_STOP_SEQUENCES = 4
TGI_MAX_TOP_N_TOKENS = 5
TGI_JSON = "application/json"


@dataclass(slots=True)
class TgiParams:
    """One TGI request after validation; size fields are set by `settle_size`."""

    inputs: str
    stream: bool
    details: bool
    decoder_input_details: bool
    return_full_text: bool
    best_of: int
    seed: int | None
    max_new_tokens: int = 0
    prompt_tokens: int = 0
    truncate: int | None = None
    #: The prompt (after `truncate`) as the engine's prefix cache sees it.
    blocks: PromptBlocks | None = None


# serde's names for the types GenerateParameters declares, and the fields of each kind.
_TGI_BOOL_FIELDS = ("do_sample", "watermark", "details", "decoder_input_details")
_TGI_INT_FIELDS = {
    "max_new_tokens": ("u32", 0, 2**32 - 1),
    "top_n_tokens": ("u32", 0, 2**32 - 1),
    "best_of": ("usize", 0, 2**64 - 1),
    "truncate": ("usize", 0, 2**64 - 1),
    "seed": ("u64", 0, 2**64 - 1),
    "top_k": ("i32", -(2**31), 2**31 - 1),
}
_TGI_FLOAT_FIELDS = ("temperature", "repetition_penalty", "frequency_penalty", "top_p", "typical_p")


def _serde_unexpected(value: Any) -> str:
    """How serde names a JSON value it did not expect."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"boolean `{'true' if value else 'false'}`"
    if isinstance(value, int):
        return f"integer `{value}`"
    if isinstance(value, float):
        return f"floating point `{value}`"
    if isinstance(value, str):
        return f'string "{value}"'
    return "sequence" if isinstance(value, list) else "map"


def _data_error(path: str, message: str) -> TgiRejection:
    prefix = f"{path}: " if path else ""
    return TgiRejection(
        422,
        "json_data",
        f"Failed to deserialize the JSON body into the target type: {prefix}{message}",
    )


def _invalid_type(path: str, value: Any, expected: str) -> TgiRejection:
    return _data_error(path, f"invalid type: {_serde_unexpected(value)}, expected {expected}")


async def read_body(request: web.Request, compat: bool) -> tuple[str, bool, dict[str, Any]]:
    """`inputs`, `stream` and `parameters` of a GenerateRequest, type-checked like serde does."""
    content_type = request.content_type
    if content_type != TGI_JSON and not (
        content_type.startswith("application/") and content_type.endswith("+json")
    ):
        raise TgiRejection(
            415, "unsupported_media_type", "Expected request with `Content-Type: application/json`"
        )
    try:
        body = json.loads(await request.read())
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:  # too deep: not ours to parse
        raise TgiRejection(
            400, "json_syntax", f"Failed to parse the request body as JSON: {exc}"
        ) from None
    struct = "struct CompatGenerateRequest" if compat else "struct GenerateRequest"
    if not isinstance(body, dict):
        raise _invalid_type("", body, struct)
    if "inputs" not in body:
        raise _data_error("", "missing field `inputs`")
    inputs = body["inputs"]
    if not isinstance(inputs, str):
        raise _invalid_type("inputs", inputs, "a string")
    parameters = body.get("parameters", {})
    if not isinstance(parameters, dict):
        raise _invalid_type("parameters", parameters, "struct GenerateParameters")
    stream = False
    if compat and "stream" in body:
        stream = body["stream"]
        if not isinstance(stream, bool):
            raise _invalid_type("stream", stream, "a boolean")
    for name in _TGI_BOOL_FIELDS:
        if name in parameters and not isinstance(parameters[name], bool):
            raise _invalid_type(f"parameters.{name}", parameters[name], "a boolean")
    flag = parameters.get("return_full_text")
    if flag is not None and not isinstance(flag, bool):
        raise _invalid_type("parameters.return_full_text", flag, "a boolean")
    for name, (kind, low, high) in _TGI_INT_FIELDS.items():
        value = parameters.get(name)
        if value is None:
            continue
        if type(value) is not int:
            raise _invalid_type(f"parameters.{name}", value, kind)
        if not low <= value <= high:
            raise _data_error(
                f"parameters.{name}", f"invalid value: integer `{value}`, expected {kind}"
            )
    for name in _TGI_FLOAT_FIELDS:
        value = parameters.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int | float)):
            raise _invalid_type(f"parameters.{name}", value, "f32")
    stop = parameters.get("stop", [])
    if not isinstance(stop, list):
        raise _invalid_type("parameters.stop", stop, "a sequence")
    for index, item in enumerate(stop):
        if not isinstance(item, str):
            raise _invalid_type(f"parameters.stop[{index}]", item, "a string")
    return inputs, stream, parameters


def validate_parameters(
    inputs: str, stream: bool, parameters: dict[str, Any], compat: bool
) -> TgiParams:
    """TGI's router validation up to tokenization, in its order; raises `TgiError`."""
    best_of = parameters.get("best_of")
    best_of = 1 if best_of is None else best_of
    return_full_text = parameters.get("return_full_text")
    if return_full_text is None:
        # `/` defaults it from the model's pipeline tag ("text-generation": the full text).
        return_full_text = compat and TGI_PIPELINE_TAG == "text-generation"
    if stream:
        if best_of != 1:
            raise tgi_validation("`best_of` != 1 is not supported when streaming tokens")
        if parameters.get("decoder_input_details", False):
            raise tgi_validation(
                "`decoder_input_details` == true is not supported when streaming tokens"
            )
    temperature = parameters.get("temperature")
    sampling = bool(parameters.get("do_sample", False)) or any(
        parameters.get(name) is not None for name in ("temperature", "top_k", "top_p", "typical_p")
    )
    if best_of > 1 and not sampling:
        raise tgi_validation("you must use sampling when `best_of` is > 1")
    if temperature is not None and temperature <= 0:
        raise tgi_validation("`temperature` must be strictly positive")
    penalty = parameters.get("repetition_penalty")
    if penalty is not None and penalty <= 0:
        raise tgi_validation("`repetition_penalty` must be strictly positive")
    for name in ("top_p", "typical_p"):
        value = parameters.get(name)
        if value is not None and not 0 < value < 1:
            raise tgi_validation(f"`{name}` must be > 0.0 and < 1.0")
    top_k = parameters.get("top_k")
    if top_k is not None and top_k <= 0:
        raise tgi_validation("`top_k` must be strictly positive")
    if parameters.get("max_new_tokens") == 0:
        raise tgi_validation("`max_new_tokens` must be strictly positive")
    stop = parameters.get("stop", [])
    if len(stop) > TGI_MAX_STOP_SEQUENCES:
        raise tgi_validation(
            f"`stop` supports up to {TGI_MAX_STOP_SEQUENCES} stop sequences. Given: {len(stop)}"
        )
    seed = parameters.get("seed")
    if seed is not None and best_of > 1:
        raise tgi_validation("`seed` must not be set when `best_of` > 1")
    top_n = parameters.get("top_n_tokens")
    if top_n is not None and top_n > TGI_MAX_TOP_N_TOKENS:
        raise tgi_validation(
            f"`top_n_tokens` must be >= 0 and <= {TGI_MAX_TOP_N_TOKENS}. Given: {top_n}"
        )
    if not inputs:
        raise tgi_validation("`inputs` cannot be empty")
    if not sampling:
        seed = None  # TGI reports a seed only for sampled generations
    elif seed is None:
        seed = random.getrandbits(64)
    return TgiParams(
        inputs=inputs,
        stream=stream,
        details=bool(parameters.get("details", False)),
        decoder_input_details=bool(parameters.get("decoder_input_details", False)),
        return_full_text=return_full_text,
        best_of=best_of,
        seed=seed,
    )


async def settle_size(
    params: TgiParams, parameters: dict[str, Any], config: SimulatorConfig, counter: PromptCounter
) -> None:
    """Count the prompt with the OpenAI routes' tokenizer and settle `max_new_tokens`."""
    limit = config.max_model_len
    max_input = limit - 1
    truncate = parameters.get("truncate")
    if truncate is not None and (truncate == 0 or truncate > max_input):
        raise tgi_validation(
            f"`truncate` must be strictly positive and less than {max_input}. Given: {truncate}"
        )
    # TGI truncates to the prompt's last `truncate` tokens: that is what it prefills and
    # what its prefix cache (TGI 3's radix allocator) matches.
    blocks = await counter.encode_async(
        completion_prompt_parts(params.inputs),
        lambda ids: config.backend_prompt(ids, keep_last=truncate),
    )
    input_length = blocks.tokens
    requested = parameters.get("max_new_tokens")
    if requested is None:
        # TGI's server-side default fills the rest of the window; with no EOS here that
        # would run to max_model_len, so the simulator's default_max_tokens caps it.
        max_new_tokens = max(0, min(config.default_max_tokens, limit - input_length))
    else:
        max_new_tokens = requested
    if input_length + max_new_tokens > limit:
        raise tgi_validation(
            f"`inputs` tokens + `max_new_tokens` must be <= {limit}. Given: {input_length} "
            f"`inputs` tokens and {max_new_tokens} `max_new_tokens`"
        )
    if input_length > max_input:
        raise tgi_validation(
            f"`inputs` must have less than {max_input} tokens. Given: {input_length}"
        )
    params.prompt_tokens = input_length
    params.max_new_tokens = max_new_tokens
    params.truncate = truncate
    params.blocks = blocks
