"""Packages of the wheel: every subpackage of ``zero_offload`` (found, not listed) and the C
sources of ``kernels/``, shipped as the data package ``zero_offload._kernels`` and compiled on
first use for the CPU they run on. Everything else is in ``pyproject.toml``."""

from setuptools import find_packages, setup

setup(
    packages=[*find_packages(include=["zero_offload", "zero_offload.*"]), "zero_offload._kernels"],
    package_dir={"zero_offload._kernels": "kernels"},
    package_data={"zero_offload._kernels": ["*.c"]},
)
