from http.server import BaseHTTPRequestHandler, HTTPServer


class Receiver(BaseHTTPRequestHandler):
    def do_POST(self) -> None:  # one record per POST: a 2xx acks, 400 or 422 dead-letters
        value = self.rfile.read(int(self.headers.get("content-length", 0)))
        print(f"{self.headers['ce-id']}: {value!r}", flush=True)  # ce-id: topic/partition/offset
        self.send_response(204)
        self.end_headers()


HTTPServer(("127.0.0.1", 8080), Receiver).serve_forever()
