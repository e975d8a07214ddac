"""Runs documentation snippets, each in a child forked from one interpreter (``tests/test_docs.py``).

The runner imports torch, lightning and lightning_smp once and does nothing else; every request forks a child that
runs one snippet as ``python -c`` would (``__name__ == "__main__"``, ``sys.argv == ["-c"]``), writes its output to the
files it is given and exits as an interpreter does (atexit handlers included). So each snippet starts from a fresh
interpreter's state, without paying the seconds of those imports again.

Protocol, one JSON object per line: the test writes ``{"source", "filename", "stdout", "stderr"}``; the runner
answers ``{"pid": ...}`` when the child has started (its own process group, so that a test that times out can end
it and every rank it started), then ``{"returncode": ...}``.
"""

from __future__ import annotations

import json
import os
import sys
import traceback

import lightning  # noqa: F401
import torch  # noqa: F401

import lightning_smp  # noqa: F401


def _child(request: dict) -> None:
    os.setpgid(0, 0)
    stdin = os.open(os.devnull, os.O_RDONLY)
    os.dup2(stdin, 0)
    for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
        os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), fd)
    sys.argv = ["-c"]
    code = 0
    try:
        exec(compile(request["source"], request["filename"], "exec", dont_inherit=True), {"__name__": "__main__"})
    except SystemExit as stop:
        if stop.code is not None and not isinstance(stop.code, int):
            print(stop.code, file=sys.stderr)
        code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
    except BaseException:  # noqa: BLE001 - reported as an interpreter reports it
        traceback.print_exc()
        code = 1
    sys.exit(code)  # unwinds through main(): the interpreter ends as after `python -c`, atexit handlers included


def main() -> None:
    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            _child(request)
        print(json.dumps({"pid": pid}), flush=True)
        _, status = os.waitpid(pid, 0)
        print(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}), flush=True)


if __name__ == "__main__":
    main()
