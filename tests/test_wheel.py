"""The package as a user installs it: a wheel built from this checkout, installed in a fresh virtual environment
with no checkout on its path, trains (issue 41, defect 4: packages listed by hand once left `etrain.worker` and the
presets out of the wheel). Its dependencies come from the test's own environment, added to the fresh one's path."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import venv
import zipfile

from helpers.runs import ROOT


def test_a_wheel_installed_in_a_fresh_venv_trains_with_no_checkout_on_its_path(tmp_path, data_dir):
    source, dist = tmp_path / "source", tmp_path / "dist"
    listed = ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"]
    for name in subprocess.run(listed, cwd=ROOT, check=True, capture_output=True, text=True).stdout.split("\0"):
        if name and (ROOT / name).is_file():  # the checkout as a clone has it: a build leaves nothing in ours
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, source / name)
    build = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(dist)]
    subprocess.run([*build, str(source)], check=True, cwd=tmp_path, capture_output=True)
    (wheel,) = dist.glob("etrain-*.whl")
    shipped = set(zipfile.ZipFile(wheel).namelist())
    for needed in ("etrain/worker/actor.py", "etrain/core/models/llama/model.py", "etrain/configs/tiny.yaml"):
        assert needed in shipped, needed
    assert {"etrain/configs/grafana/etrain.json", "etrain/driver/local_cluster.yaml"} <= shipped

    fresh = tmp_path / "venv"
    venv.create(fresh, with_pip=False)
    python = fresh / "bin" / "python"
    site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True, capture_output=True, text=True,
    ).stdout.strip()  # fmt: skip
    # torch, Ray and the rest from this environment: a path line (its .pth files, our editable install's among
    # them, are not read from there)
    (fresh / site.split(str(fresh) + "/", 1)[1] / "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    pip = [sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "-q", str(wheel)]
    subprocess.run(pip, check=True, capture_output=True)

    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "PYTHON"))} | {"HOME": str(tmp_path)}
    where = subprocess.run(
        [str(python), "-c", "import etrain, etrain.worker; print(etrain.__file__)"],
        check=True, capture_output=True, text=True, cwd=tmp_path, env=env,
    ).stdout  # fmt: skip
    assert where.startswith(str(fresh)) and str(ROOT) not in where, where
    settings = [
        "cluster.num_workers=1", "train.steps=2", "train.eval_every=0", "data.corpus_bytes=1500000",
        "data.shard_bytes=200000", f"data.cache_dir={data_dir}", f"run.root={tmp_path / 'runs'}", "run.name=wheel",
    ]  # fmt: skip
    train = [str(fresh / "bin" / "etrain"), "train", "--config", "tiny", "--no-progress"]
    done = subprocess.run(
        [*train, *(a for s in settings for a in ("--set", s))],
        capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert '"steps": 2' in done.stdout
    assert (tmp_path / "runs" / "wheel" / "checkpoints" / "step-00000002" / "commit.json").is_file()
