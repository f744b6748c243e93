"""The process an http step's request runs in: one request to one address.

Started by runtime/tools/http_process.py as ``python -I -S -c <this
file's text>`` (the checkout may be hidden from the step's sandbox), with a
built environment, no inherited descriptors but its three standard ones, as
the step's uid, where bubblewrap is inside the step's sandbox and, unless the
destination is an allow-listed internal one, in a network namespace of its
own behind pasta (the host's loopback out of reach). It imports the
standard library only, so nothing of the worker (its settings, its
database credentials) is in this process when the response is parsed.

Reads one JSON request on stdin: ``{"address", "port", "family", "scheme",
"host", "method", "target", "headers", "body_b64", "timeout_s",
"max_body_bytes", "ca_certificates", "limits"}``; connects to ``address``
and nothing else (the worker resolved and checked it), sending ``host`` as
the Host header and, for https, as the TLS server name the certificate is
verified against (the system's CAs, plus the PEM text
``ca_certificates`` when given). Writes one JSON line on stdout:
``{"status", "headers", "body_b64", "truncated"}`` or ``{"error":
"timeout" | "certificate" | "failed", "message"}``. Redirects are the
worker's to follow (each hop is checked).
"""

import base64
import http.client
import json
import resource
import socket
import sys


def _limit(kind, value):
    try:
        resource.setrlimit(kind, (value, value))
    except (ValueError, OSError):
        pass  # a lower hard limit already holds


def _contain(limits):
    # Before anything is read from the network: a response that takes the
    # parser over gets no more processes, files or memory than these.
    _limit(resource.RLIMIT_CORE, 0)
    _limit(resource.RLIMIT_NPROC, 0)
    _limit(resource.RLIMIT_NOFILE, 32)
    _limit(resource.RLIMIT_AS, int(limits["address_space_bytes"]))
    _limit(resource.RLIMIT_CPU, int(limits["cpu_seconds"]))
    _limit(resource.RLIMIT_FSIZE, int(limits["output_bytes"]))


def _request(spec):
    timeout = float(spec["timeout_s"])
    sock = socket.socket(spec["family"], socket.SOCK_STREAM)
    sock.settimeout(timeout)
    sock.connect((spec["address"], int(spec["port"])))
    if spec["scheme"] == "https":
        import ssl  # only here: its import is most of a plain request's start-up

        context = ssl.create_default_context()
        if spec.get("ca_certificates"):
            context.load_verify_locations(cadata=spec["ca_certificates"])
        sock = context.wrap_socket(sock, server_hostname=spec["host"])
        connection = http.client.HTTPSConnection(spec["host"], int(spec["port"]), timeout=timeout, context=context)
    else:
        connection = http.client.HTTPConnection(spec["host"], int(spec["port"]), timeout=timeout)
    connection.sock = sock  # connected: http.client does not connect (or resolve) again
    body = base64.b64decode(spec["body_b64"]) if spec.get("body_b64") is not None else None
    connection.request(spec["method"], spec["target"], body=body, headers=spec["headers"])
    response = connection.getresponse()
    raw = response.read(int(spec["max_body_bytes"]) + 1)
    return {
        "status": response.status,
        "headers": list(response.getheaders()),
        "body_b64": base64.b64encode(raw[: int(spec["max_body_bytes"])]).decode(),
        "truncated": len(raw) > int(spec["max_body_bytes"]),
    }


def main():
    spec = json.loads(sys.stdin.buffer.read())
    _contain(spec["limits"])
    try:
        reply = _request(spec)
    except (TimeoutError, socket.timeout):
        reply = {"error": "timeout", "message": "timed out"}
    except OSError as exc:
        # Known by name: ssl is imported for https requests only.
        if type(exc).__name__ == "SSLCertVerificationError":
            reply = {"error": "certificate", "message": exc.verify_message or str(exc)}
        else:
            reply = {"error": "failed", "message": repr(exc)}
    except http.client.HTTPException as exc:
        reply = {"error": "failed", "message": repr(exc)}
    sys.stdout.write(json.dumps(reply))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
