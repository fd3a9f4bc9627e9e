"""What a conformance machine (kvchaos.harness.conformance.v2) is made of: judging a property
after a call, calling the manager (an exception other than a refusal breaks "answers"), reading
its table as the kernels do, and rules that stop once the example has stopped.

A failure of one property can make what follows meaningless (a refusal that took a block, a
snapshot that lies): once it is known, the runner runs again without it, and an example that
breaks it again stops there rather than blaming the other properties for its consequences."""

from __future__ import annotations

import functools

from hypothesis.stateful import multiple

from kvchaos.engine.errors import OutOfBlocks


class Violation(AssertionError):
    """A property failed: its name, what happened, and the calls into the manager that led
    there, as Python (`m = Manager(...)`, `m.admit('s1', [...], 3, 2)`, ...)."""

    def __init__(self, prop: str, message: str, calls: list[str] | None = None) -> None:
        self.prop, self.calls = prop, list(calls or ())
        super().__init__(f"{prop}: {message}")


class Stopped(Exception):
    """A property already known to fail broke again: the rest of the example would only show
    its consequences."""


def guarded(target: bool = False):
    """A rule that does nothing once the example has stopped (a target rule then yields none)."""

    def wrap(fn):
        @functools.wraps(fn)
        def run(self, **kw):
            if not self.stopped:
                try:
                    return fn(self, **kw)
                except Stopped:
                    self.stopped = True
            return multiple() if target else None

        return run

    return wrap


class Judging:
    """Judging properties and calling the manager, for the conformance machine
    (kvchaos.harness.conformance.v2): set `enabled`, `tally`, `bm`, `stopped`, `resizes` and
    `made` (the calls into the manager so far, as Python)."""

    def judge(self, prop: str, ok: bool, message) -> None:
        if self.tally is not None:
            self.tally[prop] += 1
        if ok:
            return
        if prop in self.enabled:
            raise Violation(prop, message(), self.made)
        raise Stopped  # a property known to fail: what follows would only show its consequences

    def call(self, shown: str, fn, *args, refusable: bool = False, **kw):
        """A call into the manager: OutOfBlocks passes where it is an answer; anything else
        escaping breaks "answers"."""
        if self.tally is not None:
            self.tally["answers"] += 1
        try:
            return fn(*args, **kw)
        except OutOfBlocks as e:
            if refusable:
                raise
            error = e
        except Exception as e:
            error = e
        self.judge("answers", False, lambda: f"{shown} raised {type(error).__name__}: {error}")
        raise Stopped

    def read(self, name: str):
        return self.call(f"reading {name}", getattr, self.bm, name)

    def read_layout(self, table):
        """(rows by sequence, the flat table, its width) of a table component
        (kvchaos.engine.tables), read as the engine's kernels read them (host_tensor)."""
        rows = self.call("the table's rows", lambda: table.rows)
        t = self.call("the table", lambda: table.table)
        host = self.call("table.host_tensor", lambda: t.host_tensor.tolist())
        return rows, host, self.call("table.width", getattr, t, "width")

    def resize_judged(self, more_rows: int, more_width: int) -> str:
        """resize_table to a table grown by these, judged on "resize": its new size, and as
        many more free rows as rows added. Returns the call as shown."""
        table = self.read("table")
        rows, width = table.rows + more_rows, table.width + more_width
        free_rows = self.read("num_free_rows")
        shown = f"resize_table(rows={rows}, width={width})"
        self.resizes += 1
        self.made.append(f"m.{shown}")
        self.call(shown, self.bm.resize_table, rows=rows, width=width)
        table = self.read("table")
        self.judge(
            "resize",
            (table.rows, table.width) == (rows, width),
            lambda: f"after {shown} the table is {table.rows} x {table.width}",
        )
        now = self.read("num_free_rows")
        self.judge(
            "resize",
            now == free_rows + more_rows,
            lambda: (
                f"{shown} took free rows from {free_rows} to {now}, not {free_rows + more_rows}"
            ),
        )
        return shown
