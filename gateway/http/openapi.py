"""The gateway's own OpenAPI 3.1 document, served at GET /openapi.json.

It describes what the *gateway* checks before a request takes a place in a queue
(admission: types, roles, content parts, positive output caps, `n` up to the
configured `max_n`), not everything a model server may refuse later: fields the
gateway does not read are passed through to the backend untouched, and a
backend's 4xx comes back with its own status and body. That split is what lets a
schema-driven fuzzer (schemathesis) hold the gateway to it: whatever violates
this document must be refused by the gateway itself with a 4xx in the OpenAI
error envelope, and nothing valid may ever earn a 5xx from the gateway.

The request schemas are generated from the very types admission validates
with (`admission/schema.py`), and the error responses from the one error
table (`http/errors.py`), so neither can drift from the code. The document is
built once per app, from the settings in force (`n`'s maximum, the body limit).
"""

from __future__ import annotations

import importlib.metadata
from collections import defaultdict
from typing import Any

import msgspec
from aiohttp import web

from gateway.admission.schema import REQUEST_TYPES
from gateway.config import Settings
from gateway.http.errors import ERRORS, RETRY_AFTER_CODES

OPENAPI_VERSION = "3.1.0"
JSON = "application/json"
SSE = "text/event-stream"

Schema = dict[str, Any]

OPENAPI_BYTES: web.AppKey[bytes] = web.AppKey("openapi", bytes)


def _ref(name: str) -> Schema:
    return {"$ref": f"#/components/schemas/{name}"}


def _response_ref(name: str) -> Schema:
    return {"$ref": f"#/components/responses/{name}"}


def _request_schemas(settings: Settings) -> dict[str, Schema]:
    """The admission types as JSON Schema, with this gateway's `max_n` filled in."""
    _, components = msgspec.json.schema_components(
        REQUEST_TYPES, ref_template="#/components/schemas/{name}"
    )
    for schema in components.values():
        for name, field in schema.get("properties", {}).items():
            if name in ("n", "best_of"):
                for option in field.get("anyOf", [field]):
                    if option.get("type") == "integer":
                        option["maximum"] = settings.limits.max_n
    return components


def _schemas(settings: Settings) -> dict[str, Schema]:
    nullable_string: Schema = {"type": ["string", "null"]}
    return {
        **_request_schemas(settings),
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
        "ChatCompletion": {
            "type": "object",
            "description": "The backend's answer, passed through.",
            "required": ["choices"],
            "properties": {
                "id": {"type": "string"},
                "object": {"type": "string"},
                "model": {"type": "string"},
                "choices": {"type": "array", "items": {"type": "object"}},
                "usage": {"type": ["object", "null"]},
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
                "details": {"type": ["object", "null"]},
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


def _error_statuses() -> dict[int, list[str]]:
    codes: dict[int, list[str]] = defaultdict(list)
    for code, kind in ERRORS.items():
        codes[kind.status].append(code)
    return dict(sorted(codes.items()))


def _generation_responses(ok_content: dict[str, Schema], *, tgi: bool = False) -> dict[str, Schema]:
    responses: dict[str, Schema] = {
        "200": {
            "description": "The backend's answer: a JSON body, or an SSE stream relayed as it "
            "comes. A failure after the stream started arrives as a final `data:` error event.",
            "headers": _GATEWAY_HEADERS,
            "content": ok_content,
        },
    }
    for status in _error_statuses():
        responses[str(status)] = _response_ref(f"Error{status}")
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


def _admin(operation_id: str, summary: str, *, drain: bool) -> dict[str, Schema]:
    """An admin route on one backend (`http/admin.py`)."""
    parameters: list[Schema] = [
        {"name": "name", "in": "path", "required": True, "schema": {"type": "string"}}
    ]
    if drain:
        parameters += [
            {
                "name": "deadline_s",
                "in": "query",
                "required": False,
                "schema": {"type": "number", "minimum": 0, "maximum": 3600},
            },
            {"name": "wait", "in": "query", "required": False, "schema": {"type": "boolean"}},
        ]
    state: Schema = {
        "type": "object",
        "properties": {
            "backend": {"type": "string"},
            "draining": {"type": "boolean"},
            "deadline_s": {"type": ["number", "null"]},
            "in_flight": {"type": "integer"},
            "idle": {"type": "boolean"},
        },
    }
    return {
        "post": {
            "operationId": operation_id,
            "summary": summary,
            "parameters": parameters,
            "responses": {
                "200": {
                    "description": "The backend's drain state.",
                    "content": {JSON: {"schema": state}},
                },
                "400": _response_ref("Error400"),
                "401": _response_ref("Error401"),
                "404": _response_ref("Error404"),
            },
        }
    }


def _reload() -> dict[str, Schema]:
    """`POST /admin/reload` (`http/admin.py`, `reload.py`)."""
    names: Schema = {"type": "array", "items": {"type": "string"}}
    result: Schema = {
        "type": "object",
        "properties": {
            "result": {"type": "string", "enum": ["ok", "failed"]},
            "reason": {"type": "string"},
            "error": {"type": ["string", "null"]},
            "sha256": {"type": ["string", "null"]},
            "changed": names,
            "not_applied": names,
            "joined": names,
            "left": names,
            "updated": names,
        },
    }
    return {
        "post": {
            "operationId": "reloadConfig",
            "summary": "Reload the config file, as SIGHUP: applied to new requests; what "
            "cannot change live is named (admin key, or loopback without keys)",
            "responses": {
                "200": {"description": "Reloaded.", "content": {JSON: {"schema": result}}},
                "401": _response_ref("Error401"),
                "422": {
                    "description": "The config did not load: the one in force stays.",
                    "content": {JSON: {"schema": result}},
                },
            },
        }
    }


def _components_responses() -> dict[str, Schema]:
    """One response per status, its description made from the error table's situations."""
    responses: dict[str, Schema] = {}
    for status, codes in _error_statuses().items():
        lines = "; ".join(f"{ERRORS[code].situation} (`{code}`)" for code in codes)
        response: Schema = {
            "description": lines[0].upper() + lines[1:] + ". A backend's own answer with this "
            "status is passed through with its body.",
            "content": {JSON: {"schema": _ref("ErrorEnvelope")}},
        }
        headers: Schema = {"x-gateway-refusal": {"$ref": "#/components/headers/x-gateway-refusal"}}
        if any(code in RETRY_AFTER_CODES for code in codes):
            headers["Retry-After"] = {"$ref": "#/components/headers/Retry-After"}
        if status == 405:
            headers["Allow"] = {"schema": {"type": "string"}}
        response["headers"] = headers
        responses[f"Error{status}"] = response
    return responses


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
                "502": _response_ref("Error502"),
                "503": _response_ref("Error503"),
                "504": _response_ref("Error504"),
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
                "summary": "Readiness: the first health checks read what each backend serves, "
                "a backend is available and the gateway is not draining",
                "responses": {
                    "200": {"description": "Ready.", "content": {JSON: {"schema": _ref("Ready")}}},
                    "503": {
                        "description": "Not ready (the first health checks not done, no "
                        "healthy backend, or shutting down).",
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
        "/admin/backends/{name}/drain": _admin(
            "drainBackend",
            "Drain a backend: no new request; its streams finish, or are carried over to "
            "another backend at the deadline (admin key, or loopback without keys)",
            drain=True,
        ),
        "/admin/backends/{name}/undrain": _admin(
            "undrainBackend", "End a backend's drain: it takes requests again", drain=False
        ),
        "/admin/reload": _reload(),
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
                    "description": "Whole seconds to wait before retrying: how long the "
                    "lane's line takes to drain at its measured rate (1 to 60); for "
                    "`quota_exceeded`, until the key's minute window ends.",
                    "schema": {"type": "integer", "minimum": 1},
                },
                "x-gateway-refusal": {
                    "description": "Why the gateway itself refused: the error's `code`. "
                    "Absent when the error is a backend's own answer, passed through.",
                    "schema": {"type": "string"},
                },
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
    result: dict[str, Any] = msgspec.json.decode(msgspec.json.encode(document))
    return result


def _package_version() -> str:
    try:
        return importlib.metadata.version("llm-tail-gateway")
    except importlib.metadata.PackageNotFoundError:
        return "0.0.0"


async def openapi_json(request: web.Request) -> web.Response:
    """GET /openapi.json: the document for this gateway's settings, built at start-up."""
    return web.Response(body=request.app[OPENAPI_BYTES], content_type=JSON)


def install(app: web.Application, settings: Settings) -> None:
    """Build the document once and serve it at /openapi.json."""
    app[OPENAPI_BYTES] = msgspec.json.encode(openapi_document(settings))
    app.router.add_get("/openapi.json", openapi_json)
