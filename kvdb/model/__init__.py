"""Everything that knows the model: loading it and its tokenizer, the chat template, its
identity, capturing and rebuilding KV caches, the deterministic integer forward pass, and the
exact caches kept on disk for conversations that grow.

Import the submodules directly: the tokenizer loads without torch, so this package imports nothing.
"""
