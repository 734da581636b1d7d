"""OpenAI-shaped errors: {"error": {"message", "type", "param", "code"}}."""
from __future__ import annotations

import asyncio
import errno
import inspect
import logging
import sqlite3
from typing import Callable


class ApiError(Exception):
    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


def structured_error(message: str, param: str) -> ApiError:
    """A structured output's error ("structured_outputs...: why"), named as the body asked for it
    (``param``: response_format, guided_json, text.format, ...)."""
    return bad_request(param + message.removeprefix("structured_outputs"), param=param)


MAX_NESTING = 128     # JSON levels in a body or a batch line: code that walks a value recursively
                      # (templates, schemas, serializers) stays far from Python's recursion limit


def nests_deeper(value, limit: int = MAX_NESTING) -> bool:
    """Whether a JSON value holds objects or arrays more than ``limit`` levels deep (walked
    without recursion)."""
    if not isinstance(value, (dict, list)):
        return False
    stack = [(value, 1)]
    while stack:
        v, depth = stack.pop()
        for x in v.values() if isinstance(v, dict) else v:
            if isinstance(x, (dict, list)):
                if depth >= limit:
                    return True
                stack.append((x, depth + 1))
    return False


STORAGE_RETRY_S = 30.0      # work whose result the data dir refused tries to keep it again after this
_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
# SQLite's: SQLITE_FULL, and the I/O errors of a write that found no room (IOERR_WRITE, _FSYNC, _TRUNCATE)
_SQLITE_FULL_CODES = (13, 778, 1034, 1546)


def out_of_storage(e: BaseException) -> bool:
    """Whether ``e`` is a write to the data dir that the disk refused: no space, a quota, a file
    size limit, or SQLite's "database or disk is full" and the "disk I/O error" of such a write."""
    if isinstance(e, OSError):
        return e.errno in _FULL_ERRNOS
    return isinstance(e, sqlite3.OperationalError) and getattr(e, "sqlite_errorcode", 0) in _SQLITE_FULL_CODES


async def when_stored(write: Callable[[], object], what: str, log: logging.Logger):
    """``write()`` (awaited where it returns an awaitable), done again every ``STORAGE_RETRY_S``
    while the data dir refuses it, each refusal a warning naming ``what``: a full disk delays the
    work and loses none of it. Any other error is raised."""
    while True:
        try:
            result = write()
            return await result if inspect.isawaitable(result) else result
        except Exception as e:               # noqa: BLE001 -- re-raised unless the disk is full
            if not out_of_storage(e):
                raise
            log.warning("%s: the data dir refused a write (%s); trying again in %g s", what, e, STORAGE_RETRY_S)
            await asyncio.sleep(STORAGE_RETRY_S)


def storage_full(e: BaseException) -> ApiError:
    """507 for a request whose result could not be kept: nothing of it was."""
    return ApiError(507, f"the server could not store this: its data dir refused the write ({e}); "
                         "free space there and send it again", type="server_error")


def too_deep() -> ApiError:
    """A request whose values nest deeper than Python's recursion limit, where code walks them
    recursively: JSON inside a string (a schema given as text, a call's arguments), which
    ``nests_deeper`` does not see."""
    return bad_request("a value in the request nests too deeply to be read")
