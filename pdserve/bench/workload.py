"""The `--dataset` flags of `pdserve bench` and `pdserve sweep`, and the workload they build.

- random (default): `--num-prompts` prompts of `--input-len` random tokens, no two sharing a first token.
- multiturn: `--num-users` conversations of `--num-turns` turns (multiturn.py); every conversation starts with
  one system prompt of `--system-prompt-len` tokens, each turn adds `--input-len` user tokens to the history,
  and a user waits `--think-time` seconds after each answer. The arrival process starts conversations.
- shared-prefix: `--num-prompts` prompts, each one document of `--shared-prefix-len` tokens (the same in all)
  followed by its own question of `--input-len` tokens.

`--input-len` is thus always the new tokens of one request; its default depends on the dataset. The result
JSON records `dataset` and `dataset_params` (this module's `Workload.params`).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

from pdserve.arg_types import non_negative_float, non_negative_int, positive_int
from pdserve.bench.dataset import SampleRequest, random_requests, shared_prefix_requests
from pdserve.bench.multiturn import MultiTurnConfig, conversations
from pdserve.bench.runner import Arrival, num_requests
from pdserve.bench.tokenizer import Vocab

DATASETS = ("random", "multiturn", "shared-prefix")
DEFAULT_INPUT_LEN = {"random": 1024, "multiturn": 256, "shared-prefix": 128}  # new tokens per request
DEFAULT_NUM_PROMPTS = 100  # pdserve bench's; the sweep has its own


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """`--dataset` and the flags of the datasets other than random (shared by bench and sweep)."""
    parser.add_argument(
        "--dataset",
        "--dataset-name",
        dest="dataset",
        choices=DATASETS,
        default="random",
        help="random: independent prompts of --input-len tokens; multiturn: conversations whose every turn "
        "resends the history (previous prompt + answer) plus --input-len new tokens; shared-prefix: one "
        "document of --shared-prefix-len tokens shared by every prompt, then a question of --input-len tokens",
    )
    turns = parser.add_argument_group("multiturn dataset (--dataset multiturn)")
    turns.add_argument(
        "--num-users",
        type=positive_int,
        default=16,
        help="conversations; each starts at one arrival of the request rate (so the rate is in conversations/s)",
    )
    turns.add_argument(
        "--num-turns",
        type=positive_int,
        default=4,
        help="requests per conversation; --num-users x --num-turns requests in all",
    )
    turns.add_argument(
        "--system-prompt-len",
        type=non_negative_int,
        default=512,
        help="tokens of the one system prompt every conversation starts with (0: none)",
    )
    turns.add_argument(
        "--think-time",
        type=non_negative_float,
        default=1.0,
        help="seconds a user waits after an answer arrived before sending the next turn",
    )
    shared = parser.add_argument_group("shared-prefix dataset (--dataset shared-prefix)")
    shared.add_argument(
        "--shared-prefix-len",
        type=positive_int,
        default=2048,
        help="tokens of the document every prompt starts with",
    )


def input_len(args: argparse.Namespace) -> int:
    """`--input-len`, or the dataset's default when not given."""
    return args.input_len if args.input_len is not None else DEFAULT_INPUT_LEN[args.dataset]


def resolve_num_prompts(args: argparse.Namespace, default: int = DEFAULT_NUM_PROMPTS) -> int:
    """Requests in one run: `--num-prompts` (or `default`); multiturn: users x turns, which a given
    `--num-prompts` must equal."""
    if args.dataset != "multiturn":
        return args.num_prompts if args.num_prompts is not None else default
    total: int = args.num_users * args.num_turns
    if args.num_prompts is not None and args.num_prompts != total:
        raise ValueError(
            f"--dataset multiturn sends --num-users x --num-turns = {args.num_users} x {args.num_turns} = {total} "
            f"requests, not --num-prompts {args.num_prompts}; leave --num-prompts out"
        )
    return total


def bench_argv(args: argparse.Namespace) -> list[str]:
    """The dataset flags to pass on to `pdserve bench` (the sweep's points); none for random."""
    if args.dataset == "multiturn":
        argv = ["--dataset", "multiturn", "--num-users", str(args.num_users), "--num-turns", str(args.num_turns)]
        return argv + ["--system-prompt-len", str(args.system_prompt_len), "--think-time", str(args.think_time)]
    if args.dataset == "shared-prefix":
        return ["--dataset", "shared-prefix", "--shared-prefix-len", str(args.shared_prefix_len)]
    return []


@dataclass(frozen=True)
class Workload:
    """What one bench run sends."""

    arrivals: list[Arrival]  # in arrival order: requests, or conversations (multiturn)
    params: dict[str, Any]  # the dataset's parameters, as the result JSON's `dataset_params`
    warmup_input_len: int  # prompt tokens of a warm-up request: about a first request's

    @property
    def num_requests(self) -> int:
        return num_requests(self.arrivals)


def build(args: argparse.Namespace, vocab: Vocab, as_text: bool, id_prefix: str) -> Workload:
    """The workload the flags describe (`args.num_prompts` already resolved); ValueError on a combination
    that cannot be sent."""
    new_len = input_len(args)
    common = {"output_len": args.output_len, "random_range_ratio": args.random_range_ratio, "seed": args.seed}
    if args.dataset == "multiturn":
        if as_text:
            raise ValueError("--dataset multiturn sends token-id prompts: use --endpoint /v1/completions")
        if not args.return_token_ids:
            raise ValueError("--dataset multiturn appends each answer's token ids: drop --no-return-token-ids")
        cfg = MultiTurnConfig(
            args.num_users,
            args.num_turns,
            args.system_prompt_len,
            new_len,
            args.output_len,
            args.think_time,
            args.random_range_ratio,
        )
        params = {
            "num_users": cfg.num_users,
            "num_turns": cfg.num_turns,
            "system_prompt_len": cfg.system_prompt_len,
            "turn_len": cfg.turn_len,
            "think_time_s": cfg.think_time_s,
            "max_prompt_len": cfg.max_prompt_len,
            **common,
        }
        arrivals: list[Arrival] = list(conversations(vocab, cfg, args.seed, id_prefix))
        return Workload(arrivals, params, cfg.system_prompt_len + new_len)
    requests: list[SampleRequest]
    if args.dataset == "shared-prefix":
        requests = shared_prefix_requests(
            vocab,
            args.num_prompts,
            args.shared_prefix_len,
            new_len,
            args.output_len,
            args.random_range_ratio,
            args.seed,
            as_text,
            id_prefix,
        )
        params = {"num_prompts": args.num_prompts, "shared_prefix_len": args.shared_prefix_len}
        return Workload(list(requests), {**params, "question_len": new_len, **common}, args.shared_prefix_len + new_len)
    requests = random_requests(
        vocab, args.num_prompts, new_len, args.output_len, args.random_range_ratio, args.seed, as_text, id_prefix
    )
    return Workload(list(requests), {"num_prompts": args.num_prompts, "input_len": new_len, **common}, new_len)
