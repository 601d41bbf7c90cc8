"""TrainLoop against a hand-written loop: same model, data and devices, one process.

    python benchmarks/loop_overhead.py [--quick] [--json results/loop_overhead.json]
    python benchmarks/loop_overhead.py --anatomy [--rounds 9]   # the small MLP's step taken apart
    python benchmarks/loop_overhead.py --only mlp-64-32-10 --processes 5   # medians over processes

For each workload and device count the script alternates a hand-written
loop and a TrainLoop run of the same steps, three times, and reports the
median steps per second of each and their ratio (TrainLoop / hand-written;
1.00 means no overhead). The hand-written loop is the fastest plain one: numpy
batches passed straight into `jax.jit` on one device, `jax.jit(jax.shard_map)`
with `pmean` on several, its dispatch bounded as the TrainLoop bounds its own
(`flax_loop.parallel.CPU_COLLECTIVE_DISPATCH_DEPTH`). Peak host memory of each (resident set growth over the run) is
reported too.

On this 2-core machine the same code's ratio moves by up to +-10% from one
process to the next (the small MLP's 32 steps per dispatch: 0.87 in one
process, 0.98 in the next), more than between the rounds of one process;
`--processes N` runs the measurement in N fresh processes and reports the
median of their ratios and their range.
"""

import argparse
import json
import os
import sys

N_DEVICES = 4
os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={N_DEVICES}"
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import itertools  # noqa: E402
import resource  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from collections import deque  # noqa: E402

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from harness import make_batches, timed_loop  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec  # noqa: E402

from flax_loop import TrainLoop, TrainTask  # noqa: E402
from flax_loop.parallel import Placement  # noqa: E402


class MLP(nn.Module):
    widths: tuple[int, ...]

    @nn.compact
    def __call__(self, x, train: bool = True):
        for width in self.widths[:-1]:
            x = nn.relu(nn.Dense(width)(x))
        return nn.Dense(self.widths[-1])(x)


class CNN(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool = True):
        for features in (32, 64):
            x = nn.Conv(features, (3, 3))(x)
            x = nn.BatchNorm(use_running_average=not train, momentum=0.9)(x)
            x = nn.max_pool(nn.relu(x), (2, 2), (2, 2))
        x = nn.relu(nn.Dense(128)(x.reshape(x.shape[0], -1)))
        x = nn.Dropout(0.5, deterministic=not train)(x)
        return nn.Dense(10)(x)


def cross_entropy(logits, labels):
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


WORKLOADS = {
    "mlp-784-512-512-10": dict(
        model=MLP((512, 512, 10)), shape=(784,), batch=128, steps=400, devices=(1, 2, 4), rngs=[]
    ),
    "cnn-bn-dropout": dict(
        model=CNN(), shape=(28, 28, 1), batch=64, steps=40, devices=(1, 4), rngs=["dropout"]
    ),
    "mlp-64-32-10": dict(
        model=MLP((32, 10)), shape=(64,), batch=32, steps=6400, devices=(1,), rngs=[]
    ),
}


def hand_written(model, optimizer, batches, n_devices, rngs, depth, source=None):
    """A plain training loop; returns run(n_steps) -> seconds. It cycles
    `batches`, or reads `source` (an iterator) when given one."""
    devices = jax.devices()[:n_devices]
    x0, _ = batches[0]
    variables = model.init({"params": jax.random.key(0), "dropout": jax.random.key(1)}, x0)
    params = variables.pop("params")
    state = (params, dict(variables), optimizer.init(params), jnp.zeros((), jnp.int32))
    key = jax.random.key(2)

    def update(state, x, y, key):
        params, model_state, opt_state, step = state
        step = step + 1
        keys = {name: jax.random.fold_in(jax.random.fold_in(key, step), 0) for name in rngs}
        if n_devices > 1:
            keys = {n: jax.random.fold_in(k, jax.lax.axis_index("data")) for n, k in keys.items()}

        def loss_fn(params):
            logits, new_state = model.apply(
                {"params": params, **model_state}, x, rngs=keys, mutable=list(model_state)
            )
            return cross_entropy(logits, y), new_state

        (loss, new_state), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
        if n_devices > 1:
            loss, grads, new_state = jax.lax.pmean((loss, grads, new_state), "data")
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), new_state, opt_state, step), loss

    if n_devices > 1:
        mesh = Mesh(np.array(devices), ("data",))
        replicated = NamedSharding(mesh, PartitionSpec())
        state = jax.device_put(state, replicated)
        key = jax.device_put(key, replicated)
        update = jax.shard_map(
            update,
            mesh=mesh,
            in_specs=(
                PartitionSpec(),
                PartitionSpec("data"),
                PartitionSpec("data"),
                PartitionSpec(),
            ),
            out_specs=(PartitionSpec(), PartitionSpec()),
            check_vma=False,
        )
    else:
        state = jax.device_put(state, devices[0])
        key = jax.device_put(key, devices[0])
    step = jax.jit(update, donate_argnums=0)
    holder = {"state": state}
    holder["state"], loss = step(holder["state"], *batches[0], key)  # compile
    loss.block_until_ready()

    def run(n_steps):
        stream = itertools.cycle(batches) if source is None else source
        in_flight = deque()
        started = time.perf_counter()
        state = holder["state"]
        for _ in range(n_steps):
            x, y = next(stream)
            state, loss = step(state, x, y, key)
            in_flight.append(loss)
            if len(in_flight) > depth:
                in_flight.popleft().block_until_ready()
        loss.block_until_ready()
        holder["state"] = state
        return time.perf_counter() - started

    return run


def managed(model, optimizer, batches, n_devices, rngs, steps_per_dispatch=1):
    loop = TrainLoop(
        init=model.init,
        task=TrainTask(model.apply, optimizer, cross_entropy, itertools.cycle(batches)),
        rnkey=jax.random.key(0),
        collections={"init": ["params", "dropout"], "apply": rngs},
        devices=jax.devices()[:n_devices],
        n_steps_per_checkpoint=10**9,  # one checkpoint per run: at its end
        stdout=False,
        **({"steps_per_dispatch": steps_per_dispatch} if steps_per_dispatch > 1 else {}),
    )

    return timed_loop(loop)


def hand_written_scan(model, optimizer, batches, steps_per_call, stack=True):
    """A jitted lax.scan of `steps_per_call` steps a call.

    With `stack`, each call stacks the next `steps_per_call` batches of the
    stream first, as any loop over a stream of batches must; without, the
    groups are stacked before the clock starts (a ceiling no stream reaches:
    the copy of a group into one array is never timed).
    """
    x0, _ = batches[0]
    params = model.init(jax.random.key(0), x0)["params"]

    def update(state, xy):
        params, opt_state = state
        x, y = xy
        loss, grads = jax.value_and_grad(lambda p: cross_entropy(model.apply({"params": p}, x), y))(
            params
        )
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), loss

    many = jax.jit(lambda state, xs, ys: jax.lax.scan(update, state, (xs, ys)), donate_argnums=0)

    def group_of(stream):  # the fastest plain stacking: one concatenate per leaf
        group = [next(stream) for _ in range(steps_per_call)]
        return tuple(
            np.concatenate([batch[k] for batch in group]).reshape(
                steps_per_call, *group[0][k].shape
            )
            for k in (0, 1)
        )

    stacked = itertools.cycle(batches)
    groups = [group_of(stacked) for _ in range(max(len(batches) // steps_per_call, 1))]
    holder = {"state": (params, optimizer.init(params))}
    holder["state"], losses = many(holder["state"], *groups[0])
    losses.block_until_ready()

    def run(n_steps):
        source = itertools.cycle(batches)
        stream = (
            map(lambda _: group_of(source), itertools.count()) if stack else itertools.cycle(groups)
        )
        started = time.perf_counter()
        state = holder["state"]
        for _ in range(n_steps // steps_per_call):
            state, losses = many(state, *next(stream))
        losses.block_until_ready()
        holder["state"] = state
        return time.perf_counter() - started

    return run


def anatomy(rounds, n_steps=3200):
    """Where the small MLP's per-step time goes: the hand-written loop, the
    TrainLoop's compiled step called bare (the hand-written loop's queue and
    batches), that with the feed's `take`, that plus 1.6 us of busy waiting
    instead of `take`, and the whole TrainLoop; each as steps per second,
    its paired ratio to the hand-written loop, and the process's CPU time per
    step (all threads). Uses the loop's internals: a diagnosis, not an API."""
    spec = WORKLOADS["mlp-64-32-10"]
    batches = make_batches(spec["shape"], spec["batch"])
    optimizer = optax.adam(1e-3)
    depth = Placement(jax.devices()[:1]).dispatch_depth
    hand = hand_written(spec["model"], optimizer, batches, 1, [], depth)
    loop = TrainLoop(
        init=spec["model"].init,
        task=TrainTask(spec["model"].apply, optimizer, cross_entropy, itertools.cycle(batches)),
        rnkey=jax.random.key(0),
        devices=jax.devices()[:1],
        n_steps_per_checkpoint=10**9,
        stdout=False,
    )
    whole = timed_loop(loop)
    whole(64)  # past the feed's first reads (it decides to read inline)
    runner = loop._runner  # the set-up run's parts (flax_loop.run.runner)
    one, key, feed = loop.compiled.programs["one"], runner.train_key, runner.feed
    plain = [((x,), (y,)) for x, y in batches]

    def busy():
        until = time.perf_counter() + 1.6e-6
        while time.perf_counter() < until:
            pass

    def bare(read):
        def run(n):
            state, queue = runner.state, deque()
            stream = itertools.cycle(plain)
            started = time.perf_counter()
            for _ in range(n):
                if read == "take":
                    batch = feed.take(1, 10**9, False, 1)[0]
                else:
                    batch = next(stream)
                    if read == "busy":
                        busy()
                state, loss = one(state, batch, key)
                queue.append(loss)
                if len(queue) > depth:
                    queue.popleft().block_until_ready()
            loss.block_until_ready()
            runner.state = state
            return time.perf_counter() - started

        return run

    runs = {
        "hand-written": hand,
        "compiled step, bare": bare(None),
        "  + the feed's take": bare("take"),
        "  + 1.6 us busy instead": bare("busy"),
        "TrainLoop": whole,
    }
    times = {name: [] for name in runs}
    cpu = {name: [] for name in runs}
    for _ in range(rounds):
        for name, run in runs.items():
            before = time.process_time()
            times[name].append(run(n_steps))
            cpu[name].append(time.process_time() - before)
    ratios = paired_ratios(times, "hand-written")
    print(f"mlp-64-32-10, 1 device, {rounds} rounds of {n_steps} steps; medians")
    print(f"{'':<26}{'us/step':>9}{'ratio':>7}{'CPU us/step':>13}")
    for name in runs:
        wall = statistics.median(times[name]) / n_steps * 1e6
        used = statistics.median(cpu[name]) / n_steps * 1e6
        print(f"{name:<26}{wall:>9.1f}{ratios[name]:>7.2f}{used:>13.1f}")


def memory_child(variant):
    """Runs one variant alone; prints its peak resident memory."""
    spec = WORKLOADS["mlp-784-512-512-10"]
    batches = make_batches(spec["shape"], spec["batch"])
    optimizer = optax.adam(1e-3)
    if variant == "hand-written":
        run = hand_written(
            spec["model"], optimizer, batches, 1, [], Placement(jax.devices()[:1]).dispatch_depth
        )
    else:
        run = managed(spec["model"], optimizer, batches, 1, [])
    run(300)
    print(f"PEAK {peak_rss_mib():.1f}", flush=True)


def memory_rows():
    import subprocess

    peaks = {}
    for variant in ("hand-written", "TrainLoop"):
        values = []
        for _ in range(3):
            output = subprocess.run(
                [sys.executable, __file__, "--memory-child", variant],
                capture_output=True,
                text=True,
                timeout=600,
            ).stdout
            values.append(float(output.split("PEAK ")[1]))
        peaks[variant] = statistics.median(values)
    return peaks


def over_processes(args):
    """Runs the measurement in `args.processes` fresh processes, one after the
    other; prints and writes each row's median ratio over them and its range."""
    import subprocess
    import tempfile

    runs = []
    for index in range(args.processes):
        with tempfile.TemporaryDirectory() as directory:
            path = os.path.join(directory, "rows.json")
            command = [sys.executable, __file__, "--rounds", str(args.rounds), "--json", path]
            command += ["--only", args.only] if args.only else []
            command += ["--quick"] if args.quick else []
            command += ["--skip-memory"]
            subprocess.run(command, check=True, timeout=3600, stdout=subprocess.DEVNULL)
            with open(path) as handle:
                runs.append(json.load(handle)["rows"])
        print(f"process {index + 1} of {args.processes} done", flush=True)
    rows = []
    print(f"medians over {args.processes} processes of {args.rounds} rounds each; [range]")
    for at, first in enumerate(runs[0]):
        row = dict(first)
        for field in ("ratio", "ratio_to_prestacked", "stream_scan_to_prestacked"):
            if field in first:
                values = [run[at][field] for run in runs]
                row[field] = statistics.median(values)
                row[f"{field}_per_process"] = values
        rows.append(row)
        extra = ""
        if "ratio_to_prestacked" in row:
            values = row["ratio_to_prestacked_per_process"]
            stream = row["stream_scan_to_prestacked_per_process"]
            extra = (
                f"  (/ pre-stacked: {row['ratio_to_prestacked']:.2f} "
                f"[{min(values):.2f}-{max(values):.2f}]; the hand-written scan / pre-stacked: "
                f"{row['stream_scan_to_prestacked']:.2f} [{min(stream):.2f}-{max(stream):.2f}])"
            )
        values = row["ratio_per_process"]
        print(
            f"{row['workload']:<20}{row['devices']:>3}  {row['variant']:<45}"
            f"{row['ratio']:>6.2f} [{min(values):.2f}-{max(values):.2f}]{extra}"
        )
    os.makedirs(os.path.dirname(args.json), exist_ok=True)
    with open(args.json, "w") as handle:
        json.dump(
            {
                "jax": jax.__version__,
                "processes": args.processes,
                "repeats": args.rounds,
                "rows": rows,
            },
            handle,
            indent=2,
        )
    print(f"wrote {args.json}")


def peak_rss_mib():
    """This process's resident-memory high-water mark (VmHWM: unlike ru_maxrss,
    it is not inherited from the parent across exec)."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def measure(runs, n_steps, repeats):
    """Alternates the runs `repeats` times.

    Returns each run's median steps per second and, for each run, the median
    of its per-round ratio to the first run (paired rounds cancel much of this
    2-core machine's drift, which moves single timings by +-15%).
    """
    for run in runs.values():
        run(max(n_steps // 10, 2))  # warm up
    times = {name: [] for name in runs}
    for _ in range(repeats):
        for name, run in runs.items():
            times[name].append(run(n_steps))
    rates = {name: n_steps / statistics.median(values) for name, values in times.items()}
    return rates, paired_ratios(times, next(iter(times))), times


def paired_ratios(times, base):
    """Each run's median over rounds of its speed relative to `base`'s."""
    return {
        name: statistics.median(b / t for b, t in zip(times[base], values))
        for name, values in times.items()
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps, one repeat")
    parser.add_argument(
        "--json", default=None, help="default: benchmarks/results/loop_overhead[.WORKLOAD].json"
    )
    parser.add_argument("--only", default=None, help="run one workload")
    parser.add_argument("--rounds", type=int, default=7, help="rounds per workload (default 7)")
    parser.add_argument(
        "--processes", type=int, default=1, help="run in N fresh processes; medians of their ratios"
    )
    parser.add_argument("--skip-memory", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--memory-child", default=None, help=argparse.SUPPRESS)
    parser.add_argument(
        "--anatomy", action="store_true", help="where the small MLP's per-step time goes"
    )
    args = parser.parse_args()
    if args.anatomy:
        anatomy(args.rounds)
        return
    if args.json is None:
        suffix = f".{args.only}" if args.only else ""
        args.json = os.path.join("benchmarks", "results", f"loop_overhead{suffix}.json")
    if args.memory_child:
        memory_child(args.memory_child)
        return
    if args.processes > 1:
        over_processes(args)
        return
    repeats = 1 if args.quick else args.rounds
    rows = []
    print(
        f"JAX {jax.__version__}, {os.cpu_count()} cores, {N_DEVICES} forced CPU devices; medians of {repeats} rounds; ratio = median of per-round ratios"
    )
    header = f"{'workload':<22}{'devices':>8}{'hand-written':>14}{'TrainLoop':>11}{'ratio':>7}  peak RSS MiB"
    print(header)
    for name, spec in WORKLOADS.items():
        if args.only and name != args.only:
            continue
        batches = make_batches(spec["shape"], spec["batch"])
        n_steps = spec["steps"] // (5 if args.quick else 1)
        for n_devices in spec["devices"]:
            depth = Placement(jax.devices()[:n_devices]).dispatch_depth
            optimizer = optax.adam(1e-3)
            runs = {
                "hand-written": hand_written(
                    spec["model"], optimizer, batches, n_devices, spec["rngs"], depth
                ),
                "TrainLoop": managed(spec["model"], optimizer, batches, n_devices, spec["rngs"]),
            }
            if name == "mlp-64-32-10":
                runs["TrainLoop, 32 steps per dispatch"] = managed(
                    spec["model"],
                    optimizer,
                    batches,
                    n_devices,
                    spec["rngs"],
                    steps_per_dispatch=32,
                )
                runs["hand-written scan, 32 per call"] = hand_written_scan(
                    spec["model"], optimizer, batches, 32
                )
                runs["  (its groups stacked before timing)"] = hand_written_scan(
                    spec["model"], optimizer, batches, 32, stack=False
                )
            rates, ratios, times = measure(runs, n_steps, repeats)
            base = rates["hand-written"]
            for variant, rate in rates.items():
                if variant == "hand-written":
                    continue
                row = dict(
                    workload=name,
                    devices=n_devices,
                    variant=variant,
                    hand_written_steps_per_second=base,
                    steps_per_second=rate,
                    ratio=ratios[variant],
                    peak_rss_mib=peak_rss_mib(),
                )
                rows.append(row)
                label = name if variant == "TrainLoop" else f"  {variant}"
                print(
                    f"{label:<22}{n_devices:>8}{base:>14,.1f}{rate:>11,.1f}{ratios[variant]:>7.2f}  {row['peak_rss_mib']:,.0f}"
                )
            if name == "mlp-64-32-10":
                scan = paired_ratios(times, "hand-written scan, 32 per call")
                ceiling = paired_ratios(times, "  (its groups stacked before timing)")
                variant = "TrainLoop, 32 steps per dispatch"
                rows.append(
                    dict(
                        workload=name,
                        devices=n_devices,
                        variant="32 steps per dispatch vs hand-written scan",
                        ratio=scan[variant],
                        ratio_to_prestacked=ceiling[variant],
                        # the plain loop over the stream against the same ceiling
                        stream_scan_to_prestacked=ceiling["hand-written scan, 32 per call"],
                    )
                )
                print(
                    f"  TrainLoop 32 per dispatch / hand-written scan: {scan[variant]:.2f} "
                    f"(/ the scan of pre-stacked groups: {ceiling[variant]:.2f}; the "
                    f"hand-written scan / that: {ceiling['hand-written scan, 32 per call']:.2f})"
                )
    memory = None
    if not args.skip_memory and (not args.only or args.only == "mlp-784-512-512-10"):
        memory = memory_rows()
        print(
            f"peak host memory, mlp-784-512-512-10 on 1 device, each alone (median of 3 processes): "
            f"hand-written {memory['hand-written']:,.0f} MiB, TrainLoop {memory['TrainLoop']:,.0f} MiB "
            f"({memory['TrainLoop'] / memory['hand-written']:.2f}x)"
        )
    os.makedirs(os.path.dirname(args.json), exist_ok=True)
    with open(args.json, "w") as handle:
        json.dump(
            {"jax": jax.__version__, "repeats": repeats, "rows": rows, "peak_memory_mib": memory},
            handle,
            indent=2,
        )
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
