"""``zero-offload convert-config ds_config.json``: the zero_offload keywords equivalent to a
DeepSpeed config, printed as an ``initialize`` call (or JSON with ``--json``). It reads the
config as ``initialize(config=...)`` does: batch sizes left ``"auto"`` are the data loader's;
``gradient_accumulation_steps`` derived from ``train_batch_size`` is for the world size it
names (``--world-size``, else ``WORLD_SIZE``, else 1)."""

from __future__ import annotations

import argparse
import json
import logging
import sys

from ..config import ConfigError, build_config, load_config
from ..deepspeed_config import keyword_autos, translate, world_size


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", help="a DeepSpeed JSON config file")
    parser.add_argument(
        "--json",
        action="store_true",
        help="print the keywords as a JSON object (a config= file for initialize)",
    )
    parser.add_argument(
        "--world-size",
        type=int,
        default=None,
        help="the data-parallel world size that gradient_accumulation_steps is derived for "
        "from train_batch_size (default: WORLD_SIZE, else 1)",
    )


def run(args: argparse.Namespace) -> int:
    # say what is not needed
    logging.getLogger("zero_offload.deepspeed_config").setLevel(logging.INFO)
    world = args.world_size if args.world_size is not None else world_size()
    try:
        data = load_config(args.config)
        keywords = translate(data, keyword_autos({}), world=world)  # as initialize reads it
        build_config(**keywords)  # the translated values must also be valid keywords
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    note = None
    if "gradient_accumulation_steps" in keywords and data.get("train_batch_size") not in (
        None,
        "auto",
    ):
        note = (
            f"gradient_accumulation_steps={keywords['gradient_accumulation_steps']} is "
            f"train_batch_size / (train_micro_batch_size_per_gpu x world size {world}); "
            "for another world size pass --world-size"
        )
    if args.json:
        print(json.dumps(keywords, indent=2))
        if note:
            print(f"note: {note}", file=sys.stderr)
    else:
        if note:
            print(f"# {note}")
        body = "".join(f",\n    {k}={v!r}" for k, v in keywords.items())
        print(f"engine = zero_offload.initialize(model{body})")
    return 0
