"""Every README snippet runs as written.

Each ```python block of README.md runs as `python SCRIPT` would (a world of one process), after the
block marked ``<!-- prelude -->`` (the README's stand-in for the reader's model and data), in the
order of the README and in one working directory, as a reader following it would. Then the lines of
```bash blocks that are cheap to run (`CHEAP`) run there too, with `dtrain` and `python` being this
interpreter. New snippets are picked up without touching this file. The snippets run in processes
forked from an interpreter that has imported torch and the package (the `warm_python` fixture), not each
in a fresh interpreter: the same script, `__main__`, working directory and environment, without ~3 s of
imports a snippet. So do the bash lines' `python` and `dtrain`: on PATH they are a small client (no torch
import) that hands its arguments, working directory and environment to the warm server through a socket
(`_warm_bridge`) and gives back the job's output and exit status as its own.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import stat
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text()
BLOCK = re.compile(r"(?P<marker><!-- prelude -->\n)?```(?P<lang>python|bash)\n(?P<body>.*?)```", re.S)
# Lines of bash blocks that finish in seconds on a CPU and need nothing but this package.
CHEAP = re.compile(r"^(dtrain --print-config|python -m distributed_training\.monitor\.plot)\b")


def _blocks(lang: str) -> list[tuple[bool, str]]:
    return [(bool(m["marker"]), m["body"]) for m in BLOCK.finditer(README) if m["lang"] == lang]


PRELUDE = "".join(body for marked, body in _blocks("python") if marked)
SNIPPETS = [body for marked, body in _blocks("python") if not marked]
COMMANDS = [line.strip() for _, body in _blocks("bash") for line in body.splitlines() if CHEAP.match(line.strip())]


def _env(bin_dir: Path) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "",
           "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"}
    # The snippets import the package from this checkout, wherever the test is started from.
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    return env


def _commands_dir(tmp: Path, bridge: Path | None = None) -> Path:
    """`python` and `dtrain` on PATH: this interpreter and the package's command (`python -m distributed_training`);
    with `bridge` (a `_warm_bridge` socket), run as the warm server's jobs through `CLIENT`."""
    bin_dir = tmp / "bin"
    bin_dir.mkdir()
    if bridge is not None:
        (bin_dir / "warm_client.py").write_text(CLIENT)
    for name, args in (("python", ""), ("dtrain", " -m distributed_training")):
        path = bin_dir / name  # a script, not a link: a link out of a virtual environment loses its packages
        if bridge is None:
            path.write_text(f'#!/bin/sh\nexec "{sys.executable}"{args} "$@"\n')
        else:
            path.write_text(f'#!/bin/sh\nexec "{sys.executable}" -S "{bin_dir / "warm_client.py"}" "{bridge}"{args} "$@"\n')
        path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return bin_dir


# `python ARGS` for a bash line: sends ARGS, its working directory and environment to the bridge, writes
# the job's stdout and stderr as its own (after the job: these commands are short) and exits with its status.
CLIENT = """
import json, os, socket, sys
with socket.socket(socket.AF_UNIX) as s:
    s.connect(sys.argv[1])
    s.sendall(json.dumps({"argv": sys.argv[2:], "cwd": os.getcwd(), "env": dict(os.environ)}).encode() + b"\\n")
    answer = json.loads(s.makefile("rb").readline())
sys.stdout.write(answer["stdout"])
sys.stderr.write(answer["stderr"])
sys.exit(answer["returncode"] if answer["returncode"] is not None else 124)
"""


@contextlib.contextmanager
def _warm_bridge(warm_python, path: Path, timeout: float):
    """A Unix socket at `path` on which a thread runs each client's job on the warm server (one at a time,
    as the server does): yields `path`; the thread and the socket end with the block."""
    server = socket.socket(socket.AF_UNIX)
    server.bind(str(path))
    server.listen()
    server.settimeout(0.2)
    stop = threading.Event()

    def serve():
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except (socket.timeout, OSError):
                continue
            with conn:
                conn.settimeout(None)
                job = json.loads(conn.makefile("rb").readline())
                try:
                    out = warm_python(job["argv"], cwd=job["cwd"], env=job["env"], timeout=timeout)
                    answer = {"returncode": out.returncode, "stdout": out.stdout, "stderr": out.stderr}
                except subprocess.TimeoutExpired as err:
                    answer = {"returncode": None, "stdout": err.stdout or "", "stderr": f"{err.stderr or ''}\n{err}"}
                conn.sendall(json.dumps(answer).encode() + b"\n")

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield path
    finally:
        stop.set()
        thread.join(timeout + 30)
        server.close()


def test_the_readme_has_snippets_and_a_prelude():
    assert PRELUDE and "class MyModel" in PRELUDE
    assert len(SNIPPETS) >= 4 and any("trainer.fit(" in s for s in SNIPPETS)
    assert any("run_distributed(" in s for s in SNIPPETS) and any("run_torchrun(" in s for s in SNIPPETS)
    assert any(c.startswith("dtrain --print-config") for c in COMMANDS)
    assert any(c.startswith("python -m distributed_training.monitor.plot") for c in COMMANDS)


def test_the_readme_configs_of_shipped_examples_are_the_files():
    """A ```yaml block that follows a mention of an examples/configs/ file is that file, or a verbatim part of
    it (the user-model block once showed other sections and values than the file it introduced)."""
    blocks = list(re.finditer(r"`(examples/configs/[\w.]+\.yaml)`[^`]*?:\n\n```yaml\n(.*?)```", README, re.S))
    assert any(m[1] == "examples/configs/user_model.yaml" for m in blocks)
    for m in blocks:
        text = (REPO / m[1]).read_text()
        assert m[2] in text, f"README's block for {m[1]} is not a verbatim part of it:\n{m[2]}"
    # And the README's commands over the shipped configs load (a --set included).
    from distributed_training.config import load_config

    commands = [line for _, body in _blocks("bash") for line in body.splitlines() if "examples/configs/" in line]
    assert commands
    for line in commands:
        words = line.split("#")[0].split()
        path = next(w for w in words if w.startswith("examples/configs/"))
        sets = [words[i + 1] for i, w in enumerate(words) if w == "--set"]
        load_config(str(REPO / path), sets)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_every_readme_snippet_runs_as_written(tmp_path, warm_python):
    work = tmp_path / "work"
    work.mkdir()
    failures = []
    with _warm_bridge(warm_python, tmp_path / "warm.sock", timeout=300) as bridge:
        env = _env(_commands_dir(tmp_path, bridge))
        for k, snippet in enumerate(SNIPPETS):
            script = tmp_path / f"snippet_{k}.py"
            script.write_text(PRELUDE + "\n# ---- README snippet\n" + snippet)
            out = warm_python([script], cwd=work, env=env, timeout=300)
            if out.returncode != 0:
                failures.append(f"snippet {k}:\n{snippet}\n--- stderr:\n{out.stderr[-3000:]}")
        for command in COMMANDS:
            out = subprocess.run(["bash", "-euo", "pipefail", "-c", command], cwd=work, env=env, capture_output=True,
                                 text=True, timeout=330)
            if out.returncode != 0:
                failures.append(f"$ {command}\n{out.stdout[-2000:]}{out.stderr[-3000:]}")
    assert not failures, "\n\n".join(failures)
    # What the commands wrote is what they promise: a config that loads, a PNG of the run.
    from distributed_training.config import load_config

    for command in COMMANDS:
        written = re.search(r"(?:>|-o)\s*(\S+)", command)
        if written and written.group(1).endswith((".yaml", ".yml")):
            assert load_config(str(work / written.group(1))).model_dump() == yaml.safe_load(
                (work / written.group(1)).read_text())
        elif written and written.group(1).endswith(".png"):
            assert (work / written.group(1)).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_model_that_returns_logits_without_a_criterion_is_told_what_to_do(tmp_path, warm_python):
    """The README's long-job snippet once called fit() without a criterion: the error must say what to do."""
    script = tmp_path / "no_criterion.py"
    script.write_text(PRELUDE + """
from distributed_training import DistributedTrainer
trainer = DistributedTrainer(model, make_optimizer)
for batch in ((inputs, targets), inputs):          # a pair unpacked into forward(x); logits instead of a loss
    try:
        trainer.train_step(batch)
    except (TypeError, ValueError) as err:
        print(type(err).__name__, err)
    else:
        raise SystemExit("no error")
trainer.close()
""")
    out = warm_python([script], cwd=tmp_path, env=_env(_commands_dir(tmp_path)), timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.strip().splitlines()
    assert len(lines) == 2, out.stdout
    assert lines[0].startswith("TypeError") and "positional argument" in lines[0], lines[0]
    assert lines[1].startswith("ValueError") and "shape (32, 5)" in lines[1], lines[1]
    for line in lines:
        assert "criterion=" in line and "cross_entropy" in line, line
