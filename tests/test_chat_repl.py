"""`llama-ane chat` at a real terminal (a pseudo-terminal driven by pexpect): typing a turn, recalling
it with the up arrow, /set, Ctrl-C during a reply, /help, /save and /load, and leaving with Ctrl-C then
Ctrl-D.

With LLAMA_ANE_CHAT_TRANSCRIPT=PATH the session's screen output is written to PATH as Markdown
(docs/chat-transcript.md is made that way).
"""

from __future__ import annotations

import io
import json
import os
import re
import sys
import time
import zipfile
from pathlib import Path

import numpy as np
import pytest

pexpect = pytest.importorskip("pexpect")

pytestmark = pytest.mark.export

UP = "\x1b[A"
CTRL_C = "\x03"
CTRL_D = "\x04"
PROMPT = re.compile(r">(?: |\x08\x1b\[2C)")  # prompt_toolkit may draw the space as a cursor move
ANSI = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]|\x1b[()][0-9A-Za-z]|\x1b[=>]")


def saved_messages(path: Path) -> list[dict]:
    with zipfile.ZipFile(path) as z:
        return json.loads(np.load(io.BytesIO(z.read("messages.npy"))).tobytes())


REDRAWN = re.compile(r"^>+ ?(.*)> \1$")  # the line editor draws an accepted line once more


def screen_text(raw: str, names: dict[str, str]) -> str:
    """What the terminal showed, roughly: escape sequences dropped, carriage returns resolved,
    each accepted line once, and the paths in `names` replaced by their short names."""
    for path, name in names.items():
        raw = raw.replace(path, name)
    lines = []
    for line in ANSI.sub("", raw).replace("\x08", "").replace("\r\n", "\n").split("\n"):
        line = line.split("\r")[-1] if "\r" in line.rstrip("\r") else line.rstrip("\r")
        lines.append(REDRAWN.sub(r"> \1", line.rstrip()))
    return "\n".join(line for line in lines if line.strip()) + "\n"


def test_the_chat_repl_at_a_terminal(tiny_export, tmp_path):
    env = dict(os.environ, XDG_CACHE_HOME=str(tmp_path / "cache"), PROMPT_TOOLKIT_NO_CPR="1", TERM="xterm",
               COLUMNS="120", LINES="40")
    log = io.StringIO()
    child = pexpect.spawn(sys.executable, ["-m", "llama_ane", "chat", str(tiny_export), "--backend", "torch",
                                           "--max-new-tokens", "40"],
                          env=env, encoding="utf-8", codec_errors="replace", timeout=300, dimensions=(40, 120))
    child.logfile_read = log
    saved = tmp_path / "talk.npz"
    try:
        child.expect_exact("/help for commands")
        child.expect(PROMPT)
        child.send("hello\r")
        child.expect_exact("[prefill")  # the reply is done
        child.expect(PROMPT)
        child.send(UP)  # the line editor recalls the last line
        child.expect_exact("hello")
        child.send("\r")
        child.expect_exact("[prefill")
        child.expect(PROMPT)
        child.send("/set max-new-tokens 100000\r")  # a reply that cannot end before the Ctrl-C below
        child.expect_exact("[max-new-tokens = 100000]")
        child.expect(PROMPT)
        child.send("tell me a long story\r")
        child.expect_exact("tell me a long story")
        # the line editor is done once it turns bracketed paste off: the terminal is out of raw
        # mode, so the Ctrl-C below is a signal (typed in raw mode, it would be a byte for the next prompt)
        child.expect_exact("\x1b[?2004l")
        time.sleep(0.5)
        child.send(CTRL_C)  # stops the reply, not the chat
        child.expect_exact("[reply stopped")
        child.expect(PROMPT)
        child.send("/help\r")
        child.expect_exact("/save FILE")
        child.expect(PROMPT)
        child.send(f"/save {saved}\r")
        child.expect_exact("[saved 4 messages")
        child.expect(PROMPT)
        child.send(f"/load {saved}\r")
        child.expect_exact("[loaded 4 messages")
        child.expect(PROMPT)
        child.send(CTRL_C)  # at the prompt: a warning first
        child.expect_exact("Ctrl-C again or Ctrl-D to quit")
        child.expect(PROMPT)
        child.send(CTRL_D)
        child.expect(pexpect.EOF)
    finally:
        child.close(force=True)
        transcript = os.environ.get("LLAMA_ANE_CHAT_TRANSCRIPT")
        if transcript:
            Path(transcript).write_text(
                "# A chat session at a terminal\n\n"
                "What `llama-ane chat` shows at a terminal, recorded by `tests/test_chat_repl.py` on the tiny random "
                "test model (so the replies are noise): a turn, the same line recalled with the up arrow, `/set`, "
                "Ctrl-C during a reply, `/help`, `/save`, `/load`, then Ctrl-C and Ctrl-D at the prompt to leave.\n\n"
                "```text\n" + screen_text(log.getvalue(), {str(saved): "talk.npz", str(tiny_export): "out/tiny"})
                + "```\n", encoding="utf-8")
    assert child.exitstatus == 0, log.getvalue()[-2000:]
    messages = saved_messages(saved)
    assert [m["role"] for m in messages] == ["user", "assistant"] * 2
    assert [m["content"] for m in messages if m["role"] == "user"] == ["hello", "hello"]  # the recalled line
    history = (tmp_path / "cache" / "llama-ane" / "chat_history").read_text()
    assert "+hello" in history and "+tell me a long story" in history
