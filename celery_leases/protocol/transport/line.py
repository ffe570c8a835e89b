"""The publish line: this process's own connection for enqueues read after the publish.

Publish tracking (queued/) writes a task's enqueue on it, publishes the message
meanwhile, then reads the reply: a publish costs about one round trip, not two.
Commands arrive packed; replies are parsed with resp.py, and the usual reply
(``RECORDED``) is recognised without parsing.
"""
from __future__ import annotations

import os
import threading
from typing import Any

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError

from ...exceptions import LeaseUnavailable
from ..codes import Code
from ..errors import lease_error
from .direct import close_connection, open_connection
from .resp import Incomplete, parse

__all__ = ["Line", "RECORDED"]

#: enqueue's reply for a task it recorded, as ``result()`` returns it, and as it comes on the
#: wire (the same in RESP2 and RESP3): the line recognises it without parsing.
RECORDED = (Code.OK, "queued")
_RECORDED = b"*2\r\n:%d\r\n$6\r\nqueued\r\n" % int(Code.OK)
_RECORDED_LEN = len(_RECORDED)


class Line:
    """This process's own connection for enqueues whose replies are read after the publish.

    Taken from the store's pool once and kept, so a publish pays neither the pool's
    lock and bookkeeping nor its poll of the socket; commands are packed and replies
    parsed with resp.py. The same rules as direct.py: one process (a forked child opens
    its own, never touching the parent's socket), one holder at a time from ``take`` to
    ``give_back`` (a second thread uses the pool meanwhile), any error closes it. The
    replies are read in the order the commands were written; a holder that gives it
    back with replies still due closes it, so a reply is never read by the wrong caller.
    """

    def __init__(self, client: Any) -> None:
        self.client = client
        self._reset()

    def _reset(self) -> None:
        self.lock = threading.Lock()
        self.pid = os.getpid()
        self.conn: Any = None
        self.buffer = bytearray()
        #: Replies written for and not read yet, on the current socket.
        self.due = 0
        #: Counts the sockets opened, so a reply due on a closed one is never read from the next.
        self.epoch = 0
        #: True when the socket was opened before the current holder took the line.
        self.reused = False

    def take(self) -> bool:
        if self.pid != os.getpid():
            self._reset()  # a forked child: the parent's socket and lock are not ours
        if not self.lock.acquire(blocking=False):
            return False
        self.reused = self.conn is not None
        return True

    def give_back(self) -> None:
        if self.due:
            self.disconnect()
        self.lock.release()

    def write(self, command: bytes) -> None:
        while True:
            if self.conn is None or self.conn._sock is None:
                if self.conn is not None:
                    self.disconnect()  # closed under us (the client's pool was reset)
                self.conn = open_connection(self.client)
                self.epoch += 1
                self.reused = False
            try:
                self.conn._sock.sendall(command)
            except (OSError, RedisConnectionError):
                stale = self.reused
                self.disconnect()
                if not stale:
                    raise
                # Held since an earlier publish and closed by the server meanwhile (idle
                # timeout, restart): written once more on a new connection, still before the
                # message. The replies due on the old one are lost; their readers know (epoch).
                self.reused = False
                continue
            except BaseException:
                self.disconnect()
                raise
            self.due += 1
            return

    def read(self, epoch: int) -> Any:
        """The next reply due on socket ``epoch``; an error reply is raised as redis-py's exception."""
        if self.conn is None or epoch != self.epoch or self.due <= 0:
            raise RedisConnectionError("the lease store connection closed before the reply was read")
        buffer = self.buffer
        try:
            while True:
                if buffer[:_RECORDED_LEN] == _RECORDED:  # the usual reply, without parsing it
                    del buffer[:_RECORDED_LEN]
                    self.due -= 1
                    return RECORDED
                if buffer:
                    try:
                        reply, end = parse(buffer)
                    except Incomplete:
                        pass
                    else:
                        del buffer[:end]
                        self.due -= 1
                        if isinstance(reply, ResponseError):
                            if isinstance(lease_error(reply, "EVALSHA"), LeaseUnavailable):
                                self.disconnect()  # READONLY, LOADING: a reconnect may reach the master
                            raise reply
                        return reply
                data = self.conn._sock.recv(65536)
                if not data:
                    raise RedisConnectionError("the lease store closed the connection")
                buffer += data
        except ResponseError:
            raise
        except BaseException:
            self.disconnect()
            raise

    def disconnect(self) -> None:
        conn, self.conn = self.conn, None
        self.buffer = bytearray()
        self.due = 0
        if conn is not None:
            close_connection(self.client, conn)
