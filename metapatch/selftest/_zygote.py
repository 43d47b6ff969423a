"""A warm parent for scenario runs: it imports the stack once, then forks one child per run.

Started as a plain script (``python .../_zygote.py``), never as ``-m metapatch...``, with the
environment of the runs it serves (the harness keeps one parent per environment): the child of a
fork inherits every module its parent imported, and with them every import-time decision.

Without ``METAPATCH_ZYGOTE_PRELOAD`` the parent imports torch only: no metapatch, no Hugging Face
package. With it (a comma-separated list of modules), the parent first does ``import metapatch``,
which installs metapatch's import hooks (or, under ``METAPATCH_DISABLE=all``, stays inert), and only
then imports the listed modules: the order of a fresh child, which imports metapatch before its
scenario imports anything. So transformers, accelerate and peft are patched as they execute, exactly
as in a fresh interpreter, and no module captures an unpatched function by name (that is what a
parent importing transformers *before* metapatch would get wrong; tests/test_selftest_speed.py
compares a forked child's patch sites with a fresh interpreter's). A listed module that is not
installed is left out; one that fails to import makes this parent refuse to start (the harness then
runs that kind of run in a torch-only parent), as a half-imported package is no clean state.

CUDA: a child forked from a process that initialised CUDA cannot use it ("CUDA error: initialization
error"), so this parent never does. Where the imported torch may meet a GPU, modules that initialise CUDA
at import (bitsandbytes) are left out of the preload and each child imports them (``_device.preload_plan``;
the hello line lists them); after the imports the parent checks that CUDA is still untouched
(``_device.cuda_touched``) and otherwise refuses to start: the harness then tries a torch-only parent,
which checks the same, and failing that starts a fresh interpreter per run.

Several runs at once: each request line names an id, each reply line carries it; the replies go out on
the process's original stdout, which carries nothing else (what the parent prints goes to stderr, a
child's output to its log file). A reply gives the child's CPU time (wait4),
its own waited-for subprocesses included.
"""

import importlib
import importlib.util
import json
import os
import selectors
import signal
import sys
import time

if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
    del sys.path[0]  # a script's own folder: the scenario modules are no top-level modules of a child

import torch  # noqa: F401 - the point of this process

REPO = os.environ["METAPATCH_ZYGOTE_REPO"]
# The protocol's own copy of stdout: whatever an import prints (bitsandbytes reports missing kernels)
# goes to stderr instead, never into a reply.
PROTOCOL = os.fdopen(os.dup(1), "w")
os.dup2(2, 1)
PRELOAD = [m for m in os.environ.get("METAPATCH_ZYGOTE_PRELOAD", "").split(",") if m]


def _device_rules():
    """metapatch/selftest/_device.py, loaded by path: importing it through the package would run
    ``metapatch/__init__`` in the torch-only parent, which imports no metapatch."""
    spec = importlib.util.spec_from_file_location("_metapatch_zygote_device",
                                                  os.path.join(os.path.dirname(os.path.abspath(__file__)), "_device.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


DEVICE = _device_rules()


def _preload() -> tuple:
    sys.path.insert(0, REPO)
    import metapatch  # noqa: F401 - first, as in a fresh child: its hooks see every later import

    wanted, skipped = DEVICE.preload_plan(PRELOAD)
    loaded = []
    for name in wanted:
        try:
            if importlib.util.find_spec(name) is None:
                continue
        except ModuleNotFoundError:  # its parent package is not installed
            continue
        importlib.import_module(name)
        loaded.append(name)
    return loaded, skipped


def _child(request: dict) -> None:
    log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)  # the request pipe is the parent's alone
    os.close(PROTOCOL.fileno())  # so is the reply pipe
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    if REPO not in sys.path:
        sys.path.insert(0, REPO)
    from metapatch.selftest._child import main

    main(request["function"], request["workdir"], request["result"])


def _fork(request: dict) -> int:
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
    return pid


def _cpu(usage) -> float:
    return round(usage.ru_utime + usage.ru_stime, 3)


def _reply(reply: dict) -> None:
    PROTOCOL.write(json.dumps(reply) + "\n")
    PROTOCOL.flush()


def _untouched(imported: list) -> None:
    """Raises where this process touched CUDA: its children could not use it."""
    touched = DEVICE.cuda_touched()
    if touched:
        raise RuntimeError(f"CUDA is not untouched after importing {', '.join(imported)}: {touched}")


def main() -> None:
    try:
        _untouched(["torch"])  # before the (slow) preload: a refusal costs nothing
        loaded, skipped = _preload() if PRELOAD else ([], {})
        _untouched(["torch", *loaded])
    except BaseException as exc:  # noqa: BLE001 - the harness falls back to a torch-only parent
        _reply({"ready": False, "error": f"{type(exc).__name__}: {exc}"[:500]})
        return
    _reply({"ready": True, "preloaded": loaded, "skipped": skipped})
    running = {}  # pid -> (request id, deadline)
    selector = selectors.DefaultSelector()
    selector.register(sys.stdin.fileno(), selectors.EVENT_READ)
    buffered, open_input = b"", True
    while open_input or running:
        if open_input and selector.select(timeout=0.02 if running else None):
            chunk = os.read(sys.stdin.fileno(), 65536)
            if not chunk:  # the harness is gone (or exiting): stop what still runs, then exit
                open_input = False
                selector.unregister(sys.stdin.fileno())
            buffered += chunk
            while b"\n" in buffered:
                line, buffered = buffered.split(b"\n", 1)
                request = json.loads(line)
                running[_fork(request)] = (request["id"], time.monotonic() + request["timeout"])
        elif not open_input:
            time.sleep(0.02)
        for pid, (rid, deadline) in list(running.items()):
            done, status, usage = os.wait4(pid, os.WNOHANG)
            if done:
                del running[pid]
                _reply({"id": rid, "rc": os.waitstatus_to_exitcode(status), "timed_out": False, "cpu": _cpu(usage)})
            elif time.monotonic() > deadline or not open_input:
                os.kill(pid, signal.SIGKILL)
                _, _, usage = os.wait4(pid, 0)
                del running[pid]
                _reply({"id": rid, "rc": -9, "timed_out": True, "cpu": _cpu(usage)})


if __name__ == "__main__":
    main()
