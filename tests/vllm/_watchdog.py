"""Run a command and take its whole process group down with the test process.

``python _watchdog.py PARENT_PID CMD...``: started by the tests in a session of its
own (``start_new_session``), it runs CMD (a vLLM server, which forks its engine core)
in that session and exits with CMD's status. When PARENT_PID stops being its parent
(pytest died without running its finalizers: killed, or pytest-timeout's thread
method), it SIGKILLs the session's process group, so no server outlives the test run.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time


def main() -> int:
    parent = int(sys.argv[1])
    child = subprocess.Popen(sys.argv[2:], stdin=subprocess.DEVNULL)
    while True:
        code = child.poll()
        if code is not None:
            return code
        if os.getppid() != parent:
            os.killpg(0, signal.SIGKILL)
        time.sleep(0.5)


if __name__ == "__main__":
    sys.exit(main())
