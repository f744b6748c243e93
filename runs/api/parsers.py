import io

from django.conf import settings
from rest_framework.exceptions import ParseError
from rest_framework.parsers import JSONParser


class BoundedJSONParser(JSONParser):
    """JSON with a body-size ceiling: an oversized body is a 400, read no
    further than one byte past the limit."""

    def parse(self, stream, media_type=None, parser_context=None):
        limit = settings.DATA_UPLOAD_MAX_MEMORY_SIZE
        request = (parser_context or {}).get("request")
        declared = int(request.META.get("CONTENT_LENGTH") or 0) if request is not None else 0
        if declared > limit:
            raise ParseError(f"request body of {declared} bytes exceeds the limit of {limit} bytes")
        body = stream.read(limit + 1) if stream is not None else b""
        if len(body) > limit:
            raise ParseError(f"request body exceeds the limit of {limit} bytes")
        return super().parse(io.BytesIO(body), media_type, parser_context)
