"""Incremental server-sent-events parser: feed bytes as they arrive, get `data:` payloads.

Handles events split across network chunks anywhere (even inside a UTF-8 character or
between `\\r` and `\\n`), several events in one chunk, and multi-line data fields.
"""

from __future__ import annotations

import codecs
import re

# A lone trailing CR may be the first half of CRLF: it ends a line only once more follows.
_EOL = re.compile(r"\r\n|\n|\r(?=[\s\S])")


class SSEParser:
    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._buf = ""
        self._data: list[str] = []

    def feed(self, chunk: bytes) -> list[str]:
        """Return the data of every event completed by this chunk, in order."""
        buf = self._buf + self._decoder.decode(chunk)
        out: list[str] = []
        pos = 0
        while (m := _EOL.search(buf, pos)) is not None:
            line = buf[pos : m.start()]
            pos = m.end()
            if line == "":
                if self._data:
                    out.append("\n".join(self._data))
                    self._data = []
            elif line.startswith("data:"):
                value = line[5:]
                self._data.append(value[1:] if value.startswith(" ") else value)
            # Comments (":"), event:, id: and retry: carry nothing a client needs here.
        self._buf = buf[pos:]
        return out
