"""One process of a multi-process training run, for the multi-process tests.

    python -m tests.distributed_worker --process-id 0 --num-processes 2 --port P \
        --devices 2 --n-steps 20 --out params.npz [--dir CKPTS] [--bad-batch-at 5]
    mpirun -np 2 python -m tests.distributed_worker --launcher --devices 2 ...

Every process trains on its share of the same global batches (32 digits a
step, split in process order) with Adam; process 0 saves the final
parameters (and, with --eval, the test accuracy across processes).
"""

import argparse
import functools
import os
import sys
from typing import Any


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "--launcher",
        action="store_true",
        help="jax.distributed.initialize() reads the launcher's environment (mpirun, srun)",
    )
    parser.add_argument("--process-id", type=int, default=0)
    parser.add_argument("--num-processes", type=int, default=1)
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--devices", type=int, default=4)
    parser.add_argument("--n-steps", type=int, default=20)
    parser.add_argument("--every", type=int, default=10)
    parser.add_argument("--dir", default=None)
    parser.add_argument("--out", default=None)
    parser.add_argument("--bad-batch-at", type=int, default=0)
    parser.add_argument("--eval", action="store_true")
    parser.add_argument("--tensorboard", default=None)
    parser.add_argument("--batch-delay", type=float, default=0.0)
    parser.add_argument("--body-delay", type=float, default=0.0, help="seconds a checkpoint")
    parser.add_argument(
        "--data-ends-at", type=int, default=0, help="the last process's stream ends there"
    )
    parser.add_argument(
        "--slow-exit", type=float, default=0.0, help="seconds the last process takes to exit"
    )
    parser.add_argument("--sharding", default="replicated")
    parser.add_argument(
        "--width-of-process-1", type=int, default=0, help="process 1 builds another model"
    )
    parser.add_argument("--orbax", action="store_true", help="Orbax checkpoints in --dir")
    parser.add_argument(
        "--own-step", action="store_true", help="the same training as a step of your own"
    )
    parser.add_argument("--keep", type=int, default=1)
    parser.add_argument(
        "--grain", action="store_true", help="a grain pipeline, every process its own examples"
    )
    args = parser.parse_args()
    if args.dir:
        args.dir = args.dir.replace("{process}", str(args.process_id))
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from tests.flags import xla_flags

    os.environ["XLA_FLAGS"] = xla_flags(args.devices)
    os.environ["JAX_PLATFORMS"] = "cpu"

    import time

    import jax

    if args.launcher:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        from flax_loop import initialize_processes

        initialize_processes()  # no address, count or rank: the launcher's environment
        args.process_id, args.num_processes = jax.process_index(), jax.process_count()
        print(f"process {args.process_id} of {args.num_processes}", flush=True)
    elif args.num_processes > 1:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(
            coordinator_address=f"127.0.0.1:{args.port}",
            num_processes=args.num_processes,
            process_id=args.process_id,
            initialization_timeout=60,
        )
    import numpy as np
    import optax
    from flax import traverse_util

    from flax_loop import (
        CheckpointFileReader,
        CheckpointFileWriter,
        EvalLoop,
        EvalTask,
        OrbaxCheckpointReader,
        OrbaxCheckpointWriter,
        TrainLoop,
        TrainTask,
    )
    from flax_loop.parallel import to_host
    from tests.helpers import MLP, accuracy, cross_entropy, digits_split

    x, y, x_test, y_test = digits_split()
    share = 32 // args.num_processes
    low, high = args.process_id * share, (args.process_id + 1) * share

    class LocalBatches:
        """This process's share of the global batches; resumable."""

        def __init__(self):
            self.step = 0

        def __iter__(self):
            return self

        def __next__(self):
            if args.batch_delay:
                time.sleep(args.batch_delay)
            if args.data_ends_at and self.step == args.data_ends_at and args.process_id == 1:
                raise StopIteration
            self.step += 1
            index = np.random.default_rng([7, self.step]).choice(len(x), 32, replace=False)
            mine = index[low:high]
            if self.step == args.bad_batch_at and args.process_id == args.num_processes - 1:
                mine = mine[:-2]
            return x[mine], y[mine]

        def get_state(self):
            return {"step": self.step}

        def set_state(self, state):
            self.step = state["step"]

    local_batches: Any = LocalBatches
    if args.grain:
        from tests.grain_pipeline import pipeline

        # Process p of n reads examples p, p + n, ... of the shuffled digits,
        # 32 / n a step: grain's own sharding by process.
        shard = (jax.process_index(), jax.process_count())
        local_batches = functools.partial(pipeline, x, y, 32 // args.num_processes, 5, shard)

    model = MLP()
    if args.width_of_process_1 and args.process_id == 1:
        model = MLP(features=(args.width_of_process_1,))
    reader, writer_type = (
        (OrbaxCheckpointReader, OrbaxCheckpointWriter)
        if args.orbax
        else (CheckpointFileReader, CheckpointFileWriter)
    )
    init = reader(dir=args.dir, target=model.init) if args.dir else model.init

    def update(state, batch, *, rng, step):
        x, y = batch
        loss, grads = jax.value_and_grad(lambda p: cross_entropy(state.model(p)(x), y))(
            state.params
        )
        return state.apply_gradients(grads), {"loss": loss}

    form = {"update": update} if args.own_step else {"loss": cross_entropy}
    loop = TrainLoop(
        sharding=args.sharding,
        fsdp_min_bytes=0,
        init=init,
        task=TrainTask(model.apply, optax.adam(1e-2), data=local_batches(), **form),
        rnkey=jax.random.key(0),
        n_steps=args.n_steps,
        n_steps_per_checkpoint=args.every,
    )
    writer = writer_type(output_dir=args.dir, keep=args.keep) if args.dir else None
    print(f"START {loop.step}", flush=True)
    if args.slow_exit and args.process_id == args.num_processes - 1:
        import atexit

        # Runs before flax_loop's exit handler (registered earlier): an exit
        # held up by its threads or a loaded machine.
        atexit.register(time.sleep, args.slow_exit)
    checkpoint = None
    for checkpoint in loop:
        if writer:
            writer(checkpoint)
        preempted = " preempted" if checkpoint.preempted else ""
        print(f"STEP {checkpoint.step} loss {checkpoint.loss:.6f}{preempted}", flush=True)
        time.sleep(args.body_delay)
    result = {}
    if checkpoint is not None:
        result.update(
            traverse_util.flatten_dict(
                to_host(checkpoint.model_params),  # every process takes part
                sep="/",
            )
        )
        if args.eval:
            # Processes hold different numbers of test examples: 160 and 140.
            bounds = [0, 160, 300] if args.num_processes == 2 else [0, 300]
            mine_x = x_test[bounds[args.process_id] : bounds[args.process_id + 1]]
            mine_y = y_test[bounds[args.process_id] : bounds[args.process_id + 1]]
            data = [(mine_x[i : i + 48], mine_y[i : i + 48]) for i in range(0, len(mine_x), 48)]
            summary = EvalLoop(
                EvalTask(model.apply, {"accuracy": accuracy}, data),
                rnkey=jax.random.key(1),
                n_steps=None,
            )(checkpoint)
            result["accuracy"] = np.asarray(summary.metrics["eval"]["accuracy"])
            from flax_loop.output.console import SummaryLogger

            SummaryLogger()(summary)
            if args.tensorboard:
                from flax_loop.output.tensorboard import SummaryWriter

                with SummaryWriter(args.tensorboard) as tensorboard:
                    tensorboard(summary)
    if writer:
        writer.close()
    if args.out and args.process_id == 0:
        np.savez(args.out, step=loop.step, **result)
    print(f"DONE {loop.step}", flush=True)


if __name__ == "__main__":
    main()
