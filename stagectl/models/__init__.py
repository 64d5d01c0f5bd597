"""stagectl.models: Qwen-VL loading (real checkpoints and the built-in tiny models), the tiny tokenizer
recipe and token -> bytes table, pillow image preprocessing, and chat encoding of detection samples.

Import the submodules directly (`stagectl.models.loading`, `.tokenizer`, `.chat`, ...); this package
file imports nothing so that `import stagectl.models` stays cheap.
"""
