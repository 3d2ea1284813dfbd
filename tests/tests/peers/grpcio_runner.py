"""A desktop runner written with grpc C-core (Python grpcio), a gRPC stack
that shares no code with ours: it checks health, is refused with a bad
token, then connects with a real one, says Hello, heartbeats three times
and leaves. Messages travel as bytes the Rust test encodes and decodes.

    python grpcio_runner.py ADDR TOKEN HELLO_HEX HEARTBEAT_HEX

Prints one line per fact: `health <hex>`, `refused <code>`, `got <hex>`
for each message of the stream, `ended <code>`.
"""
import queue
import sys

import grpc

addr, token, hello, heartbeat = sys.argv[1], sys.argv[2], bytes.fromhex(sys.argv[3]), bytes.fromhex(sys.argv[4])
channel = grpc.insecure_channel(addr)
grpc.channel_ready_future(channel).result(timeout=10)

check = channel.unary_unary("/grpc.health.v1.Health/Check")
print("health", check(b"", timeout=10).hex(), flush=True)

connect = channel.stream_stream("/automesh.runner.v1.DesktopRunnerService/Connect")
try:
    for _ in connect(iter([hello]), metadata=[("authorization", "Bearer not-a-token")], timeout=10):
        pass
except grpc.RpcError as e:
    print("refused", e.code().name, flush=True)

answers = queue.Queue()


def requests():
    yield hello
    for _ in range(3):
        answers.get(timeout=10)
        yield heartbeat
    answers.get(timeout=10)


call = connect(requests(), metadata=[("authorization", "Bearer " + token)], timeout=30)
try:
    for message in call:
        print("got", message.hex(), flush=True)
        answers.put(message)
    print("ended", call.code().name, flush=True)
except grpc.RpcError as e:
    print("ended", e.code().name, flush=True)
