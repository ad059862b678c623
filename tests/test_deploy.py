"""Deployment files: the Dockerfile, docker/entrypoint.sh and docker/probe.sh, and the manifests in k8s/.

No Docker engine or cluster is needed. The files are checked with the tools the `dev` extra installs
(`hadolint`, `kubernetes-validate --strict`) and with structural assertions, and the image's two
steps that matter at run time are replayed on this machine:

* the install: the build context that .dockerignore lets through is copied to a temporary directory
  and `pip install`ed, non-editable, into a fresh virtual environment that already sees torch (as the
  base image does, so pip must not install it again);
* the entrypoint: docker/entrypoint.sh runs real torchrun jobs with that environment's Python, on one
  node with two processes and on two "nodes" (two entrypoints on this host) with one process each; the
  two runs must produce bit-identical models. A rerun after completion must idle instead of training.

Fast cases drive the entrypoint with a stand-in Python that prints the torchrun command it was given.
"""

from __future__ import annotations

import json
import os
import posixpath
import queue
import re
import shutil
import signal
import socket
import stat
import subprocess
import sys
import sysconfig
import threading
import time
from pathlib import Path

import pytest
import torch
import yaml

from distributed_training.testing import run_distributed

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILE = ROOT / "Dockerfile"
ENTRYPOINT = ROOT / "docker" / "entrypoint.sh"
PROBE = ROOT / "docker" / "probe.sh"
K8S = ROOT / "k8s"
K8S_VERSIONS = ("1.30.0", "1.37.0")  # oldest cluster we claim to support; newest schema the validator ships

# Variables of launchers and of our entrypoint that must not leak from the caller into these runs.
_SCRUB = re.compile(r"^(DT_|PET_|TORCHELASTIC_)|^(RANK|WORLD_SIZE|LOCAL_RANK|LOCAL_WORLD_SIZE|GROUP_RANK|"
                    r"ROLE_RANK|MASTER_ADDR|MASTER_PORT)$")

TINY_CONFIG = """\
model: {{preset: tiny}}
data: {{dataset: repo_text, block_size: 32, val_fraction: 0.01}}
training: {{strategy: ddp, epochs: 1, max_steps: 4, batch_size: 4, lr: 0.002, seed: 0}}
checkpoint: {{dir: {ckpt}, every: 2}}
logging: {{dir: null}}
output: {output}
"""


# ----------------------------------------------------------------------------------------- helpers
def _tool(name: str) -> str:
    """A command-line tool of the `dev` extra: next to this Python first, then on PATH; fail if absent."""
    here = Path(sys.executable).parent / name
    if here.is_file() and os.access(here, os.X_OK):
        return str(here)
    found = shutil.which(name)
    if found is None:
        pytest.fail(f"`{name}` not found: install the dev extra (pip install -e '.[dev]')")
    return found


def _clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not _SCRUB.match(k)}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", CUDA_VISIBLE_DEVICES="")
    env.update(extra)
    return env


def _run(args: list[str], timeout: float, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(args, capture_output=True, text=True, timeout=timeout, **kwargs)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _address_in_use(output: str) -> bool:
    return bool(re.search(r"address already in use|EADDRINUSE|errno: 98", output, re.I))


class Node:
    """One docker/entrypoint.sh process (a "container"), in its own process group."""

    def __init__(self, env: dict[str, str], args: tuple[str, ...] = ()) -> None:
        self.proc = subprocess.Popen([str(ENTRYPOINT), *args], env=env, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, start_new_session=True)
        self.out = self.err = ""

    def wait(self, timeout: float) -> int | None:
        """The exit status, or None after killing the whole group when `timeout` passes."""
        try:
            self.out, self.err = self.proc.communicate(timeout=timeout)
            return self.proc.returncode
        except subprocess.TimeoutExpired:
            self.kill()
            return None

    def kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.out, self.err = self.proc.communicate()

    def report(self) -> str:
        return f"--- stdout ---\n{self.out}\n--- stderr ---\n{self.err}"


def _run_nodes(envs: list[dict[str, str]], timeout: float) -> list[Node]:
    """Start one entrypoint per env together, wait for all (killing every group at the deadline)."""
    nodes = [Node(env) for env in envs]
    deadline = time.monotonic() + timeout
    for node in nodes:
        if node.wait(max(0.1, deadline - time.monotonic())) is None:
            for other in nodes:
                if other.proc.returncode is None:
                    other.kill()
            pytest.fail(f"entrypoint(s) still running after {timeout}s:\n" + "\n".join(n.report() for n in nodes))
    return nodes


def _run_job(make_envs, timeout: float = 180) -> list[Node]:
    """Run a job on a fresh rendezvous port; once more on another port if the first was taken meanwhile."""
    for attempt in range(2):
        nodes = _run_nodes(make_envs(f"127.0.0.1:{_free_port()}"), timeout)
        failed = any(n.proc.returncode != 0 for n in nodes)
        if not failed or attempt == 1 or not any(_address_in_use(n.out + n.err) for n in nodes):
            return nodes
    raise AssertionError("unreachable")


# ------------------------------------------------------------------------------ the build context
def _dockerignore() -> list[tuple[bool, re.Pattern, str]]:
    """(negated, regex, pattern) per .dockerignore line, with Docker's matching rules: patterns are
    cleaned paths relative to the context, `*` and `?` stay within one path element, `**` spans any."""
    rules = []
    for line in (ROOT / ".dockerignore").read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        negated = line.startswith("!")
        pattern = os.path.normpath(line[1:].strip() if negated else line).lstrip("/")
        rx, i = "", 0
        while i < len(pattern):
            if pattern.startswith("**/", i):
                rx, i = rx + "(?:.*/)?", i + 3
            elif pattern.startswith("**", i):
                rx, i = rx + ".*", i + 2
            elif pattern[i] == "*":
                rx, i = rx + "[^/]*", i + 1
            elif pattern[i] == "?":
                rx, i = rx + "[^/]", i + 1
            elif pattern[i] == "[" and "]" in pattern[i:]:
                j = pattern.index("]", i)
                rx, i = rx + pattern[i : j + 1].replace("[!", "[^"), j + 1
            else:
                rx, i = rx + re.escape(pattern[i]), i + 1
        rules.append((negated, re.compile(rx + r"\Z"), pattern))
    return rules


def _excluded(rel: str, rules) -> bool:
    """Docker: the last rule that matches the path or one of its parent directories decides."""
    parts = rel.split("/")
    prefixes = ["/".join(parts[: k + 1]) for k in range(len(parts))]
    excluded = False
    for negated, rx, _ in rules:
        if any(rx.match(p) for p in prefixes):
            excluded = not negated
    return excluded


def _build_context() -> list[str]:
    """Files of the repository that `docker build .` would send (relative paths, sorted)."""
    rules = _dockerignore()
    files = []
    for dirpath, dirnames, filenames in os.walk(ROOT):
        rel_dir = os.path.relpath(dirpath, ROOT)
        rel_dir = "" if rel_dir == "." else rel_dir
        keep = []
        for d in dirnames:
            rel = f"{rel_dir}/{d}" if rel_dir else d
            # Skip an excluded directory unless a negated rule could re-include something inside it.
            reopens = any(neg and (p.startswith(rel + "/") or p.startswith("*")) for neg, _, p in rules)
            if not _excluded(rel, rules) or reopens:
                keep.append(d)
        dirnames[:] = keep
        for f in filenames:
            rel = f"{rel_dir}/{f}" if rel_dir else f
            if not _excluded(rel, rules):
                files.append(rel)
    return sorted(files)


# ----------------------------------------------------------------------------------- Dockerfile
def _instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of the Dockerfile, continuation lines joined, comments dropped."""
    out, pending = [], ""
    for raw in DOCKERFILE.read_text().splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if pending and line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        full = pending + line
        pending = ""
        name, _, rest = full.partition(" ")
        out.append((name.upper(), rest.strip()))
    return out


def test_hadolint_passes():
    result = _run([_tool("hadolint"), "--no-color", "--failure-threshold", "info", str(DOCKERFILE)], timeout=60)
    assert result.returncode == 0, f"hadolint found problems:\n{result.stdout}{result.stderr}"


def test_dockerfile_structure():
    ins = _instructions()
    froms = [args for name, args in ins if name == "FROM"]
    assert len(froms) == 1, froms
    image = froms[0].split()[0]
    assert "$" not in image and "@" not in image, image
    repo, _, tag = image.rpartition(":")
    assert repo == "pytorch/pytorch", image
    assert re.fullmatch(r"\d+\.\d+\.\d+-cuda\d+\.\d+-cudnn\d+-runtime", tag), f"not an exact version tag: {image}"

    users = [args for name, args in ins if name == "USER"]
    assert users, "no USER: the image would run as root"
    user = users[-1].split(":")[0]
    assert user not in ("root", "0") and user.isdigit(), f"last USER must be a numeric non-root id: {users[-1]}"
    user_index = max(i for i, (name, _) in enumerate(ins) if name == "USER")
    assert all(name != "RUN" for name, _ in ins[user_index:]), "RUN after USER would run as the non-root user"

    assert any(name == "WORKDIR" for name, _ in ins)
    exposed = {p.split("/")[0] for name, args in ins if name == "EXPOSE" for p in args.split()}
    assert {"6006", "29400"} <= exposed, exposed

    entry = [json.loads(args) for name, args in ins if name == "ENTRYPOINT"]
    assert len(entry) == 1 and isinstance(entry[0], list), "ENTRYPOINT must be in exec (JSON) form"
    target = entry[0][0]
    assert target.endswith("docker/entrypoint.sh"), target
    copies = [args for name, args in ins if name == "COPY" and "docker/entrypoint.sh" in args]
    assert copies and any(args.split()[-1].rstrip("/") == str(Path(target).parent) for args in copies), \
        f"entrypoint.sh is not copied to {Path(target).parent}"

    installs = [args for name, args in ins if name == "RUN" and re.search(r"\bpip install\b", args)]
    assert len(installs) == 1, installs
    assert "--no-cache-dir" in installs[0]
    assert not re.search(r"\btorch\b(?!\.)", installs[0].split("&&")[0]), "must not reinstall torch: the base has it"
    assert any(name == "LABEL" for name, _ in ins)
    assert any(name == "HEALTHCHECK" for name, _ in ins)


def test_scripts_are_executable_bash():
    for script in (ENTRYPOINT, PROBE):
        assert script.stat().st_mode & stat.S_IXUSR, f"{script} is not executable"
        assert script.read_text().startswith("#!/usr/bin/env bash\n")
        assert "set -euo pipefail" in script.read_text()
        result = _run(["bash", "-n", str(script)], timeout=30)
        assert result.returncode == 0, result.stderr


def test_dockerignore_context():
    context = _build_context()
    for needed in ("pyproject.toml", "README.md", "LICENSE", "distributed_training/__init__.py",
                   "distributed_training/__main__.py", "distributed_training/cli.py",
                   "distributed_training/datasets/digits.csv.gz", "docker/entrypoint.sh", "docker/probe.sh"):
        assert needed in context, f"{needed} is not in the build context"
    for path in context:
        top = path.split("/")[0]
        assert top in ("pyproject.toml", "README.md", "LICENSE", "distributed_training", "docker"), path
        assert "__pycache__" not in path and not path.endswith(".pyc"), path


# -------------------------------------------------------------------------------------- k8s
def _manifests() -> dict[tuple[str, str], dict]:
    docs = {}
    for path in sorted(K8S.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                docs[(doc["kind"], doc["metadata"]["name"])] = doc
    return docs


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_kubernetes_validate_strict(version):
    files = sorted(str(p) for p in K8S.glob("*.yaml"))
    assert {Path(f).name for f in files} >= {"service.yaml", "statefulset.yaml", "configmap.yaml",
                                             "tensorboard.yaml", "networkpolicy.yaml"}
    result = _run([_tool("kubernetes-validate"), "--strict", "-k", version, *files], timeout=120)
    assert result.returncode == 0, f"kubernetes-validate failed:\n{result.stdout}{result.stderr}"
    assert result.stdout.count("passed") == len(files), result.stdout


def _env_of(container: dict) -> dict[str, dict]:
    return {e["name"]: e for e in container.get("env", [])}


def test_k8s_structure():
    docs = _manifests()
    sts = next(d for (kind, _), d in docs.items() if kind == "StatefulSet")
    headless = docs[("Service", sts["spec"]["serviceName"])]
    pod = sts["spec"]["template"]
    pod_labels = pod["metadata"]["labels"]
    spec = pod["spec"]

    # Headless Service: stable DNS for the pods, names published before readiness, rendezvous port.
    assert headless["spec"]["clusterIP"] == "None"
    assert headless["spec"].get("publishNotReadyAddresses") is True
    assert headless["spec"]["selector"].items() <= pod_labels.items()
    assert 29400 in [p["port"] for p in headless["spec"]["ports"]]

    # StatefulSet.
    assert sts["spec"]["podManagementPolicy"] == "Parallel"
    assert sts["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    trainer = next(c for c in spec["containers"] if c["name"] == "trainer")
    env = _env_of(trainer)
    # Elastic: DT_NNODES is MIN:MAX around `replicas`, with the rendezvous settings growth and shrink need.
    low, high = (int(x) for x in env["DT_NNODES"]["value"].split(":"))
    assert 1 <= low <= sts["spec"]["replicas"] == 2 < 3 <= high, env["DT_NNODES"]
    assert env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"]["value"] == "1"
    rdzv = dict(kv.split("=") for kv in env["PET_RDZV_CONF"]["value"].split(","))
    assert float(rdzv["keep_alive_interval"]) * int(rdzv["keep_alive_max_attempt"]) <= 10, rdzv
    assert float(rdzv["last_call_timeout"]) <= 5 and "is_host" not in rdzv, rdzv
    assert int(env["DT_MAX_RESTARTS"]["value"]) >= 10, "several resizes (a restart each) must not end the job"
    assert env["DT_MASTER_HOST"]["value"] == (
        f"{sts['metadata']['name']}-0.{headless['metadata']['name']}.$(POD_NAMESPACE).svc.cluster.local")
    names = list(env)
    assert names.index("POD_NAMESPACE") < names.index("DT_MASTER_HOST"), "$(POD_NAMESPACE) must be defined first"
    assert env["POD_NAMESPACE"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace"
    assert env["DT_NODE_RANK"]["valueFrom"]["fieldRef"]["fieldPath"] == \
        "metadata.labels['apps.kubernetes.io/pod-index']"
    assert 29400 in [p["containerPort"] for p in trainer["ports"]]

    res = trainer["resources"]
    assert int(res["limits"]["nvidia.com/gpu"]) >= 1
    assert {"cpu", "memory"} <= res["requests"].keys() and {"cpu", "memory"} <= res["limits"].keys()

    volumes = {v["name"]: v for v in spec["volumes"]}
    mounts = {m["mountPath"]: m for m in trainer["volumeMounts"]}
    shm = volumes[mounts["/dev/shm"]["name"]]
    assert shm["emptyDir"]["medium"] == "Memory" and shm["emptyDir"].get("sizeLimit")
    config_volume = volumes[mounts["/config"]["name"]]
    assert mounts["/config"].get("readOnly") is True
    configmap = docs[("ConfigMap", config_volume["configMap"]["name"])]
    assert env["DT_CONFIG"]["value"] == "/config/config.yaml" and "config.yaml" in configmap["data"]
    claims = {t["metadata"]["name"]: t for t in sts["spec"]["volumeClaimTemplates"]}
    assert mounts["/checkpoints"]["name"] in claims and mounts["/checkpoints"]["name"] not in volumes
    assert env["DT_CHECKPOINT_DIR"]["value"] == "/checkpoints"

    # Non-root, no privilege escalation, no capabilities; the image's USER is the pod's runAsUser.
    psc = spec["securityContext"]
    assert psc["runAsNonRoot"] is True and psc["runAsUser"] == 1000 and psc["fsGroup"] == 1000
    image_user = [a for n, a in _instructions() if n == "USER"][-1].split(":")[0]
    assert str(psc["runAsUser"]) == image_user
    for c in spec["containers"]:
        csc = c["securityContext"]
        assert csc["allowPrivilegeEscalation"] is False and csc["capabilities"]["drop"] == ["ALL"], c["name"]
        assert csc.get("runAsNonRoot", psc["runAsNonRoot"]) is True
        assert c["resources"]["requests"] and c["resources"]["limits"], c["name"]

    # Probes: exec probes through probe.sh, at the path the Dockerfile copies it to.
    entry_dir = str(Path(json.loads([a for n, a in _instructions() if n == "ENTRYPOINT"][0])[0]).parent)
    for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
        command = trainer[kind]["exec"]["command"]
        assert command[0] == f"{entry_dir}/probe.sh" and command[1] in ("started", "alive"), (kind, command)
    assert trainer["livenessProbe"]["exec"]["command"][1] == "alive"

    # The job's config: valid for the CLI, and what the brief of the deployment says.
    from distributed_training.config import load_config

    cfg = load_config(yaml.safe_load(configmap["data"]["config.yaml"]))
    assert cfg.training.strategy == "zero3" and cfg.model.preset == "gpt2-124m"
    # The same training at every size DT_NNODES allows: a global batch that each of those worlds divides.
    gpus = int(res["limits"]["nvidia.com/gpu"])
    assert cfg.training.global_batch_size is not None and "batch_size" not in cfg.training.model_fields_set
    assert all(cfg.training.global_batch_size % (pods * gpus) == 0 for pods in range(low, high + 1)), \
        (cfg.training.global_batch_size, gpus, low, high)
    assert cfg.checkpoint.dir == "/checkpoints" and cfg.logging.dir == "/checkpoints/runs"
    assert env["DT_LOG_DIR"]["value"] == cfg.logging.dir

    # TensorBoard: a sidecar on the checkpoint volume, a Service in front of pod 0's.
    tb = next(c for c in spec["containers"] if c["name"] == "tensorboard")
    assert any(a == f"--logdir={cfg.logging.dir}" for a in tb["args"])
    tb_port = next(p for p in tb["ports"] if p["containerPort"] == 6006)
    tb_service = next(d for (kind, _), d in docs.items() if kind == "Service" and d is not headless)
    port = tb_service["spec"]["ports"][0]
    assert port["port"] == 6006 and port["targetPort"] == tb_port["name"]
    selector = dict(tb_service["spec"]["selector"])
    assert selector.pop("statefulset.kubernetes.io/pod-name") == f"{sts['metadata']['name']}-0"
    assert selector.items() <= pod_labels.items()

    # NetworkPolicy: rendezvous + the pinned ephemeral range from the job's pods, 6006 from the namespace.
    policy = next(d for (kind, _), d in docs.items() if kind == "NetworkPolicy")
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= pod_labels.items()
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    rules = policy["spec"]["ingress"]
    job_rule = next(r for r in rules if any(p["port"] == 29400 for p in r["ports"]))
    assert [f["podSelector"]["matchLabels"] for f in job_rule["from"]] == [policy["spec"]["podSelector"]["matchLabels"]]
    ranges = [(p["port"], p["endPort"]) for p in job_rule["ports"] if "endPort" in p]
    sysctl = {s["name"]: s["value"] for s in psc["sysctls"]}["net.ipv4.ip_local_port_range"]
    assert ranges == [tuple(int(x) for x in sysctl.split())], (ranges, sysctl)
    tb_rule = next(r for r in rules if any(p["port"] == 6006 for p in r["ports"]))
    assert tb_rule["from"] == [{"podSelector": {}}]
    assert all(p["port"] != 6006 for p in job_rule["ports"])


def _volume_paths() -> list[str]:
    """The paths the Dockerfile declares as VOLUMEs (JSON or plain form)."""
    paths = []
    for name, args in _instructions():
        if name == "VOLUME":
            paths += json.loads(args) if args.startswith("[") else args.split()
    return paths


def _under(path: str, root: str) -> bool:
    path, root = posixpath.normpath(path), posixpath.normpath(root)
    return path == root or path.startswith(root.rstrip("/") + "/")


def test_relative_paths_land_on_writable_volumes():
    """The root filesystem is read-only (Kubernetes' readOnlyRootFilesystem, `docker run --read-only`):
    the example configs' relative checkpoint/log/output paths must resolve, from the container's working
    directory, onto a writable volume, and checkpoints onto the persistent one (or nothing resumes)."""
    workdir = [args for name, args in _instructions() if name == "WORKDIR"][-1]
    assert posixpath.isabs(workdir), workdir
    # docker run --read-only: only volumes are writable; a declared VOLUME is one even without -v.
    assert any(_under(workdir, v) for v in _volume_paths()), f"WORKDIR {workdir} is not under a VOLUME"

    docs = _manifests()
    sts = next(d for (kind, _), d in docs.items() if kind == "StatefulSet")
    spec = sts["spec"]["template"]["spec"]
    trainer = next(c for c in spec["containers"] if c["name"] == "trainer")
    assert trainer["securityContext"]["readOnlyRootFilesystem"] is True
    cwd = trainer.get("workingDir", workdir)
    assert cwd == workdir, f"the pod's workingDir {cwd} differs from the image's WORKDIR {workdir}"
    claims = {t["metadata"]["name"] for t in sts["spec"]["volumeClaimTemplates"]}
    mounts = sorted(trainer["volumeMounts"], key=lambda m: -len(m["mountPath"]))

    def mount_of(path: str) -> dict | None:
        return next((m for m in mounts if _under(path, m["mountPath"])), None)

    from distributed_training.config import load_config

    configs = {p.name: yaml.safe_load(p.read_text()) for p in sorted((ROOT / "examples" / "configs").glob("*.yaml"))}
    configs["configmap"] = yaml.safe_load(next(d for (kind, _), d in docs.items()
                                               if kind == "ConfigMap")["data"]["config.yaml"])
    relative = 0
    for name, raw in configs.items():
        cfg = load_config(raw)
        for field, value in (("checkpoint.dir", cfg.checkpoint.dir), ("logging.dir", cfg.logging.dir),
                             ("output", cfg.output)):
            if value is None:
                continue
            relative += not posixpath.isabs(value)
            where = posixpath.normpath(posixpath.join(cwd, value))
            mount = mount_of(where)
            assert mount is not None, f"{name}: {field}={value} resolves to {where}, on the read-only root filesystem"
            assert not mount.get("readOnly", False), f"{name}: {field}={value} resolves to read-only {mount}"
            if field == "checkpoint.dir":
                assert mount["name"] in claims, f"{name}: checkpoints at {where} are not on the persistent volume"
            if field == "logging.dir":  # where TensorBoard and the liveness probe look
                assert _under(where, _env_of(trainer)["DT_LOG_DIR"]["value"]), f"{name}: logs at {where}"
    assert relative, "no example config uses relative paths: this test would check nothing relative"
    home = _env_of(trainer)["HOME"]["value"]
    assert mount_of(home) is not None and not mount_of(home).get("readOnly", False), f"HOME={home} is read-only"


# --------------------------------------------------------------- the image's install, replayed
@pytest.fixture(scope="module")
def image_python(tmp_path_factory) -> Path:
    """A fresh virtual environment holding the package as the Dockerfile installs it; its Python.

    The base image has torch installed; here the environment is given this interpreter's packages
    (torch among them) through a .pth file, the way --system-site-packages would if torch were
    installed system-wide, and has no pip of its own. `pip install` then resolves the package's
    dependencies against them, offline (--no-index), and must install nothing but the package.
    """
    base = tmp_path_factory.mktemp("image")
    src = base / "dtrain-src"  # COPY . /tmp/dtrain-src
    for rel in _build_context():
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / rel, src / rel)
    venv = base / "venv"
    result = _run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(venv)], timeout=120)
    assert result.returncode == 0, result.stderr
    python = venv / "bin" / "python"
    site = Path(_run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                     timeout=60).stdout.strip())
    outer = dict.fromkeys([sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]])
    (site / "_image_base.pth").write_text("".join(f"{p}\n" for p in outer))
    result = _run([str(python), "-m", "pip", "install", "--no-cache-dir", "--no-index", "--no-build-isolation",
                   str(src)], timeout=300, env=_clean_env(PIP_DISABLE_PIP_VERSION_CHECK="1"), cwd=base)
    assert result.returncode == 0, f"pip install failed:\n{result.stdout}\n{result.stderr}"
    installed = re.search(r"^Successfully installed (.*)$", result.stdout, re.M)
    assert installed and installed.group(1).split() == ["distributed_training-0.1.0"], result.stdout
    return python


@pytest.mark.slow
def test_image_install(image_python, tmp_path):
    code = ("import distributed_training, torch\n"
            "from distributed_training.datasets import digits\n"
            "print(distributed_training.__file__)\n"
            "print(len(digits()))\n")
    result = _run([str(image_python), "-c", code], timeout=120, cwd=tmp_path, env=_clean_env())
    assert result.returncode == 0, result.stderr
    location, n_digits = result.stdout.split()
    assert Path(location).is_relative_to(image_python.parents[1]), f"imported from {location}, not the venv"
    assert n_digits == "1797", "package data (digits.csv.gz) missing from the installed package"


# ------------------------------------------------------------------------- the entrypoint, real runs
def _node_env(python: Path, root: Path, name: str, **extra: str) -> dict[str, str]:
    return _clean_env(
        DT_PYTHON=str(python),
        PATH=f"{python.parent}{os.pathsep}{os.environ.get('PATH', '')}",
        DT_STATE_DIR=str(root / f"state-{name}"),
        **extra,
    )


@pytest.fixture(scope="module")
def single_node(image_python, tmp_path_factory):
    """One node, two processes (world size 2): the reference run. Probes are polled while it trains."""
    root = tmp_path_factory.mktemp("single")
    config = root / "job.yaml"
    config.write_text(TINY_CONFIG.format(ckpt=root / "ckpt", output=root / "final.pt"))
    probe_env: dict[str, str] = {}
    started_seen: list[bool] = []

    def make_envs(endpoint):
        env = _node_env(image_python, root, "node", DT_NNODES="1", DT_NPROC_PER_NODE="2",
                        DT_RDZV_ENDPOINT=endpoint, DT_CONFIG=str(config), DT_CHECKPOINT_DIR=str(root / "ckpt"),
                        HOSTNAME="dtrain-0")
        probe_env.update(env)
        return [env]

    for attempt in range(2):
        envs = make_envs(f"127.0.0.1:{_free_port()}")
        before = _run([str(PROBE), "started"], timeout=30, env=envs[0])
        node = Node(envs[0])
        deadline = time.monotonic() + 180
        while node.proc.poll() is None and time.monotonic() < deadline:
            probe = _run([str(PROBE), "alive"], timeout=30, env=envs[0])
            started_seen.append(probe.returncode == 0)
            time.sleep(0.2)
        if node.wait(max(0.1, deadline - time.monotonic())) is None:
            pytest.fail(f"single-node run did not finish within 180s\n{node.report()}")
        if node.proc.returncode == 0 or attempt == 1 or not _address_in_use(node.out + node.err):
            break
    return {"root": root, "config": config, "node": node, "env": probe_env, "probe_before": before,
            "probe_during": started_seen}


@pytest.mark.slow
def test_single_node_run(single_node):
    node, root = single_node["node"], single_node["root"]
    assert node.proc.returncode == 0, node.report()
    assert "node 0 of 1, 2 process(es)" in node.err, "node rank not derived from HOSTNAME=dtrain-0"
    assert (root / "ckpt" / "COMPLETED").is_file()
    assert sorted(p.name for p in (root / "ckpt").glob("step_*")) == ["step_000000002", "step_000000004"]
    state = torch.load(root / "final.pt", map_location="cpu", weights_only=True)
    assert state and all(isinstance(v, torch.Tensor) for v in state.values())
    # probe.sh: not started before the launch, healthy while torchrun ran, healthy (complete) after.
    assert single_node["probe_before"].returncode == 1 and "not launched" in single_node["probe_before"].stdout
    assert any(single_node["probe_during"]), "probe.sh never saw the trainer running"
    after = _run([str(PROBE), "alive"], timeout=30, env=single_node["env"])
    assert after.returncode == 0, after.stdout


def test_completed_run_idles(single_node):
    assert single_node["node"].proc.returncode == 0, single_node["node"].report()
    root = single_node["root"]
    final = root / "final.pt"
    mtime = final.stat().st_mtime_ns
    env = dict(single_node["env"], DT_IDLE_CMD="echo idling-now", DT_RDZV_ENDPOINT="127.0.0.1:1")
    node = Node(env)
    assert node.wait(60) == 0, node.report()
    assert "run complete" in node.err and str(root / "ckpt" / "COMPLETED") in node.err, node.report()
    assert node.out.strip() == "idling-now", node.report()
    assert "torch.distributed.run" not in node.err, "trained again"
    assert final.stat().st_mtime_ns == mtime


def test_default_idle_stops_on_sigterm(tmp_path):
    """Without DT_IDLE_CMD a completed node sleeps until stopped, and stops at once on SIGTERM (PID 1)."""
    (tmp_path / "COMPLETED").touch()
    node = Node(_clean_env(DT_CHECKPOINT_DIR=str(tmp_path), DT_STATE_DIR=str(tmp_path / "state")))
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in node.proc.stderr], daemon=True).start()
    try:
        first = lines.get(timeout=30)  # logged once the SIGTERM trap is in place
        assert "run complete" in first and "idling until stopped" in first, first
        time.sleep(0.5)
        assert node.proc.poll() is None, "the entrypoint should idle, not exit"
        node.proc.send_signal(signal.SIGTERM)
        assert node.proc.wait(timeout=10) == 0
    finally:
        if node.proc.poll() is None:
            os.killpg(node.proc.pid, signal.SIGKILL)
            node.proc.wait(timeout=30)


@pytest.mark.slow
def test_two_nodes_match_one_node(single_node, image_python, tmp_path):
    assert single_node["node"].proc.returncode == 0, single_node["node"].report()
    config = single_node["config"]
    shared = tmp_path / "shared"

    def make_envs(endpoint):
        # A shared checkpoint.dir and output (as a ReadWriteMany volume would be), a marker dir per node.
        extra = f"--set checkpoint.dir={shared / 'ckpt'} --set output={shared / 'final.pt'}"
        return [_node_env(image_python, tmp_path, f"node{r}", DT_NNODES="2", DT_NODE_RANK=str(r),
                          DT_NPROC_PER_NODE="1", DT_RDZV_ENDPOINT=endpoint, DT_CONFIG=str(config),
                          DT_CHECKPOINT_DIR=str(tmp_path / f"node{r}"), DT_EXTRA_ARGS=extra,
                          HOSTNAME=f"dtrain-{r}")
                for r in range(2)]

    nodes = _run_job(make_envs, timeout=180)
    for r, node in enumerate(nodes):
        assert node.proc.returncode == 0, f"node {r}:\n{node.report()}"
        assert f"node {r} of 2, 1 process(es)" in node.err
        assert (tmp_path / f"node{r}" / "COMPLETED").is_file(), f"node {r} did not mark the run complete"
    assert (shared / "ckpt" / "COMPLETED").is_file(), "rank 0 did not write checkpoint.dir/COMPLETED"
    assert sorted(p.name for p in (shared / "ckpt" / "step_000000004").iterdir()) == ["meta.pt", "meta.pt.sha256", "rank0.pt", "rank1.pt"]

    two = torch.load(shared / "final.pt", map_location="cpu", weights_only=True)
    one = torch.load(single_node["root"] / "final.pt", map_location="cpu", weights_only=True)
    assert two.keys() == one.keys()
    for name in one:
        assert torch.equal(two[name], one[name]), f"{name} differs between 2x1 and 1x2 processes"


# Loaded by every Python of a node whose PYTHONPATH names its directory; in torchrun's worker of global
# rank DT_TEST_CRASH_RANK it kills the process (no cleanup, like a node lost) right after the numbered
# checkpoint of step DT_TEST_CRASH_STEP is complete.
CRASH_HOOK = """\
import os
if os.environ.get("RANK") is not None and os.environ.get("RANK") == os.environ.get("DT_TEST_CRASH_RANK"):
    import distributed_training.trainer as _trainer

    _save = _trainer.DistributedTrainer._save_numbered

    def _save_then_crash(self, metrics):
        _save(self, metrics)
        if self.step == int(os.environ["DT_TEST_CRASH_STEP"]):
            os._exit(17)

    _trainer.DistributedTrainer._save_numbered = _save_then_crash
"""


@pytest.mark.slow
def test_per_node_volumes_resume_after_a_crash(single_node, image_python, tmp_path):
    """The StatefulSet's layout: each node has its own checkpoint volume (checkpoint.dir = its mount).

    A two-node job crashes (rank 1 dies hard) right after the checkpoint of step 2; both nodes are
    started again, this time with the nodes in the other order (torchrun sorts them by address), so
    each node holds the files of the rank it no longer runs. The job must resume at step 2 on both
    nodes, finish equal to the unbroken one-node run, and each volume must be pruned to keep_last.
    """
    assert single_node["node"].proc.returncode == 0, single_node["node"].report()
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(CRASH_HOOK)
    volumes = [tmp_path / f"volume{r}" for r in range(2)]

    def job(addresses, **extra_env):
        def make_envs(endpoint):
            envs = []
            for r in range(2):
                args = (f"--set checkpoint.dir={volumes[r]} --set output={volumes[r] / 'final.pt'} "
                        "--set checkpoint.keep_last=1 --set logging.every=1 --set training.timeout_s=60")
                envs.append(_node_env(image_python, tmp_path, f"node{r}", DT_NNODES="2", DT_NODE_RANK=str(r),
                                      DT_NPROC_PER_NODE="1", DT_RDZV_ENDPOINT=endpoint,
                                      DT_CONFIG=str(single_node["config"]), DT_CHECKPOINT_DIR=str(volumes[r]),
                                      DT_EXTRA_ARGS=args, HOSTNAME=f"dtrain-{r}", PET_LOCAL_ADDR=addresses[r],
                                      **extra_env))
            return envs

        return _run_job(make_envs, timeout=180)

    def steps_trained(nodes):
        return sorted(int(m) for n in nodes for m in re.findall(r"^step +(\d+) \|", n.out + n.err, re.M))

    # 1. Node 0 runs rank 0 (127.0.0.1 sorts first); rank 1 dies right after the checkpoint of step 2.
    crashed = job(["127.0.0.1", "127.0.0.2"], PYTHONPATH=str(hook), DT_TEST_CRASH_RANK="1",
                  DT_TEST_CRASH_STEP="2", DT_MAX_RESTARTS="0")
    report = "\n".join(n.report() for n in crashed)
    assert all(n.proc.returncode != 0 for n in crashed), f"the crash did not stop the job:\n{report}"
    assert steps_trained(crashed) == [1, 2], report
    for r, volume in enumerate(volumes):
        assert not (volume / "COMPLETED").exists(), report
        assert sorted(p.name for p in (volume / "step_000000002").iterdir()) == ["meta.pt", "meta.pt.sha256", f"rank{r}.pt"], report

    # 2. Both nodes start again, now node 1 first (127.0.0.2 < 127.0.0.3): it runs rank 0 on a volume
    #    that holds rank 1's files, and the other way round.
    resumed = job(["127.0.0.3", "127.0.0.2"])
    report = "\n".join(n.report() for n in resumed)
    for r, node in enumerate(resumed):
        assert node.proc.returncode == 0, f"node {r}:\n{report}"
        assert (volumes[r] / "COMPLETED").is_file(), report
    assert steps_trained(resumed) == [3, 4], f"did not resume from step 2:\n{report}"
    # keep_last=1 on every volume: step 2 is gone everywhere; step 4 has each node's own files.
    for r, volume in enumerate(volumes):
        assert sorted(p.name for p in volume.glob("step_*")) == ["step_000000004"], report
        files = sorted(p.name for p in (volume / "step_000000004").iterdir())
        assert files == ["meta.pt", "meta.pt.sha256", f"rank{1 - r}.pt"], (r, files)

    two = torch.load(volumes[1] / "final.pt", map_location="cpu", weights_only=True)  # rank 0 ran on node 1
    one = torch.load(single_node["root"] / "final.pt", map_location="cpu", weights_only=True)
    assert two.keys() == one.keys()
    for name in one:
        assert torch.equal(two[name], one[name]), f"{name} differs between the resumed run and an unbroken one"


# --------------------------------------------------------- the entrypoint's command line, stubbed
FAKE_PYTHON = """#!/usr/bin/env bash
# Stand-in for DT_PYTHON: runs `-c` snippets with the real Python, prints any other command line.
if [ "$1" = "-c" ]; then exec {python} "$@"; fi
printf '%s\\n' "$@" > "$FAKE_ARGV"
printf '%s\\n' "${{TORCH_DISABLE_SHARE_RDZV_TCP_STORE:-unset}}" > "$FAKE_ARGV.store"
if [ -n "${{FAKE_SLEEP:-}}" ]; then
    trap 'kill $!; exit ${{FAKE_TERM_RC:-143}}' TERM
    sleep "$FAKE_SLEEP" > /dev/null 2>&1 &
    wait
fi
exit "${{FAKE_RC:-0}}"
"""


@pytest.fixture
def fake(tmp_path):
    python = tmp_path / "bin" / "python"
    python.parent.mkdir()
    python.write_text(FAKE_PYTHON.format(python=sys.executable))
    python.chmod(0o755)
    config = tmp_path / "job.yaml"
    config.write_text("model: {preset: tiny}\n")

    def run(*args: str, timeout: float = 30, **env: str):
        full = _clean_env(DT_PYTHON=str(python), DT_CONFIG=str(config), DT_CHECKPOINT_DIR=str(tmp_path / "ckpt"),
                          DT_STATE_DIR=str(tmp_path / "state"), FAKE_ARGV=str(tmp_path / "argv"),
                          PATH=f"{python.parent}{os.pathsep}/usr/bin:/bin")
        full.update(env)
        (tmp_path / "ckpt" / "COMPLETED").unlink(missing_ok=True)  # each call is a fresh run
        node = Node(full, args)
        rc = node.wait(timeout)
        argv_file = tmp_path / "argv"
        argv = argv_file.read_text().splitlines() if argv_file.exists() else None
        if argv_file.exists():
            argv_file.unlink()
        return rc, argv, node

    run.dir = tmp_path
    run.config = config
    run.python = python
    return run


def test_entrypoint_command_defaults(fake):
    smi = fake.python.parent / "nvidia-smi"  # present but failing, as on a node without a driver: 1 process
    smi.write_text("#!/usr/bin/env bash\nexit 9\n")
    smi.chmod(0o755)
    rc, argv, node = fake(HOSTNAME="dtrain-3")
    assert rc == 0, node.report()
    assert argv == ["-m", "torch.distributed.run", "--nnodes=1", "--nproc-per-node=1", "--node-rank=3",
                    "--rdzv-backend=c10d", "--rdzv-endpoint=localhost:29400", "--rdzv-id=dtrain",
                    "--max-restarts=3", "-m", "distributed_training", str(fake.config)]
    assert (fake.dir / "ckpt" / "COMPLETED").is_file(), "a successful torchrun must mark the run complete"


def test_entrypoint_command_from_env(fake):
    smi = fake.python.parent / "nvidia-smi"
    smi.write_text("#!/usr/bin/env bash\nfor i in 0 1 2 3; do echo \"GPU $i: NVIDIA H100 (UUID: GPU-$i)\"; done\n")
    smi.chmod(0o755)
    rc, argv, node = fake("--set", "training.seed=7", HOSTNAME="worker", DT_NNODES="2", DT_MASTER_HOST="dtrain-0.dtrain",
                          DT_JOB_ID="job-9", DT_MAX_RESTARTS="0",
                          DT_EXTRA_ARGS="--set training.max_steps=10 --set 'output=/tmp/a b.pt'")
    assert rc == 0, node.report()
    assert argv[2:10] == ["--nnodes=2", "--nproc-per-node=4", "--node-rank=0", "--rdzv-backend=c10d",
                          "--rdzv-endpoint=dtrain-0.dtrain:29400", "--rdzv-id=job-9", "--max-restarts=0", "-m"]
    assert argv[11:] == [str(fake.config), "--set", "training.max_steps=10", "--set", "output=/tmp/a b.pt",
                         "--set", "training.seed=7"]

    # torchrun's own PET_* variables come next after ours.
    rc, argv, node = fake(PET_NNODES="1:4", PET_NPROC_PER_NODE="2", PET_NODE_RANK="5", PET_RDZV_ENDPOINT="h:1234",
                          PET_MAX_RESTARTS="9", PET_RDZV_ID="pet", DT_NODE_RANK="1")
    assert rc == 0, node.report()
    assert argv[2:9] == ["--nnodes=1:4", "--nproc-per-node=2", "--node-rank=1", "--rdzv-backend=c10d",
                         "--rdzv-endpoint=h:1234", "--rdzv-id=pet", "--max-restarts=9"]


def test_entrypoint_failures(fake):
    rc, argv, node = fake(FAKE_RC="7")
    assert rc == 7 and argv is not None, node.report()
    assert not (fake.dir / "ckpt" / "COMPLETED").exists(), "a failed run must not be marked complete"
    assert "torchrun exited with status 7" in node.err

    rc, argv, node = fake(DT_CONFIG=str(fake.dir / "missing.yaml"))
    assert rc == 2 and argv is None and "missing.yaml" in node.err, node.report()

    rc, argv, node = fake(DT_EXTRA_ARGS="--set 'unbalanced")
    assert rc == 2 and argv is None and "DT_EXTRA_ARGS" in node.err, node.report()


def test_entrypoint_forwards_sigterm(fake):
    full_env = _clean_env(DT_PYTHON=str(fake.python), DT_CONFIG=str(fake.config), FAKE_SLEEP="60",
                          DT_CHECKPOINT_DIR=str(fake.dir / "ckpt"), DT_STATE_DIR=str(fake.dir / "state"),
                          FAKE_ARGV=str(fake.dir / "argv"))
    node = Node(full_env)
    try:
        deadline = time.monotonic() + 30
        while not (fake.dir / "state" / "trainer.pid").exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        pid = int((fake.dir / "state" / "trainer.pid").read_text())
        time.sleep(0.3)
        node.proc.send_signal(signal.SIGTERM)
        rc = node.wait(15)
    finally:
        if node.proc.returncode is None:
            node.kill()
    assert rc == 143, node.report()
    assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text().lower()
    assert not (fake.dir / "ckpt" / "COMPLETED").exists()


def test_entrypoint_elastic_settings_and_a_stopped_node(fake):
    """MIN:MAX turns on the unshared rendezvous store (unless set); a node told to stop never marks the
    run complete, even when torchrun then exits 0 (a scale-down removes the pod; the job goes on)."""
    rc, argv, node = fake(DT_NNODES="1:4")
    assert rc == 0 and "--nnodes=1:4" in argv, node.report()
    assert (fake.dir / "argv.store").read_text().strip() == "1"
    rc, argv, node = fake(DT_NNODES="1:4", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="0")
    assert (fake.dir / "argv.store").read_text().strip() == "0"
    rc, argv, node = fake(DT_NNODES="2")
    assert (fake.dir / "argv.store").read_text().strip() == "unset"

    env = _clean_env(DT_PYTHON=str(fake.python), DT_CONFIG=str(fake.config), FAKE_SLEEP="60", FAKE_TERM_RC="0",
                     DT_NNODES="1:4", DT_CHECKPOINT_DIR=str(fake.dir / "ckpt"), DT_STATE_DIR=str(fake.dir / "state"),
                     FAKE_ARGV=str(fake.dir / "argv"))
    (fake.dir / "state" / "trainer.pid").unlink(missing_ok=True)
    (fake.dir / "ckpt" / "COMPLETED").unlink(missing_ok=True)  # the runs above finished and marked it
    node = Node(env)
    try:
        deadline = time.monotonic() + 30
        while not (fake.dir / "state" / "trainer.pid").exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(0.3)
        node.proc.send_signal(signal.SIGTERM)
        rc = node.wait(15)
    finally:
        if node.proc.returncode is None:
            node.kill()
    assert rc == 0 and "not marking the run complete" in node.err, node.report()
    assert not (fake.dir / "ckpt" / "COMPLETED").exists(), "a stopped node marked the run complete"


def test_probe_detects_a_stall(tmp_path):
    """A live torchrun whose logs stopped moving for DT_STALL_SECONDS fails `probe.sh alive`."""
    fake_torchrun = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "torch.distributed.run"])
    try:
        state, logs = tmp_path / "state", tmp_path / "runs" / "rank_0"
        state.mkdir()
        logs.mkdir(parents=True)
        (state / "trainer.pid").write_text(f"{fake_torchrun.pid}\n")
        (logs / "metrics.jsonl").write_text("{}\n")
        env = _clean_env(DT_CHECKPOINT_DIR=str(tmp_path / "ckpt"), DT_STATE_DIR=str(state),
                         DT_LOG_DIR=str(tmp_path / "runs"), DT_STALL_SECONDS="600")
        assert _run([str(PROBE), "alive"], timeout=30, env=env).returncode == 0
        old = time.time() - 3600
        for f in (state / "trainer.pid", logs / "metrics.jsonl"):
            os.utime(f, (old, old))
        stalled = _run([str(PROBE), "alive"], timeout=30, env=env)
        assert stalled.returncode == 1 and "no progress" in stalled.stdout
        assert _run([str(PROBE), "started"], timeout=30, env=env).returncode == 0, "started ignores stalls"
        (logs / "metrics.jsonl").touch()
        assert _run([str(PROBE), "alive"], timeout=30, env=env).returncode == 0
        (state / "trainer.pid").write_text(f"{os.getpid()}\n")  # alive, but not torchrun
        assert _run([str(PROBE), "started"], timeout=30, env=env).returncode == 1
        (tmp_path / "ckpt").mkdir()
        (tmp_path / "ckpt" / "COMPLETED").touch()
        assert _run([str(PROBE), "alive"], timeout=30, env=env).returncode == 0, "a completed run is healthy"
    finally:
        fake_torchrun.kill()
        fake_torchrun.wait(timeout=30)


# ------------------------------------------------------- the StatefulSet scaled 2 -> 3 -> 2 pods
# The job trains with SGD and momentum (`optimizer: {name: sgd}`), not dtrain's default AdamW: AdamW divides
# each gradient by its own running size, so entries whose gradient is 0 up to rounding (a dead unit, the
# attention's key bias) take lr-sized steps in directions that rounding decides, and rounding differs with
# the number of replicas; over a hundred steps that grows past any tolerance (measured: 1e-5 at step 1,
# 1e-2 at step 80), which would hide what this test checks.
# Loaded by every Python of a pod whose PYTHONPATH names its directory; in torchrun's workers it
# * prints every step with the world it ran at, and has rank 0 save the full model after each step in
#   DT_TEST_RECORD;
# * with DT_TEST_HOLD (a file), keeps the job from ending while the test resizes it: after each step from
#   DT_TEST_HOLD_FROM on, each worker waits while that file exists, until it receives SIGTERM (its agent
#   restarting it for a new world, or its pod being removed), at most 120 s. It hands the signal on to
#   fit's handler, which stops at a step boundary the ranks agree on (at least one step later: the
#   agreement is pipelined), and prints DTSIGTERM after its step (the test removes the file once the
#   removed pod's worker printed it).
STEP_HOOK = """\
import os
if os.environ.get("RANK") is not None:
    import signal
    import threading
    import time
    import torch
    import distributed_training.trainer as _trainer

    _step = _trainer.DistributedTrainer.train_step
    _terminated = threading.Event()
    _said = []

    def _watch_sigterm():
        handler = signal.getsignal(signal.SIGTERM)  # fit's: a flag acted on at a step boundary
        if getattr(handler, "__name__", "") == "_chained":
            return

        def _chained(signum, frame):
            _terminated.set()
            if callable(handler):
                handler(signum, frame)

        signal.signal(signal.SIGTERM, _chained)  # fit restores its predecessor's handler on return

    def _recorded_step(self, *args, **kwargs):
        _watch_sigterm()  # from the first step on, so that no SIGTERM is missed
        out = _step(self, *args, **kwargs)
        now = time.time()
        print(f"DTSTEP step={self.step} world={self.context.world_size} time={now:.3f}", flush=True)
        state = self.strategy.model_state_dict(self.model)  # every rank: ZeRO-3 gathers the shards
        if self.context.rank == 0:
            torch.save(state, os.path.join(os.environ["DT_TEST_RECORD"], f"{self.step}-{now:.3f}.pt"))
        hold = os.environ.get("DT_TEST_HOLD")
        if hold and self.step >= int(os.environ["DT_TEST_HOLD_FROM"]):
            started = time.monotonic()
            while os.path.exists(hold) and not _terminated.is_set() and time.monotonic() - started < 120:
                _terminated.wait(0.05)
        if _terminated.is_set() and not _said:  # said here, not in the handler: it could cut a line in two
            _said.append(True)
            print("DTSIGTERM", flush=True)
        return out

    _trainer.DistributedTrainer.train_step = _recorded_step
"""

ELASTIC_CONFIG = """\
model: {{preset: tiny}}
data: {{dataset: repo_text, block_size: 32, val_fraction: 0.01}}
training: {{strategy: zero3, epochs: 100, max_steps: {steps}, global_batch_size: 6, lr: 0.05, seed: 0, timeout_s: 60}}
optimizer: {{name: sgd, momentum: 0.9}}
checkpoint: {{dir: {ckpt}, every: 2, keep_last: 2}}
logging: {{dir: null, every: 10}}
output: {output}
"""


def reference_worker(rank: int, world_size: int, argv: list[str]) -> int:
    """`run_distributed` target: STEP_HOOK installed as a pod's sitecustomize installs it, then dtrain's main
    on `argv` (what `python -m distributed_training` runs) in the process group that already exists."""
    exec(compile(STEP_HOOK, "sitecustomize.py", "exec"), {"__name__": "sitecustomize"})
    from distributed_training import cli

    return cli.main(argv)


class Pod:
    """One docker/entrypoint.sh as a StatefulSet pod (HOSTNAME dtrain-<i>, its own volume), its output
    in files (read while it runs), in its own process group."""

    def __init__(self, env: dict[str, str], log: Path) -> None:
        self.log = log
        with open(log, "w") as out:
            self.proc = subprocess.Popen([str(ENTRYPOINT)], env=env, stdout=out, stderr=subprocess.STDOUT,
                                         start_new_session=True)

    def steps(self) -> list[tuple[int, int, float]]:
        return [(int(s), int(w), float(t)) for s, w, t in
                re.findall(r"^DTSTEP step=(\d+) world=(\d+) time=([\d.]+)$", self.log.read_text(), re.M)]

    def kill(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(timeout=30)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_statefulset_scaled_up_and_down(image_python, tmp_path):
    """`kubectl scale statefulset dtrain --replicas=3` and back to 2, replayed on this host: three
    entrypoints as pods dtrain-0/1/2, one process each, each with its own checkpoint volume, with the
    manifest's DT_NNODES (MIN:MAX), rendezvous settings and restarts. Two pods start; once they train at
    world 2 the third starts (scale up) and the job re-forms at world 3; once it trains there, the third
    pod's entrypoint gets SIGTERM, as Kubernetes stops the pod a scale-down removes, and the job re-forms
    at world 2 and finishes. The two remaining pods mark the run complete, the removed one does not, and
    the final model equals a one-process run of the same config (global batch 6 there and at 2 and 3 pods).

    The job cannot end before the resizes, however fast it trains: from step `steps - 10` on it holds
    after each step (the hook's DT_TEST_HOLD) until the removed pod's worker got its SIGTERM; a SIGTERM
    ends a worker's hold at once, so the resizes are not slowed down by it."""
    steps = 12
    sts = next(d for (kind, _), d in _manifests().items() if kind == "StatefulSet")
    trainer = next(c for c in sts["spec"]["template"]["spec"]["containers"] if c["name"] == "trainer")
    manifest = {k: e["value"] for k, e in _env_of(trainer).items()
                if k in ("DT_NNODES", "DT_MAX_RESTARTS", "PET_RDZV_CONF", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE")}
    assert ":" in manifest["DT_NNODES"], manifest
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(STEP_HOOK)
    config = tmp_path / "job.yaml"
    config.write_text(ELASTIC_CONFIG.format(steps=steps, ckpt="/unused", output="/unused"))
    volumes = [tmp_path / f"volume{i}" for i in range(3)]

    def pod_env(i: int, endpoint: str, **extra: str) -> dict[str, str]:
        env = {**manifest, "DT_NPROC_PER_NODE": "1", "HOSTNAME": f"dtrain-{i}", "DT_RDZV_ENDPOINT": endpoint,
               "DT_CONFIG": str(config), "DT_CHECKPOINT_DIR": str(volumes[i]),
               "DT_EXTRA_ARGS": f"--set checkpoint.dir={volumes[i]} --set output={volumes[i] / 'final.pt'}", **extra}
        return _node_env(image_python, tmp_path, f"pod{i}", **env)

    records = {"alone": tmp_path / "records-alone", "pods": tmp_path / "records-pods"}
    for path in records.values():
        path.mkdir()

    # The reference: one process, the same config and the same step hook: the pod's worker's command
    # (`python -m distributed_training CONFIG --set ...`) as dtrain's main in a process forked from the warm
    # fork server (`run_distributed`, a world of one), not an entrypoint with torchrun and a fresh worker
    # (three interpreters to start). The pods below are the entrypoints under test.
    alone_s = time.time()
    codes = run_distributed(reference_worker, 1, args=([str(config), "--set", f"checkpoint.dir={tmp_path / 'alone'}",
                                                         "--set", f"output={tmp_path / 'alone' / 'final.pt'}"],),
                            env={"DT_TEST_RECORD": str(records["alone"]), "CUDA_VISIBLE_DEVICES": ""}, timeout=120)
    assert codes == [0], codes
    reference = torch.load(tmp_path / "alone" / "final.pt", map_location="cpu", weights_only=True)
    alone_s = time.time() - alone_s

    endpoint = f"127.0.0.1:{_free_port()}"
    hold = tmp_path / "hold"  # removed once the removed pod's worker got its SIGTERM
    hold.touch()
    held = {"PYTHONPATH": str(hook), "DT_TEST_RECORD": str(records["pods"]), "DT_TEST_HOLD": str(hold),
            "DT_TEST_HOLD_FROM": str(steps - 10)}
    pods: list[Pod] = []

    def all_steps() -> list[tuple[int, int, float]]:
        return sorted({s for pod in pods for s in pod.steps()}, key=lambda s: s[2])

    def wait_for(what: str, predicate, timeout: float = 60) -> tuple[int, int, float]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = [s for s in all_steps() if predicate(s)]
            if found:
                return found[0]
            if any(pod.proc.poll() not in (None, 0) for pod in pods[:2]):
                break
            time.sleep(0.1)
        pytest.fail(f"{what}: not seen\n" + "\n".join(f"--- pod {i} ---\n{pod.log.read_text()[-3000:]}"
                                                    for i, pod in enumerate(pods)))

    try:
        started = time.time()
        pods += [Pod(pod_env(i, endpoint, **held), tmp_path / f"pod{i}.log") for i in range(2)]
        wait_for("a step at world 2", lambda s: s[1] == 2, timeout=90)
        up = time.time()  # kubectl scale --replicas=3
        pods.append(Pod(pod_env(2, endpoint, **held), tmp_path / "pod2.log"))
        grown = wait_for("a step at world 3 after the scale-up", lambda s: s[1] == 3 and s[2] > up)
        down = time.time()  # kubectl scale --replicas=2: the removed pod's container gets SIGTERM
        pods[2].proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 60
        while "DTSIGTERM" not in pods[2].log.read_text() and time.monotonic() < deadline:
            time.sleep(0.1)
        if "DTSIGTERM" not in pods[2].log.read_text():
            pytest.fail(f"the removed pod's worker got no SIGTERM\n{pods[2].log.read_text()[-3000:]}")
        hold.unlink()  # the job may end now: its stop at world 3 is on its way
        shrunk = wait_for("a step at world 2 after the scale-down", lambda s: s[1] == 2 and s[2] > down)
        removed_rc = pods[2].proc.wait(timeout=60)
        rcs = [pod.proc.wait(timeout=120) for pod in pods[:2]]
        finished = time.time()
    finally:
        for pod in pods:
            pod.kill()
    logs = "\n".join(f"--- pod {i} ---\n{pod.log.read_text()[-3000:]}" for i, pod in enumerate(pods))
    trained = all_steps()
    last2 = max(s for s, w, t in trained if w == 2 and t < grown[2])  # the steps each resize's stop saved
    last3 = max(s for s, w, t in trained if w == 3)
    print(f"scale-up: {grown[2] - up:.1f} s from the new pod's start to the first step at world 3 (step {grown[0]} "
          f"after {last2}); scale-down: {shrunk[2] - down:.1f} s from SIGTERM to the next step at world 2 (step "
          f"{shrunk[0]} after {last3}); whole run {finished - started:.1f} s, the one-process reference {alone_s:.1f} s")
    assert rcs == [0, 0], logs
    assert removed_rc != 0 or "not marking the run complete" in pods[2].log.read_text(), logs
    assert (volumes[0] / "COMPLETED").is_file() and (volumes[1] / "COMPLETED").is_file(), logs
    assert not (volumes[2] / "COMPLETED").exists(), f"the removed pod marked the run complete\n{logs}"
    # Each size ran, the job ended at world 2, and no step was lost or redone: each resize's stop saved
    # the step the ranks agreed on, and the re-formed job continued right after it.
    assert {w for _, w, _ in trained} == {2, 3} and trained[-1][:2] == (steps, 2), trained[-5:]
    assert sorted({s for s, _, _ in trained}) == list(range(1, steps + 1))
    assert (grown[0], shrunk[0]) == (last2 + 1, last3 + 1), (last2, grown, last3, shrunk)
    finals = [v / "final.pt" for v in volumes if (v / "final.pt").is_file()]
    assert len(finals) == 1 and finals[0].parent != volumes[2], finals
    final = torch.load(finals[0], map_location="cpu", weights_only=True)
    assert final.keys() == reference.keys()
    for name in reference:
        torch.testing.assert_close(final[name], reference[name], rtol=0, atol=1e-5, msg=lambda m: f"{name}: {m}")
    # And after every step, whichever world trained it (the steps each stop saved included).
    alone_steps = {int(p.name.split("-")[0]): p for p in records["alone"].glob("*.pt")}
    pod_records = sorted(records["pods"].glob("*.pt"))
    assert sorted(alone_steps) == list(range(1, steps + 1))
    assert sorted({int(p.name.split("-")[0]) for p in pod_records}) == list(range(1, steps + 1))
    for record in pod_records:
        step = int(record.name.split("-")[0])
        got = torch.load(record, map_location="cpu", weights_only=True)
        want = torch.load(alone_steps[step], map_location="cpu", weights_only=True)
        for name in want:
            torch.testing.assert_close(got[name], want[name], rtol=0, atol=1e-5,
                                       msg=lambda m: f"step {step}, {name}: {m}")
