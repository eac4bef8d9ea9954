"""A launcher process with its imports done, forked once per run: tests whose point is a whole process (killed by
SIGKILL at a crash point, an exit code) get one in ~0.1 s instead of ~6 s of imports each.

`python tests/preloaded.py` imports the launcher and what a run loads (no JAX backend: devices are made in each
child, from its own XLA_FLAGS), then reads one JSON request a line from stdin — {"argv", "env", "cwd", "out", "err"}
— forks, and answers with the child's exit status as a line: the exit code, or minus the signal that ended it, as
`subprocess` reports it. The child runs `spmdlm.launch.main(argv)` with the request's environment and working
directory, its stdout and stderr written to the files named.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

PRELOAD = ("spmdlm.launch", "spmdlm.train.run", "jax", "flax.nnx", "orbax.checkpoint", "grain", "transformers")


class PreloadedLauncher:
    """The server above; `run(argv, env, cwd)` behaves as `subprocess.run([python, -m, spmdlm.launch, *argv],
    capture_output=True, text=True, env=env, cwd=cwd)`. What the imports read from the environment (the Hub's
    endpoint and offline switch, JAX's configuration) is the server's `env`: start it with the one the runs share."""

    def __init__(self, scratch: Path, env: dict[str, str]):
        self.scratch, self.count, self.lock = scratch, 0, threading.Lock()
        self.server = subprocess.Popen(
            [sys.executable, __file__], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=scratch, env=env
        )

    def run(self, argv: list[str], env: dict[str, str], cwd: Path, timeout: float = 600) -> subprocess.CompletedProcess:
        with self.lock:
            self.count += 1
            out, err = self.scratch / f"{self.count}.out", self.scratch / f"{self.count}.err"
            request = {"argv": argv, "env": env, "cwd": str(cwd), "out": str(out), "err": str(err)}
            self.server.stdin.write(json.dumps(request) + "\n")
            self.server.stdin.flush()
            answer = self.server.stdout.readline()
        if not answer:
            raise RuntimeError(f"the preloaded launcher died (exit {self.server.poll()})")
        code = int(answer)
        return subprocess.CompletedProcess(argv, code, out.read_text(errors="replace"), err.read_text(errors="replace"))

    def close(self) -> None:
        self.server.stdin.close()
        self.server.wait(timeout=30)


def serve() -> None:
    import importlib

    for module in PRELOAD:
        importlib.import_module(module)
    from spmdlm.launch import main

    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:  # the child: the run, as `python -m spmdlm.launch ARGV` would be
            code = 1
            try:
                os.environ.clear()
                os.environ.update(request["env"])
                os.chdir(request["cwd"])
                for fd, path in ((1, request["out"]), (2, request["err"])):
                    os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), fd)
                sys.argv = ["spmdlm.launch", *request["argv"]]
                code = main(request["argv"])
            except SystemExit as stop:
                code = stop.code if isinstance(stop.code, int) else 1
            except BaseException:
                import traceback

                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code or 0)
        _, status = os.waitpid(pid, 0)
        code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
        sys.stdout.write(f"{code}\n")
        sys.stdout.flush()


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    serve()
