"""Durable store for files, batches and kept responses: SQLite (stdlib) plus file bodies under
the data dir.

Every batch line's result is committed as soon as it exists, exactly once
(``UPDATE ... WHERE status = 'pending'``), so a server killed at any point and
restarted resumes the pending lines and the output lists each custom_id once. Once a batch has
ended (its output and error files written), its lines are dropped and its counts kept. A batch's
input file keeps its bytes until all its lines are in the store, even when it is deleted (it is
then gone for the API), so a stop while it validates loses no line. Each start removes what a
stop left on disk (a part-written body, the body of a deleted file).
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import sqlite3
import time
import uuid
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path

SCHEMA = """
CREATE TABLE IF NOT EXISTS files (
    id TEXT PRIMARY KEY, bytes INTEGER NOT NULL, created_at INTEGER NOT NULL,
    filename TEXT NOT NULL, purpose TEXT NOT NULL, deleted INTEGER NOT NULL DEFAULT 0);
CREATE TABLE IF NOT EXISTS batches (
    id TEXT PRIMARY KEY, seq INTEGER NOT NULL, input_file_id TEXT NOT NULL, endpoint TEXT NOT NULL,
    completion_window TEXT NOT NULL, status TEXT NOT NULL, created_at INTEGER NOT NULL,
    expires_at INTEGER, metadata TEXT, errors TEXT, output_file_id TEXT, error_file_id TEXT,
    in_progress_at INTEGER, finalizing_at INTEGER, completed_at INTEGER, failed_at INTEGER,
    cancelling_at INTEGER, cancelled_at INTEGER, expired_at INTEGER);
CREATE TABLE IF NOT EXISTS batch_lines (
    batch_id TEXT NOT NULL, line_no INTEGER NOT NULL, custom_id TEXT NOT NULL, body TEXT NOT NULL,
    status TEXT NOT NULL DEFAULT 'pending', status_code INTEGER, result TEXT,
    PRIMARY KEY (batch_id, line_no));
CREATE TABLE IF NOT EXISTS responses (
    id TEXT PRIMARY KEY, seq INTEGER NOT NULL, response TEXT NOT NULL, conversation TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS response_inputs (id TEXT PRIMARY KEY, items TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS response_jobs (id TEXT PRIMARY KEY, body TEXT NOT NULL);
"""
# columns added since the tables were first made: a data dir written before gets them on opening
ADDED_COLUMNS = {
    "files": ("expires_at INTEGER",),
    "batches": ("model TEXT", "output_expires_s INTEGER", "input_tokens INTEGER NOT NULL DEFAULT 0",
                "cached_tokens INTEGER NOT NULL DEFAULT 0", "output_tokens INTEGER NOT NULL DEFAULT 0",
                "reasoning_tokens INTEGER NOT NULL DEFAULT 0",
                # a batch's request_counts once it has ended (its lines are dropped then)
                "total_lines INTEGER", "completed_lines INTEGER", "failed_lines INTEGER",
                "lines_stored INTEGER NOT NULL DEFAULT 0")}     # 1 once every line is in batch_lines
LINES_PER_WRITE = 2_000     # batch lines inserted per transaction
SIDE_WAIT_S = 30.0          # how long a connection waits for another's write lock
STALE_PART_S = 3600.0       # a part-written body this old was left by a stop (a start removes it)
USAGE = ("input_tokens", "cached_tokens", "output_tokens", "reasoning_tokens")

ACTIVE = ("validating", "in_progress", "finalizing", "cancelling")
# the batches whose lines are not all stored yet: they read their input file (again, after a stop)
NEEDS_INPUT = "(status='validating' OR (status='cancelling' AND lines_stored=0))"

TIMESTAMPS = ("in_progress_at", "finalizing_at", "completed_at", "failed_at", "cancelling_at",
              "cancelled_at", "expired_at")

log = logging.getLogger("tandem.store")


class StoreError(Exception):
    """The data dir's database cannot be used (damaged, or locked by another process): the
    server cannot start on it."""


@dataclass(frozen=True, slots=True)
class NewFile:
    """A file to list: its id, size, name, purpose and seconds to keep it (None: until deleted)."""
    id: str
    nbytes: int
    filename: str
    purpose: str
    expires_s: int | None = None


def new_id(prefix: str, sep: str = "-") -> str:
    """OpenAI's id shapes: ``file-…``, ``batch_…``."""
    return f"{prefix}{sep}{uuid.uuid4().hex[:24]}"


def result_file_id(bid: str, kind: str) -> str:
    """The id of a batch's ``kind`` ("output", "error") file: derived from the batch's, so
    writing the file again (a finalize run again after a stop) gives the same one."""
    return "file-" + hashlib.sha256(f"{bid}:{kind}".encode()).hexdigest()[:24]


class Store:
    """Files, batches and kept responses in one SQLite database. Its methods run on the event
    loop's thread, on one connection, except those that say they run on a thread of their own:
    they take a connection of their own and do the work of a whole batch there."""

    def __init__(self, data_dir: str | os.PathLike):
        self.root = Path(data_dir)
        self.files_dir = self.root / "files"
        self.files_dir.mkdir(parents=True, exist_ok=True)
        path = self.root / "tandem.sqlite3"
        try:
            self.db = self._connect()
            self._open()
        except sqlite3.OperationalError as e:       # locked by another process, a full disk, no access
            raise StoreError(f"the data dir's database {path} cannot be opened: {e}") from None
        except sqlite3.DatabaseError as e:
            raise StoreError(f"the data dir's database {path} is damaged ({e}). Restore it from a backup, or "
                             f"move it aside to start with an empty one (the files, batches and kept "
                             f"responses it lists are then not listed)") from None

    def _open(self) -> None:
        """Check the database, make or update its tables, and tidy what a stop left."""
        if self.db.execute("PRAGMA quick_check").fetchone()[0] != "ok":
            raise sqlite3.DatabaseError("its integrity check failed")
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.executescript(SCHEMA)
        for table, columns in ADDED_COLUMNS.items():
            have = {r["name"] for r in self.db.execute(f"PRAGMA table_info({table})")}
            for col in columns:
                if col.split()[0] not in have:
                    self.db.execute(f"ALTER TABLE {table} ADD COLUMN {col}")
        self.sweep_expired()
        for r in self.db.execute("SELECT id FROM batches WHERE total_lines IS NOT NULL AND id IN "
                                 "(SELECT DISTINCT batch_id FROM batch_lines)").fetchall():
            self._drop_lines(self.db, r["id"])        # a stop between a batch's end and its lines' drop
        self._sweep_bodies()

    def _sweep_bodies(self) -> None:
        """Remove what a stop left under files/: the bodies of deleted files (unless a batch still
        reads its input from one) and part-written bodies an hour old (younger ones may be
        another server's on this data dir, still being written). Bodies no file lists (a stop
        between writing and listing one; a database restored from a backup or replaced) are kept
        and counted in the log: they may be a user's."""
        listed = {r["id"]: r["deleted"] for r in self.db.execute("SELECT id, deleted FROM files")}
        needed = {r[0] for r in self.db.execute(f"SELECT input_file_id FROM batches WHERE {NEEDS_INPUT}")}
        stale = time.time() - STALE_PART_S
        unlisted = 0
        for f in self.files_dir.iterdir():
            if f.name.startswith(".") and f.name.endswith(".tmp"):
                if f.stat().st_mtime < stale:
                    f.unlink(missing_ok=True)
            elif f.name in listed:
                if listed[f.name] and f.name not in needed:
                    f.unlink(missing_ok=True)
            elif f.is_file():
                unlisted += 1
        if unlisted:
            log.warning("%s holds %d file bodies no file lists (left by a stop between writing and listing "
                        "them, or listed by a database this one replaced): kept; remove them if they are not "
                        "needed", self.files_dir, unlisted)

    def _connect(self) -> sqlite3.Connection:
        db = sqlite3.connect(self.root / "tandem.sqlite3", isolation_level=None, timeout=SIDE_WAIT_S,
                             check_same_thread=False)
        db.row_factory = sqlite3.Row
        db.execute("PRAGMA synchronous=FULL")
        return db

    # ---- files ---------------------------------------------------------------
    def add_file(self, data: bytes, filename: str, purpose: str, expires_s: int | None = None) -> dict:
        """Keep an uploaded file; one given ``expires_s`` is gone that many seconds after now."""
        self.sweep_expired()
        fid = new_id("file")
        self.write_blob(fid, data)
        try:
            return self.register_file(fid, len(data), filename, purpose, expires_s)
        except BaseException:
            (self.files_dir / fid).unlink(missing_ok=True)
            raise

    def write_blob(self, fid: str, data: bytes) -> None:
        """A file's bytes on disk, whole or not at all (touches no database: safe from a thread)."""
        tmp = self.files_dir / f".{fid}.tmp"
        try:
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.files_dir / fid)
        except BaseException:          # a full disk: the part written must not take its space for ever
            tmp.unlink(missing_ok=True)
            raise

    def register_file(self, fid: str, nbytes: int, filename: str, purpose: str,
                      expires_s: int | None = None) -> dict:
        """List a file whose bytes ``write_blob`` has written."""
        self._insert_file(self.db, NewFile(fid, nbytes, filename, purpose, expires_s))
        return self.get_file(fid)

    @staticmethod
    def _insert_file(db: sqlite3.Connection, f: NewFile) -> None:
        now = int(time.time())
        db.execute("INSERT INTO files (id, bytes, created_at, filename, purpose, expires_at) VALUES (?,?,?,?,?,?)",
                   (f.id, f.nbytes, now, f.filename, f.purpose, None if f.expires_s is None else now + f.expires_s))

    def get_file(self, fid: str) -> dict | None:
        """A file, unless it was deleted or has expired (an expired one is gone before the sweep
        that removes its bytes)."""
        r = self.db.execute("SELECT * FROM files WHERE id=? AND deleted=0 AND (expires_at IS NULL OR "
                            "expires_at > ?)", (fid, int(time.time()))).fetchone()
        if r is None:
            return None
        return {"id": r["id"], "object": "file", "bytes": r["bytes"], "created_at": r["created_at"],
                "expires_at": r["expires_at"], "filename": r["filename"], "purpose": r["purpose"],
                "status": "processed", "status_details": None}

    def sweep_expired(self) -> None:
        """Delete the files whose time is up, bytes included (those of a batch's input once it has
        stored its lines)."""
        gone = self.db.execute("UPDATE files SET deleted=1 WHERE deleted=0 AND expires_at <= ? RETURNING id",
                               (int(time.time()),)).fetchall()
        for r in gone:
            self._drop_input_bytes(self.db, r["id"])

    def list_files(self, purpose: str | None = None, limit: int = 10_000, newest_first: bool = True,
                   after: str | None = None) -> tuple[list[dict], bool]:
        """Up to ``limit`` files (of ``purpose``, where given) in upload order or its reverse,
        starting after the file ``after`` (none when it is unknown), and whether more follow."""
        self.sweep_expired()
        mark = None
        if after is not None:
            row = self.db.execute("SELECT rowid FROM files WHERE id=?", (after,)).fetchone()
            if row is None:
                return [], False
            mark = row[0]
        cmp, order = ("<", "DESC") if newest_first else (">", "ASC")
        rows = self.db.execute(f"SELECT id FROM files WHERE deleted=0 AND (? IS NULL OR purpose=?) "
                               f"AND (? IS NULL OR rowid {cmp} ?) ORDER BY rowid {order} LIMIT ?",
                               (purpose, purpose, mark, mark, limit + 1)).fetchall()
        return [self.get_file(r["id"]) for r in rows[:limit]], len(rows) > limit

    def file_path(self, fid: str) -> Path | None:
        """Where a (not deleted) file's bytes are."""
        return None if self.get_file(fid) is None else self.files_dir / fid

    def file_content(self, fid: str) -> bytes | None:
        path = self.file_path(fid)
        return None if path is None else path.read_bytes()

    def delete_file(self, fid: str) -> bool:
        """Delete a file for the API; its bytes go now, unless a batch has not stored all its lines
        from it yet (they go once it has)."""
        cur = self.db.execute("UPDATE files SET deleted=1 WHERE id=? AND deleted=0", (fid,))
        if cur.rowcount:
            self._drop_input_bytes(self.db, fid)
        return bool(cur.rowcount)

    def _drop_input_bytes(self, db: sqlite3.Connection, fid: str) -> None:
        """Remove a deleted file's bytes, unless a batch still reads its lines from it."""
        if db.execute(f"SELECT 1 FROM files WHERE id=? AND deleted=1 AND id NOT IN (SELECT input_file_id "
                      f"FROM batches WHERE {NEEDS_INPUT})", (fid,)).fetchone():
            (self.files_dir / fid).unlink(missing_ok=True)

    def input_bytes(self, bid: str) -> bytes | None:
        """A batch's input file's bytes, also where the file was deleted since the batch was made
        (kept until the batch has stored its lines); None where they are gone."""
        fid = self.db.execute("SELECT input_file_id FROM batches WHERE id=?", (bid,)).fetchone()[0]
        try:
            return (self.files_dir / fid).read_bytes()
        except FileNotFoundError:
            return None

    # ---- batches ---------------------------------------------------------------
    def add_batch(self, input_file_id: str, endpoint: str, window_s: int, window: str,
                  metadata: dict | None, model: str, output_expires_s: int | None = None) -> dict:
        """A new batch, validating; its output and error files expire ``output_expires_s`` after
        they are written, where given."""
        bid = new_id("batch", "_")
        now = int(time.time())
        seq = self.db.execute("SELECT COALESCE(MAX(seq), 0) + 1 FROM batches").fetchone()[0]
        self.db.execute("INSERT INTO batches (id, seq, input_file_id, endpoint, completion_window, status,"
                        " created_at, expires_at, metadata, model, output_expires_s) VALUES (?,?,?,?,?,?,?,?,?,?,?)",
                        (bid, seq, input_file_id, endpoint, window, "validating", now, now + window_s,
                         json.dumps(metadata) if metadata is not None else None, model, output_expires_s))
        return self.get_batch(bid)

    def output_expiry(self, bid: str) -> int | None:
        """Seconds a batch's output and error files are kept, or None: until deleted."""
        return self.db.execute("SELECT output_expires_s FROM batches WHERE id=?", (bid,)).fetchone()[0]

    def set_status(self, bid: str, status: str, **fields) -> None:
        stamp = f"{status}_at" if f"{status}_at" in TIMESTAMPS else None
        sets = {"status": status, **fields}
        if stamp:
            sets[stamp] = int(time.time())
        cols = ", ".join(f"{k}=?" for k in sets)
        self.db.execute(f"UPDATE batches SET {cols} WHERE id=?", (*sets.values(), bid))

    def add_lines(self, bid: str, lines: list[tuple[int, str, dict]]) -> None:
        """Insert validated lines, then move to in_progress (unless cancelled meanwhile); on a
        thread of its own. In transactions of ``LINES_PER_WRITE`` lines, so the event loop's own
        writes never wait long for the lock; a stop in between leaves the batch validating (or
        cancelling), to be validated and inserted again (a line inserted twice is kept once)."""
        with closing(self._connect()) as db:
            for at in range(0, len(lines), LINES_PER_WRITE):
                with db:
                    db.execute("BEGIN")
                    db.executemany("INSERT OR IGNORE INTO batch_lines (batch_id, line_no, custom_id, body) "
                                   "VALUES (?,?,?,?)", [(bid, n, cid, json.dumps(b))
                                                        for n, cid, b in lines[at:at + LINES_PER_WRITE]])
            with db:
                db.execute("BEGIN")
                db.execute("UPDATE batches SET lines_stored=1 WHERE id=?", (bid,))
                # a batch cancelled while it was validating stays cancelling
                db.execute("UPDATE batches SET status='in_progress', in_progress_at=? WHERE id=? AND "
                           "status='validating'", (int(time.time()), bid))
            self._drop_batch_input(db, bid)

    def _drop_batch_input(self, db: sqlite3.Connection, bid: str) -> None:
        """A batch's input bytes, where the file was deleted and no batch reads it any more."""
        fid = db.execute("SELECT input_file_id FROM batches WHERE id=?", (bid,)).fetchone()[0]
        self._drop_input_bytes(db, fid)

    def needs_lines(self, bid: str) -> bool:
        """Whether a batch has not stored all its lines yet (validating, or cancelled while it
        was and stopped before they were in)."""
        return self.db.execute(f"SELECT 1 FROM batches WHERE id=? AND {NEEDS_INPUT}", (bid,)).fetchone() is not None

    def fail_batch(self, bid: str, errors: list[dict]) -> None:
        """A batch failed with ``errors``: its request_counts as its lines stand, then its lines
        dropped (no file lists their results), and a deleted input's bytes with them."""
        with self.db:
            self.db.execute("BEGIN")
            c = self._line_counts(self.db, bid)
            self.db.execute("UPDATE batches SET status='failed', failed_at=?, errors=?, total_lines=?, "
                            "completed_lines=?, failed_lines=? WHERE id=?",
                            (int(time.time()), json.dumps({"object": "list", "data": errors}), c["total"],
                             c["completed"], c["failed"], bid))
        self._drop_lines(self.db, bid)
        self._drop_batch_input(self.db, bid)

    def pending_lines(self, bid: str, after: int = -1, limit: int = -1) -> list[tuple[int, str, dict]]:
        """The lines with no result yet, in order: the first ``limit`` (-1: all) after ``after``."""
        rows = self.db.execute("SELECT line_no, custom_id, body FROM batch_lines WHERE batch_id=? AND "
                               "line_no > ? AND status='pending' ORDER BY line_no LIMIT ?",
                               (bid, after, limit)).fetchall()
        return [(r["line_no"], r["custom_id"], json.loads(r["body"])) for r in rows]

    def finish_line(self, bid: str, line_no: int, status_code: int, result: dict,
                    usage: tuple[int, int, int, int] = (0, 0, 0, 0)) -> bool:
        """Record a line's result once, its ``usage`` (tokens in, of them cached, out, of them
        reasoning) added to the batch's in the same transaction; False if it already had one."""
        with self.db:
            self.db.execute("BEGIN")
            cur = self.db.execute("UPDATE batch_lines SET status=?, status_code=?, result=? WHERE batch_id=? "
                                  "AND line_no=? AND status='pending'",
                                  ("done" if status_code == 200 else "error", status_code,
                                   json.dumps(result), bid, line_no))
            if cur.rowcount:
                self.db.execute(f"UPDATE batches SET {', '.join(f'{k} = {k} + ?' for k in USAGE)} WHERE id=?",
                                (*usage, bid))
        return bool(cur.rowcount)

    def line_results(self, bid: str) -> list[dict]:
        """Every line's result, in order; on a thread of its own."""
        with closing(self._connect()) as db:
            return [dict(r) for r in db.execute("SELECT line_no, custom_id, status, status_code, result FROM "
                                                "batch_lines WHERE batch_id=? ORDER BY line_no", (bid,))]

    def end_batch(self, bid: str, final: str, output: NewFile | None, errors: NewFile | None) -> None:
        """A batch's final state, its result files (whose bytes ``write_blob`` has written: listed
        in the same transaction, so a stop before it lists none, and one after it ended the batch)
        and request_counts; then its lines are dropped (their results are in the files),
        ``LINES_PER_WRITE`` at a time; on a thread of its own."""
        output_file_id, error_file_id = (None if f is None else f.id for f in (output, errors))
        with closing(self._connect()) as db:
            with db:
                db.execute("BEGIN IMMEDIATE")         # counted and ended with no write in between
                for f in (output, errors):
                    if f is not None:
                        self._insert_file(db, f)
                c = self._line_counts(db, bid)
                db.execute("UPDATE batches SET status=?, output_file_id=?, error_file_id=?, total_lines=?, "
                           f"completed_lines=?, failed_lines=?, {final}_at=? WHERE id=?",
                           (final, output_file_id, error_file_id, c["total"], c["completed"], c["failed"],
                            int(time.time()), bid))
            self._drop_lines(db, bid)
            self._drop_batch_input(db, bid)

    @staticmethod
    def _drop_lines(db: sqlite3.Connection, bid: str) -> None:
        while db.execute("DELETE FROM batch_lines WHERE rowid IN (SELECT rowid FROM batch_lines WHERE batch_id=? "
                         "LIMIT ?)", (bid, LINES_PER_WRITE)).rowcount:
            pass

    def counts(self, r: sqlite3.Row) -> dict:
        """A batch's request_counts: kept once it ended, else counted from its lines."""
        if r["total_lines"] is not None:
            return {"total": r["total_lines"], "completed": r["completed_lines"], "failed": r["failed_lines"]}
        return self._line_counts(self.db, r["id"])

    @staticmethod
    def _line_counts(db: sqlite3.Connection, bid: str) -> dict:
        r = db.execute("SELECT COUNT(*) t, SUM(status='done') c, SUM(status='error') f FROM batch_lines "
                       "WHERE batch_id=?", (bid,)).fetchone()
        return {"total": r["t"] or 0, "completed": r["c"] or 0, "failed": r["f"] or 0}

    def get_batch(self, bid: str) -> dict | None:
        r = self.db.execute("SELECT * FROM batches WHERE id=?", (bid,)).fetchone()
        if r is None:
            return None
        out = {"id": r["id"], "object": "batch", "endpoint": r["endpoint"], "errors": json.loads(r["errors"])
               if r["errors"] else None, "input_file_id": r["input_file_id"],
               "completion_window": r["completion_window"], "status": r["status"],
               "output_file_id": r["output_file_id"], "error_file_id": r["error_file_id"],
               "created_at": r["created_at"], "expires_at": r["expires_at"],
               "request_counts": self.counts(r),
               "metadata": json.loads(r["metadata"]) if r["metadata"] else None,
               "model": r["model"], "usage": None if r["model"] is None else _usage(r)}
        for k in TIMESTAMPS:
            out[k] = r[k]
        return out

    def list_batches(self, limit: int, after: str | None) -> tuple[list[dict], bool]:
        seq = None
        if after is not None:
            row = self.db.execute("SELECT seq FROM batches WHERE id=?", (after,)).fetchone()
            seq = row["seq"] if row else None
            if row is None:
                return [], False
        rows = self.db.execute("SELECT id FROM batches WHERE (? IS NULL OR seq < ?) ORDER BY seq DESC LIMIT ?",
                               (seq, seq, limit + 1)).fetchall()
        return [self.get_batch(r["id"]) for r in rows[:limit]], len(rows) > limit

    def active_batches(self) -> list[str]:
        q = f"SELECT id FROM batches WHERE status IN ({','.join('?' * len(ACTIVE))}) ORDER BY seq"
        return [r["id"] for r in self.db.execute(q, ACTIVE).fetchall()]

    def status(self, bid: str) -> str:
        return self.db.execute("SELECT status FROM batches WHERE id=?", (bid,)).fetchone()["status"]

    # ---- responses (the Responses API's store) ---------------------------------------
    def keep_response(self, response: dict, conversation: list[dict], keep: int, inputs: list[dict],
                      job: dict | None = None, ends_job: bool = False) -> None:
        """Keep a response, its conversation and its input items; only the ``keep`` newest stay.
        With ``job`` (a background response's request, kept until it ends) or ``ends_job`` (it
        ended: its request goes), in the same transaction: a stop never leaves a response kept
        queued with no request to run, nor one ended whose request runs again."""
        with self.db:
            self.db.execute("BEGIN")
            seq = self.db.execute("SELECT COALESCE(MAX(seq), 0) + 1 FROM responses").fetchone()[0]
            self.db.execute("INSERT OR REPLACE INTO responses VALUES (?,?,?,?)",
                            (response["id"], seq, json.dumps(response), json.dumps(conversation)))
            self.db.execute("INSERT OR REPLACE INTO response_inputs VALUES (?,?)",
                            (response["id"], json.dumps(inputs)))
            self._job(response["id"], job, ends_job)
            self.db.execute("DELETE FROM responses WHERE seq <= ? AND id NOT IN (SELECT id FROM response_jobs)",
                            (seq - keep,))        # a background response still running stays
            self.db.execute("DELETE FROM response_inputs WHERE id NOT IN (SELECT id FROM responses)")

    def _job(self, rid: str, job: dict | None, ends: bool) -> None:
        if job is not None:
            self.db.execute("INSERT OR REPLACE INTO response_jobs VALUES (?,?)", (rid, json.dumps(job)))
        elif ends:
            self.db.execute("DELETE FROM response_jobs WHERE id=?", (rid,))

    def response_inputs(self, rid: str) -> list[dict]:
        """A kept response's input items (none for one kept before they were)."""
        r = self.db.execute("SELECT items FROM response_inputs WHERE id=?", (rid,)).fetchone()
        return [] if r is None else json.loads(r["items"])

    def get_response(self, rid: str) -> tuple[dict, list[dict]] | None:
        r = self.db.execute("SELECT response, conversation FROM responses WHERE id=?", (rid,)).fetchone()
        return None if r is None else (json.loads(r["response"]), json.loads(r["conversation"]))

    def set_response(self, response: dict, ends_job: bool = False) -> None:
        """A kept response as it is now (its conversation and place stay); ``ends_job``: it ended,
        and its request goes in the same transaction."""
        with self.db:
            self.db.execute("BEGIN")
            self.db.execute("UPDATE responses SET response=? WHERE id=?", (json.dumps(response), response["id"]))
            self._job(response["id"], None, ends_job)

    def add_response_job(self, rid: str, body: dict) -> None:
        """A background response's request, kept until it ends."""
        self._job(rid, body, False)

    def response_job(self, rid: str) -> dict | None:
        r = self.db.execute("SELECT body FROM response_jobs WHERE id=?", (rid,)).fetchone()
        return None if r is None else json.loads(r["body"])

    def response_jobs(self) -> list[tuple[str, dict]]:
        """The background responses not ended: (id, request), oldest first."""
        return [(r["id"], json.loads(r["body"])) for r in self.db.execute("SELECT id, body FROM response_jobs "
                                                                        "ORDER BY rowid")]

    def end_response_job(self, rid: str) -> None:
        self.db.execute("DELETE FROM response_jobs WHERE id=?", (rid,))

    def delete_response(self, rid: str) -> bool:
        self.db.execute("DELETE FROM response_inputs WHERE id=?", (rid,))
        return bool(self.db.execute("DELETE FROM responses WHERE id=?", (rid,)).rowcount)

    def close(self) -> None:
        self.db.close()


def _usage(r: sqlite3.Row) -> dict:
    """A batch's usage object, as OpenAI's batch carries it."""
    return {"input_tokens": r["input_tokens"], "input_tokens_details": {"cached_tokens": r["cached_tokens"]},
            "output_tokens": r["output_tokens"], "output_tokens_details": {"reasoning_tokens": r["reasoning_tokens"]},
            "total_tokens": r["input_tokens"] + r["output_tokens"]}
