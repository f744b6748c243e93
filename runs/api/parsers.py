"""The API's only request parser: JSON, bounded before it is decoded.

Three things the standard parser lets through reach the database or the
interpreter's stack: a body larger than the server means to read, nesting
deep enough that the C decoder overflows Python's recursion limit
(RecursionError, a 500), and strings no database can store (NUL, lone
surrogates; PostgreSQL refuses them at INSERT, another 500). Each is
refused here, once for every endpoint, with a 413 or a 400 envelope.
"""

import json
import re
from itertools import accumulate

from django.conf import settings
from rest_framework import parsers
from rest_framework.exceptions import ParseError

from runs.errors import ErrorCode, ExecGoError
from runs.plan_schema import unstorable_error

# A JSON string (escapes included), removed before brackets are counted so
# a "[" inside a string is not nesting. An unterminated one runs to the end
# of the text: a match that could fail would be retried from every later
# quote, quadratic in a body of escaped quotes.
_JSON_STRING = re.compile(r'"(?:[^"\\]|\\.)*(?:"|\\?\Z)', re.DOTALL)
_BRACKET = re.compile(r"[\[\]{}]")


class RequestTooLarge(ExecGoError):
    http_status = 413

    def __init__(self, limit: int) -> None:
        super().__init__(ErrorCode.INVALID_INPUT, f"request body exceeds the limit of {limit} bytes",
                         source="api", retryable=False, details={"limit_bytes": limit})


def nesting_depth(text: str) -> int:
    """The deepest nesting of arrays and objects in ``text``, counted
    without recursion (the body is already bounded in size)."""
    brackets = _BRACKET.findall(_JSON_STRING.sub("", text))
    return max(accumulate(1 if bracket in "[{" else -1 for bracket in brackets), default=0)


def read_bounded(stream, content_length: int | None, limit: int) -> bytes:
    """At most ``limit`` bytes of the body, refusing a declared or actual
    length over it before keeping more than ``limit + 1`` bytes."""
    if content_length is not None and content_length > limit:
        raise RequestTooLarge(limit)
    data = stream.read(limit + 1) if stream is not None else b""
    if len(data) > limit:
        raise RequestTooLarge(limit)
    return data


def decode_json(data: bytes, *, max_depth: int):
    """``data`` as JSON, or a 400 envelope naming what is wrong with it."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ParseError(f"JSON parse error - the body is not UTF-8 (byte {exc.start})") from None
    depth = nesting_depth(text)
    if depth > max_depth:
        raise ExecGoError(ErrorCode.INVALID_INPUT, f"JSON nested {depth} deep; the limit is {max_depth}",
                          source="api", retryable=False, details={"max_depth": max_depth})
    try:
        value = json.loads(text, parse_constant=_refuse_constant)
    except (ValueError, RecursionError) as exc:
        # RecursionError: a last guard, should the count above ever be fooled.
        raise ParseError(f"JSON parse error - {exc}") from None
    error = unstorable_error(value, source="api")
    if error is not None:
        raise error
    return value


def _refuse_constant(name: str):
    raise ValueError(f"{name} is not valid JSON")


class StrictJSONParser(parsers.JSONParser):
    def parse(self, stream, media_type=None, parser_context=None):
        request = (parser_context or {}).get("request")
        content_length = _content_length(request)
        limit = settings.DATA_UPLOAD_MAX_MEMORY_SIZE
        data = read_bounded(stream, content_length, limit)
        return decode_json(data, max_depth=settings.EXECGO_API_MAX_JSON_DEPTH)


def _content_length(request) -> int | None:
    raw = request.META.get("CONTENT_LENGTH") if request is not None else None
    try:
        return int(raw) if raw else None
    except ValueError:
        return None
