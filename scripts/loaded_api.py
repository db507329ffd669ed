"""A loopback API for scripts/bench-loaded.sh: answers every call 200 at once and
counts them, writing the calls made, their span and the busiest window of WINDOW
seconds to STATS (JSON) every second. It refuses nothing: the busiest window is what a
strict sliding-window limiter of the tier would have seen."""

import http.server
import json
import socketserver
import sys
import threading
import time

PORT, WINDOW, STATS = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3]
calls = []
lock = threading.Lock()


class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_GET(self):
        with lock:
            calls.append(time.monotonic())
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"{}")

    def log_message(self, *args):
        pass


class Server(socketserver.ThreadingMixIn, http.server.HTTPServer):
    daemon_threads = True


def report():
    while True:
        time.sleep(1)
        with lock:
            seen = list(calls)
        busiest, first = 0, 0
        for last, at in enumerate(seen):
            while at - seen[first] >= WINDOW:
                first += 1
            busiest = max(busiest, last - first + 1)
        span = seen[-1] - seen[0] if seen else 0.0
        with open(STATS, "w") as out:
            json.dump({"calls": len(seen), "span_seconds": round(span, 3), "busiest_window": busiest}, out)


threading.Thread(target=report, daemon=True).start()
Server(("127.0.0.1", PORT), Handler).serve_forever()
