"""The echo.v1.Echo gRPC service of the manual's gRPC walkthrough, on grpcio.

  python echo.py serve ADDR          serve it (h2c) on ADDR
  python echo.py say ADDR TEXT       one unary Say call
  python echo.py chat ADDR TEXT...   one bidirectional Chat call, in turns: each text sent once
                                     the previous one came back

A call prints what came back, then how it ended; a refused call its status, its retry delay
(google.rpc.RetryInfo) and the rule that refused it (google.rpc.QuotaFailure), read from the
grpc-status-details-bin trailer with grpc_status, as any grpcio client can. Messages are the
text's bytes as they are (no protobuf schema needed for an echo).
"""

import queue
import sys
from concurrent import futures

import grpc
from google.rpc import error_details_pb2
from grpc_status import rpc_status

SAY = "/echo.v1.Echo/Say"
CHAT = "/echo.v1.Echo/Chat"


def serve(addr):
    def say(request, context):
        return request

    def chat(requests, context):
        for message in requests:
            yield message

    handler = grpc.method_handlers_generic_handler(
        "echo.v1.Echo",
        {
            "Say": grpc.unary_unary_rpc_method_handler(say),
            "Chat": grpc.stream_stream_rpc_method_handler(chat),
        },
    )
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    server.add_generic_rpc_handlers((handler,))
    server.add_insecure_port(addr)
    server.start()
    print("serving echo.v1.Echo on", addr, flush=True)
    server.wait_for_termination()


def report(error):
    print("status:", error.code().name)
    status = rpc_status.from_call(error)
    if status is None:
        return
    for detail in status.details:
        if detail.Is(error_details_pb2.RetryInfo.DESCRIPTOR):
            info = error_details_pb2.RetryInfo()
            detail.Unpack(info)
            print("retry after:", info.retry_delay.seconds, "s")
        elif detail.Is(error_details_pb2.QuotaFailure.DESCRIPTOR):
            failure = error_details_pb2.QuotaFailure()
            detail.Unpack(failure)
            for violation in failure.violations:
                print("refused by:", violation.subject)


def say(addr, text):
    with grpc.insecure_channel(addr) as channel:
        try:
            print("reply:", channel.unary_unary(SAY)(text.encode()).decode())
        except grpc.RpcError as error:
            report(error)


def chat(addr, texts):
    turns = queue.Queue()

    def requests():
        for text in texts:
            yield text.encode()
            if turns.get() is None:
                return

    with grpc.insecure_channel(addr) as channel:
        try:
            for message in channel.stream_stream(CHAT)(requests()):
                print("echo:", message.decode())
                turns.put(message)
            print("status: OK")
        except grpc.RpcError as error:
            turns.put(None)
            report(error)


if __name__ == "__main__":
    command, addr, rest = sys.argv[1], sys.argv[2], sys.argv[3:]
    if command == "serve":
        serve(addr)
    elif command == "say":
        say(addr, rest[0])
    elif command == "chat":
        chat(addr, rest)
    else:
        sys.exit("usage: echo.py serve|say|chat ADDR [TEXT...]")
