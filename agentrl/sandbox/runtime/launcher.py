"""agentrl's in-sandbox launcher. Runs INSIDE the sandbox (bubblewrap or a Docker container): stdlib only,
Python >= 3.8, never imported by the host (the host reads this file and passes it to ``python3 -I -c``).

Protocol over one duplex byte stream (requests arrive on fd 0, frames leave on fd 1):
  request = 4-byte big-endian length + UTF-8 JSON object
  frame   = 1-byte kind + 4-byte big-endian length + payload
            K ready (JSON), O / E a chunk of the program's stdout / stderr, R a result (JSON)
The launcher stays silent until the first request; ``{"op": "ping"}`` answers K and waits for the next one:
  {"op": "run", ...}  one program in a forked child (python in-process after fork, other languages via exec of
                      ``argv``); streams at most ``out_limit`` bytes per stream (and counts the rest), kills the
                      child when ``time_s`` of wall time have passed, then kills and reaps every process it can
                      signal, fetches files, optionally wipes scratch dirs and checks that nothing is left,
                      reports, and exits. ``tools`` missing from PATH: R {"missing": tool}, nothing runs.
                      With ``compile`` (argv, limits, time_s): the compiler runs first, its output captured; if
                      it succeeds, C (its outcome) is sent and the launcher waits for {"op": "go"} (the host
                      sets the run's limits meanwhile). With ``cases`` (stdin strings): the program runs once
                      per case, output captured, reported in R's ``cases``.
  {"op": "repl", ...} a persistent interpreter: each following {"op": "cell", "code": ...} runs in one namespace;
                      fd-level stdout/stderr of the cell (also of subprocesses) are captured through pipes.
The host never trusts what comes back: it bounds every frame it reads and enforces its own deadline.
"""

import ast
import base64
import builtins
import gc
import json
import os
import resource
import selectors
import signal
import struct
import sys
import time
import traceback
import types

MAX_REQUEST = 512 * 1024 * 1024
CHUNK = 65536
PR_SET_DUMPABLE, PR_SET_CHILD_SUBREAPER = 4, 36


class Channel:
    def __init__(self):
        self.rfd = os.dup(0)  # os.dup gives non-inheritable fds: an exec'd program never sees them
        self.wfd = os.dup(1)
        null = os.open(os.devnull, os.O_RDWR)
        os.dup2(null, 0)
        os.dup2(null, 1)
        os.close(null)
        self.lock = None  # a threading.Lock in repl mode

    def _read_exact(self, n):
        parts, got = [], 0
        while got < n:
            b = os.read(self.rfd, min(n - got, 1 << 20))
            if not b:
                return None
            parts.append(b)
            got += len(b)
        return b"".join(parts)

    def recv(self):
        head = self._read_exact(4)
        if head is None:
            return None
        (n,) = struct.unpack(">I", head)
        if n > MAX_REQUEST:
            raise ValueError("request too large")
        body = self._read_exact(n)
        return None if body is None else json.loads(body.decode("utf-8"))

    def send(self, kind, payload):
        data = kind + struct.pack(">I", len(payload)) + payload
        if self.lock is not None:
            with self.lock:
                self._write_all(data)
        else:
            self._write_all(data)

    def _write_all(self, data):
        view = memoryview(data)
        while view:
            view = view[os.write(self.wfd, view):]

    def send_json(self, kind, obj):
        self.send(kind, json.dumps(obj).encode("utf-8"))

    def close_in_child(self):
        os.close(self.rfd)
        os.close(self.wfd)


def prctl(option, value):
    try:
        import ctypes

        return ctypes.CDLL(None, use_errno=True).prctl(option, value, 0, 0, 0)
    except Exception:
        return -1


def set_limits(limits):
    """Lower (never raise) this process's rlimits; keys: cpu_s, fsize, nproc, nofile, as_bytes."""
    pairs = [
        (resource.RLIMIT_CORE, 0),
        (resource.RLIMIT_CPU, limits.get("cpu_s")),
        (resource.RLIMIT_FSIZE, limits.get("fsize")),
        (resource.RLIMIT_NPROC, limits.get("nproc")),
        (resource.RLIMIT_NOFILE, limits.get("nofile")),
        (resource.RLIMIT_AS, limits.get("as_bytes")),
    ]
    for which, value in pairs:
        if value is None:
            continue
        value = int(value)
        _, hard = resource.getrlimit(which)
        new_hard = value + 1 if which == resource.RLIMIT_CPU else value  # SIGXCPU first, SIGKILL a second later
        if hard != resource.RLIM_INFINITY:
            new_hard = min(new_hard, hard)
        resource.setrlimit(which, (min(value, new_hard), new_hard))


def safe_path(workdir, name):
    path = os.path.normpath(os.path.join(workdir, name))
    if path != workdir and not path.startswith(workdir.rstrip("/") + "/"):
        raise ValueError("path escapes the working directory: %r" % name)
    return path


def write_files(workdir, files):
    for name, b64 in files.items():
        path = safe_path(workdir, name)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(base64.b64decode(b64 or ""))


def fetch_files(workdir, names, cap):
    out = {}
    for name in names:
        try:
            with open(safe_path(workdir, name), "rb") as f:
                data = f.read(cap + 1)
        except (OSError, ValueError):
            continue  # missing files are left out, as SandboxFusion does
        if len(data) > cap:
            continue  # too large to fetch back: left out rather than cut
        cap -= len(data)
        out[name] = base64.b64encode(data).decode("ascii")
    return out


def kill_others(deadline_s=1.0):
    """SIGKILL every process this uid may signal (kill(-1) spares ourselves and the namespace's init), reaping
    those that were reparented to us (we are a child subreaper), until none is left or ``deadline_s`` passes."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        try:
            os.kill(-1, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            break
        reap()
        time.sleep(0.002)
    reap()


def reap():
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def leftovers():
    """Processes other than ourselves and the namespace's init, and SysV IPC objects still alive."""
    me = os.getpid()
    procs = [int(p) for p in os.listdir("/proc") if p.isdigit() and int(p) not in (1, me)]
    ipc = 0
    for kind in ("shm", "msg", "sem"):
        try:
            with open("/proc/sysvipc/" + kind) as f:
                ipc += max(0, len(f.read().splitlines()) - 1)
        except OSError:
            pass
    return procs, ipc


def wipe(dirs):
    """Empty each directory; True if they all ended up empty."""
    ok = True
    for d in dirs:
        try:
            names = os.listdir(d)
        except FileNotFoundError:
            continue
        except OSError:
            ok = False
            continue
        for name in names:
            path = os.path.join(d, name)
            try:
                if os.path.isdir(path) and not os.path.islink(path):
                    _rmtree(path)
                else:
                    os.unlink(path)
            except OSError:
                ok = False
    return ok


def _rmtree(path):
    os.chmod(path, 0o700)
    for root, dirs, files in os.walk(path, topdown=False):
        for name in files:
            os.unlink(os.path.join(root, name))
        for name in dirs:
            p = os.path.join(root, name)
            os.unlink(p) if os.path.islink(p) else os.rmdir(p)
    os.rmdir(path)


# ----------------------------------------------------------------------------------------------- one run


def run_child(req, chan, pipes, workdir):
    r_in, _, _, w_out, _, w_err = pipes
    chan.close_in_child()
    os.setsid()
    os.dup2(r_in, 0)
    os.dup2(w_out, 1)
    os.dup2(w_err, 2)
    for fd in pipes:
        os.close(fd)
    set_limits(req.get("limits", {}))
    prctl(PR_SET_DUMPABLE, 1)  # the program may read its own /proc/self; the launcher stays undumpable
    argv = req.get("argv")
    if argv:  # a compiler or a program of another language than Python
        signal.signal(signal.SIGPIPE, signal.SIG_DFL)
        env = dict(os.environ)
        env.update(req.get("env") or {})
        try:
            os.execvpe(argv[0], argv, env)
        except OSError as e:
            os.write(2, ("cannot run %s: %s\n" % (argv[0], e)).encode())
            os._exit(127)
    path = req["path"]
    main = types.ModuleType("__main__")
    main.__file__ = path
    main.__builtins__ = builtins
    sys.modules["__main__"] = main
    sys.argv = [path]
    sys.path.insert(0, workdir)
    try:
        exec(compile(req["code"], path, "exec"), main.__dict__)
    except SystemExit as e:
        exit_child(exit_status(e.code), main)
    except BaseException as e:  # print as the interpreter would, minus the launcher's frames
        sys.excepthook(type(e), e.with_traceback(user_tb(e.__traceback__)), None)
        exit_child(1, main)
    exit_child(0, main)


def user_tb(tb):
    """The traceback without the launcher's own frames (its code is compiled from ``-c``: ``<string>``)."""
    while tb is not None and tb.tb_frame.f_code.co_filename == "<string>":
        tb = tb.tb_next
    return tb


def exit_status(code):
    """The exit status Python gives ``sys.exit(code)``."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    try:
        sys.stderr.write(str(code) + "\n")
    except Exception:
        pass
    return 1


def exit_child(code, main):
    """Python's exit sequence minus the interpreter teardown: after a fork the teardown would touch (and so
    copy) every page of the launcher's heap, ~15 ms. Non-daemon threads are joined, atexit handlers run, the
    program's globals are dropped (files it left open are flushed and closed), stdio is flushed."""
    try:
        threading = sys.modules.get("threading")
        if threading is not None:
            threading._shutdown()
        import atexit

        atexit._run_exitfuncs()
    except SystemExit as e:
        code = exit_status(e.code)
    except BaseException:
        traceback.print_exc()
    try:
        main.__dict__.clear()
    except BaseException:
        pass
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            code = 120  # as Python does when it cannot flush stdout at exit
    os._exit(code)


def pump(sink, pid, stdin, r_out, r_err, w_in, out_limit, deadline, grace_s):
    """Forward output until the child exited and its pipes closed (or ``grace_s`` after it exited: a background
    grandchild may hold them); SIGKILL the child at ``deadline``. Returns (out bytes, err bytes, timed out)."""
    sel = selectors.DefaultSelector()
    sent = {r_out: 0, r_err: 0}
    kinds = {r_out: b"O", r_err: b"E"}
    for fd in (r_out, r_err):
        os.set_blocking(fd, False)
        sel.register(fd, selectors.EVENT_READ)
    if stdin:
        os.set_blocking(w_in, False)
        sel.register(w_in, selectors.EVENT_WRITE)
    else:
        os.close(w_in)
    pidfd = os.pidfd_open(pid) if hasattr(os, "pidfd_open") else None
    if pidfd is not None:
        sel.register(pidfd, selectors.EVENT_READ)
    pos, exited_at, open_reads, timed_out = 0, None, 2, False
    while True:
        now = time.monotonic()
        if exited_at is None and now >= deadline:
            timed_out = True
            os.kill(pid, signal.SIGKILL)
            try:  # the rest of the tree too (not reaped here: wait4 below needs the child)
                os.kill(-1, signal.SIGKILL)
            except OSError:
                pass
            exited_at = now - grace_s + 0.05  # the killed tree's pipes close at once; do not wait long
        if exited_at is not None:
            timeout = max(0.0, exited_at + grace_s - now)
        else:
            timeout = max(0.0, deadline - now)
            if pidfd is None:
                timeout = min(timeout, 0.01)
        for key, _ in sel.select(timeout):
            fd = key.fd
            if fd == pidfd:
                sel.unregister(pidfd)
                if exited_at is None:
                    exited_at = time.monotonic()
            elif fd == w_in:
                try:
                    pos += os.write(w_in, stdin[pos:pos + CHUNK])
                except BlockingIOError:
                    pass
                except BrokenPipeError:  # the program closed its stdin: the rest is dropped
                    pos = len(stdin)
                if pos >= len(stdin):
                    sel.unregister(w_in)
                    os.close(w_in)
            else:
                data = os.read(fd, CHUNK)
                if not data:
                    sel.unregister(fd)
                    open_reads -= 1
                    continue
                room = out_limit - sent[fd]
                if room > 0:
                    sink.send(kinds[fd], data[:room])
                sent[fd] += len(data)
        if pidfd is None and exited_at is None and os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT):
            exited_at = time.monotonic()
        if exited_at is not None and (open_reads == 0 or time.monotonic() >= exited_at + grace_s):
            break
    sel.close()
    if pidfd is not None:
        os.close(pidfd)
    if stdin and pos < len(stdin):
        os.close(w_in)
    return sent[r_out], sent[r_err], timed_out


class Captured:
    """A sink for ``pump`` that keeps output instead of streaming it (compile steps, test cases)."""

    def __init__(self):
        self.out, self.err = bytearray(), bytearray()

    def send(self, kind, data):
        (self.out if kind == b"O" else self.err).extend(data)


def missing_tool(tools):
    """The first of ``tools`` not found on PATH, or None."""
    dirs = os.environ.get("PATH", "/usr/bin:/bin").split(":")
    for tool in tools:
        if not any(os.access(os.path.join(d, tool), os.X_OK) for d in dirs):
            return tool
    return None


def spawn(req, step, chan, stdin, sink, deadline):
    """Fork one process of a run (``step``: argv, env, limits) and pump it until it ends or ``deadline``.
    Returns the process's outcome as a dict."""
    r_in, w_in = os.pipe()
    r_out, w_out = os.pipe()
    r_err, w_err = os.pipe()
    t0 = time.monotonic()
    gc.freeze()  # the child's collections then skip (and do not copy) the launcher's objects
    pid = os.fork()
    if pid == 0:
        run_child(dict(req, **step), chan, (r_in, w_in, r_out, w_out, r_err, w_err), req["workdir"])
    gc.unfreeze()
    for fd in (r_in, w_out, w_err):
        os.close(fd)
    out_bytes, err_bytes, timed_out = pump(sink, pid, stdin, r_out, r_err, w_in, req.get("out_limit", 65536),
                                           deadline, req.get("grace_s", 0.2))
    _, status, usage = os.wait4(pid, 0)
    for fd in (r_out, r_err):
        os.close(fd)
    return {
        "exit_code": os.WEXITSTATUS(status) if os.WIFEXITED(status) else None,
        "signal": os.WTERMSIG(status) if os.WIFSIGNALED(status) else None,
        "cpu_s": usage.ru_utime + usage.ru_stime,
        "wall_s": time.monotonic() - t0,
        "timed_out": timed_out,
        "out_bytes": out_bytes,
        "err_bytes": err_bytes,
    }


def captured(outcome, sink):
    outcome["stdout"] = sink.out.decode("utf-8", "replace")
    outcome["stderr"] = sink.err.decode("utf-8", "replace")
    return outcome


def run_once(chan, req):
    missing = missing_tool(req.get("tools") or [])
    if missing is not None:  # before anything runs: the sandbox's lack, not the program's failure
        chan.send_json(b"R", {"missing": missing})
        return
    workdir = req.setdefault("workdir", "/tmp")
    os.chdir(workdir)
    write_files(workdir, req.get("files", {}))
    req["path"] = os.path.join(workdir, req.get("source") or "main.py")
    with open(req["path"], "w", encoding="utf-8") as f:
        f.write(req["code"])
    chan.send_json(b"K", {"started": True})  # from here on, whatever happens is the program's doing
    result = {"compile": None, "cases": None}
    go = True
    build = req.get("compile")
    if build:
        sink = Captured()
        comp = captured(spawn(req, build, chan, b"", sink, time.monotonic() + float(build["time_s"])), sink)
        kill_others()
        result["compile"] = comp
        go = comp["exit_code"] == 0 and not comp["timed_out"]
        if go:  # the host sets the run's (smaller) limits on the sandbox, then says go
            chan.send_json(b"C", comp)
            answer = chan.recv()
            go = answer is not None and answer.get("op") == "go"
            result["aborted"] = not go
    if go and req.get("cases") is not None:
        result["cases"] = run_cases(chan, req)
    elif go:
        stdin = req.get("stdin", "").encode("utf-8")
        result.update(spawn(req, {}, chan, stdin, chan, time.monotonic() + float(req.get("time_s", 10.0))))
    kill_others()
    result["files"] = fetch_files(workdir, req.get("fetch_files", []), req.get("fetch_cap", 16 << 20))
    os.chdir("/")
    clean = wipe(req.get("wipe", []))
    procs, ipc = leftovers() if req.get("check_clean") else ([], 0)
    result["clean"] = clean and not procs and not ipc
    result["leftover"] = {"procs": len(procs), "ipc": ipc}
    chan.send_json(b"R", result)


def run_cases(chan, req):
    """The program once per case (stdin), each within ``time_s``, all within ``total_time_s``."""
    out = []
    end = time.monotonic() + float(req.get("total_time_s") or 0)
    for stdin in req["cases"]:
        now = time.monotonic()
        if now >= end:
            break
        sink = Captured()
        deadline = min(end, now + float(req.get("time_s", 10.0)))
        outcome = captured(spawn(req, {}, chan, stdin.encode("utf-8"), sink, deadline), sink)
        kill_others()  # what a case left running does not reach the next one
        out.append(outcome)
    return out


# ----------------------------------------------------------------------------------------------- repl


class Drain:
    """Reads one captured fd in a thread; forwards at most ``limit`` bytes per cell; a nonce ends a cell."""

    def __init__(self, threading, chan, kind, rfd):
        self.chan, self.kind, self.rfd = chan, kind, rfd
        self.limit, self.sent, self.nonce, self.tail = 0, 0, b"", b""
        self.done = threading.Event()
        threading.Thread(target=self.loop, daemon=True).start()

    def start_cell(self, limit, nonce):
        self.limit, self.sent, self.nonce, self.tail = limit, 0, nonce, b""
        self.done.clear()

    def forward(self, data):
        room = self.limit - self.sent
        if room > 0 and data:
            self.chan.send(self.kind, data[:room])
        self.sent += len(data)

    def loop(self):
        while True:
            data = os.read(self.rfd, CHUNK)
            if not data:
                return
            buf = self.tail + data
            nonce = self.nonce
            at = buf.find(nonce) if nonce else -1
            if at >= 0:
                self.forward(buf[:at])
                self.forward(buf[at + len(nonce):])  # late output of background work: counted in this cell
                self.tail = b""
                self.done.set()
                continue
            keep = 0  # hold back only a tail that could be the start of the nonce
            for k in range(min(len(nonce) - 1, len(buf)), 0, -1):
                if nonce.startswith(buf[-k:]):
                    keep = k
                    break
            self.forward(buf[:len(buf) - keep])
            self.tail = buf[len(buf) - keep:]


class CellTimeout(BaseException):
    """Raised into a session cell by SIGALRM when it passes its time limit."""


def _cell_alarm(signum, frame):
    raise CellTimeout()


def run_cell(code, name, ns, limit):
    """Execute ``code`` in ``ns``; returns the text/plain displays (repr of a trailing expression)."""
    import linecache

    linecache.cache[name] = (len(code), None, code.splitlines(True), name)
    tree = ast.parse(code, name, "exec")
    last = tree.body[-1] if tree.body and isinstance(tree.body[-1], ast.Expr) else None
    if last is not None:
        tree.body.pop()
    exec(compile(tree, name, "exec"), ns)
    if last is None:
        return []
    value = eval(compile(ast.Expression(last.value), name, "eval"), ns)
    if value is None:
        return []
    builtins._ = value
    return [repr(value)[:limit]]


def repl(chan, req):
    import threading

    chan.lock = threading.Lock()
    workdir = req.get("workdir", "/tmp")
    os.chdir(workdir)
    write_files(workdir, req.get("files", {}))
    set_limits(req.get("limits", {}))
    prctl(PR_SET_DUMPABLE, 1)  # the program runs in this very process
    main = types.ModuleType("__main__")
    main.__builtins__ = builtins
    sys.modules["__main__"] = main
    sys.argv = [""]
    sys.path.insert(0, workdir)
    drains = []
    for fd, kind in ((1, b"O"), (2, b"E")):
        r, w = os.pipe()
        os.dup2(w, fd)
        os.close(w)
        drains.append(Drain(threading, chan, kind, r))
    chan.send_json(b"R", {"ok": True})
    count = 0
    while True:
        msg = chan.recv()
        if msg is None or msg.get("op") == "close":
            return
        count += 1
        nonce = os.urandom(16).hex().encode("ascii")
        cap = msg.get("out_limit", 65536)
        for d in drains:
            d.start_cell(cap, nonce)
        used = resource.getrusage(resource.RUSAGE_SELF)
        soft_cpu = int(used.ru_utime + used.ru_stime + float(msg.get("time_s", 10.0))) + 5
        try:  # a per-cell CPU budget; the host's wall-clock deadline is the real limit
            resource.setrlimit(resource.RLIMIT_CPU, (soft_cpu, resource.getrlimit(resource.RLIMIT_CPU)[1]))
        except (ValueError, OSError):
            pass
        result = {"ok": True, "display": [], "ename": "", "evalue": "", "traceback": ""}
        t0, c0 = time.monotonic(), time.process_time()
        # The cell's own wall-clock limit: SIGALRM interrupts it with CellTimeout and the interpreter (and its
        # state) survives; code that swallows it is killed by the host's deadline a grace period later.
        signal.signal(signal.SIGALRM, _cell_alarm)
        signal.setitimer(signal.ITIMER_REAL, max(0.001, float(msg.get("time_s", 10.0))))
        try:
            result["display"] = run_cell(msg["code"], "<cell-%d>" % count, main.__dict__, cap)
        except CellTimeout:
            result.update(ok=False, timed_out=True, ename="TimeoutError", evalue="the cell ran past its time limit")
        except BaseException as e:
            if not (isinstance(e, SystemExit) and e.code in (None, 0)):
                tb = user_tb(e.__traceback__)
                result.update(ok=False, ename=type(e).__name__, evalue=str(e)[:cap],
                              traceback="".join(traceback.format_exception(type(e), e, tb))[-cap:])
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
        result["wall_s"], result["cpu_s"] = time.monotonic() - t0, time.process_time() - c0
        for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
            try:
                stream.flush()
            except Exception:
                pass
        for fd, d in zip((1, 2), drains):
            try:
                os.write(fd, nonce)
            except OSError:
                d.done.set()
        for d in drains:
            d.done.wait(2.0)
        result["out_bytes"], result["err_bytes"] = drains[0].sent, drains[1].sent
        chan.send_json(b"R", result)


def main():
    chan = Channel()
    prctl(PR_SET_DUMPABLE, 0)  # an undumpable launcher cannot be ptraced by the program (same uid)
    prctl(PR_SET_CHILD_SUBREAPER, 1)  # orphans of the program come back to us, to be killed and reaped
    while True:
        req = chan.recv()
        if req is None:
            return
        op = req.get("op")
        if op == "ping":
            chan.send_json(b"K", {"pid": os.getpid(), "python": sys.version.split()[0]})
        elif op == "run":
            run_once(chan, req)
            if not req.get("keep"):
                return
        elif op == "repl":
            repl(chan, req)
            return
        else:
            chan.send_json(b"R", {"error": "unknown op %r" % (op,)})
            return


main()
