"""The tools a step can call. Each validates its own params before anything runs."""

from __future__ import annotations

from typing import Any

from runtime.envelopes import EnvelopeError
from runtime.tools import file, http, shell

VALIDATORS = {"shell": shell.validate_params, "http": http.validate_params, "file": file.validate_params}


def validate_params(tool: str, params: Any) -> None:
    """Raise EnvelopeError(invalid_input | denied) when the call cannot run as given."""
    validator = VALIDATORS.get(tool)
    if validator is None:
        raise EnvelopeError.of(
            "invalid_input", f"unknown tool {tool!r}", source="executor", details={"known": sorted(VALIDATORS)}
        )
    validator(params)
