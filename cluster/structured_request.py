"""The structured-output fields of an OpenAI / vLLM request, read into one StructuredOutputs.

Three spellings, at most one per request: OpenAI's `response_format` (json_object, json_schema),
vLLM's `structured_outputs` (json, regex, choice, grammar, json_object) and vLLM's older
`guided_json` / `guided_regex` / `guided_choice` / `guided_grammar`. A bad value is an ApiError(400)
naming the field; whether the schema / regex / grammar compiles is checked by the frontend
(Frontend.check_grammar), which names the same field.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from kvmesh.cluster.openai_protocol import ApiError
from kvmesh.structured_outputs import StructuredOutputs, canonical_json

GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
          "guided_grammar": "grammar"}
# vLLM's structured_outputs options kvmesh does not implement: refused when set.
UNSUPPORTED_OPTIONS = ("structural_tag", "whitespace_pattern", "disable_fallback",
                       "disable_any_whitespace", "disable_additional_properties")
BACKENDS = (None, "auto", "xgrammar")


@dataclass(frozen=True)
class Structured:
    spec: StructuredOutputs
    param: str  # the request field it came from (errors name it)


def parse_structured(req) -> Structured | None:
    """The request's output constraint, or None."""
    found = []
    response_format = getattr(req, "response_format", None)
    if response_format is not None:
        structured = _response_format(response_format)
        if structured is not None:
            found.append(structured)
    structured = getattr(req, "structured_outputs", None)
    if structured is not None:
        found.append(_structured_outputs(structured))
    for name, kind in GUIDED.items():
        value = getattr(req, name, None)
        if value is not None:
            found.append(Structured(_spec(kind, value, name), name))
    backend = getattr(req, "guided_decoding_backend", None)
    if backend not in BACKENDS:
        raise ApiError(400, f"guided_decoding_backend must be one of auto, xgrammar (kvmesh's "
                       f"grammar library), got {backend!r}", param="guided_decoding_backend")
    if len(found) > 1:
        names = ", ".join(s.param for s in found)
        raise ApiError(400, f"give at most one structured output constraint; this request has "
                       f"{names}", param=found[1].param)
    return found[0] if found else None


def _response_format(value: dict) -> Structured | None:
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return Structured(StructuredOutputs(json_object=True), "response_format")
    if kind == "json_schema":
        body = value.get("json_schema")
        if not isinstance(body, dict):
            raise ApiError(400, "response_format.json_schema must be an object with a schema",
                           param="response_format.json_schema")
        schema = body.get("schema", body.get("json_schema"))
        if not isinstance(schema, dict):
            raise ApiError(400, "response_format.json_schema.schema must be a JSON schema object",
                           param="response_format.json_schema.schema")
        param = "response_format.json_schema.schema"
        return Structured(_spec("json", schema, param), param)
    raise ApiError(400, f"response_format.type must be text, json_object or json_schema, got "
                   f"{kind!r}", param="response_format.type")


def _structured_outputs(value: dict) -> Structured:
    for name in UNSUPPORTED_OPTIONS:
        if value.get(name) not in (None, False):
            raise ApiError(400, f"structured_outputs.{name} is not supported",
                           param=f"structured_outputs.{name}")
    kinds = [k for k in ("json", "regex", "choice", "grammar") if value.get(k) is not None]
    if value.get("json_object"):
        kinds.append("json_object")
    unknown = sorted(set(value) - {"json", "regex", "choice", "grammar", "json_object",
                                   *UNSUPPORTED_OPTIONS})
    if unknown:
        raise ApiError(400, f"structured_outputs.{unknown[0]} is not a structured_outputs field",
                       param=f"structured_outputs.{unknown[0]}")
    if len(kinds) != 1:
        raise ApiError(400, "structured_outputs must set exactly one of json, regex, choice, "
                       f"grammar, json_object; got {', '.join(kinds) or 'none'}",
                       param="structured_outputs")
    kind = kinds[0]
    param = f"structured_outputs.{kind}"
    if kind == "json_object":
        return Structured(StructuredOutputs(json_object=True), param)
    return Structured(_spec(kind, value[kind], param), param)


def _spec(kind: str, value: Any, param: str) -> StructuredOutputs:
    if kind == "json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as e:
                raise ApiError(400, f"{param}: not valid JSON: {e}", param=param) from None
        if not isinstance(value, (dict, bool)):
            raise ApiError(400, f"{param} must be a JSON schema (an object)", param=param)
        value = canonical_json(value)
    elif kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
            raise ApiError(400, f"{param} must be a non-empty list of non-empty strings",
                           param=param)
        value = tuple(value)
    elif not isinstance(value, str) or not value:
        raise ApiError(400, f"{param} must be a non-empty string", param=param)
    try:
        return StructuredOutputs(**{kind: value})
    except ValueError as e:
        raise ApiError(400, f"{param}: {e}", param=param) from None
