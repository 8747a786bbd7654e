"""A JSON HTTP server on 127.0.0.1 for client tests (`kvmesh status` and the like): each GET is
answered by `answer(path, headers) -> (status, body)`; the server stops when the block ends."""

import contextlib
import http.server
import json
import threading


@contextlib.contextmanager
def json_server(answer):
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            status, body = answer(self.path, self.headers)
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_port}"
    finally:
        server.shutdown()
        server.server_close()
