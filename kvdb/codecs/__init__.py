"""Kernels: byte formats and their coders. Arrays in, arrays (or bytes) out; no database, no files.

The fractal token codec and walk keys, the byte-granular range coder, tier K's residual-VQ
codebooks, presets and stored layout, tier K's rANS entropy coder (``rans``, compiled C), and
tier L's coding of tokens against a model's next-token distributions (which calls a model it is
handed, never loads one).
"""
