import os
import random
import socket
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

# Scenario helpers (launcher, models, simulated hosts) live in support/, apart from the tests.
sys.path.insert(0, str(Path(__file__).parent / "support"))

# No object-storage request may leave this machine: until the S3 server below starts, every AWS client (s3fs,
# botocore) is pointed at a closed loopback port, with dummy credentials; nothing reads instance metadata.
os.environ["AWS_ENDPOINT_URL"] = "http://127.0.0.1:9"
os.environ["AWS_ACCESS_KEY_ID"] = "testing"
os.environ["AWS_SECRET_ACCESS_KEY"] = "testing"
os.environ["AWS_DEFAULT_REGION"] = "us-east-1"
os.environ["AWS_EC2_METADATA_DISABLED"] = "true"
for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_CONFIG_FILE", "AWS_SHARED_CREDENTIALS_FILE"):
    os.environ.pop(name, None)

# The ranks of a test are forked from this process (see support/launcher.py), and a child cannot start CUDA once its
# parent has: torch asks NVML, not CUDA, whether a GPU is there (`torch.cuda.is_available()` in a `skipif`), so that
# on a machine with GPUs the ranks of a CUDA test can use them.
os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = "1"


def _free_port() -> int:
    """A port that nothing listens on, below the kernel's range of ephemeral ports: one of that range, free now, may
    be taken by the local end of any connection (gloo's, between the ranks of a test beside this one) before the
    processes that were given it meet there, seconds later."""
    try:
        first_ephemeral = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        first_ephemeral = 32768
    for _ in range(200):
        port = random.randrange(10000, max(first_ephemeral, 10001))
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port between 10000 and {first_ephemeral} after 200 tries")


@pytest.fixture
def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on."""
    return _free_port()


@pytest.fixture(scope="session")
def s3_endpoint() -> Iterator[str]:
    """The URL of moto's S3 server, started on 127.0.0.1 for the session; every client is pointed at it."""
    server_module = pytest.importorskip("moto.server")
    port = _free_port()
    server = server_module.ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    os.environ["AWS_ENDPOINT_URL"] = endpoint
    try:
        yield endpoint
    finally:
        os.environ["AWS_ENDPOINT_URL"] = "http://127.0.0.1:9"
        server.stop()


@pytest.fixture
def bucket(s3_endpoint: str, request: pytest.FixtureRequest) -> Iterator[str]:
    """A new, empty bucket on the loopback server: its URL, ``s3://<bucket>``."""
    import s3fs

    name = "test-" + "".join(c if c.isalnum() else "-" for c in request.node.name.lower())[:50].strip("-")
    fs = s3fs.S3FileSystem(endpoint_url=s3_endpoint, skip_instance_cache=True)
    fs.mkdir(name)
    try:
        yield f"s3://{name}"
    finally:
        fs.rm(name, recursive=True)


@pytest.fixture
def storage_options(s3_endpoint: str) -> dict[str, str]:
    """The options of every client in the tests: the loopback endpoint, explicitly."""
    return {"endpoint_url": s3_endpoint}
