"""The gateway's own OpenAPI 3.0 document, served at GET /openapi.json.

It describes what the *gateway* checks before a request takes a place in a queue
(admission: types, roles, content parts, positive output caps, `n` up to the
configured `max_n`), not everything a model server may refuse later: fields the
gateway does not read are passed through to the backend untouched, and a
backend's 4xx comes back with its own status and body. That split is what lets a
schema-driven fuzzer (schemathesis) hold the gateway to it: whatever violates
this document must be refused by the gateway itself with a 4xx in the OpenAI
error envelope, and nothing valid may ever earn a 5xx from the gateway.

The document is built from the settings in force, so `n`'s maximum and the body
size limit are the ones this gateway enforces.
"""

from __future__ import annotations

import importlib.metadata
import json
from typing import Any

from aiohttp import web

from gateway.admission.tokens import CHAT_ROLES, MAX_TOKEN_ID
from gateway.config import Settings
from gateway.state import GATEWAY

OPENAPI_VERSION = "3.0.3"
JSON = "application/json"
SSE = "text/event-stream"

Schema = dict[str, Any]


def _ref(name: str) -> Schema:
    return {"$ref": f"#/components/schemas/{name}"}


def _response_ref(name: str) -> Schema:
    return {"$ref": f"#/components/responses/{name}"}


def _positive_int(description: str, maximum: int | None = None) -> Schema:
    schema: Schema = {"type": "integer", "minimum": 1, "nullable": True, "description": description}
    if maximum is not None:
        schema["maximum"] = maximum
    return schema


def _error_response(description: str, *, retry_after: bool = False) -> Schema:
    response: Schema = {
        "description": description,
        "content": {JSON: {"schema": _ref("ErrorEnvelope")}},
    }
    if retry_after:
        response["headers"] = {"Retry-After": {"$ref": "#/components/headers/Retry-After"}}
    return response


def _schemas(settings: Settings) -> dict[str, Schema]:
    max_n = settings.limits.max_n
    token_id: Schema = {"type": "integer", "minimum": 0, "maximum": MAX_TOKEN_ID}
    nullable_string: Schema = {"type": "string", "nullable": True}
    common_openai: dict[str, Schema] = {
        "model": {**nullable_string, "description": "A string, passed to the backend as is."},
        "stream": {
            "type": "boolean",
            "nullable": True,
            "description": "true: Server-Sent Events, relayed byte for byte.",
        },
        "stream_options": {
            "type": "object",
            "nullable": True,
            "description": "Passed through; the gateway adds include_usage=true towards the "
            "backend and strips the usage chunk again unless the client asked for it.",
        },
        "n": _positive_int(f"Choices per prompt; at most {max_n} (limits.max_n).", max_n),
    }
    return {
        "ErrorBody": {
            "type": "object",
            "required": ["message", "type", "param", "code"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": nullable_string,
                "code": nullable_string,
            },
        },
        "ErrorEnvelope": {
            "type": "object",
            "description": "Every error the gateway produces (OpenAI's error envelope).",
            "required": ["error"],
            "properties": {"error": _ref("ErrorBody")},
        },
        "TgiError": {
            "type": "object",
            "description": "A TGI backend's own error, passed through on the TGI routes.",
            "required": ["error"],
            "properties": {"error": {"type": "string"}, "error_type": {"type": "string"}},
        },
        "TextPart": {
            "type": "object",
            "required": ["type", "text"],
            "properties": {
                "type": {"type": "string", "enum": ["text"]},
                "text": {"type": "string"},
            },
        },
        "RefusalPart": {
            "type": "object",
            "required": ["type", "refusal"],
            "properties": {
                "type": {"type": "string", "enum": ["refusal"]},
                "refusal": {"type": "string"},
            },
        },
        "MediaPart": {
            "type": "object",
            "description": "Counted at a fixed cost (an image 85 tokens); the payload is not read.",
            "required": ["type"],
            "properties": {
                "type": {"type": "string", "enum": ["image_url", "input_audio", "file"]}
            },
        },
        "ContentPart": {
            "anyOf": [_ref("TextPart"), _ref("RefusalPart"), _ref("MediaPart")],
        },
        "ToolCall": {
            "type": "object",
            "required": ["function"],
            "properties": {
                "function": {
                    "type": "object",
                    "description": "String `name` and `arguments` are counted; others ignored.",
                }
            },
        },
        "ChatMessage": {
            "type": "object",
            "required": ["role"],
            "properties": {
                "role": {"type": "string", "enum": sorted(CHAT_ROLES)},
                "content": {
                    "anyOf": [
                        {"type": "string", "nullable": True},
                        {"type": "array", "items": _ref("ContentPart")},
                    ],
                },
                "name": nullable_string,
                "tool_calls": {"type": "array", "nullable": True, "items": _ref("ToolCall")},
            },
        },
        "ChatCompletionRequest": {
            "type": "object",
            "required": ["messages"],
            "properties": {
                **common_openai,
                "messages": {"type": "array", "minItems": 1, "items": _ref("ChatMessage")},
                "tools": {
                    "type": "array",
                    "nullable": True,
                    "items": {"type": "object"},
                    "description": "Counted as their JSON towards the prompt.",
                },
                "max_tokens": _positive_int(
                    "Output cap per choice; defaulted when absent, clamped (or refused) over "
                    "limits.max_output_tokens."
                ),
                "max_completion_tokens": _positive_int(
                    "Same as max_tokens; with both set the smaller one counts."
                ),
            },
        },
        "CompletionRequest": {
            "type": "object",
            "required": ["prompt"],
            "properties": {
                **common_openai,
                "prompt": {
                    "anyOf": [
                        {"type": "string"},
                        {"type": "array", "minItems": 1, "items": {"type": "string"}},
                        {"type": "array", "minItems": 1, "items": token_id},
                        {
                            "type": "array",
                            "minItems": 1,
                            "items": {"type": "array", "minItems": 1, "items": token_id},
                        },
                    ],
                    "description": "A string, strings, token ids, or arrays of token ids.",
                },
                "max_tokens": _positive_int(
                    "Output cap per choice and prompt; defaulted when absent, clamped (or "
                    "refused) over limits.max_output_tokens."
                ),
            },
        },
        "TgiParameters": {
            "type": "object",
            "nullable": True,
            "description": "Passed to the backend with max_new_tokens set to the cap in force.",
            "properties": {
                "max_new_tokens": _positive_int(
                    "Output cap, defaulted and capped like max_tokens."
                ),
                "best_of": _positive_int(f"At most {max_n} (limits.max_n).", max_n),
            },
        },
        "TgiGenerateRequest": {
            "type": "object",
            "required": ["inputs"],
            "properties": {"inputs": {"type": "string"}, "parameters": _ref("TgiParameters")},
        },
        "TgiCompatRequest": {
            "type": "object",
            "required": ["inputs"],
            "properties": {
                "inputs": {"type": "string"},
                "parameters": _ref("TgiParameters"),
                "stream": {"type": "boolean"},
            },
        },
        "ChatCompletion": {
            "type": "object",
            "description": "The backend's answer, passed through.",
            "required": ["choices"],
            "properties": {
                "id": {"type": "string"},
                "object": {"type": "string"},
                "model": {"type": "string"},
                "choices": {"type": "array", "items": {"type": "object"}},
                "usage": {"type": "object", "nullable": True},
            },
        },
        "ModelList": {
            "type": "object",
            "description": "The backend's model list, passed through.",
            "required": ["data"],
            "properties": {
                "object": {"type": "string"},
                "data": {"type": "array", "items": {"type": "object"}},
            },
        },
        "TgiGeneration": {
            "type": "object",
            "required": ["generated_text"],
            "properties": {
                "generated_text": {"type": "string"},
                "details": {"type": "object", "nullable": True},
            },
        },
        "SseEvent": {
            "type": "object",
            "description": "One Server-Sent Event of a stream, relayed as the backend wrote it "
            "(OpenAI: `data: <chunk JSON>` ... `data: [DONE]`; TGI: `data:<token JSON>`). A "
            'failure after the stream started is a last `data: {"error": ...}` event.',
            "required": ["data"],
            "properties": {
                "data": {"type": "string"},
                "event": {"type": "string"},
                "id": {"type": "string"},
                "retry": {"type": "integer"},
            },
        },
        "TgiInfo": {"type": "object", "description": "The TGI backend's /info, passed through."},
        "Health": {
            "type": "object",
            "required": ["status"],
            "properties": {"status": {"type": "string", "enum": ["ok"]}},
        },
        "Ready": {
            "type": "object",
            "required": ["status"],
            "properties": {
                "status": {"type": "string", "enum": ["ready", "not_ready"]},
                "backends": {"type": "array", "items": {"type": "string"}},
                "reason": {"type": "string"},
            },
        },
    }


_GATEWAY_HEADERS: dict[str, Schema] = {
    "x-request-id": {
        "description": "The client's X-Request-Id when sane (printable, at most 128 chars), "
        "else a new one; also sent to the backend.",
        "schema": {"type": "string"},
    },
    "x-gateway-lane": {"description": "The lane the request ran in.", "schema": {"type": "string"}},
    "x-gateway-prompt-tokens": {
        "description": "Prompt tokens as counted by the gateway.",
        "schema": {"type": "integer", "minimum": 0},
    },
    "x-gateway-max-tokens": {
        "description": "The output cap in force after defaults and caps.",
        "schema": {"type": "integer", "minimum": 1},
    },
    "x-gateway-max-tokens-clamped-from": {
        "description": "The client's value when it was clamped.",
        "schema": {"type": "integer"},
    },
    "x-gateway-queue-ms": {
        "description": "Time spent in the lane's queue.",
        "schema": {"type": "number", "minimum": 0},
    },
    "Server-Timing": {"description": "`queue;dur=<ms>`.", "schema": {"type": "string"}},
}


def _generation_responses(ok_content: dict[str, Schema], *, tgi: bool = False) -> dict[str, Schema]:
    responses: dict[str, Schema] = {
        "200": {
            "description": "The backend's answer: a JSON body, or an SSE stream relayed as it "
            "comes. A failure after the stream started arrives as a final `data:` error event.",
            "headers": _GATEWAY_HEADERS,
            "content": ok_content,
        },
        "400": _response_ref("BadRequest"),
        "401": _response_ref("Unauthorized"),
        "403": _response_ref("Forbidden"),
        "404": _response_ref("NotFound"),
        "405": _response_ref("MethodNotAllowed"),
        "413": _response_ref("TooLarge"),
        "415": _response_ref("UnsupportedMediaType"),
        "429": _response_ref("TooManyRequests"),
        "502": _response_ref("BadGateway"),
        "503": _response_ref("Unavailable"),
        "504": _response_ref("GatewayTimeout"),
    }
    if tgi:
        responses["422"] = {
            "description": "The TGI backend refused the parameters (passed through).",
            "content": {
                JSON: {"schema": _ref("TgiError")},
                "text/plain": {"schema": {"type": "string"}},
            },
        }
        responses["424"] = {
            "description": "The TGI backend failed during generation (passed through).",
            "content": {JSON: {"schema": _ref("TgiError")}},
        }
    return responses


def _components_responses() -> dict[str, Schema]:
    return {
        "BadRequest": _error_response(
            "Malformed JSON, a body that is not an object, wrong types, missing `messages`/"
            "`prompt`/`inputs`, an unknown role or content part type, `n` over limits.max_n "
            "(`invalid_request`); max_tokens over the cap in reject mode "
            "(`max_tokens_too_large`); prompt + max_tokens over the context window "
            "(`context_length_exceeded`). A backend's 400 is passed through unchanged."
        ),
        "Unauthorized": _error_response(
            "API keys are configured and the request has none or a wrong one (`invalid_api_key`)."
        ),
        "Forbidden": _error_response(
            "The request belongs to a lane this API key may not use (`lane_not_allowed`)."
        ),
        "NotFound": _error_response(
            "No such route (`not_found`); on generation routes, a backend's 404 (such as an "
            "unknown model) passed through."
        ),
        "MethodNotAllowed": {
            **_error_response("Another method on this path (`method_not_allowed`)."),
            "headers": {"Allow": {"schema": {"type": "string"}}},
        },
        "TooLarge": _error_response(
            "The prompt is over limits.max_prompt_tokens or no lane admits it "
            "(`prompt_too_long`), or the body is over server.max_body_bytes "
            "(`body_too_large`)."
        ),
        "UnsupportedMediaType": _error_response(
            "The body is declared as something other than JSON (`unsupported_media_type`)."
        ),
        "TooManyRequests": _error_response(
            "The lane's queue is full (`queue_full`) or the predicted wait is over its "
            "deadline (`wait_too_long`). Retry after `Retry-After` seconds.",
            retry_after=True,
        ),
        "BadGateway": _error_response(
            "The backend was unreachable or broke before the first byte (`backend_error`)."
        ),
        "Unavailable": _error_response(
            "Waited in the lane's queue past its timeout (`queue_timeout`), no healthy "
            "backend (`no_backend`), or the gateway is shutting down (`shutting_down`). "
            "Retry after `Retry-After` seconds. (A backend's own 503, passed through after "
            "the retry on another backend also failed, carries the backend's body.)",
            retry_after=True,
        ),
        "GatewayTimeout": _error_response(
            "The backend sent no first byte in time (`backend_timeout`)."
        ),
    }


def _request_body(schema_name: str, description: str) -> Schema:
    return {
        "required": True,
        "description": description,
        "content": {JSON: {"schema": _ref(schema_name)}},
    }


_REQUEST_HEADERS: list[Schema] = [
    {
        "name": "X-Request-Id",
        "in": "header",
        "required": False,
        "description": "Echoed back and sent to the backend; replaced when not printable or "
        "over 128 characters.",
        "schema": {"type": "string"},
    },
    {
        "name": "X-Gateway-Lane",
        "in": "header",
        "required": False,
        "description": "The lane to use, honoured only for API keys with "
        "allow_lane_override; ignored otherwise.",
        "schema": {"type": "string"},
    },
]

_OPTIONAL_BEARER: list[Schema] = [{}, {"bearerAuth": []}]


def _generation(
    operation_id: str, summary: str, schema_name: str, ok: dict[str, Schema], *, tgi: bool = False
) -> Schema:
    return {
        "post": {
            "operationId": operation_id,
            "summary": summary,
            "tags": ["TGI" if tgi else "OpenAI"],
            "security": _OPTIONAL_BEARER,
            "parameters": _REQUEST_HEADERS,
            "requestBody": _request_body(
                schema_name,
                "Checked by the gateway as described; other fields go to the backend as they are.",
            ),
            "responses": _generation_responses(ok, tgi=tgi),
        }
    }


def _pass_through_get(operation_id: str, summary: str, schema_name: str) -> Schema:
    return {
        "get": {
            "operationId": operation_id,
            "summary": summary,
            "responses": {
                "200": {
                    "description": "The backend's answer, passed through.",
                    "content": {JSON: {"schema": _ref(schema_name)}},
                },
                "404": {
                    "description": "The backend does not serve this route (an OpenAI-only "
                    "backend has no /info); its answer is passed through.",
                    "content": {JSON: {"schema": {}}},
                },
                "502": _response_ref("BadGateway"),
                "503": _error_response("No healthy backend (`no_backend`)."),
                "504": _response_ref("GatewayTimeout"),
            },
        }
    }


def openapi_document(settings: Settings | None = None) -> dict[str, Any]:
    """The document for a gateway running with `settings` (defaults when None)."""
    settings = settings or Settings()
    json_or_sse: dict[str, Schema] = {
        JSON: {"schema": _ref("ChatCompletion")},
        SSE: {"schema": _ref("SseEvent")},
    }
    tgi_json_or_sse: dict[str, Schema] = {
        JSON: {"schema": _ref("TgiGeneration")},
        SSE: {"schema": _ref("SseEvent")},
    }
    compat_ok: dict[str, Schema] = {
        JSON: {"schema": {"type": "array", "items": _ref("TgiGeneration")}},
        SSE: {"schema": _ref("SseEvent")},
    }
    paths: dict[str, Schema] = {
        "/v1/chat/completions": _generation(
            "createChatCompletion", "OpenAI chat completions", "ChatCompletionRequest", json_or_sse
        ),
        "/v1/completions": _generation(
            "createCompletion", "OpenAI completions", "CompletionRequest", json_or_sse
        ),
        "/v1/models": _pass_through_get("listModels", "The backend's model list", "ModelList"),
        "/generate": _generation(
            "tgiGenerate", "TGI generate", "TgiGenerateRequest", tgi_json_or_sse, tgi=True
        ),
        "/generate_stream": _generation(
            "tgiGenerateStream",
            "TGI generate, streamed",
            "TgiGenerateRequest",
            tgi_json_or_sse,
            tgi=True,
        ),
        "/": _generation(
            "tgiCompat",
            "TGI compat route (`stream` in the body)",
            "TgiCompatRequest",
            compat_ok,
            tgi=True,
        ),
        "/info": _pass_through_get("tgiInfo", "The TGI backend's server info", "TgiInfo"),
        "/healthz": {
            "get": {
                "operationId": "healthz",
                "summary": "Liveness: the process is up",
                "responses": {
                    "200": {
                        "description": "Up.",
                        "content": {JSON: {"schema": _ref("Health")}},
                    }
                },
            }
        },
        "/readyz": {
            "get": {
                "operationId": "readyz",
                "summary": "Readiness: a backend is available and the gateway is not draining",
                "responses": {
                    "200": {"description": "Ready.", "content": {JSON: {"schema": _ref("Ready")}}},
                    "503": {
                        "description": "Not ready (no healthy backend, or shutting down).",
                        "content": {JSON: {"schema": _ref("Ready")}},
                    },
                },
            }
        },
        "/metrics": {
            "get": {
                "operationId": "metrics",
                "summary": "Prometheus metrics (gateway_*)",
                "responses": {
                    "200": {
                        "description": "Prometheus text exposition format.",
                        "content": {"text/plain": {"schema": {"type": "string"}}},
                    }
                },
            }
        },
        "/openapi.json": {
            "get": {
                "operationId": "openapi",
                "summary": "This document",
                "responses": {
                    "200": {
                        "description": "The OpenAPI document.",
                        "content": {JSON: {"schema": {"type": "object"}}},
                    }
                },
            }
        },
    }
    document = {
        "openapi": OPENAPI_VERSION,
        "info": {
            "title": "LLM tail-latency gateway",
            "version": _package_version(),
            "description": (
                "An OpenAI-compatible (and TGI-compatible) gateway in front of model servers. "
                "Every error the gateway produces uses the OpenAI error envelope; a backend's "
                "errors are passed through with their status and body. Bodies over "
                f"{settings.server.max_body_bytes} bytes get 413; unknown routes 404 and "
                "other methods 405, in the envelope too."
            ),
        },
        "paths": paths,
        "components": {
            "schemas": _schemas(settings),
            "responses": _components_responses(),
            "headers": {
                "Retry-After": {
                    "required": True,
                    "description": "Whole seconds to wait before retrying.",
                    "schema": {"type": "integer", "minimum": 1},
                }
            },
            "securitySchemes": {
                "bearerAuth": {
                    "type": "http",
                    "scheme": "bearer",
                    "description": "Needed only when the gateway has api_keys configured.",
                }
            },
        },
    }
    # Parts are shared between operations and with module constants: a JSON round trip
    # gives every caller a tree of its own (and proves the document is plain JSON).
    result: dict[str, Any] = json.loads(json.dumps(document))
    return result


def _package_version() -> str:
    try:
        return importlib.metadata.version("llm-tail-gateway")
    except importlib.metadata.PackageNotFoundError:
        return "0.0.0"


async def openapi_json(request: web.Request) -> web.Response:
    """GET /openapi.json: the document for this gateway's settings."""
    return web.json_response(openapi_document(request.app[GATEWAY].settings))
