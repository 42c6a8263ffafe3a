#!/usr/bin/env python3
"""Mints an HS256 JWT for trying tollgate's `jwt:` limit keys (a test token, not an issuer).

    TOLLGATE_JWT_SECRET=... python3 examples/llm/make-jwt.py [--ttl SECS] CLAIM=VALUE...

The secret is read from TOLLGATE_JWT_SECRET, the variable `tollgate run` reads too, so it never
shows in `ps`. A dotted claim name nests (`org.id=acme` gives {"org": {"id": "acme"}}); `exp` is
now + --ttl (default 3600 s), `iat` now. Prints the token. Python's standard library only.
"""

import base64
import hashlib
import hmac
import json
import os
import sys
import time


def b64url(data):
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def main(args):
    ttl = 3600
    if len(args) >= 2 and args[0] == "--ttl":
        ttl = int(args[1])
        args = args[2:]
    secret = os.environ.get("TOLLGATE_JWT_SECRET")
    if not secret:
        sys.exit("make-jwt.py: set TOLLGATE_JWT_SECRET to the secret tollgate verifies with")
    now = int(time.time())
    claims = {"iat": now, "exp": now + ttl}
    for arg in args:
        name, sep, value = arg.partition("=")
        if not sep or not name:
            sys.exit("make-jwt.py: claims are written CLAIM=VALUE, got %r" % arg)
        *parents, leaf = name.split(".")
        node = claims
        for parent in parents:
            node = node.setdefault(parent, {})
            if not isinstance(node, dict):
                sys.exit("make-jwt.py: %r is both a value and an object" % parent)
        node[leaf] = value
    header = {"alg": "HS256", "typ": "JWT"}
    signing_input = "%s.%s" % (
        b64url(json.dumps(header, separators=(",", ":")).encode()),
        b64url(json.dumps(claims, separators=(",", ":")).encode()),
    )
    mac = hmac.new(secret.encode(), signing_input.encode(), hashlib.sha256).digest()
    print("%s.%s" % (signing_input, b64url(mac)))


if __name__ == "__main__":
    main(sys.argv[1:])
