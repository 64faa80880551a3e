"""``cmd.run_all`` for tests that run the real programs (dd, blkid, cryptsetup on image files):
what Salt's returns, from a real subprocess."""

import os
import subprocess


def real_run_all(argv, stdin=None, cwd=None, env=None, **_):
    done = subprocess.run(
        argv, input=stdin, capture_output=True, text=True, cwd=cwd, env={**os.environ, **(env or {})}
    )
    return {"retcode": done.returncode, "stdout": done.stdout, "stderr": done.stderr}
