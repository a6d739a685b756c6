"""A randomized fault campaign: scenarios drawn from a seed (a training mode and one or two faults at random ranks and
steps), each run as a user runs it (`etrain train` as its own driver process, resumed the way its last line says
when it stops), then checked against the invariants every run must keep, whatever happened to it.

    python tests/helpers/chaos.py --seed 7 --runs 30 --out bench/results/chaos_campaign.json

The same seed draws the same scenarios. tests/test_chaos.py runs a short fixed-seed slice on the test session's Ray.

Modes: data parallel (dp), ZeRO-1 (zero), two tp=2 replicas (tp2), two pp=2 replicas (pp2), one tp=2 × pp=2
replica (tp2xpp2), one shard=2 replica (shard2, FSDP2 and DCP files), DiLoCo (diloco), LoRA and PPO from a base
trained first. Faults: a worker killed, killed inside the gradient all-reduce or hung, as a step begins (those after a
checkpoint step strike while its save is written); a worker killed or hung during an evaluation; the driver
interrupted (Ctrl-C) or the coordinator killed, then a resume; storage refusing a checkpoint's commit; a resize
(`etrain scale`); a reward that turns slow (PPO); and storage faults: the run stopped (Ctrl-C) and its newest
committed checkpoint damaged before the resume, by a drawn part cut short (ckpt_truncate) or a byte of it flipped
(ckpt_bitflip), a crafted pickle put in a drawn part or in a sharded run's DCP metadata with commit.json re-hashed to
match (ckpt_pickle: it would touch a marker file if it ever ran), or a field of commit.json tampered (ckpt_commit).

Invariants, after the run and its resumes: the run ends as its faults allow (every fault but a reward that turns
slow is survived: the run finishes, resumed at most once more than its faults stop it, each time as its driver's
last line says, `--restart-if-corrupt` included; a slow reward fails it, in a line that names the reward); every
step recorded once; the data cursor exact; each step's loss equal to an unfaulted run's of the same mode (bitwise
while the world size is the reference's, within 1e-4 relative once it changed; PPO's rollouts and DiLoCo's inner
steps depend on the split, so only the former); the newest committed checkpoint is the one that loads and verifies;
each driver ended with exit 0, or with one line that names the cause and the way on; no worker, coordinator or
scorer process of the scenario is left behind; no code from storage ran (no marker file); every damaged checkpoint
was named, on the terminal and in a resume record's `skipped`. Run it alone on its Ray: a coordinator killed is the
scenario's own, but a process left behind is any new one.
"""

from __future__ import annotations

import argparse
import json
import os
import posixpath
import random
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from etrain.core import checkpoint  # noqa: E402
from etrain.core.config import Config, load_config, override  # noqa: E402
from etrain.core.records import read_jsonl  # noqa: E402

from helpers.runs import interruptible  # noqa: E402

STEPS, EVERY = 12, 4  # steps of a run; its checkpoint and evaluation cadence
FAST = [  # bounded waits, so a fault ends in seconds; an equal split, so runs compare bitwise
    "timeouts.collective_s=5",
    "timeouts.step_s=15",
    "timeouts.join_s=60",
    "train.deterministic=true",
    f"train.steps={STEPS}",
    f"train.eval_every={EVERY}",
    f"checkpoint.every={EVERY}",
    "cluster.max_recoveries=2",
]
MODES = {
    "dp": ["cluster.num_workers=2", "cluster.warm_pool=1"],
    "zero": ["cluster.num_workers=2", "cluster.warm_pool=1", "comm.zero=true"],
    # 4 workers: a warm pool of a replica (2) where the Ray instance has the CPUs for it (Campaign.pool)
    "tp2": ["cluster.num_workers=4", "parallel.tp=2"],
    "pp2": ["cluster.num_workers=4", "parallel.pp=2", "parallel.microbatches=2"],
    "tp2xpp2": ["cluster.num_workers=4", "parallel.tp=2", "parallel.pp=2", "parallel.microbatches=2"],
    "shard2": ["cluster.num_workers=2", "parallel.shard=2"],
    "diloco": ["cluster.num_workers=2", "cluster.warm_pool=1", "comm.mode=diloco", "comm.diloco.inner_steps=2"],
    "lora": ["cluster.num_workers=2", "cluster.warm_pool=1"],
    "ppo": ["cluster.num_workers=2", "cluster.warm_pool=1", "ppo.rollouts=16", "ppo.response_len=8"],
}
LAYOUTS = ("tp2", "pp2", "tp2xpp2", "shard2")  # a warm pool of a replica where there are CPUs (Campaign.pool)
ONE_REPLICA = ("tp2xpp2", "shard2")  # nowhere to resize to
WORKER_FAULTS = ("kill", "kill_in_allreduce", "hang")  # config faults, as a step begins
EVAL_FAULTS = ("eval_kill", "eval_hang")  # config faults (during: eval), in the evaluation after a step
STORAGE = ("ckpt_truncate", "ckpt_bitflip", "ckpt_pickle", "ckpt_commit")  # the run stopped, its checkpoint damaged
DRIVER_SIDE = ("driver_sigint", "coordinator_kill", "resize", *STORAGE)  # done by this harness at the step
KINDS = WORKER_FAULTS + EVAL_FAULTS + DRIVER_SIDE + ("commit_refused",)
COMMIT_TAMPERING = ({"cursor": -5}, {"step": "STEP"}, {"cursor": 10**18}, {"level": "everything"}, None)  # None: cut
SLOW_REWARD = '''import time

calls = 0


def score(prompt, response):
    """digits, until call CALLS: then slower than any timeout"""
    global calls
    calls += 1
    if calls > CALLS:
        time.sleep(3600)
    return 2 * sum(c.isdigit() for c in response) / max(len(response), 1) - 1
'''


@dataclass
class Scenario:
    seed: int
    index: int
    mode: str
    faults: list[dict]  # each {"kind", "step", "rank"?, "workers"?, "calls"?}

    @property
    def name(self) -> str:
        said = "+".join(f"{f['kind']}@{f['step']}" + (f"r{f['rank']}" if "rank" in f else "") for f in self.faults)
        return f"chaos-{self.seed}-{self.index}-{self.mode}-{said}"


def draw(seed: int, count: int, modes: list[str] | None = None) -> list[Scenario]:
    """`count` scenarios from `seed`: a mode, then one fault, or two at different steps."""
    rng = random.Random(seed)
    out = []
    for index in range(count):
        mode = rng.choice(modes or list(MODES))
        workers = 4 if mode in ("tp2", "pp2", "tp2xpp2") else 2
        kinds = [k for k in KINDS if not (k == "resize" and mode in ONE_REPLICA)]
        kinds += ["slow_reward"] if mode == "ppo" else []
        faults = []
        for step in sorted(rng.sample(range(2, STEPS), rng.choice([1, 1, 2]))):
            kind = rng.choice(kinds)
            fault = {"kind": kind, "step": step}
            if kind in WORKER_FAULTS + EVAL_FAULTS:
                fault["rank"] = rng.randrange(workers)
            if kind in EVAL_FAULTS:
                fault["step"] = EVERY * rng.randrange(1, STEPS // EVERY + 1)
            if kind == "resize":  # in or out by one replica (a replica of a 4-worker mode is 2 workers)
                fault["workers"] = rng.choice([1, 3]) if workers == 2 else 2
            if kind == "slow_reward":
                fault["calls"] = rng.randrange(2, 12)
            if kind in STORAGE:  # after a checkpoint; which part, which damage: drawn now, applied to what is there
                fault["step"] = max(step, EVERY + 1)
                fault["pick"] = rng.randrange(1000)
            faults.append(fault)
        out.append(Scenario(seed, index, mode, faults))
    return out


@dataclass
class Outcome:
    scenario: Scenario
    drivers: list[dict] = field(default_factory=list)  # each: argv, exit code, its last stderr line
    violations: list[str] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def held(self) -> bool:
        return not self.violations


class Campaign:
    """Runs scenarios on the Ray this process is connected to; `workdir` holds their configs and run directories."""

    def __init__(self, workdir: Path, data_dir: str, s3=None, bucket: str | None = None):
        import ray

        self.workdir, self.data_dir, self.s3, self.bucket = workdir, data_dir, s3, bucket
        self.references: dict[str, list[dict]] = {}
        self.base: Path | None = None
        # a replica's worth of ready workers for the 4-worker modes, where there are CPUs for them: a lost rank's
        # replica is then replaced at once, from its twins, within the run's few steps
        self.pool = 2 if ray.cluster_resources().get("CPU", 0) >= 6 else 0

    # -- configs --------------------------------------------------------------------------------------------

    def config(self, scenario: Scenario, faulted: bool = True) -> Config:
        common = [
            f"data.cache_dir={self.data_dir}",
            "data.corpus_bytes=1500000",
            "data.shard_bytes=200000",
            f"run.root={self.workdir / 'runs'}",
            *FAST,
            *MODES[scenario.mode],
            *([f"cluster.warm_pool={self.pool}"] if scenario.mode in LAYOUTS else []),
        ]
        if scenario.mode in ("lora", "ppo"):
            from etrain.core.finetune import finetune_config

            cfg = finetune_config(str(self.base_run()), None, common)
            if scenario.mode == "ppo":
                cfg = override(cfg, {"ppo.reward": self.reward(scenario) if faulted else "digits"})
        else:
            cfg = load_config("tiny", common)
        worker_faults = [
            {"rank": f["rank"], "step": f["step"], "kind": f["kind"].removeprefix("eval_")}
            | ({"during": "eval"} if f["kind"] in EVAL_FAULTS else {})
            for f in scenario.faults
            if faulted and "rank" in f
        ]
        name = scenario.name if faulted else f"reference-{scenario.mode}"
        sets = {"faults": worker_faults, "run.name": name}
        if faulted and any(f["kind"] == "commit_refused" for f in scenario.faults):
            sets["checkpoint.uri"] = f"{self.bucket}/{name}"
        return override(cfg, sets)

    def reward(self, scenario: Scenario) -> str:
        slow = next((f for f in scenario.faults if f["kind"] == "slow_reward"), None)
        if slow is None:
            return "digits"
        path = self.workdir / f"{scenario.name}-reward.py"
        path.write_text(SLOW_REWARD.replace("CALLS", str(slow["calls"])))
        return f"{path}:score"

    def base_run(self) -> Path:
        """The trained model LoRA and PPO scenarios start from (trained once per campaign)."""
        if self.base is None:
            from etrain.driver.job import new_run_dir, train

            cfg = load_config(
                "tiny",
                [
                    f"data.cache_dir={self.data_dir}",
                    "data.corpus_bytes=1500000",
                    "data.shard_bytes=200000",
                    f"run.root={self.workdir / 'runs'}",
                    "run.name=chaos-base",
                    "train.steps=40",
                    "train.deterministic=true",
                    "train.eval_every=0",
                    "checkpoint.every=0",
                ],
            )
            if not (self.workdir / "runs" / "chaos-base" / "summary.json").exists():
                train(cfg, new_run_dir(cfg), progress=False)
            self.base = self.workdir / "runs" / "chaos-base"
        return self.base

    def reference(self, scenario: Scenario) -> list[dict]:
        """The unfaulted run of the scenario's mode: its train records."""
        if scenario.mode not in self.references:
            cfg = self.config(scenario, faulted=False)
            run_dir = Path(cfg.run.root) / cfg.run.name
            if not (run_dir / "summary.json").exists():
                done = self.driver(["train", "--config", str(self.write(cfg))])
                assert done["code"] == 0, f"the {scenario.mode} reference run failed: {done['said']}"
            self.references[scenario.mode] = records(run_dir, "train")
        return self.references[scenario.mode]

    def write(self, cfg: Config) -> Path:
        path = self.workdir / f"{cfg.run.name}.yaml"
        path.write_text(cfg.to_yaml())
        return path

    # -- running ---------------------------------------------------------------------------------------------

    def run(self, scenario: Scenario) -> Outcome:
        """The scenario, resumed as its last line says until it ends (at most twice), then its invariants."""
        started = time.time()
        outcome = Outcome(scenario)
        want = self.reference(scenario)
        before = actor_pids()
        cfg = self.config(scenario)
        run_dir = Path(cfg.run.root) / cfg.run.name
        shutil.rmtree(run_dir, ignore_errors=True)  # a campaign drawn again in the same directory
        argv = ["train", "--config", str(self.write(cfg))]
        self.arm_storage(scenario, cfg)
        marker = self.marker(scenario)
        marker.unlink(missing_ok=True)
        pending = [f for f in scenario.faults if f["kind"] in DRIVER_SIDE]
        for _ in range(2 + len(pending)):  # a resume for each fault that stops the driver, and one more
            done = self.driver(argv, pending, run_dir)
            outcome.drivers.append(done)
            for fault in [
                f for f in scenario.faults if f["kind"] in STORAGE and f not in pending and "damaged" not in f
            ]:
                fault["damaged"] = damage(fault, checkpoint.checkpoint_uri(cfg, run_dir), marker)
            if done["code"] == 2 and "--restart-if-corrupt" in done["said"]:
                argv = ["train", "--resume", str(run_dir), "--restart-if-corrupt"]  # as the line says
            elif done["code"] not in (1, 130) or "--resume" not in done["said"]:
                break  # finished, refused, or a failure that no resume mends
            else:
                argv = ["train", "--resume", str(run_dir)]
        if self.s3 is not None:
            self.s3.reset()
        outcome.violations = check(scenario, run_dir, cfg, outcome.drivers, want, before)
        outcome.violations += check_storage(scenario, run_dir, outcome.drivers, marker)
        outcome.seconds = time.time() - started
        return outcome

    def marker(self, scenario: Scenario) -> Path:
        """The file a crafted pickle's command would touch: it must never exist."""
        return self.workdir / f"{scenario.name}.ran"

    def arm_storage(self, scenario: Scenario, cfg: Config) -> None:
        for f in scenario.faults:
            if f["kind"] == "commit_refused":
                saved = (f["step"] // EVERY) * EVERY or EVERY
                self.s3.fail("PUT", rf"{cfg.run.name}/step-{saved:08d}/commit\.json")

    def driver(self, argv: list[str], pending: list[dict] = (), run_dir: Path | None = None) -> dict:
        """`etrain ARGV` as its own process on this Ray; the scenario's driver-side faults still `pending` done to it
        as it runs (each taken off the list once done)."""
        import ray

        env = {**os.environ, "RAY_ADDRESS": ray.get_runtime_context().gcs_address, "PYTHONPATH": str(ROOT)}
        proc = subprocess.Popen(
            [sys.executable, "-c", "import sys; from etrain.cli import main; sys.exit(main())", *argv, "--no-progress"],
            cwd=ROOT,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            preexec_fn=interruptible,
        )
        deadline = time.time() + 600
        while proc.poll() is None and time.time() < deadline:
            reached = last_step(run_dir) if run_dir else 0
            for f in [f for f in pending if reached >= f["step"]]:
                pending.remove(f)
                act(f, proc, run_dir)
            time.sleep(0.05)
        if proc.poll() is None:
            proc.kill()
        err = proc.communicate()[1]
        lines = [x for x in err.splitlines() if x.startswith("etrain: ")]
        skipped = [x for x in err.splitlines() if x.startswith("warning: skipped checkpoint ")]
        said = lines[-1] if lines else ""
        return {"argv": argv, "code": proc.returncode, "said": said, "lines": len(lines), "skipped": skipped}


def act(fault: dict, driver: subprocess.Popen, run_dir: Path) -> None:
    """A driver-side fault, now: Ctrl-C to the driver (a storage fault's too: its damage waits for the driver's
    end), a SIGKILL to the run's coordinator, or a resize."""
    if fault["kind"] in ("driver_sigint", *STORAGE):
        driver.send_signal(signal.SIGINT)
    elif fault["kind"] == "coordinator_kill":  # the run's own (status.json names its pid)
        os.kill(json.loads((run_dir / "status.json").read_text())["coordinator_pid"], signal.SIGKILL)
    elif fault["kind"] == "resize":
        subprocess.run(
            [sys.executable, "-c", "import sys; from etrain.cli import main; sys.exit(main())", "scale", str(run_dir)]
            + ["--workers", str(fault["workers"])],
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            capture_output=True,
            timeout=60,
        )


def check(
    scenario: Scenario, run_dir: Path, cfg: Config, drivers: list[dict], want: list[dict], before: set
) -> list[str]:
    """The invariants, each broken one in a line."""
    broken = []
    fatal = any(f["kind"] == "slow_reward" for f in scenario.faults)
    last = drivers[-1]
    if not fatal and last["code"] != 0:
        broken.append(f"a survivable run did not finish after {len(drivers)} driver(s): {last['said']!r}")
    if fatal and (last["code"] != 1 or "reward" not in last["said"]):
        broken.append(f"a slow reward did not fail the run naming it: {last['code']} {last['said']!r}")
    for d in drivers:
        if d["code"] != 0 and not (d["said"] and d["lines"] == 1):
            broken.append(f"driver {d['argv'][:2]} exited {d['code']} without one line naming the cause: {d['said']!r}")
        elif d["code"] != 0 and ";" not in d["said"]:  # our lines say "cause; what to do"
            broken.append(f"a failure that names no way on: {d['said']!r}")
    ended = drivers[-1]["code"] == 0
    trained = records(run_dir, "train")
    steps = [r["step"] for r in trained]
    if ended and steps != list(range(1, STEPS + 1)):
        broken.append(f"steps recorded {steps}, not each of 1..{STEPS} once")
    elif steps != sorted(set(steps)) or (steps and steps != list(range(1, len(steps) + 1))):
        broken.append(f"steps recorded {steps}: a step twice, or one missing")
    batch = cfg.ppo.rollouts if scenario.mode == "ppo" else cfg.train.global_batch
    if any(r["cursor"] != batch * r["step"] for r in trained):
        broken.append(f"the cursor is not {batch} samples a step: {[(r['step'], r['cursor']) for r in trained]}")
    broken += compare(scenario, trained, want)
    try:
        uri = checkpoint.checkpoint_uri(cfg, run_dir)
        newest, committed = checkpoint.load_latest(uri), checkpoint.newest_meta(uri)
        if (newest and newest.meta["step"]) != (committed and committed["step"]):
            broken.append(f"the newest committed checkpoint ({committed and committed['step']}) does not verify")
        if ended and (newest is None or newest.meta["step"] != STEPS):
            broken.append(f"the finished run's newest checkpoint is {newest and newest.meta['step']}, not {STEPS}")
    except Exception as e:  # noqa: BLE001 - any failure to load is a broken invariant
        broken.append(f"the newest committed checkpoint does not load: {e}")
    deadline = time.time() + 30
    while (left := actor_pids() - before) and time.time() < deadline:
        time.sleep(0.5)
    if left:
        broken.append(f"processes left behind: {sorted(left)}")
    return broken


def damage(fault: dict, uri: str, marker: Path) -> str | None:
    """The storage fault done to the newest committed checkpoint under `uri` (its part or commit drawn by the fault's
    `pick`); the step directory damaged, or None when there was none yet."""
    import hashlib

    import fsspec

    from helpers.hostile import crafted, in_torch_file

    fs, root = fsspec.core.url_to_fs(uri)
    meta = checkpoint.newest_meta(uri)
    if meta is None:
        return None
    step_dir = posixpath.join(root, f"step-{meta['step']:08d}")
    files, pick = sorted(meta["files"]), fault["pick"]
    commit = posixpath.join(step_dir, checkpoint.COMMIT)
    if fault["kind"] == "ckpt_commit":
        change = COMMIT_TAMPERING[pick % len(COMMIT_TAMPERING)]
        body = fs.cat_file(commit)
        if change is None:
            fs.pipe_file(commit, body[: len(body) // 2])
        else:
            tampered = {k: (str(meta["step"]) if v == "STEP" else v) for k, v in change.items()}
            fs.pipe_file(commit, json.dumps(json.loads(body) | tampered).encode())
        return fs.unstrip_protocol(step_dir)
    name = files[pick % len(files)]
    path = posixpath.join(step_dir, name)
    data = fs.cat_file(path)
    if fault["kind"] == "ckpt_truncate":
        fs.pipe_file(path, data[: len(data) // 2])
    elif fault["kind"] == "ckpt_bitflip":
        at = pick * 7919 % len(data)
        fs.pipe_file(path, data[:at] + bytes([data[at] ^ 0x10]) + data[at + 1 :])
    else:  # ckpt_pickle: a crafted pickle where one is read, its sha256 in the commit to match
        cases = crafted(str(marker))
        body = cases[sorted(cases)[pick % len(cases)]]
        if name.startswith(checkpoint.DCP + "/"):
            name, path = f"{checkpoint.DCP}/.metadata", posixpath.join(step_dir, checkpoint.DCP, ".metadata")
        else:
            body = in_torch_file(body)
        fs.pipe_file(path, body)
        record = json.loads(fs.cat_file(commit))
        record["files"][name] = {"bytes": len(body), "sha256": hashlib.sha256(body).hexdigest()}
        fs.pipe_file(commit, json.dumps(record).encode())
    return fs.unstrip_protocol(step_dir)


def check_storage(scenario: Scenario, run_dir: Path, drivers: list[dict], marker: Path) -> list[str]:
    """No code from storage ran; every damaged checkpoint named on a driver's terminal and in a resume record."""
    broken = [f"a crafted pickle's command ran ({marker} exists)"] if marker.exists() else []
    said = "\n".join(line for d in drivers for line in [*d.get("skipped", []), d["said"]])
    named = {s["path"].rstrip("/") for r in records(run_dir, "resume") for s in r.get("skipped") or []}
    for fault in scenario.faults:
        damaged = fault.get("damaged")
        if fault["kind"] in STORAGE and damaged:
            step_dir = damaged.rstrip("/").rsplit("/", 1)[1]
            if step_dir not in said:
                broken.append(f"{fault['kind']}: the damaged {step_dir} was named on no driver's terminal")
            if damaged.rstrip("/") not in named:
                broken.append(f"{fault['kind']}: the damaged {step_dir} is in no resume record's skipped")
    return broken


def compare(scenario: Scenario, trained: list[dict], want: list[dict]) -> list[str]:
    """Each step's loss against the reference's: bitwise at the reference's world size, else within 1e-4."""
    size = want[0]["world_size"]
    resized = any(r["world_size"] != size for r in trained)
    if scenario.mode in ("ppo", "diloco") and resized:
        # PPO's rollouts are sampled per rank: another split draws other responses; DiLoCo's inner steps are each
        # worker's own: at another world size the workers take other local steps (not float order, another sum)
        return []
    ref = {r["step"]: r.get("loss") for r in want}
    off = []
    for r in trained:
        got, expected = r.get("loss"), ref.get(r["step"])
        if got is None or expected is None:
            continue  # committed by the survivors of a lost worker: no loss recorded
        if (got != expected) if not resized else abs(got - expected) > 1e-4 * abs(expected):
            off.append((r["step"], got, expected))
    return [f"losses differ from the unfaulted run's ({'1e-4' if resized else 'bitwise'}): {off[:3]}"] if off else []


def records(run_dir: Path, kind: str) -> list[dict]:
    return [r for r in read_jsonl(run_dir / "metrics.jsonl") if r["kind"] == kind]


def last_step(run_dir: Path | None) -> int:
    trained = records(run_dir, "train") if run_dir and (run_dir / "metrics.jsonl").exists() else []
    return trained[-1]["step"] if trained else 0


PROCESSES = ("ray::TrainWorker", "ray::Coordinator", "ray::Reference", "ray::Rewarder", "ray::ShardCache")


def actor_pids() -> set[int]:
    """Processes of this application's actors (Ray names an actor's process after its class)."""
    import psutil

    found = set()
    for p in psutil.process_iter(["pid", "cmdline", "status"]):
        cmd = " ".join(p.info["cmdline"] or [])
        if p.info["status"] != psutil.STATUS_ZOMBIE and cmd.startswith(PROCESSES):
            found.add(p.info["pid"])
    return found


def summarize(outcomes: list[Outcome]) -> dict:
    return {
        "runs": len(outcomes),
        "held": sum(o.held for o in outcomes),
        "violations": {o.scenario.name: o.violations for o in outcomes if o.violations},
        "outcomes": [
            {"scenario": asdict(o.scenario), "drivers": o.drivers, "violations": o.violations, "s": round(o.seconds)}
            for o in outcomes
        ],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, default=0, help="draws the scenarios (the same seed, the same ones)")
    parser.add_argument("--runs", type=int, default=20, help="scenarios to run")
    parser.add_argument("--modes", nargs="*", choices=list(MODES), help="only these modes")
    parser.add_argument("--workdir", default="/tmp/etrain-chaos", help="configs and run directories")
    parser.add_argument("--out", default="", help="write the campaign's result here (JSON)")
    args = parser.parse_args()
    import ray
    from moto.server import ThreadedMotoServer
    from tqdm import tqdm

    from etrain.core.ports import free_port

    from helpers.faults import S3Faults

    port = free_port()
    moto = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    moto.start()
    s3 = S3Faults(f"http://127.0.0.1:{port}")
    creds = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}
    os.environ.update({"AWS_ENDPOINT_URL": s3.endpoint, **creds})
    import boto3

    boto3.client("s3", endpoint_url=s3.endpoint).create_bucket(Bucket="chaos")
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    ray.init(address="local", num_cpus=8, include_dashboard=False, logging_level="warning")
    print(f"seed {args.seed}: python tests/helpers/chaos.py --seed {args.seed} --runs {args.runs} draws these again")
    campaign = Campaign(workdir, str(workdir / "data"), s3, "s3://chaos")
    outcomes = []
    try:
        for scenario in tqdm(draw(args.seed, args.runs, args.modes), desc="scenarios", unit="run"):
            outcomes.append(outcome := campaign.run(scenario))
            print(f"{scenario.name}: {'held' if outcome.held else outcome.violations} ({outcome.seconds:.0f} s)")
    finally:
        report = summarize(outcomes)
        print(json.dumps({k: report[k] for k in ("runs", "held", "violations")}, indent=1))
        if args.out:
            Path(args.out).write_text(json.dumps({"seed": args.seed, **report}, indent=1) + "\n")
        ray.shutdown()
        s3.close()
        moto.stop()


if __name__ == "__main__":
    main()
