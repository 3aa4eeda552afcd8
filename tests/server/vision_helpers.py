"""Helpers of the vision server tests: a tiny random VLM directory (the server tests' text model and tokenizer plus
a 2-layer vision tower), images of rendered text (Pillow), and a local HTTP server of images on 127.0.0.1 (a
thread of the test process; nothing leaves the machine)."""

import base64
import contextlib
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import torch
from image_helpers import png, text_image  # noqa: F401 (re-exported to the server tests)
from PIL import Image
from serving_helpers import train_tokenizer

from deepseek_v41.chat import tokens as T
from deepseek_v41.config import VisionConfig, tiny_config
from deepseek_v41.model.engram_hash import build_token_map
from deepseek_v41.model.transformer import Transformer

FETCH_LIMIT = 50_000  # bytes per image the test servers read (their --max-image-bytes)
# patch 14, 3x3 merge: a 42x42 image is one LLM token (span 4); min_pixels small so nothing is scaled up.
VISION = VisionConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=2, intermediate_size=48,
                      max_image_tokens=64, min_pixels=42 * 42)


def save_tiny_vlm(path) -> None:
    """A random tiny VLM directory: the server tests' text model and tokenizer plus a 2-layer vision tower; the
    image placeholder's id is the tokenizer's id of ``<｜deepseek_image｜>``."""
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer()
    tokenizer.save(str(path / "tokenizer.json"))
    config = tiny_config().replace(
        max_position_embeddings=4096, vision_config=VISION, image_token_id=tokenizer.token_to_id(T.IMAGE),
        engram_compressed_vocab_size=int(build_token_map(path / "tokenizer.json").max()) + 1)
    torch.manual_seed(0)
    Transformer(config).save_pretrained(path)


def data_url(image: Image.Image) -> str:
    return "data:image/png;base64," + base64.b64encode(png(image)).decode()


def image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


class _Images(BaseHTTPRequestHandler):
    """The local image server's routes (``self.server.files``: path -> PNG bytes)."""

    def do_GET(self):  # noqa: N802 (http.server's name)
        path = self.path
        self.server.hits.append(path)
        files = self.server.files
        if path in files:
            self._send(200, files[path], {"Content-Type": "image/png"})
        elif path == "/to-ok":
            self._send(302, b"", {"Location": "/ok.png"})
        elif path == "/to-localhost":  # same machine, but a host name the server does not allow
            self._send(302, b"", {"Location": f"http://localhost:{self.server.server_port}/ok.png"})
        elif path == "/loop":
            self._send(302, b"", {"Location": "/loop"})
        elif path == "/declared-big":
            self._send(200, b"x" * (FETCH_LIMIT + 1), {"Content-Type": "image/png"})
        elif path == "/streamed-big":  # no Content-Length: the limit must stop the read
            self.send_response(200)
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            chunk = b"x" * 4096
            with contextlib.suppress(OSError):  # the server stops reading and hangs up
                for _ in range(FETCH_LIMIT // len(chunk) + 20):
                    self.wfile.write(f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n")
                self.wfile.write(b"0\r\n\r\n")
        elif path == "/slow":
            self.send_response(200)
            self.send_header("Content-Length", "100")
            self.end_headers()
            with contextlib.suppress(OSError):
                for _ in range(20):  # one byte every 0.1 s: each read is quick, the whole fetch is not
                    self.wfile.write(b"x")
                    self.wfile.flush()
                    time.sleep(0.1)
        elif path == "/text":
            self._send(200, b"hello, not an image", {"Content-Type": "text/plain"})
        else:
            self._send(404, b"no", {})

    def _send(self, status, body, headers):
        self.send_response(status)
        for key, value in headers.items():
            self.send_header(key, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        with contextlib.suppress(OSError):
            self.wfile.write(body)

    def log_message(self, *args):
        pass


@contextlib.contextmanager
def local_image_host(files: dict[str, bytes]):
    """A ThreadingHTTPServer on 127.0.0.1 serving ``files`` (path -> bytes) and the test routes of
    :class:`_Images`, in a daemon thread; shut down and closed on exit."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Images)
    server.daemon_threads = True
    server.files = files
    server.hits = []  # the paths asked for, in order
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)
