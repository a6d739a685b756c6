"""One local Ray instance per test session, a local S3 server, a shared small corpus; the tiers.

Every test is in one tier, by what it starts: `e2e` processes of its own beside the session (a Ray head, a
notebook kernel, a wheel's build), `ray` the session's Ray instance, `groups` torch process groups in local
processes, `unit` none of these (`make test-unit`: the loop while editing, in about two minutes)."""

from __future__ import annotations

import os
import random

import pytest
import ray

from etrain.core.config import Config, load_config
from etrain.core.ports import free_port

from helpers.faults import S3Faults
from helpers.runs import FAMILIES, SESSION_SEED


@pytest.fixture(scope="session")
def s3_proxy() -> S3Faults:
    """moto's S3 on 127.0.0.1 behind a fault-injecting proxy (tests/helpers/faults.py), which the environment
    names as the endpoint before Ray starts, so every actor reaches S3 through it."""
    from moto.server import ThreadedMotoServer

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    proxy = S3Faults(f"http://127.0.0.1:{port}")
    env = {
        "AWS_ENDPOINT_URL": proxy.endpoint,
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
    }
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    yield proxy
    proxy.close()
    server.stop()
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture(scope="session")
def s3_server(s3_proxy) -> str:
    """The endpoint every process of the session uses for s3:// (the proxy in front of moto)."""
    return s3_proxy.endpoint


@pytest.fixture
def s3_faults(s3_proxy) -> S3Faults:
    """The session's S3 proxy, to fail requests on demand; everything passes again after the test."""
    yield s3_proxy
    s3_proxy.reset()


@pytest.fixture
def s3_bucket(s3_server, request) -> str:
    import hashlib

    import boto3

    # a test's own bucket: a long name cut short is told apart by a hash of the whole (two parametrized cases of one
    # test once shared a bucket, and the second resumed from the first's checkpoint)
    name = request.node.name.lower().replace("_", "-").replace("[", "-").replace("]", "")[:41]
    name = f"{name}-{hashlib.sha256(request.node.nodeid.encode()).hexdigest()[:8]}"
    boto3.client("s3", endpoint_url=s3_server).create_bucket(Bucket=name)
    return f"s3://{name}"


E2E = ("test_cluster_e2e.py", "test_notebooks.py", "test_wheel.py", "test_real_model.py")


def pytest_report_header(config) -> str:
    return f"cases drawn at collection: seed {SESSION_SEED} (ETRAIN_TEST_SEED={SESSION_SEED} draws the same)"


def pytest_addoption(parser):
    parser.addoption(
        "--campaign",
        action="store_true",
        help="run the campaign's scenarios too (minutes each; `make test-campaign`); `make test` deselects them",
    )


def tier(item) -> str:
    """What the test starts: its own processes beside the session (e2e), the session's Ray (ray), torch process
    groups in local processes (groups: its module spawns with torch.multiprocessing or etrain.core.local_ranks), or
    nothing (unit)."""
    if item.path.name in E2E:
        return "e2e"
    if "ray_session" in item.fixturenames:
        return "ray"
    spawners = {"torch.multiprocessing", "etrain.core.local_ranks"}
    names = {getattr(v, "__module__", None) or getattr(v, "__name__", None) for v in vars(item.module).values()}
    if names & spawners:
        return "groups"
    return "unit"


def pytest_collection_modifyitems(config, items):
    for item in items:
        item.add_marker(tier(item))
    if not config.getoption("--campaign"):  # deselected, not skipped: the summary counts them apart
        left = [item for item in items if item.get_closest_marker("campaign")]
        config.hook.pytest_deselected(items=left)
        items[:] = [item for item in items if not item.get_closest_marker("campaign")]


@pytest.fixture(scope="session")
def ray_session(s3_server) -> int | None:
    """The session's Ray; yields the port of its Prometheus endpoint (what `ray start --metrics-export-port` sets)."""
    if ray.is_initialized():
        yield None
        return
    port = free_port()
    # 4 logical CPUs on 2 cores: room for 3 workers; a test never shares a core budget with another suite.
    ray.init(
        address="local",
        num_cpus=4,
        include_dashboard=False,
        logging_level="warning",  # never a stray cluster
        _metrics_export_port=port,
        _system_config={"metrics_report_interval_ms": 1000},
    )
    yield port
    ray.shutdown()


@pytest.fixture
def rng(request) -> random.Random:
    """Draws for a test that covers combinations (which rank, which step, which mode) at random: a new seed each
    run unless ETRAIN_TEST_SEED gives one. The seed is printed, and shown with the test's output when it fails."""
    seed = int(os.environ.get("ETRAIN_TEST_SEED") or random.SystemRandom().randrange(2**32))
    print(f"{request.node.nodeid}: seed {seed} (ETRAIN_TEST_SEED={seed} draws the same)")
    return random.Random(seed)


@pytest.fixture(scope="module")
def module_family(request) -> tuple[str, int]:
    """The model family a module's runs train (gpt or llama, the tiny preset's shape), drawn from a seed once per
    module: its reference run and the runs compared with it train the same one."""
    seed = int(os.environ.get("ETRAIN_TEST_SEED") or random.SystemRandom().randrange(2**32))
    return random.Random(seed).choice(sorted(FAMILIES)), seed


@pytest.fixture
def family(module_family) -> list[str]:
    """module_family's overrides, the draw printed with each test (shown when it fails)."""
    name, seed = module_family
    print(f"model family {name}: module seed {seed} (ETRAIN_TEST_SEED={seed} draws the same)")
    return FAMILIES[name]


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("data"))


def _cfg_maker(data_dir: str, root) -> callable:
    def make(*overrides: str) -> Config:
        base = [
            f"data.cache_dir={data_dir}",
            "data.corpus_bytes=1500000",
            "data.shard_bytes=200000",
            f"run.root={root / 'runs'}",
            "train.steps=8",
            "train.eval_every=4",
            "checkpoint.every=4",
        ]
        return load_config("tiny", [*base, *overrides])

    return make


@pytest.fixture
def make_cfg(data_dir, tmp_path):
    """The tiny preset on a small corpus with several shards, writing under tmp_path."""
    return _cfg_maker(data_dir, tmp_path)


@pytest.fixture(scope="module")
def make_cfg_module(data_dir, tmp_path_factory):
    return _cfg_maker(data_dir, tmp_path_factory.mktemp("module"))
