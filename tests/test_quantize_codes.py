"""Each compiled path's 8-bit quantizer gives the scalar reference's code for every fp32 bit
pattern where codes change (|x| from 2**-24 to 1, both signs, both maps) and around zero,
one, infinity and NaN. (All 2**32 patterns: the command in docs/optimizer_states.md.)"""

from __future__ import annotations

import pytest

from zero_offload.errors import IsaUnavailable, KernelBuildError
from zero_offload.optim.native import optim_kernel as OK

ONE = 0x3F800000
TINY = 0x33800000  # 2**-24: every decision point is above it
SIGN = 0x80000000
EDGES = (0, ONE, 0x7F800000, 0x7FC00000)  # zero, one, infinity, the default NaN


def _kernel(isa: str) -> OK.NativeKernel:
    try:
        return OK.load_optim_kernel(isa)
    except IsaUnavailable:
        pytest.skip(f"no {isa} path on this machine")
    except KernelBuildError as exc:
        pytest.skip(f"the optimizer kernel does not build here: {exc}")


@pytest.mark.parametrize("signed", [True, False], ids=["signed", "unsigned"])
def test_every_code_changing_pattern_matches_the_reference(signed: bool) -> None:
    k = _kernel("auto")
    for sign in (0, SIGN):
        assert OK.code_mismatches(k, signed, sign | TINY, ONE - TINY + 1, threads=2) == 0


@pytest.mark.parametrize("isa", ["auto", "avx2", "scalar"])
def test_edges_and_top_decade_match_the_reference(isa: str) -> None:
    k = _kernel(isa)
    for signed in (True, False):
        for sign in (0, SIGN):
            for edge in EDGES:
                first = (sign | edge) - (1 << 16)
                assert OK.code_mismatches(k, signed, first, 1 << 17) == 0, (signed, sign, edge)
            top = sign | 0x3DCCCCCD  # 0.1 .. 1: the densest decade
            assert OK.code_mismatches(k, signed, top, ONE - 0x3DCCCCCD + 1, threads=2) == 0
