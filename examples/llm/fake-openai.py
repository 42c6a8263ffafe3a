#!/usr/bin/env python3
"""A fake OpenAI-compatible chat completions API, for trying tollgate's LLM token budgets.

    python3 examples/llm/fake-openai.py [PORT]      (default 3000, loopback only)

POST /v1/chat/completions answers like the real API, with a `usage` block, without any model:
the reply is a fixed sentence, and the usage it reports is
  - prompt_tokens: 4/3 of the words of the messages' text, rounded up (a rough count);
  - completion_tokens: the most the request allowed (`max_completion_tokens`, else `max_tokens`,
    else 16): the fake model always writes as long as it may, so budgets drain quickly.
With "stream": true it answers as a server-sent event stream, its last chunk carrying the usage
(as OpenAI does with `stream_options.include_usage`). Anything else: 404. Python's standard
library only; one line per request on standard error. Answers are pretty-printed JSON with
ids chatcmpl-fake-1, -2... in the order requests arrive.
"""

import itertools
import json
import math
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

REPLY = "This is a fake answer from the test upstream."

# Answer ids: chatcmpl-fake-1, -2... (next() on a count is atomic under the GIL).
IDS = itertools.count(1)


def texts(value):
    """Every string in a message's content (a string, or a list of parts)."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, list):
        for part in value:
            if isinstance(part, dict) and isinstance(part.get("text"), str):
                yield part["text"]
            elif isinstance(part, str):
                yield part


def usage_for(body):
    words = sum(
        len(text.split())
        for message in body.get("messages", [])
        if isinstance(message, dict)
        for text in texts(message.get("content"))
    )
    prompt = math.ceil(words * 4 / 3)
    completion = body.get("max_completion_tokens") or body.get("max_tokens") or 16
    if not isinstance(completion, int) or completion < 0:
        completion = 16
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def send(self, status, content_type, payload):
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def do_POST(self):
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length)
        if self.path.split("?")[0] != "/v1/chat/completions":
            self.send(404, "application/json", b'{"error": {"message": "not found"}}')
            return
        try:
            body = json.loads(raw or b"{}")
            if not isinstance(body, dict):
                raise ValueError("not an object")
        except ValueError:
            self.send(400, "application/json", b'{"error": {"message": "the body is not a JSON object"}}')
            return
        usage = usage_for(body)
        model = str(body.get("model", "fake-model"))
        created = int(time.time())
        ident = "chatcmpl-fake-%d" % next(IDS)
        if body.get("stream"):
            self.stream(ident, created, model, usage)
            return
        answer = {
            "id": ident,
            "object": "chat.completion",
            "created": created,
            "model": model,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": REPLY},
                    "finish_reason": "stop",
                }
            ],
            "usage": usage,
        }
        self.send(200, "application/json", (json.dumps(answer, indent=2) + "\n").encode())

    def stream(self, ident, created, model, usage):
        def chunk(delta, finish=None, usage=None):
            event = {
                "id": ident,
                "object": "chat.completion.chunk",
                "created": created,
                "model": model,
                "choices": [] if usage else [{"index": 0, "delta": delta, "finish_reason": finish}],
            }
            if usage:
                event["usage"] = usage
            return ("data: %s\n\n" % json.dumps(event)).encode()

        events = [chunk({"role": "assistant", "content": ""})]
        events += [chunk({"content": word + " "}) for word in REPLY.split()]
        events += [chunk({}, "stop"), chunk(None, usage=usage), b"data: [DONE]\n\n"]
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        for event in events:
            self.wfile.write(b"%x\r\n%s\r\n" % (len(event), event))
        self.wfile.write(b"0\r\n\r\n")

    def do_GET(self):
        self.send(404, "application/json", b'{"error": {"message": "not found"}}')

    def log_message(self, fmt, *args):
        sys.stderr.write("%s %s\n" % (self.log_date_time_string(), fmt % args))


def main():
    port = int(sys.argv[1]) if len(sys.argv) > 1 else 3000
    server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
    print("fake OpenAI API on http://127.0.0.1:%d/v1/chat/completions" % port, file=sys.stderr)
    server.serve_forever()


if __name__ == "__main__":
    main()
