"""OpenAI's embeddings, POST /v1/embeddings (what RAG applications call): `input` as one
text, several, one list of token ids or several; `encoding_format` "float" or "base64"
(little-endian float32, what the openai client asks for by default); `dimensions` keeps
the first that many of each vector and scales it to unit length again (as Ollama's
`dimensions` does; a model not trained for it, Matryoshka-style, loses more by it).

The vectors are tformer.decoding.embeddings' (the server's --pooling, "mean" by default),
the same as tformer.load(...).embed(texts) and Ollama's /api/embed.
"""

from __future__ import annotations

import asyncio
import base64
from typing import Any

import torch
from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import Field

from tformer.data.tokenizers import text_start
from tformer.decoding.embeddings import embed_ids
from tformer.errors import TformerError
from tformer.serving.api import Route, check_model, read_body
from tformer.serving.protocol import ApiError, Prompt, Strict
from tformer.serving.turn import Server


class EmbeddingRequest(Strict):
    model: str | None = None
    input: Prompt
    encoding_format: str = "float"
    dimensions: int | None = Field(None, ge=1)
    user: str | None = None


MAX_INPUTS = 2048
"""Inputs in one request at most (as OpenAI's embeddings take)."""


def token_lists(server: Server, inputs: Prompt, param: str = "input", *,
                truncate: bool = False) -> list[list[int]]:
    """Each input as token ids (a text after bos where the model reads texts so); one
    longer than the model's window is a 400, or with `truncate` cut to the window."""
    if isinstance(inputs, str):
        inputs = [inputs]
    if not inputs:
        raise ApiError(400, f"{param}: an empty list holds no input", param=param)
    if isinstance(inputs[0], int):
        inputs = [inputs]  # one list of token ids
    if len(inputs) > MAX_INPUTS:
        raise ApiError(400, f"{param}: {len(inputs)} inputs; send at most {MAX_INPUTS}",
                       param=param)
    vocab = server.tokenizer.vocab_size
    lists = []
    for i, item in enumerate(inputs):
        if isinstance(item, str):
            if not item:
                raise ApiError(400, f"{param}[{i}]: an empty text has no embedding",
                               param=param)
            try:
                ids = text_start(server.tokenizer, server.tokenizer.encode(item))
            except TformerError as e:
                raise ApiError(400, f"{param}[{i}]: {e}", param=param) from None
        else:
            ids = list(item)
            bad = next((t for t in ids if not 0 <= t < vocab), None)
            if not ids or bad is not None:
                raise ApiError(400, f"{param}[{i}]: token ids are 1 or more, each 0 to "
                               f"{vocab - 1}", param=param)
        window = server.engine.context or server.limits.max_prompt_tokens
        if truncate:
            ids = ids[:window]
        if len(ids) > window:
            raise ApiError(400, f"{param}[{i}] is {len(ids)} tokens; the model reads at most "
                           f"{window}", param=param, code="context_length_exceeded")
        lists.append(ids)
    return lists


async def vectors(server: Server, lists: list[list[int]], dimensions: int | None = None,
                  param: str = "dimensions") -> torch.Tensor:
    """The embeddings of the token lists, (N, D) or (N, dimensions), unit length."""
    width = server.engine.model.cfg.d_model
    if dimensions is not None and dimensions > width:
        raise ApiError(400, f"{param}: {dimensions} is more than the model's {width}",
                       param=param)
    try:
        # Off the event loop: a forward pass per text.
        out = await asyncio.to_thread(embed_ids, server.engine.model, lists,
                                      pooling=server.pooling)
    except TformerError as e:
        raise ApiError(400, str(e), param="model") from None
    if dimensions is not None and dimensions < width:
        out = out[:, :dimensions]
        out = out / out.norm(dim=1, keepdim=True).clamp_min(1e-12)
    return out


async def create(request: Request, server: Server) -> Response:
    body = await read_body(request, EmbeddingRequest)
    check_model(body.model, server)
    if body.encoding_format not in ("float", "base64"):
        raise ApiError(400, f"encoding_format {body.encoding_format!r} is not float or base64",
                       param="encoding_format")
    lists = token_lists(server, body.input)
    out = await vectors(server, lists, body.dimensions)
    data: list[dict[str, Any]] = []
    for i, vector in enumerate(out):
        if body.encoding_format == "base64":
            raw = vector.numpy().astype("<f4").tobytes()
            value: Any = base64.b64encode(raw).decode("ascii")
        else:
            value = vector.tolist()
        data.append({"object": "embedding", "index": i, "embedding": value})
    tokens = sum(len(ids) for ids in lists)
    return JSONResponse({"object": "list", "data": data, "model": server.model_name,
                         "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})


def error_response(exc: ApiError) -> JSONResponse:
    return exc.response()


ROUTES = [Route("POST", "/v1/embeddings", create)]
