"""Checkpoint write and read: flax_loop against orbax-checkpoint and flax msgpack.

    python benchmarks/checkpoint_io.py [--gib 1.0] [--json benchmarks/results/checkpoint_io.json]

A training state of `--gib` GiB (parameters plus Adam's two moments, float32,
as JAX arrays) is written and read back by each method, each in a fresh
process so its peak memory is its own:

- flax_loop `CheckpointFileWriter` (fsync, checksums), in the foreground and
  in the background (`background=True`);
- orbax-checkpoint's `CheckpointManager` with asynchronous saving;
- `flax.serialization.msgpack_serialize` of the state dict, written to a file.

Columns: write and read throughput (MB/s of state), the stall (seconds the
training loop waits before it may go on: the whole write in the foreground,
the call's return in the background), the host copy time of the state (the
floor for a background stall), and the peak host memory beyond the state
itself, as a multiple of the state's size.
"""

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

METHODS = ["flax_loop", "flax_loop background", "orbax async", "flax msgpack"]


def peak_rss_bytes():
    """This process's resident-memory high-water mark (VmHWM: unlike ru_maxrss,
    it is not inherited from the parent across exec)."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def child(method, directory, gib):
    os.environ["JAX_PLATFORMS"] = "cpu"
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import jax
    import numpy as np
    import optax
    import psutil

    n_leaves = 8
    per_leaf = int(gib * 2**30 / 4 / 3 / n_leaves)
    rng = np.random.default_rng(0)
    params = {}
    for i in range(n_leaves):
        host = rng.random(per_leaf, dtype=np.float32)
        params[f"layer{i}"] = jax.device_put(host)
        del host
    optimizer_state = optax.adam(1e-3).init(params)
    optimizer_state = jax.tree.map(lambda x: x + 1.0 if x.ndim else x, optimizer_state)
    jax.block_until_ready((params, optimizer_state))
    state_bytes = sum(x.nbytes for x in jax.tree.leaves((params, optimizer_state)))
    process = psutil.Process()
    before = process.memory_info().rss

    result = {"method": method, "state_bytes": state_bytes}
    if method.startswith("flax_loop"):
        from flax_loop import Checkpoint, CheckpointFileReader, CheckpointFileWriter

        checkpoint = Checkpoint(params, {}, optimizer_state, {}, 0.0, 1, 0.0, 1)
        writer = CheckpointFileWriter(
            output_dir=directory, background=method.endswith("background")
        )
        started = time.perf_counter()
        writer(checkpoint)
        stall = time.perf_counter() - started
        writer.close()
        written = time.perf_counter() - started
        peak_write = peak_rss_bytes()
        started = time.perf_counter()
        raw = CheckpointFileReader(dir=directory, target=None).read(None)
        read = time.perf_counter() - started
        assert np.array_equal(raw["model_params"]["layer3"], np.asarray(params["layer3"]))
    elif method == "orbax async":
        import orbax.checkpoint as ocp

        manager = ocp.CheckpointManager(
            directory,
            options=ocp.CheckpointManagerOptions(max_to_keep=1, enable_async_checkpointing=True),
        )
        state = {"params": params, "optimizer": optimizer_state}
        started = time.perf_counter()
        manager.save(1, args=ocp.args.StandardSave(state))
        stall = time.perf_counter() - started
        manager.wait_until_finished()
        written = time.perf_counter() - started
        peak_write = peak_rss_bytes()
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, state)
        started = time.perf_counter()
        restored = manager.restore(1, args=ocp.args.StandardRestore(abstract))
        jax.block_until_ready(restored)
        read = time.perf_counter() - started
        assert np.array_equal(
            np.asarray(restored["params"]["layer3"]), np.asarray(params["layer3"])
        )
        manager.close()
    else:
        from flax import serialization

        path = os.path.join(directory, "state.msgpack")
        started = time.perf_counter()
        data = serialization.msgpack_serialize(
            serialization.to_state_dict({"params": params, "optimizer": optimizer_state})
        )
        with open(path, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        del data
        written = stall = time.perf_counter() - started
        peak_write = peak_rss_bytes()
        started = time.perf_counter()
        with open(path, "rb") as handle:
            restored = serialization.msgpack_restore(handle.read())
        read = time.perf_counter() - started
        assert np.array_equal(restored["params"]["layer3"], np.asarray(params["layer3"]))
    # Measured last: a host copy of the whole state would raise the peak.
    started = time.perf_counter()
    host_copy = jax.tree.map(np.array, (params, optimizer_state))
    host_copy_seconds = time.perf_counter() - started
    del host_copy
    result.update(
        host_copy_seconds=host_copy_seconds,
        write_seconds=written,
        stall_seconds=stall,
        read_seconds=read,
        extra_write_memory=(peak_write - before) / state_bytes,
    )
    print("RESULT " + json.dumps(result), flush=True)


def run_child(method, gib):
    directory = tempfile.mkdtemp(prefix="ckpt-bench-", dir=os.environ.get("BENCH_DIR"))
    try:
        output = subprocess.run(
            [sys.executable, __file__, "--child", method, "--dir", directory, "--gib", str(gib)],
            capture_output=True,
            text=True,
            timeout=600,
        )
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    lines = [line for line in output.stdout.splitlines() if line.startswith("RESULT ")]
    if output.returncode or not lines:
        print(f"{method} failed:\n{output.stdout[-2000:]}{output.stderr[-2000:]}")
        return None
    return json.loads(lines[0][len("RESULT ") :])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--json", default=os.path.join("benchmarks", "results", "checkpoint_io.json")
    )
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--dir", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.dir, args.gib)
        return
    print(
        f"state of {args.gib:.2f} GiB (params + Adam moments, float32), {os.cpu_count()} cores; "
        f"medians of {args.repeats} rounds, methods in turn"
    )
    runs: dict[str, list[dict]] = {method: [] for method in METHODS}
    for round_ in range(args.repeats):
        order = METHODS[round_ % len(METHODS) :] + METHODS[: round_ % len(METHODS)]
        for method in order:
            row = run_child(method, args.gib)
            if row is not None:
                runs[method].append(row)
    print(
        f"{'method':<22}{'write MB/s':>11}{'read MB/s':>11}{'stall s':>9}{'host copy s':>13}{'extra memory':>14}"
    )
    rows = []
    for method, results in runs.items():
        if not results:
            continue
        row = {"method": method, "state_bytes": results[0]["state_bytes"], "rounds": results}
        megabytes = row["state_bytes"] / 1e6
        for key in (
            "write_seconds",
            "read_seconds",
            "stall_seconds",
            "host_copy_seconds",
            "extra_write_memory",
        ):
            row[key] = statistics.median(result[key] for result in results)
        row["write_mb_per_second"] = megabytes / row["write_seconds"]
        row["read_mb_per_second"] = megabytes / row["read_seconds"]
        rows.append(row)
        print(
            f"{method:<22}{row['write_mb_per_second']:>11,.0f}{row['read_mb_per_second']:>11,.0f}"
            f"{row['stall_seconds']:>9.3f}{row['host_copy_seconds']:>13.3f}{row['extra_write_memory']:>13.2f}x"
        )
    os.makedirs(os.path.dirname(args.json), exist_ok=True)
    with open(args.json, "w") as handle:
        json.dump({"gib": args.gib, "rows": rows}, handle, indent=2)
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
