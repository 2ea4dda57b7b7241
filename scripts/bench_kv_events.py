"""What the prefix cache's event log (engine/kv_events.py, GET /kv_events) costs the engine: its decode loop with
the log attached and detached, alternating round after round in one process, and the pool's cache + evict path
per block with and without it.

    .venv/bin/python scripts/bench_kv_events.py [--model smollm2-135m] [--batch 8] [--input-len 64]
        [--output-len 128] [--rounds 6] [--num-blocks 160] [--device cpu] [--load-format auto]

Each round sends `batch` fresh random prompts (so every round stores new blocks) and times every engine step
(LLMEngine.step(), the loop AsyncEngine runs) until they finish: the first step is the prefill, the others decode.
The KV cache is small (`--num-blocks`) so later rounds evict earlier rounds' blocks: the log records removals too.
The output-len tokens fill a block every 16 decode steps per request, so the log is written during decode as well.
Prints medians over the rounds (min in brackets) and the on/off ratio; `--control` runs both settings without
the log, so the ratio it prints is the noise floor of this machine.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from pdserve import LLM, SamplingParams
from pdserve.engine.block_pool import BlockPool
from pdserve.engine.kv_events import KVEventLog
from pdserve.kv.block_hashes import hash_block


def one_round(llm: LLM, log: KVEventLog | None, prompts: list[list[int]], output_len: int) -> dict[str, float]:
    engine = llm.engine
    engine.pool.record_events(log)
    before = log.seq if log is not None else 0
    params = SamplingParams.greedy(output_len, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{time.monotonic_ns()}-{i}", p, params)
    steps: list[float] = []
    while engine.has_work():
        t = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - t)
    decode = steps[1:]
    return {
        "decode_ms_per_step": 1e3 * statistics.median(decode),
        "decode_tok_s": len(prompts) * len(decode) / sum(decode),
        "prefill_ms": 1e3 * steps[0],
        "events": (log.seq - before) if log is not None else 0,
    }


def pool_ns_per_block(log: KVEventLog | None, num_blocks: int = 4096, rounds: int = 20) -> float:
    """The pool's cache() of a full block and its later eviction by allocate(), per block."""
    pool = BlockPool(num_blocks)
    pool.record_events(log)
    keys = [hash_block(None, [i]) for i in range(num_blocks * (rounds + 1))]
    k = 0
    t = time.perf_counter()
    for _ in range(rounds):
        blocks = pool.allocate(num_blocks)  # evicts the previous round's cached blocks (after the first)
        for b in blocks:
            pool.cache(b, keys[k])
            k += 1
        pool.free(reversed(blocks))
    return 1e9 * (time.perf_counter() - t) / (num_blocks * rounds)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--load-format", default="auto", choices=["auto", "dummy"])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--input-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=6, help="rounds per setting, alternating off/on")
    ap.add_argument("--num-blocks", type=int, default=160, help="KV blocks (small: later rounds evict)")
    ap.add_argument("--num-threads", type=int, default=None)
    ap.add_argument("--control", action="store_true", help="the 'on' rounds without the log too: the noise floor")
    args = ap.parse_args()

    llm = LLM(
        args.model, load_format=args.load_format, device=args.device, dtype=args.dtype, num_blocks=args.num_blocks,
        num_threads=args.num_threads, max_num_seqs=max(64, args.batch),
    )  # fmt: skip
    vocab, rng = llm.engine.vocab_size, random.Random(0)

    def prompts() -> list[list[int]]:
        return [[rng.randrange(10, vocab - 10) for _ in range(args.input_len)] for _ in range(args.batch)]

    one_round(llm, None, prompts(), 8)  # warm-up (graphs, kernels)
    samples: dict[str, list[dict[str, float]]] = {"off": [], "on": []}
    for r in range(2 * args.rounds):
        setting = ("off", "on")[r % 2]
        log = KVEventLog() if setting == "on" and not args.control else None
        samples[setting].append(one_round(llm, log, prompts(), args.output_len))
    micro = {"off": [], "on": []}  # type: dict[str, list[float]]
    for _ in range(5):
        micro["off"].append(pool_ns_per_block(None))
        micro["on"].append(pool_ns_per_block(KVEventLog()))
    llm.shutdown()

    print(
        f"{args.model} on {args.device}, batch {args.batch}, {args.input_len} -> {args.output_len} tokens, "
        f"{args.num_blocks} blocks of 16, {args.rounds} rounds per setting (alternating)"
        + (" -- control: no log in either setting" if args.control else "")
    )
    print(f"{'metric':<34}{'log off':>18}{'log on':>18}{'on/off':>9}")
    rows = [("decode ms per step", "decode_ms_per_step"), ("decode tok/s", "decode_tok_s")]
    rows.append(("prefill ms", "prefill_ms"))
    for label, key in rows:
        off = [s[key] for s in samples["off"]]
        on = [s[key] for s in samples["on"]]
        cell = lambda v: f"{statistics.median(v):9.3f} [{min(v):6.3f}]"  # noqa: E731
        print(f"{label:<34}{cell(off):>18}{cell(on):>18}{statistics.median(on) / statistics.median(off):>8.3f}x")
    events = [s["events"] for s in samples["on"]]
    print(f"{'events recorded per round':<34}{0:>18}{statistics.median(events):>18.0f}")
    off_ns, on_ns = statistics.median(micro["off"]), statistics.median(micro["on"])
    print(f"{'pool cache + evict, ns per block':<34}{off_ns:>18.0f}{on_ns:>18.0f}{on_ns / off_ns:>8.3f}x")
    per_event_ns = (on_ns - off_ns) / 2  # a block stored and later removed is two events
    steps_s = [s["decode_ms_per_step"] * 1e-3 * args.output_len for s in samples["on"]]
    share = statistics.median(events) * per_event_ns * 1e-9 / statistics.median(steps_s)
    print(f"the log's cost per event: ~{per_event_ns:.0f} ns; at the events of a round: {100 * share:.4f}% of its time")


if __name__ == "__main__":
    main()
