"""The server's APIs besides OpenAI's completions and chat completions, one small module
each: what its requests say, mapped to a neutral chat turn (serving/turn.py), and the
reply's events mapped to its frames, with its own error body.

A module exposes `ROUTES` (its rows: method, path, handler) and `error_response` (an
ApiError in its words); serving/app.py adds the rows and answers every error on a route in
the words of the module that owns it.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ValidationError

from tformer.serving.protocol import ApiError
from tformer.serving.turn import Server

Handler = Callable[[Request, Server], Awaitable[Response]]
ErrorShape = Callable[[ApiError], JSONResponse]


@dataclass(frozen=True)
class Route:
    """One row of an API's routes."""

    method: str
    path: str
    handler: Handler


def field_path(loc: tuple[Any, ...]) -> list[str]:
    """pydantic's location of an error -> the field's path: without FastAPI's "body", and
    without the union member tried ("input.str" is the field input)."""
    path = []
    for part in loc:
        if part == "body":
            continue
        if isinstance(part, str) and ("[" in part or part in UNION_MEMBERS):
            break
        path.append(str(part))
    return path


UNION_MEMBERS = {"str", "int", "float", "bool", "none", "list", "dict"}


def invalid_body(errors: list[Any]) -> ApiError:
    """A body's first validation error (pydantic's list) as a 400 naming the field."""
    first = errors[0] if errors else {"msg": "invalid request", "loc": ()}
    loc = field_path(tuple(first.get("loc", ())))
    if first.get("type") == "json_invalid":
        return ApiError(400, "the body is not valid JSON")
    if first.get("type") == "extra_forbidden":
        return ApiError(400, f"unknown field {'.'.join(loc)!r}", param=".".join(loc))
    param = ".".join(loc) or None
    message = f"{param}: {first.get('msg')}" if param else str(first.get("msg"))
    return ApiError(400, message, param=param)


M = TypeVar("M", bound=BaseModel)


async def read_body(request: Request, model: type[M]) -> M:
    """The request's JSON body as `model`, or a 400 naming the field that is wrong."""
    raw = await request.body()
    try:
        value = json.loads(raw or b"null")
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise ApiError(400, "the body is not valid JSON") from None
    if not isinstance(value, dict):
        raise ApiError(400, "the body is a JSON object")
    try:
        return model.model_validate(value)
    except ValidationError as e:
        raise invalid_body(e.errors()) from None


def check_model(name: str | None, server: Server, *, param: str = "model") -> None:
    if name is not None and name != server.model_name:
        raise ApiError(404, f"model {name!r} is not served here; this server serves "
                       f"{server.model_name!r}", param=param, code="model_not_found")
