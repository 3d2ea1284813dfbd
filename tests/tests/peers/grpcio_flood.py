"""A third-party desktop runner on grpc C-core (Python grpcio) that keeps the
documented heartbeat liveness (it asks for no PING liveness and sends no
PINGs of its own) and reports one large run: it says Hello, accepts the run
it is assigned, waits for a line `go` on stdin, then sends the run's reports
(its events in large messages, then its result) while a thread heartbeats
into the same stream every HEARTBEAT seconds, so its heartbeats wait behind
the reports, as they do in any runner with one ordered stream. It keeps
heartbeating until its stream ends. Messages travel as bytes the Rust test
encodes and decodes.

    python grpcio_flood.py ADDR TOKEN MESSAGES HEARTBEAT

MESSAGES is a file of hex-encoded ConnectRequest lines: the Hello, a
Heartbeat, the acceptance, then the reports in order.

Prints one line per fact: `got <first byte of the message, hex>` for each
message of the stream (0a Welcome, 12 Assignment, 22 HeartbeatAck, 2a
ProtocolError, 32 AssignmentConfirmed), `sent <n>` once the last of the n
reports was handed to grpc, `ended <code> <details>` when the stream ends.
"""
import queue
import sys
import threading

import grpc

addr, token, path, every = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4])
with open(path) as f:
    lines = [bytes.fromhex(line.strip()) for line in f if line.strip()]
hello, heartbeat, accept, reports = lines[0], lines[1], lines[2], lines[3:]

outbox = queue.Queue()
done = threading.Event()


def requests():
    while True:
        m = outbox.get()
        if m is None:
            return
        yield m
        if m is reports[-1]:
            print("sent", len(reports), flush=True)


def heartbeats():
    while not done.wait(every):
        outbox.put(heartbeat)


def flood():
    sys.stdin.readline()
    for r in reports:
        outbox.put(r)


channel = grpc.insecure_channel(addr)
grpc.channel_ready_future(channel).result(timeout=10)
connect = channel.stream_stream("/automesh.runner.v1.DesktopRunnerService/Connect")
outbox.put(hello)
call = connect(requests(), metadata=[("authorization", "Bearer " + token)])
threading.Thread(target=heartbeats, daemon=True).start()
try:
    for message in call:
        kind = message[:1].hex()
        print("got", kind, flush=True)
        if kind == "12":
            outbox.put(accept)
        elif kind == "32":
            threading.Thread(target=flood, daemon=True).start()
    print("ended", call.code().name, call.details(), flush=True)
except grpc.RpcError as e:
    print("ended", e.code().name, e.details(), flush=True)
done.set()
outbox.put(None)
