"""OpenAI's published description of Chat Completions (openai/openai-openapi, `openapi.yaml`; the
commit and date are in `openai_chat_completions.json`'s `source`): the schemas of the request,
the response, the stream's chunk, the model list and the error, verbatim, with the operations.
Read here, never from the app: what a client of OpenAI's API can rely on.

OpenAPI 3.1's JSON Schema has no `nullable`, yet 21 places in the description still say
`nullable: true` (the 3.0 keyword; the stream chunk's `finish_reason` and `usage` among them, and
OpenAI's own example chunks carry those nulls): it is read as OpenAPI tools read it, "or null".
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path
from typing import Any

import jsonschema

from harness.workers_ai import first_violation

DESCRIPTION: dict[str, Any] = json.loads(Path(__file__).with_name("openai_chat_completions.json").read_text())


def _nullable(node: Any) -> Any:
    if isinstance(node, list):
        return [_nullable(item) for item in node]
    if not isinstance(node, dict):
        return node
    node = {key: _nullable(value) for key, value in node.items()}
    if node.pop("nullable", False) is True:
        return {"anyOf": [node, {"type": "null"}]}
    return node


@cache
def _validator(name: str) -> Any:
    components = _nullable(DESCRIPTION["components"])
    schema = {"$ref": f"#/components/schemas/{name}", "components": components}
    return jsonschema.Draft202012Validator(schema)


def violation(name: str, instance: object) -> str:
    """What the schema `name` (CreateChatCompletionResponse, ...) finds wrong, or "" (valid)."""
    found = first_violation(_validator(name), instance, limit=300)
    return f"{name}: {found}" if found else ""
