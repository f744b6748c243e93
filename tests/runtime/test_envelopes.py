"""The step result and error envelopes (docs/data-plane.md#envelopes)."""

from datetime import UTC, datetime

import pytest

from runtime.envelopes import EnvelopeError, error_envelope, iso_utc, step_result


def test_error_envelope_has_exactly_the_spec_fields():
    envelope = error_envelope("timeout", "step exceeded timeout 5000ms", retryable=True, details={"timeout_ms": 5000})
    assert envelope == {
        "code": "timeout",
        "message": "step exceeded timeout 5000ms",
        "retryable": True,
        "source": "executor",
        "details": {"timeout_ms": 5000},
    }


@pytest.mark.parametrize("code", ["boom", "", "TIMEOUT"])
def test_unknown_codes_are_refused(code):
    with pytest.raises(ValueError):
        error_envelope(code, "x")


def test_step_result_timestamps_and_duration():
    result = step_result(
        status="success",
        handle_id="h-1",
        output={"a": 1},
        started_at=datetime(2024, 1, 2, 3, 4, 5, 120000, tzinfo=UTC),
        finished_at=datetime(2024, 1, 2, 3, 4, 8, 120000, tzinfo=UTC),
        attempt=2,
    )
    assert result["started_at"] == "2024-01-02T03:04:05.120Z"
    assert result["finished_at"] == "2024-01-02T03:04:08.120Z"
    assert result["duration_ms"] == 3000
    assert result["error"] is None
    assert result["details"] == {}


def test_status_and_error_must_agree():
    error = error_envelope("internal", "x")
    with pytest.raises(ValueError):
        step_result(status="success", handle_id="h", output={}, started_at=0, finished_at=0, attempt=1, error=error)
    with pytest.raises(ValueError):
        step_result(status="failed", handle_id="h", output={}, started_at=0, finished_at=0, attempt=1)


def test_iso_utc_refuses_naive_datetimes():
    with pytest.raises(ValueError):
        iso_utc(datetime(2024, 1, 1))
    assert iso_utc(0) == "1970-01-01T00:00:00.000Z"


def test_envelope_error_carries_its_envelope():
    error = EnvelopeError.of("denied", "no", source="policy")
    assert error.code == "denied"
    assert error.envelope["source"] == "policy"
    assert str(error) == "no"
