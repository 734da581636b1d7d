"""Chat templates a request brought (``--trust-request-chat-template``), rendered in a child
process that is killed past its time.

Jinja's sandbox bounds what a template may reach, not how long it runs: a request's template of
two nested loops of 100,000 ran in the server's process for as long as it liked, holding one of
its threads at full CPU, slowing every other request, and keeping the process from stopping at
SIGTERM. Such templates are rendered here instead, one at a time, by a child that loads the
model's tokenizer once (its special tokens are the template's variables). Past ``seconds`` the
child is killed, the request is refused, and the next request template starts a new child. A
rendering longer than the context can hold comes back as its length alone.
"""
from __future__ import annotations

import multiprocessing
import threading
from dataclasses import replace
from pathlib import Path

START_SECONDS = 120.0     # for the child to load the tokenizer (not counted in a rendering's time)
TEMPLATE_SECONDS = 10.0   # a request's template renders within this, or the request is refused


def _serve(conn, hf_dir: str) -> None:
    """The child: render (template, messages, most characters) requests until the parent goes."""
    import signal
    signal.signal(signal.SIGINT, signal.SIG_IGN)      # a Ctrl-C at the terminal is the server's to handle
    from tandem.engine.models.loader import load_tokenizer
    import tandem.sched.llm  # noqa: F401  (what the templates sent here unpickle into)
    tokenizer = load_tokenizer(Path(hf_dir))
    conn.send(("ready", None))
    while True:
        try:
            template, messages, most = conn.recv()
        except (EOFError, OSError):
            return
        try:
            text = template.render(tokenizer, messages)
            conn.send(("text", text) if most is None or len(text) <= most else ("long", len(text)))
        except ValueError as e:
            conn.send(("error", str(e)))
        except Exception as e:          # anything else a template's own code raised
            conn.send(("error", f"chat_template: does not render these messages: {type(e).__name__}: {e}"))


class IsolatedTemplates:
    """Renders request templates in one child process at a time; ``seconds``: each rendering's limit."""

    def __init__(self, hf_dir: Path, seconds: float):
        self.hf_dir = str(hf_dir)
        self.seconds = seconds
        self._lock = threading.Lock()
        self._proc = None
        self._conn = None
        self._closed = False

    def render(self, template, messages: list[dict], most: int | None = None) -> str | int:
        """The text of ``template`` (a ChatTemplate) over ``messages``, or its length where it is
        longer than ``most`` characters; ValueError where it fails or runs past ``seconds`` (the
        child is then killed)."""
        if not self._lock.acquire(timeout=self.seconds):
            raise ValueError(f"chat_template: other request templates held the renderer past {self.seconds:g} s")
        try:
            if self._closed:
                raise ValueError("chat_template: the server is stopping")
            conn = self._child()
            try:
                conn.send((replace(template, isolated=False), messages, most))
            except OSError:                     # the child died since it was last seen alive
                raise self._lost("the process rendering it stopped; try again") from None
            if not conn.poll(self.seconds):
                raise self._lost(f"took more than {self.seconds:g} s to render (stopped)")
            try:
                kind, value = conn.recv()
            except (EOFError, OSError):         # the child died (out of memory, say)
                raise self._lost("its rendering stopped the process rendering it") from None
        finally:
            self._lock.release()
        if kind == "error":
            raise ValueError(value)
        return value

    def _child(self):
        if self._proc is None or not self._proc.is_alive():
            ctx = multiprocessing.get_context("spawn")
            self._conn, theirs = ctx.Pipe()
            self._proc = ctx.Process(target=_serve, args=(theirs, self.hf_dir), daemon=True,
                                     name="tandem-chat-template")
            self._proc.start()
            theirs.close()
            try:
                if not self._conn.poll(START_SECONDS):
                    raise EOFError
                self._conn.recv()
            except (EOFError, OSError):
                raise self._lost("the process that renders request templates did not start") from None
        return self._conn

    def _lost(self, why: str) -> ValueError:
        """The child stopped (killed here, where it still runs); the request's error, saying ``why``."""
        self._stop()
        return ValueError(f"chat_template: {why}")

    def _stop(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.join(5)
            self._conn.close()
        self._proc = self._conn = None

    def close(self) -> None:
        """Stop the child; later renderings are refused."""
        self._closed = True
        with self._lock:
            self._stop()
