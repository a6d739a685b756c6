"""A run's lease (etrain/core/lease.py) on local disk and on S3: one owner, stale owners taken over, a lost lease
noticed."""

from __future__ import annotations

import json
import subprocess
import threading
import time

import fsspec
import pytest

from etrain.core import lease


@pytest.fixture(params=["local", "s3"])
def root(request, tmp_path) -> str:
    if request.param == "local":
        return str(tmp_path / "checkpoints")
    return request.getfixturevalue("s3_bucket") + "/run/checkpoints"


def rewrite(held: lease.Lease, **changes) -> None:
    """Change the lease file behind its owner's back (as another host or a crash would leave it)."""
    fs, path = fsspec.core.url_to_fs(held.path)
    fs.pipe_file(path, json.dumps({**json.loads(fs.cat_file(path)), **changes}).encode())


def test_a_live_lease_refuses_a_second_owner_naming_the_first(root):
    first = lease.acquire(root, "r", ttl_s=60)
    with pytest.raises(lease.RunBusy, match=r"being trained by host \S+ pid \d+ \(its lease .* renewed 0 s ago\)"):
        lease.acquire(root, "r", ttl_s=60)
    lease.renew(first)  # the owner keeps it
    lease.release(first)
    lease.release(lease.acquire(root, "r", ttl_s=60))  # free again


def test_a_stale_lease_is_taken_over_and_its_old_owner_learns_it(root, caplog):
    first = lease.acquire(root, "r", ttl_s=60)
    dead = subprocess.Popen(["true"])
    dead.wait()
    rewrite(first, pid=dead.pid)  # its driver is gone (this host): stale at once
    second = lease.acquire(root, "r", ttl_s=60)
    assert "taking over the stale lease" in caplog.text
    with pytest.raises(lease.LeaseLost, match="another driver took the run over"):
        lease.renew(first)
    lease.release(first)  # not its lease any more: nothing happens
    with pytest.raises(lease.RunBusy):
        lease.acquire(root, "r", ttl_s=60)
    lease.release(second)


def test_a_lease_not_renewed_for_its_ttl_is_stale_on_another_host(root):
    first = lease.acquire(root, "r", ttl_s=60)
    rewrite(first, host="elsewhere", renewed=time.time() - 30)
    with pytest.raises(lease.RunBusy, match="wait 30 s more"):
        lease.acquire(root, "r", ttl_s=60)
    rewrite(first, host="elsewhere", renewed=time.time() - 61)
    lease.release(lease.acquire(root, "r", ttl_s=60))


def test_racing_takers_get_one_lease(root):
    """Compare-and-swap: of several drivers taking a free run at once, exactly one wins."""
    won, busy = [], []

    def take():
        try:
            won.append(lease.acquire(root, "r", ttl_s=60))
        except lease.RunBusy:
            busy.append(1)

    threads = [threading.Thread(target=take) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert (len(won), len(busy)) == (1, 3)


def test_keeper_renews_and_reports_a_takeover(tmp_path):
    held = lease.acquire(str(tmp_path), "r", ttl_s=4)  # renewed every second
    keeper = lease.Keeper(held)
    time.sleep(2.5)
    fs, path = fsspec.core.url_to_fs(held.path)
    assert time.time() - json.loads(fs.cat_file(path))["renewed"] < 2
    rewrite(held, token="another-driver")
    deadline = time.time() + 5
    while keeper.lost is None and time.time() < deadline:
        time.sleep(0.1)
    keeper.stop()
    assert "another driver took the run over" in keeper.lost
