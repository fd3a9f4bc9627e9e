"""Block managers for the fleet soak's tests (tests/test_fleet.py): a user's manager that meets
its fate in one run only, the first to claim the flag file $KVCHAOS_FLEET_FLAG names, in its
third growth call; every other run (and the check before any run, on its tiny pool) is the
reference's behaviour through tests/managers.py's Delegate."""

from __future__ import annotations

import os
import signal
import time

import psutil

from tests.managers import Delegate

SMOKE_BLOCKS = 8  # the check's tiny pool (user_code.SMOKE_POOL): never the fated run


def _claimed() -> bool:
    path = os.environ.get("KVCHAOS_FLEET_FLAG")
    if not path:
        return False
    try:
        os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    return True


class Once(Delegate):
    def grow(self, seq_id, n):
        if self.calls == 2 and self.inner.num_blocks > SMOKE_BLOCKS and _claimed():
            self.fate()
        return super().grow(seq_id, n)

    def fate(self) -> None:
        raise NotImplementedError


class HangsOnce(Once):
    """Hangs inside the call (the run's limit stops it: a FAIL naming the call)."""

    def fate(self) -> None:
        while True:
            time.sleep(0.05)


class KillsItsRayWorkerOnce(Once):
    """Kills the Ray worker its run came from (the run's worker -> fork server -> Ray worker), as
    a node that died would, and itself with it."""

    def fate(self) -> None:
        server = psutil.Process(os.getppid())
        ray_worker = server.parent()
        os.kill(ray_worker.pid, signal.SIGKILL)
        os.kill(server.pid, signal.SIGKILL)
        os._exit(1)
