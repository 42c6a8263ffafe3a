#!/usr/bin/env python3
"""A webhook receiver for the walkthrough "Tenants": what a billing or alerting service does
with tollgate's threshold webhooks.

Each POST's body is checked against its `X-Tollgate-Signature: sha256=<hex>` header (HMAC-SHA256
of the exact body bytes, keyed with the secret tollgate was given), answered 200 when it
matches and 401 when it does not, and printed as one line to standard output:

    signature ok: {"policy": ..., "threshold": 0.8, ...}

Usage: python3 webhook_receiver.py SECRET_FILE [PORT] (default 8000), on 127.0.0.1. The secret
is the file's first line, as tollgate reads `--webhook-secret-file`.
"""

import hashlib
import hmac
import http.server
import sys

with open(sys.argv[1], "rb") as f:
    SECRET = f.read().split(b"\n", 1)[0].rstrip(b"\r")


class Receiver(http.server.BaseHTTPRequestHandler):
    def do_POST(self):
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length)
        expected = "sha256=" + hmac.new(SECRET, body, hashlib.sha256).hexdigest()
        given = self.headers.get("X-Tollgate-Signature") or ""
        ok = hmac.compare_digest(expected, given)
        verdict = "signature ok" if ok else "signature BAD"
        print(f"{verdict}: {body.decode('utf-8', 'replace')}", flush=True)
        self.send_response(200 if ok else 401)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass


port = int(sys.argv[2]) if len(sys.argv) > 2 else 8000
http.server.ThreadingHTTPServer(("127.0.0.1", port), Receiver).serve_forever()
