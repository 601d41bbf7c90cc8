"""MFU and steps a second: a TrainLoop against a hand-written `jax.jit` step, on the device at hand.

    python benchmarks/mfu.py [--rounds 3] [--steps N] [--only small|wide|gpt] [--peak 989e12]

One device (`jax.devices()[0]`: a GPU or TPU where JAX has one, else a CPU
core set). Three workloads, sized for the backend (smaller on a CPU so the
script ends in a few minutes there):

- small: the MLP 64-32-10 at batch 32, the cheapest step, where the loop's
  own costs weigh most;
- wide: a compute-bound MLP, 784-W-W-10 (W 512 on a CPU, 4096 on an
  accelerator), batch 128 / 4096;
- gpt: a miniGPT (causal self-attention, pre-norm blocks, learned positions;
  6 layers, 6 heads, 384 wide, context 256, batch 64, a 65-token vocabulary
  on an accelerator, as nanoGPT's character model; 2 layers, 128 wide,
  context 64, batch 8 on a CPU) on random tokens.

Both sides train the same model with the same AdamW on the same batches,
already on the device (so neither side's time holds a host transfer): the
hand-written side is `jax.jit(step, donate_argnums=(0, 1))` of
`value_and_grad` and `optimizer.update`, the TrainLoop side a `TrainTask`
of the same `apply`, loss and optimizer with one checkpoint a round. Rounds
alternate the two, `--steps` steps each (by default 3000 of the small MLP,
50 of the wide one, 30 of the miniGPT: a checkpoint's cost spread thin); the ratio is TrainLoop /
hand-written steps a second (the median of the rounds' ratios). The models
compute in bfloat16 on an accelerator (parameters and the optimizer in
float32), float32 on a CPU (`--dtype` chooses).

FLOPs a step are XLA's count of the hand-written step (its compiled cost
analysis), and the loop's own count (`Checkpoint.throughput["flops_per_step"]`)
beside it; MFU is FLOP/s over the device's peak: the loop's
`PEAK_FLOPS` table (dense bfloat16), or `--peak`. A CPU's peak is not
listed: the script then prints FLOP/s alone.
"""

import argparse
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from harness import hand_written_step, write_results  # noqa: E402

from flax_loop import TrainLoop, TrainTask  # noqa: E402
from flax_loop.run.throughput import device_peak  # noqa: E402


class MLP(nn.Module):
    widths: tuple[int, ...]
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x):
        x = x.astype(self.dtype)
        for width in self.widths[:-1]:
            x = nn.relu(nn.Dense(width, dtype=self.dtype)(x))
        return nn.Dense(self.widths[-1], dtype=self.dtype)(x).astype(jnp.float32)


class Block(nn.Module):
    heads: int
    dtype: jnp.dtype

    @nn.compact
    def __call__(self, x):
        batch, length, width = x.shape
        h = nn.LayerNorm(dtype=self.dtype)(x)
        qkv = nn.Dense(3 * width, dtype=self.dtype)(h)
        qkv = qkv.reshape(batch, length, 3 * self.heads, width // self.heads)
        q, k, v = jnp.split(qkv, 3, axis=2)
        attended = jax.nn.dot_product_attention(q, k, v, is_causal=True)
        x = x + nn.Dense(width, dtype=self.dtype)(attended.reshape(batch, length, width))
        h = nn.LayerNorm(dtype=self.dtype)(x)
        return x + nn.Dense(width, dtype=self.dtype)(
            nn.gelu(nn.Dense(4 * width, dtype=self.dtype)(h))
        )


class MiniGPT(nn.Module):
    vocab: int
    context: int
    layers: int
    heads: int
    width: int
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, tokens):
        position = self.param("position", nn.initializers.normal(0.02), (self.context, self.width))
        x = (nn.Embed(self.vocab, self.width)(tokens) + position[: tokens.shape[1]]).astype(
            self.dtype
        )
        for _ in range(self.layers):
            x = Block(self.heads, self.dtype)(x)
        x = nn.LayerNorm(dtype=self.dtype)(x)
        return nn.Dense(self.vocab, dtype=self.dtype)(x).astype(jnp.float32)


def cross_entropy(logits, labels):
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def workloads(accelerator, dtype):
    """name -> (model, batches as numpy arrays: a few, cycled)."""
    rng = np.random.default_rng(0)

    def classes(batch, features, count=4):
        return [
            (
                rng.normal(size=(batch, features)).astype(np.float32),
                rng.integers(0, 10, batch).astype(np.int32),
            )
            for _ in range(count)
        ]

    def tokens(batch, context, vocab, count=4):
        text = [rng.integers(0, vocab, (batch, context + 1)).astype(np.int32) for _ in range(count)]
        return [(t[:, :-1], t[:, 1:]) for t in text]

    width, wide_batch = (4096, 4096) if accelerator else (512, 128)
    if accelerator:
        gpt = MiniGPT(65, 256, 6, 6, 384, dtype), tokens(64, 256, 65)
    else:
        gpt = MiniGPT(65, 64, 2, 4, 128, dtype), tokens(8, 64, 65)
    return {
        "small": (MLP((32, 10), dtype), classes(32, 64)),
        "wide": (MLP((width, width, 10), dtype), classes(wide_batch, 784)),
        "gpt": gpt,
    }


def hand_written(model, optimizer, batches, device):
    """run(n_steps) -> seconds, and the step's FLOPs (XLA's count)."""
    x, _ = batches[0]
    params = model.init(jax.random.key(0), x)["params"]
    state = jax.device_put((params, optimizer.init(params)), device)

    step = hand_written_step(model, optimizer, cross_entropy)
    compiled = step.lower(*state, *batches[0]).compile()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    flops = float(cost.get("flops", 0.0)) if cost else 0.0

    def run(n_steps):
        nonlocal state
        params, opt_state = state
        started = time.perf_counter()
        for i in range(n_steps):
            params, opt_state, loss = compiled(params, opt_state, *batches[i % len(batches)])
        jax.block_until_ready((params, opt_state, loss))
        state = (params, opt_state)
        return time.perf_counter() - started

    return run, flops


def managed(model, optimizer, batches, device, steps, peak):
    """run(n_steps) -> seconds, and the loop (its throughput in its checkpoints)."""
    task = TrainTask(model.apply, optimizer, cross_entropy, batches)
    loop = TrainLoop(
        init=model.init,
        task=task,
        rnkey=jax.random.key(0),
        n_steps_per_checkpoint=steps,
        devices=[device],
        stdout=False,
    )
    if peak is not None:
        loop.peak_flops = peak

    def run(n_steps):
        started = time.perf_counter()
        for checkpoint in loop.run(loop.step + n_steps):
            run.last = checkpoint
        jax.block_until_ready(run.last.model_params)
        return time.perf_counter() - started

    return run


STEPS = {"small": 3000, "wide": 50, "gpt": 30}
r"""Steps a round by default, by workload."""


def measure(name, model, batches, arguments, device, peak):
    """One workload's row: alternating rounds, medians."""
    optimizer = optax.adamw(1e-4)
    placed = jax.device_put(batches, device)
    steps = arguments.steps or STEPS[name]
    hand, flops = hand_written(model, optimizer, placed, device)
    ours = managed(model, optimizer, placed, device, steps, peak)
    hand(2), ours(steps)  # compiled, warm
    rounds = []
    for _ in range(arguments.rounds):
        base, loop_seconds = hand(steps), ours(steps)
        rounds.append((base / steps, loop_seconds / steps))
    base, step = (statistics.median(column) for column in zip(*rounds))
    ratio = statistics.median(b / s for b, s in rounds)
    throughput = ours.last.throughput
    row = {
        "hand_written_step_seconds": base,
        "train_loop_step_seconds": step,
        "ratio": ratio,
        "flops_per_step": flops,
        "loop_flops_per_step": throughput.get("flops_per_step"),
        "hand_written_flops_per_second": flops / base,
        "train_loop_flops_per_second": flops / step,
    }
    line = (
        f"{name}: hand-written {base * 1e3:.3f} ms a step, TrainLoop {step * 1e3:.3f} ms "
        f"(ratio {ratio:.2f}); {flops / 1e9:.3g} GFLOP a step (the loop counts "
        f"{(throughput.get('flops_per_step') or 0) / 1e9:.3g}); "
        f"{flops / base / 1e12:.3g} / {flops / step / 1e12:.3g} TFLOP/s"
    )
    if peak:
        row.update(hand_written_mfu=flops / base / peak, train_loop_mfu=flops / step / peak)
        row["loop_reported_mfu"] = throughput.get("mfu")
        line += f"; MFU {flops / base / peak:.1%} / {flops / step / peak:.1%}"
    print(line, flush=True)
    return row


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, help="steps a round (default: STEPS)")
    parser.add_argument("--only", choices=("small", "wide", "gpt"))
    parser.add_argument("--peak", type=float, help="the device's peak FLOP/s (default: listed)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"))
    parser.add_argument("--json", help="default: benchmarks/results/mfu.<platform>.json")
    arguments = parser.parse_args()
    device = jax.devices()[0]
    accelerator = device.platform != "cpu"
    dtype = jnp.dtype(arguments.dtype or ("bfloat16" if accelerator else "float32"))
    peak = arguments.peak or device_peak(device)
    print(
        f"JAX {jax.__version__} on {device.device_kind} ({device.platform}); {dtype.name}; "
        f"peak {'unlisted' if peak is None else f'{peak / 1e12:g} TFLOP/s'}; "
        f"medians of {arguments.rounds} rounds",
        flush=True,
    )
    results = {"device": device.device_kind, "jax": jax.__version__, "dtype": dtype.name}
    for name, (model, batches) in workloads(accelerator, dtype).items():
        if arguments.only in (None, name):
            results[name] = measure(name, model, batches, arguments, device, peak)
    write_results(
        arguments.json
        or os.path.join(ROOT, "benchmarks", "results", f"mfu.{device.platform}.json"),
        results,
    )


if __name__ == "__main__":
    main()
