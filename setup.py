"""Build hook: compiles the C core into ``infinity._aio`` with cffi. Metadata is in pyproject.toml."""

from setuptools import setup

setup(cffi_modules=["aio_csrc/build_ffi.py:ffibuilder"])
