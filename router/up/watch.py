"""`radix-router up` while it runs: every process it started is watched, the embedded
Redis too, and each exit is one line that says what still serves.

- A worker, the router or Redis that exits is reported in one line and restarted after
  the backoff of router/up/restarts.py; one that exits more than its limit within the
  window stops the fleet (exit 1), and its last log lines are shown, each whole.
- What the line says keeps serving is the truth of the fleet at that moment
  (`keeps_serving`): the router is the only entry point, a lone worker leaves nobody,
  and a restarted Redis is empty until each worker's next heartbeat.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

from router.up.restarts import Restarts, describe_exit
from shared.procs import Child, answers_health, last_lines
from shared.redis_server import RedisServer

POLL_S = 0.5
GIVE_UP_LINES = 20  # of the failing process's log, shown when `up` gives up
REDIS = "redis"


def keeps_serving(name: str, workers_up: int) -> str:
    """What serves while `name` is down, `workers_up` the workers still running."""
    if name == "router":
        return "the router is the only entry point: requests are refused until it is back."
    if name == REDIS:
        return ("the router keeps routing on its last known fleet; the new Redis starts "
                "empty and each worker re-registers with its next heartbeat (within 1s).")  # fmt: skip
    if workers_up == 0:
        return "it was the only worker running: requests fail until it is back."
    if workers_up == 1:
        return "the other worker keeps serving."
    return f"the other {workers_up} workers keep serving."


class RedisChild:
    """The embedded Redis in the shape the watch loop reads of a child."""

    name = REDIS

    def __init__(self, server: RedisServer) -> None:
        self.server = server

    @property
    def alive(self) -> bool:
        return self.server.running  # polls, so an exited server is reaped at once

    @property
    def pid(self) -> int | None:
        return self.server.pid

    @property
    def returncode(self) -> int | None:
        return self.server.returncode

    @property
    def log(self) -> Path:
        return self.server.log_file

    def last_line(self) -> str:
        lines = last_lines(self.log, 1)
        return lines[0].strip() if lines else ""


Watched = Child | RedisChild


class Watch:
    """Serve until `stop` (0), restarting what exits; 1 once a process keeps exiting.
    `children` is the fleet's own list: a restarted child replaces its entry there."""

    def __init__(
        self, children: list[Child], redis: RedisServer | None, restarts: Restarts,
        say: Callable[[str], None], stop: threading.Event, launched: dict[str, float],
    ) -> None:  # fmt: skip
        self.children = children
        self.redis = RedisChild(redis) if redis is not None else None
        self.restarts = restarts
        self.say = say
        self.stop = stop
        self.launched = launched  # name -> when it was (re)started
        self.down: dict[str, float] = {}  # name -> when to restart it
        self.coming_back: set[str] = set()  # restarted, not answering yet
        self.gave_up: Watched | None = None

    def _watched(self) -> list[Watched]:
        return [*self.children, *([self.redis] if self.redis is not None else [])]

    def run(self) -> int:
        while not self.stop.wait(POLL_S):
            now = time.monotonic()
            for child in self._watched():
                if not self._check(child, now):
                    return 1
        self.say("stopping ...")
        return 0

    def _check(self, child: Watched, now: float) -> bool:
        name = child.name
        if name in self.down:
            if now >= self.down[name]:
                del self.down[name]
                return self._restart(child, now)
            return True
        if child.alive:
            if name in self.coming_back and self._answers(child):
                self.coming_back.discard(name)
                took = now - self.launched[name]
                back = f"{name} is back (pid {child.pid}, ready in {took:.1f}s)"
                if name == REDIS:
                    back += ": empty until the workers' next heartbeats"
                self.say(back)
            return True
        self.coming_back.discard(name)
        if isinstance(child, Child):
            child.signal(signal.SIGKILL)  # whatever it spawned goes with it
        return self._on_exit(child, describe_exit(child.returncode), child.last_line(), now)

    def _answers(self, child: Watched) -> bool:
        if isinstance(child, RedisChild):
            return child.alive  # start() returned only once it answered PING
        return answers_health(child.url)

    def _restart(self, child: Watched, now: float) -> bool:
        self.launched[child.name] = now
        if isinstance(child, RedisChild):
            try:
                child.server.start()  # same port: the workers' and router's URL stays
            except RuntimeError as e:
                return self._on_exit(child, "could not start again", str(e)[:200], now)
        else:
            self.children[self.children.index(child)] = child.fresh().start()
        self.coming_back.add(child.name)
        return True

    def _workers_up(self, but: str) -> int:
        return sum(
            1 for c in self.children
            if c.name not in ("router", but) and c.alive and c.name not in self.down
        )  # fmt: skip

    def _on_exit(self, child: Watched, how: str, last: str, now: float) -> bool:
        """Report an exit in one line and schedule the restart; False: give up, after
        showing the process's last log lines."""
        name = child.name
        delay = self.restarts.on_exit(name, now)
        said = f"{name} exited ({how})" + (f"; its last log line: {last}" if last else "")
        window = f"{self.restarts.window_s:.0f}s"
        if delay is None:
            self.say(f"{said}. It exited {self.restarts.recent(name)} times within {window}: "
                     "giving up, stopping the fleet.")  # fmt: skip
            lines = last_lines(child.log, GIVE_UP_LINES)
            if lines:
                self.say(f"Last lines of {child.log}:")
                for line in lines:
                    self.say(f"  {line}")
            self.gave_up = child
            return False
        self.say(f"{said}. Restarting it in {delay:.0f}s (restart {self.restarts.recent(name)} "
                 f"of at most {self.restarts.max_restarts} within {window}); "
                 f"{keeps_serving(name, self._workers_up(name))}")  # fmt: skip
        self.down[name] = now + delay
        return True
