"""A warm parent for scenario runs: it imports torch once, then forks one child per run.

Started as a plain script (``python .../_zygote.py``), never as ``-m metapatch...``: importing
the metapatch package here would install patches in the parent that every child inherits. The
parent imports torch only: not transformers, accelerate or peft, which would capture functions by
name before a child's ``import metapatch`` could patch them, exactly what the reproducers must
not get wrong. Each child sets its environment, imports metapatch fresh and runs
``metapatch.selftest._child.main``; stdout carries only this protocol (one JSON line per request
and reply), a child's output goes to a log file.
"""

import json
import os
import signal
import sys
import time

import torch  # noqa: F401 - the point of this process

REPO = os.environ["METAPATCH_ZYGOTE_REPO"]


def _child(request: dict) -> None:
    log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    sys.path.insert(0, REPO)
    from metapatch.selftest._child import main

    main(request["function"], request["workdir"], request["result"])


def _serve(request: dict) -> dict:
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            _child(request)
        except BaseException:  # noqa: BLE001 - reported through the missing result file
            code = 1
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    deadline = time.monotonic() + request["timeout"]
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return {"rc": os.waitstatus_to_exitcode(status), "timed_out": False}
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return {"rc": -9, "timed_out": True}
        time.sleep(0.02)


def main() -> None:
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        print(json.dumps(_serve(json.loads(line))), flush=True)


if __name__ == "__main__":
    main()
