"""A training process for resume tests: trains to --n-steps, writing checkpoints.

    python -m tests.resume_worker DIR --n-steps 30 --devices 4 --out params.npz

Resumes from the newest file in DIR if there is one. Adam, dropout,
BatchNorm and a resumable data stream: everything exact resume must carry.
"""

import argparse
import os
import sys


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("dir")
    parser.add_argument("--n-steps", type=int, required=True)
    parser.add_argument("--every", type=int, default=10)
    parser.add_argument("--devices", type=int, default=4)
    parser.add_argument("--keep", type=int, default=1)
    parser.add_argument("--out", default=None)
    parser.add_argument("--plain-stream", action="store_true")
    parser.add_argument("--sleep", type=float, default=0.0)
    parser.add_argument("--batch-delay", type=float, default=0.0)
    parser.add_argument("--nnx", action="store_true", help="the NNX CNN instead of linen")
    parser.add_argument("--orbax", action="store_true", help="Orbax checkpoints, not files")
    parser.add_argument("--sharding", default="replicated")
    parser.add_argument(
        "--grain-workers", type=int, default=-1, help="a grain pipeline with N mp_prefetch workers"
    )
    args = parser.parse_args()
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from tests.flags import xla_flags

    os.environ["XLA_FLAGS"] = xla_flags(args.devices)
    os.environ["JAX_PLATFORMS"] = "cpu"

    import time

    import jax
    import numpy as np
    import optax
    from flax import traverse_util

    from flax_loop import (
        CheckpointFileReader,
        CheckpointFileWriter,
        OrbaxCheckpointReader,
        OrbaxCheckpointWriter,
        TrainLoop,
        TrainTask,
    )
    from flax_loop.parallel import to_host
    from tests.helpers import (
        BatchNormDropoutNet,
        ResumableBatches,
        batches,
        cross_entropy,
        digits_split,
        nnx_models,
    )

    x, y, _, _ = digits_split()
    data = batches(x, y, 32) if args.plain_stream else ResumableBatches(x, y, 32, seed=3)
    if args.grain_workers >= 0:
        from absl import flags

        from tests.grain_pipeline import pipeline

        # grain 0.2.18's mp_prefetch reads an absl flag, which a program not
        # started by absl.app must mark parsed first.
        flags.FLAGS.mark_as_parsed()
        data = pipeline(x, y, seed=3, workers=args.grain_workers)
    if args.batch_delay:
        data = SlowBatches(data, args.batch_delay)
    if args.nnx:
        from flax import nnx

        model = init = apply = nnx_models()[0](rngs=nnx.Rngs(0))
    else:
        model = BatchNormDropoutNet()
        init, apply = model.init, model.apply
    reader, writer_type = (
        (OrbaxCheckpointReader, OrbaxCheckpointWriter)
        if args.orbax
        else (CheckpointFileReader, CheckpointFileWriter)
    )
    loop = TrainLoop(
        init=reader(dir=args.dir, target=init),
        sharding=args.sharding,
        fsdp_min_bytes=0,
        task=TrainTask(apply, optax.adam(1e-2), cross_entropy, data),
        rnkey=jax.random.key(42),
        n_steps=args.n_steps,
        n_steps_per_checkpoint=args.every,
        collections={"apply": ["dropout"]},
        stdout=True,
    )
    writer = writer_type(output_dir=args.dir, keep=args.keep)
    start = loop.step
    loop.compiled.wait()  # set-up done: the variants compiling in the background too
    print(f"START {start}", flush=True)
    for checkpoint in loop:
        writer(checkpoint)
        print(f"WROTE {checkpoint.step}{' preempted' if checkpoint.preempted else ''}", flush=True)
        if args.sleep:
            time.sleep(args.sleep)
    writer.close()
    if args.out:
        if loop.step == start and args.orbax:
            raise SystemExit("nothing trained: nothing to save")
        if loop.step == start:  # nothing left to train: take the newest file
            raw = CheckpointFileReader(dir=args.dir, target=init).read_newest()
            state = {"params": raw.model_params, **raw.model_state}
        else:
            state = to_host({"params": checkpoint.model_params, **checkpoint.model_state})
        if args.nnx:  # integer keys: name arrays by their paths
            leaves = jax.tree_util.tree_leaves_with_path(state)
            flat = {jax.tree_util.keystr(path): np.asarray(leaf) for path, leaf in leaves}
        else:
            flat = traverse_util.flatten_dict(jax.tree.map(np.asarray, state), sep="/")
        np.savez(args.out, step=loop.step, **flat)
    print(f"DONE {loop.step}", flush=True)


class SlowBatches:
    """Delays each batch, so that a test can signal or kill mid-training."""

    def __init__(self, stream, delay):
        self.stream, self.delay = iter(stream), delay

    def __iter__(self):
        return self

    def __next__(self):
        import time

        time.sleep(self.delay)
        return next(self.stream)

    def get_state(self):
        return self.stream.get_state()

    def set_state(self, state):
        self.stream.set_state(state)


if __name__ == "__main__":
    main()
