"""``zero-offload convert-config ds_config.json``: the zero_offload keywords equivalent to a
DeepSpeed config, printed as an ``initialize`` call (or JSON with ``--json``)."""

from __future__ import annotations

import argparse
import json
import logging
import sys

from ..config import ConfigError, build_config, load_config
from ..deepspeed_config import translate


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", help="a DeepSpeed JSON config file")
    parser.add_argument(
        "--json",
        action="store_true",
        help="print the keywords as a JSON object (a config= file for initialize)",
    )


def run(args: argparse.Namespace) -> int:
    # say what is not needed
    logging.getLogger("zero_offload.deepspeed_config").setLevel(logging.INFO)
    try:
        keywords = translate(load_config(args.config))
        build_config(**keywords)  # the translated values must also be valid keywords
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(keywords, indent=2))
    else:
        body = "".join(f",\n    {k}={v!r}" for k, v in keywords.items())
        print(f"engine = zero_offload.initialize(model{body})")
    return 0
