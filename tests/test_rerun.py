"""A re-run in one process (a notebook cell run again) compiles nothing: a
second `TrainLoop` of the same model, task functions, shapes and devices
takes the first's programs and computes the same bits; a changed model,
loss, optimizer, shape or device set compiles anew."""

import json
import os
import subprocess
import sys
import textwrap

from tests.flags import xla_flags
from tests.helpers import ROOT

PROGRAM = textwrap.dedent(
    """
    import json, os
    os.environ["JAX_ENABLE_COMPILATION_CACHE"] = "false"  # JAX's own cache: off
    import jax, numpy as np, optax, flax.linen as nn
    from flax_loop import TrainLoop, TrainTask

    compiles = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda name, duration, **kwargs: compiles.append(name)
        if name == "/jax/core/compile/backend_compile_duration" else None
    )

    traced = []  # the model's calls: each is a trace (init, step, shapes)

    class MLP(nn.Module):
        width: int = 32
        @nn.compact
        def __call__(self, x):
            traced.append(x.shape)
            return nn.Dense(10)(nn.relu(nn.Dense(self.width)(x)))

    def cross_entropy(logits, labels):
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

    def squared(logits, labels):
        return ((logits - jax.nn.one_hot(labels, 10)) ** 2).mean()

    rng = np.random.default_rng(0)
    data = [(rng.normal(size=(32, 16)).astype(np.float32), rng.integers(0, 10, 32)) for _ in range(8)]
    model, adam = MLP(), optax.adam(1e-2)

    def run(model=model, optimizer=adam, loss=cross_entropy, batch=32, devices=1):
        before, traced_before = len(compiles), len(traced)
        loop = TrainLoop(
            init=model.init,
            task=TrainTask(model.apply, optimizer, loss, [(x[:batch], y[:batch]) for x, y in data]),
            rnkey=jax.random.key(0), n_steps=12, n_steps_per_checkpoint=6,
            devices=jax.devices()[:devices], stdout=False,
        )
        *_, last = loop
        loop.compiled.wait()
        params = [np.asarray(leaf).tolist() for leaf in jax.tree.leaves(last.model_params)]
        run.traced = len(traced) - traced_before
        return len(compiles) - before, params

    first, params = run()
    again, params_again = run()
    report = {
        "first": first, "again": again, "same": params_again == params, "traced_again": run.traced,
        "other_model": run(model=MLP(width=48))[0],
        "other_loss": run(loss=squared)[0],
        "other_optimizer": run(optimizer=optax.sgd(0.1))[0],
        "other_shape": run(batch=16)[0],
        "other_devices": run(devices=2)[0],
        "same_model_anew": run(model=MLP())[0],
    }
    print("REPORT", json.dumps(report))
    """
)


def test_a_rerun_compiles_nothing_and_a_changed_task_compiles_anew():
    result = subprocess.run(
        [sys.executable, "-c", PROGRAM],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "XLA_FLAGS": xla_flags(4)},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.split("REPORT", 1)[1])
    assert report["first"] >= 3  # the init, the step's variants, the copy
    assert report["again"] == 0 and report["same"]
    assert report["traced_again"] == 0  # nor traced: the init's shapes are known too
    for changed in ("other_model", "other_loss", "other_optimizer", "other_shape", "other_devices"):
        assert report[changed] >= 2, (changed, report)
    # a new module of the same class is another object: its programs compile anew
    assert report["same_model_anew"] >= 2, report


def test_a_cell_run_again_with_its_objects_rebuilt_takes_its_programs_from_the_cache():
    """A notebook cell run again builds its model, optimizer and loss anew:
    the process's cache (by identity) misses, and every program it compiles
    comes from the persistent compilation cache instead (the seconds:
    benchmarks/rerun.py), computing the same bits."""
    import flax.linen as nn
    import jax
    import numpy as np
    import optax

    from flax_loop import TrainLoop, TrainTask

    events = {"hits": 0, "compiles": 0, "on": False}

    def heard(name, **kwargs):
        if events["on"] and name == "/jax/compilation_cache/cache_hits":
            events["hits"] += 1

    def timed(name, duration, **kwargs):
        if events["on"] and name == "/jax/core/compile/backend_compile_duration":
            events["compiles"] += 1

    jax.monitoring.register_event_listener(heard)
    jax.monitoring.register_event_duration_secs_listener(timed)
    rng = np.random.default_rng(0)
    data = [
        (rng.normal(size=(32, 16)).astype(np.float32), rng.integers(0, 10, 32)) for _ in range(4)
    ]

    def cell():
        class Net(nn.Module):  # the cell's code, run again: new objects throughout
            @nn.compact
            def __call__(self, x):
                return nn.Dense(10)(nn.relu(nn.Dense(24)(x)))

        def loss(logits, labels):
            return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

        net = Net()
        loop = TrainLoop(
            init=net.init, task=TrainTask(net.apply, optax.adam(1e-2), loss, data),
            rnkey=jax.random.key(0), n_steps=8, n_steps_per_checkpoint=4,
            devices=jax.devices()[:1], stdout=False,
        )  # fmt: skip
        *_, last = loop
        loop.compiled.wait()
        return jax.device_get(last.model_params)

    first = cell()
    events["on"] = True
    again = cell()
    events["on"] = False
    assert events["compiles"] >= 3 and events["hits"] == events["compiles"], events
    for a, b in zip(jax.tree.leaves(first), jax.tree.leaves(again)):
        np.testing.assert_array_equal(a, b)


def test_a_rerun_with_a_carry_of_another_shape_carries_that_shape(tmp_path):
    # The same model, optimizer and loss, so the same step's key: the shapes
    # of the step's fields a first set-up found are kept for a re-run, and a
    # carry of another shape must not find them.
    import flax.linen as nn
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    from flax_loop import CheckpointFileReader, CheckpointFileWriter, TrainLoop, TrainTask

    model, optimizer = nn.Dense(3), optax.sgd(0.1)
    data = [(np.ones((4, 2), np.float32), np.zeros((4, 3), np.float32))] * 3

    def counting(model, batch, *, rng, step, carry):
        inputs, targets = batch
        return ((model(inputs) - targets) ** 2).mean(), {}, {"seen": carry["seen"] + 1}

    def carried(size, n_steps=3, init=model.init, write=None):
        task = TrainTask(
            model.apply, optimizer, compute_loss=counting, data=data,
            carry={"seen": jnp.zeros((size,), jnp.int32)},
        )  # fmt: skip
        loop = TrainLoop(
            init=init, task=task, rnkey=jax.random.key(0), n_steps=n_steps,
            n_steps_per_checkpoint=3, devices=jax.devices()[:1], stdout=False,
        )  # fmt: skip
        checkpoint = loop.next_checkpoint()
        if write is not None:
            write(checkpoint)
        return np.asarray(checkpoint.carry["seen"]).tolist()

    assert carried(2) == [3, 3]
    with CheckpointFileWriter(output_dir=str(tmp_path)) as write:
        assert carried(5, write=write) == [3] * 5
    # resumed: the file's carry is restored into the shapes of this run's
    reader = CheckpointFileReader(dir=str(tmp_path), target=model.init)
    assert carried(5, n_steps=6, init=reader) == [6] * 5


def test_a_rerun_finds_every_program_at_set_up_and_starts_no_compiling_thread():
    """A re-run's programs are all in the process's cache: set-up takes them
    there, on the caller's thread, instead of handing them to a compiling
    thread (which the caller's next steps would share the interpreter with)."""
    import threading

    loop = small_mlp_loops(4)

    def compiling_threads():
        return {t for t in threading.enumerate() if t.name.startswith("flax_loop-compile")}

    first = loop()
    assert "compiling" in first.compiled.status().values() or compiling_threads()
    first.compiled.wait()
    before = compiling_threads()
    again = loop()
    assert compiling_threads() <= before  # none started
    status = again.compiled.status()
    assert status["last"] == status["one"] == status["copy"] == "compiled", status
    assert status["close"] == "on first call", status  # needed only by a stop
    assert [c.step for c in again] == [c.step for c in first] == [2, 4]


def test_a_quiet_rerun_makes_no_jitted_function_and_no_memory_plan(monkeypatch):
    """With its programs in the cache a re-run traces nothing, so it makes
    no `jax.jit` of the step (~0.1 ms each); quiet (`stdout=False`) on
    devices that say no memory limit, nothing shows or checks the memory
    plan, so it is not made. A device that says its limit still gets the
    plan checked (tests/test_memory_plan.py)."""
    import jax

    from flax_loop.run import memory

    loop = small_mlp_loops(4)
    loop().compiled.wait()
    jitted, plans = [], []
    real_jit, real_plan = jax.jit, memory.plan_of
    monkeypatch.setattr(jax, "jit", lambda fn, **k: jitted.append(fn) or real_jit(fn, **k))
    monkeypatch.setattr(memory, "plan_of", lambda *a: plans.append(a) or real_plan(*a))
    again = loop()
    ours = [fn for fn in jitted if getattr(fn, "__module__", "").startswith("flax_loop")]
    assert ours == [] and plans == []
    assert again.memory_plan()["total"] > 0  # made when asked for
    assert [c.step for c in again] == [2, 4]


def test_program_keys_tell_trees_of_shardings_apart():
    """A tree of shardings is signed by its shardings (each leaf once signed
    as a 0-d object array: every layout of a structure alike)."""
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from flax_loop.step.keys import signature

    mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
    split, whole = NamedSharding(mesh, P("data")), NamedSharding(mesh, P())
    assert signature({"w": split}) != signature({"w": whole})
    assert signature({"w": split}) == signature({"w": NamedSharding(mesh, P("data"))})


def test_a_loop_resuming_in_the_process_that_wrote_its_file_compiles_nothing(
    tmp_path, without_compilation_cache
):
    """A file's arrays go to the devices with the packing program's call
    (not placed one by one first): that program is keyed and compiled as
    for the placed state, so a resumed loop in the process of a fresh one
    takes it, and every other program, from the process's cache, and
    trains the same bits as the loop that goes on."""
    import jax
    import numpy as np

    from flax_loop import CheckpointFileReader, CheckpointFileWriter

    loop = small_mlp_loops(8)
    model = loop.model

    compiles = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda name, duration, **kwargs: (
            compiles.append(name) if name == "/jax/core/compile/backend_compile_duration" else None
        )
    )
    fresh = loop()
    with CheckpointFileWriter(output_dir=str(tmp_path)) as write:
        write(fresh.next_checkpoint())
    fresh.compiled.wait()
    last = fresh.next_checkpoint()
    before = len(compiles)
    resumed = loop(CheckpointFileReader(dir=str(tmp_path), target=model.init))
    assert resumed.step == 2
    resumed.compiled.wait()
    assert len(compiles) == before  # nothing compiled
    again = resumed.next_checkpoint()
    assert again.step == last.step == 4
    for ours, theirs in zip(
        jax.tree.leaves(again.model_params), jax.tree.leaves(last.model_params)
    ):
        np.testing.assert_array_equal(np.asarray(ours), np.asarray(theirs))


def small_mlp_loops(n_batches):
    """`loop(init=None)`: a TrainLoop of one small MLP, optimizer and data
    (made once), 4 steps with a checkpoint every 2, on one device."""
    import jax
    import numpy as np
    import optax

    from flax_loop import TrainLoop, TrainTask
    from tests.helpers import MLP, cross_entropy

    rng = np.random.default_rng(0)
    data = [(rng.normal(size=(8, 16)).astype(np.float32), rng.integers(0, 10, 8))] * n_batches
    model, optimizer = MLP(), optax.adam(1e-3)

    def loop(init=None):
        return TrainLoop(
            init=init or model.init,
            task=TrainTask(model.apply, optimizer, cross_entropy, data),
            rnkey=jax.random.key(0),
            n_steps=4,
            n_steps_per_checkpoint=2,
            devices=jax.devices()[:1],
            stdout=False,
        )

    loop.model = model
    return loop
