"""The sandbox's launcher (run as `python -I -S -B _sandbox_child.py`, the run's config as JSON
on stdin): builds the namespaces, filesystem and limits described in `mmrl.eval.sandbox`, then
runs the program as MEGA-Bench's `CodeTester` does. Standard library only.

Protocol on stdout: `U` and the reason on stderr when the sandbox cannot be built; else `R`
right before the program starts, then, if the program finishes, `\\0RESULT\\0` and a JSON object
`{"output", "status"}`.
"""

import builtins
import ctypes
import io
import json
import os
import resource
import sys

CLONE_NEWNS = 0x00020000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
MS_NOATIME, MS_NODIRATIME, MS_RELATIME = 1024, 2048, 1 << 21
ST_RELATIME = 4096

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]


def fail(message: str) -> None:
    os.write(1, b"U")
    os.write(2, message.encode(errors="replace"))
    os._exit(3)


def mount(source, target, fstype, flags, data=None) -> None:
    enc = [None if v is None else v.encode() for v in (source, target, fstype, data)]
    if _libc.mount(enc[0], enc[1], enc[2], flags, enc[3]) != 0:
        err = ctypes.get_errno()
        fail(f"mount {source} -> {target} failed: {os.strerror(err)}")


def locked_flags(path: str) -> int:
    """The flags a remount inside a user namespace must keep (the kernel locks them)."""
    f = os.statvfs(path).f_flag
    flags = f & (MS_NOSUID | MS_NODEV | MS_NOEXEC | MS_NOATIME | MS_NODIRATIME)
    return flags | (MS_RELATIME if f & ST_RELATIME else 0)


def bind_readonly(source: str, target: str) -> None:
    mount(source, target, None, MS_BIND | MS_REC)
    mount(None, target, None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV | locked_flags(source))


def build(config: dict) -> None:
    uid, gid = os.getuid(), os.getgid()
    flags = CLONE_NEWUSER | CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWPID | CLONE_NEWIPC | CLONE_NEWUTS
    if _libc.unshare(flags) != 0:
        fail(f"unshare failed: {os.strerror(ctypes.get_errno())} (user namespaces unavailable?)")
    for name, text in (("setgroups", "deny"), ("uid_map", f"0 {uid} 1"), ("gid_map", f"0 {gid} 1")):
        with open(f"/proc/self/{name}", "w") as f:
            f.write(text)
    mount(None, "/", None, MS_REC | MS_PRIVATE)
    root = config["root"]
    os.mkdir(root, 0o755)
    mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=755")
    sources = ["/usr", "/lib", "/lib64", "/lib32", "/libx32", "/bin", "/sbin", *config["prefixes"]]
    done: list[str] = []
    for source in sources:
        if not os.path.lexists(source) or any(source == d or source.startswith(d + "/") for d in done):
            continue
        target = root + source
        if os.path.islink(source):  # merged /usr: /lib -> usr/lib
            os.makedirs(os.path.dirname(target), exist_ok=True)
            os.symlink(os.readlink(source), target)
            continue
        os.makedirs(target, exist_ok=True)
        bind_readonly(source, target)
        done.append(source)
    os.mkdir(root + "/dev")
    for name in ("null", "zero", "urandom"):
        target = f"{root}/dev/{name}"
        open(target, "w").close()
        mount(f"/dev/{name}", target, None, MS_BIND)
    os.mkdir(root + "/work")
    mount(config["work"], root + "/work", None, MS_BIND)
    mount(
        None, root + "/work", None, MS_BIND | MS_REMOUNT | MS_NOSUID | MS_NODEV | locked_flags(config["work"])
    )
    mount(None, root, None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)
    os.chroot(root)
    os.chdir("/work")


def limit(config: dict) -> None:
    memory = config["memory_bytes"]
    for which, value in (
        (resource.RLIMIT_AS, memory),
        (resource.RLIMIT_CPU, config["cpu_s"]),
        (resource.RLIMIT_NPROC, config["processes"]),
        (resource.RLIMIT_FSIZE, config["file_bytes"]),
        (resource.RLIMIT_CORE, 0),
        (resource.RLIMIT_NOFILE, 64),
    ):
        resource.setrlimit(which, (value, value))


def run(config: dict, result_fd: int) -> None:
    """MEGA-Bench's `CodeTester.target`, with its quirks."""
    code = config["code"]
    lines = iter(config["lines"])

    def fake_input(*args, **kwargs):  # mock's side_effect: the next line, StopIteration when none
        return next(lines)

    builtins.input = fake_input
    captured = io.StringIO()
    sys.stdout = captured
    os.write(result_fd, b"R")
    status = "ok"
    try:
        if 'if __name__ == "__main__":' in code:
            exec(code, {"__name__": "__main__"})
        else:
            # MEGA-Bench calls exec(code) inside a method: top-level names land in that frame's
            # locals while functions look names up in the evaluator module's globals.
            import pathlib

            module_globals = {
                "__name__": "metrics.scoring.program_judge",
                "__builtins__": builtins,
                "io": io,
                "json": json,
                "pathlib": pathlib,
            }
            exec(code, module_globals, {})
    except Exception as exc:  # noqa: BLE001 - the program's own error is its output
        output, status = f"ERROR during execution: {exc}", "error"
    else:
        output = captured.getvalue().rstrip()
    sys.stdout = sys.__stdout__
    os.write(result_fd, b"\x00RESULT\x00" + json.dumps({"output": output, "status": status}).encode())


def main() -> None:
    config = json.loads(sys.stdin.buffer.read())
    build(config)
    pid = os.fork()  # the child is PID 1 of the new PID namespace: its exit ends every process
    if pid:
        _, status = os.waitpid(pid, 0)
        os._exit(os.waitstatus_to_exitcode(status) & 0xFF)
    limit(config)
    null = os.open("/dev/null", os.O_RDWR)
    os.dup2(null, 0)  # MEGA-Bench's child process reads no stdin
    result_fd = os.dup(1)
    os.dup2(null, 1)  # writes past sys.stdout are not the program's output there either
    os.close(null)
    try:
        run(config, result_fd)
    except BaseException:  # noqa: BLE001 - SystemExit & co.: no result, as in MEGA-Bench
        os._exit(0)
    os._exit(0)


if __name__ == "__main__":
    main()
