"""Real OpenAI-compatible servers for the backend tests: llama.cpp's own (`python -m llama_cpp.server`) on 127.0.0.1,
and a sampling override in front of one (a gateway that forces a hot temperature, as a misconfigured proxy does)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
from omegaconf import OmegaConf

from evalkit.cli.spec import model_spec
from evalkit.embedded import gguf_path
from tests.conftest import ROOT

N_CTX = 512  # the prompts of the tests' needles (256-token haystacks) and their answers fit


def smollm2_gguf() -> Path:
    return gguf_path(model_spec(OmegaConf.load(ROOT / "conf" / "model" / "smollm2-135m.yaml")))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LlamaServer:
    """`python -m llama_cpp.server` on SmolLM2's GGUF, on a free port of 127.0.0.1, with the KV cache types given
    (GGML type numbers: 1 f16, 2 q4_0, 8 q8_0); stopped by its own process id."""

    def __init__(self, type_k: int = 1, type_v: int = 1, alias: str | None = None, n_ctx: int = N_CTX):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/v1"
        args = [
            *("--model", str(smollm2_gguf()), "--host", "127.0.0.1", "--port", str(self.port)),
            *("--n_ctx", str(n_ctx), "--n_batch", "512", "--n_ubatch", "512", "--flash_attn", "true"),
            *("--type_k", str(type_k), "--type_v", str(type_v), "--seed", "0", "--verbose", "false"),
            *(("--model_alias", alias) if alias else ()),
        ]
        env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}
        self.process = subprocess.Popen(
            [sys.executable, "-m", "llama_cpp.server", *args],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            env=env,
            start_new_session=True,
        )
        self._wait()

    def _wait(self, seconds: float = 180.0) -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            if self.process.poll() is not None:
                raise RuntimeError(f"llama_cpp.server exited: {self.process.stderr.read().decode()[-2000:]}")
            try:
                if httpx.get(f"{self.url}/models", timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"llama_cpp.server did not answer on {self.url} within {seconds:.0f} s")

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()


class Gateway:
    """An HTTP gateway in front of a real server. `hot`: each completion request is rewritten to temperature 5 with a
    new seed, so the server behind it samples whatever the client asked. `delay_first`: the first completion request
    is held that many seconds before it is forwarded, as a long prefill on a loaded server is."""

    def __init__(self, target: str, hot: bool = False, delay_first: float = 0.0):
        gateway = self
        self.delay = delay_first

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 - http.server's method names
                gateway._forward(self, None)

            def do_POST(self):  # noqa: N802
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if hot:
                    # two 24-token answers all but never agree (at temperature 1 a confident needle answer can).
                    # The server's truncation samplers are switched off too: by default llama.cpp keeps only the
                    # tokens with at least 5% of the best one's probability (min_p) before the temperature, so where
                    # the model is sure it stays greedy at any temperature, and two answers could agree token for
                    # token
                    body.update(temperature=5.0, min_p=0.0, top_k=0, top_p=1.0, seed=int(time.monotonic_ns() % 2**31))
                delay, gateway.delay = gateway.delay, 0.0
                time.sleep(delay)
                gateway._forward(self, body)

            def log_message(self, *args):
                pass

        self.target = target.rstrip("/")
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def _forward(self, handler: BaseHTTPRequestHandler, body: dict | None) -> None:
        url = self.target + handler.path.removeprefix("/v1")
        reply = httpx.request("POST" if body is not None else "GET", url, json=body, timeout=120)
        handler.send_response(reply.status_code)
        handler.send_header("Content-Type", "application/json")
        handler.send_header("Content-Length", str(len(reply.content)))
        handler.end_headers()
        handler.wfile.write(reply.content)

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
