"""Checks of OpenAI Batch output lines against the openai package's own types (tests only)."""

from __future__ import annotations

import base64
import json

import numpy as np
from openai.types import Completion, CreateEmbeddingResponse
from openai.types.chat import ChatCompletion
from openai.types.responses import Response
from pydantic import BaseModel, ConfigDict


class LineError(BaseModel):
    model_config = ConfigDict(extra="forbid")
    code: str
    message: str


class LineResponse(BaseModel):
    model_config = ConfigDict(extra="forbid")
    status_code: int
    request_id: str
    body: dict


class OutputLine(BaseModel):
    """One line of an OpenAI Batch output or error file."""

    model_config = ConfigDict(extra="forbid")
    id: str
    custom_id: str | None
    response: LineResponse | None
    error: LineError | None


BODY_TYPES = {"chat.completion": ChatCompletion, "text_completion": Completion, "list": CreateEmbeddingResponse,
              "response": Response}


def read_output_lines(text: str) -> list[dict]:
    """Every line of an output file, each checked against the batch line shape and its body
    against the openai package's type for it."""
    lines = [json.loads(line) for line in text.splitlines()]
    for line in lines:
        OutputLine.model_validate(line)
        if line["response"] is not None and line["response"]["status_code"] == 200:
            body = decoded(line["response"]["body"])
            model_type = BODY_TYPES[body["object"]]
            model_type.model_validate(body)
            assert set(body) <= set(model_type.model_fields), f"fields the API does not return: {body}"
    return lines


def decoded(body: dict) -> dict:
    """``body`` with base64 embeddings decoded, as the openai client decodes them."""
    if body.get("object") != "list":
        return body
    data = [{**item, "embedding": np.frombuffer(base64.b64decode(item["embedding"]), dtype="<f4").tolist()}
            if isinstance(item["embedding"], str) else item for item in body["data"]]
    return {**body, "data": data}
