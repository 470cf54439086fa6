"""Stopping a run on request: `StopSignal` turns SIGTERM/SIGINT into a flag the run checks between
its stages and steps, so a signal ends the run with a checkpoint instead of killing it half-way."""
from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading

log = logging.getLogger("specjax")


class StopSignal:
    """SIGTERM/SIGINT, at any moment of the run (set-up, steps, final validation, save, export), ask it
    to finish what it is doing, checkpoint and exit cleanly; nothing is killed half-way. A second
    SIGINT exits at once.

    Python runs signal handlers between bytecodes of the main thread, so while XLA compiles (one long
    C++ call) two Ctrl-C's would reach the handler as one, late. The signal numbers are therefore
    also written to a wakeup pipe (`signal.set_wakeup_fd`, done in C when each signal arrives) that a
    watcher thread reads: it sees the second SIGINT when it arrives and ends the process there.
    Raising KeyboardInterrupt instead could land inside XLA's compiler or a runtime thread (a
    segfault was seen); checkpoints on disk are complete or absent (atomic saves), so exiting the
    process directly loses nothing saved."""

    def __init__(self):
        self.requested = False
        self._sigints = 0
        self._undo = None  # set while installed

    def _handler(self, signum, frame):
        if not self.requested:
            log.warning("received %s: finishing the current stage, then checkpointing and exiting",
                        signal.Signals(signum).name)
        self.requested = True

    def _watch(self, fd: int) -> None:
        while True:
            try:
                data = os.read(fd, 64)
            except OSError:
                data = b""
            if not data:  # the write end was closed: the run is over
                os.close(fd)
                return
            for signum in data:
                if signum in (signal.SIGINT, signal.SIGTERM):
                    self.requested = True
                if signum == signal.SIGINT:
                    self._sigints += 1
                    if self._sigints >= 2:
                        os.write(2, b"\nsecond interrupt: exiting now; the last saved checkpoint is intact\n")
                        os._exit(130)

    def _install(self):
        """Set the handlers and the wakeup pipe; returns what undoes it."""
        old = {sig: signal.signal(sig, self._handler) for sig in (signal.SIGTERM, signal.SIGINT)}
        r, w = os.pipe()
        os.set_blocking(w, False)
        old_fd = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
        threading.Thread(target=self._watch, args=(r,), name="specjax-signals", daemon=True).start()

        def undo():
            signal.set_wakeup_fd(old_fd)
            os.close(w)  # the watcher reads EOF and ends
            for sig, h in old.items():
                signal.signal(sig, h)
        return undo

    @contextlib.contextmanager
    def installed(self):
        """The handlers for the block (set from the main thread only: Python allows no other)."""
        if threading.current_thread() is not threading.main_thread():
            yield self
            return
        self._undo = self._install()
        try:
            yield self
        finally:
            self._undo()
            self._undo = None

    @contextlib.contextmanager
    def paused(self):
        """The handling from before `installed` for the block: in a stage with no point at which to
        stop and checkpoint (the regeneration stage, which a rerun resumes), a signal acts as it would
        without this object. Outside `installed` nothing changes."""
        if self._undo is None:
            yield self
            return
        self._undo()
        try:
            yield self
        finally:
            self._undo = self._install()
