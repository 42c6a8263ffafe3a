#!/usr/bin/env python3
"""A fake login endpoint for the walkthrough "Protect a login endpoint".

POST /login answers 200 "welcome" when the request's X-Password header is "right", and
401 "wrong password" otherwise. Usage: python3 fake_login.py [PORT] (default 3000), on
127.0.0.1.
"""

import http.server
import sys


class Login(http.server.BaseHTTPRequestHandler):
    def do_POST(self):
        length = int(self.headers.get("Content-Length") or 0)
        self.rfile.read(length)
        ok = self.headers.get("X-Password") == "right"
        body = b"welcome\n" if ok else b"wrong password\n"
        self.send_response(200 if ok else 401)
        self.send_header("Content-Type", "text/plain")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


port = int(sys.argv[1]) if len(sys.argv) > 1 else 3000
http.server.ThreadingHTTPServer(("127.0.0.1", port), Login).serve_forever()
