"""The compiled parts of kvdb: the integer forward pass's kernel and tier K's rANS coder (everything else is in pyproject.toml).

-ffp-contract=off is part of the specification: a fused multiply-add rounds once where
kvdb.model.integer_lm rounds twice, and payloads would decode differently (docs/formats.md).
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "kvdb.model._integer_kernel",
            sources=["kvdb/model/integer_kernel.c"],
            extra_compile_args=["-O3", "-ffp-contract=off", "-fno-fast-math", "-Wall"],
            libraries=["pthread"],
        ),
        Extension("kvdb.codecs._rans", sources=["kvdb/codecs/rans.c"], extra_compile_args=["-O3", "-Wall"]),
    ]
)
