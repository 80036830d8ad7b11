"""`python -m minisgl --shell`: a multi-turn chat with the engine running in this process.

Each turn re-sends the whole conversation through the chat template; the radix cache
recognises the previous turns' tokens, so only the new message is prefilled (the status
line after each reply shows how many prompt tokens came from the cache).
"""

from __future__ import annotations

import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, TextIO

from minisgl.core import SamplingParams
from minisgl.tokenizer import IncrementalDetokenizer, encode_chat

from .args import ServerArgs

HELP = "/reset clears the conversation, /exit (or Ctrl-D) quits, Ctrl-C stops a reply."


class _DeferredInterrupt:
    """Within the block, Ctrl-C only sets `requested`: an engine step is never cut in the
    middle (that could leave the scheduler's bookkeeping half-updated)."""

    def __init__(self) -> None:
        self.requested = False
        self._previous: Any = None

    def __enter__(self) -> _DeferredInterrupt:
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._on_sigint)
        return self

    def _on_sigint(self, signum: int, frame: Any) -> None:
        self.requested = True

    def __exit__(self, *exc: object) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)


class ChatSession:
    """A conversation with an in-process engine (an `LLM`: scheduler + tokenizer)."""

    def __init__(self, llm: Any, sampling_params: SamplingParams) -> None:
        self.llm = llm
        self.sampling_params = sampling_params
        self.history: list[dict[str, str]] = []

    def reset(self) -> None:
        self.history.clear()

    def turn(self, text: str, write: Callable[[str], None]) -> dict[str, Any]:
        """Answer `text`, streaming the reply through `write`; returns the turn's numbers.

        On Ctrl-C the reply is aborted between two engine steps (its pages are released),
        the turn is dropped from the history, and KeyboardInterrupt is raised.
        """
        messages = [*self.history, {"role": "user", "content": text}]
        ids = encode_chat(self.llm.tokenizer, messages)
        uid = self.llm.add_request(ids, self.sampling_params)  # ValueError: too long
        detok = IncrementalDetokenizer(self.llm.tokenizer)
        start, cached, reason = time.perf_counter(), 0, None
        with _DeferredInterrupt() as interrupt:
            while reason is None and not interrupt.requested:
                for out in self.llm.step():
                    if out.uid != uid:
                        continue
                    if out.token is not None:
                        write(detok.add_token(out.token))
                    if out.finish_reason is not None:
                        reason, cached = out.finish_reason, out.cached_tokens
            if reason is None:  # Ctrl-C: stop the reply, hand its pages back
                self.llm.abort_request(uid)
                while self.llm.has_work:
                    self.llm.step()
                raise KeyboardInterrupt
        write(detok.finish())
        elapsed = time.perf_counter() - start
        self.history = [*messages, {"role": "assistant", "content": detok.output_text}]
        return {
            "prompt_tokens": len(ids),
            "cached_tokens": cached,
            "completion_tokens": len(detok.token_ids),
            "finish_reason": reason,
            "tokens_per_s": len(detok.token_ids) / elapsed if elapsed > 0 else 0.0,
        }


def _line_reader(stdin: TextIO, stdout: TextIO) -> Callable[[str], str | None]:
    """prompt_toolkit (line editing, history) on a terminal; plain lines from a pipe."""
    if stdin.isatty() and stdout.isatty():
        from prompt_toolkit import PromptSession
        from prompt_toolkit.history import InMemoryHistory

        session: PromptSession = PromptSession(history=InMemoryHistory())

        def read_tty(prompt: str) -> str | None:
            while True:
                try:
                    return session.prompt(prompt)
                except KeyboardInterrupt:  # Ctrl-C at the prompt clears the line
                    continue
                except EOFError:
                    return None

        return read_tty

    def read_pipe(prompt: str) -> str | None:
        stdout.write(prompt)
        stdout.flush()
        line = stdin.readline()
        return None if line == "" else line.rstrip("\n")

    return read_pipe


def run_shell(args: ServerArgs, stdin: TextIO | None = None, stdout: TextIO | None = None) -> int:
    """Load the model in-process and chat until /exit or end of input."""
    from minisgl.llm import LLM

    stdin, stdout = stdin or sys.stdin, stdout or sys.stdout
    llm = LLM(args.model_path, dtype=args.dtype, device=args.device, **args.engine_kwargs())
    params = SamplingParams(temperature=args.shell_temperature, max_tokens=args.shell_max_tokens)
    session = ChatSession(llm, params)
    dim = stdout.isatty()

    def write(text: str) -> None:
        stdout.write(text)
        stdout.flush()

    def note(text: str) -> None:
        write(f"\033[2m{text}\033[0m\n" if dim else f"{text}\n")

    read = _line_reader(stdin, stdout)
    note(f"minisgl shell: {llm.model_path.name}. {HELP}")
    while True:
        line = read(">>> ")
        if line is None or line.strip() in ("/exit", "/quit"):
            break
        text = line.strip()
        if not text:
            continue
        if text == "/reset":
            session.reset()
            note("[conversation cleared]")
            continue
        if text.startswith("/"):
            note(f"[unknown command {text.split()[0]}] {HELP}")
            continue
        try:
            stats = session.turn(text, write)
        except KeyboardInterrupt:
            write("\n")
            note("[reply stopped]")
            continue
        except ValueError as exc:
            note(f"[error] {exc}; /reset starts a new conversation")
            continue
        write("\n")
        note(
            "[{prompt_tokens} prompt tokens ({cached_tokens} cached), {completion_tokens} "
            "generated, {finish_reason}, {tokens_per_s:.1f} tok/s]".format(**stats)
        )
    llm.shutdown()
    return 0
