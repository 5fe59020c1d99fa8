"""Experiments on megatron_tah, kept out of the installed package (the wheel ships ``megatron_tah*`` only).

Run from the repository root; each imports the product as any user would. ``benchmarks/README.md`` lists every
study (its entry, its question, its page), what they share (``common``: runs, codecs, statistics, pages) and how to
add one: a study is a folder, ``python -m benchmarks.<study>`` its entry.
"""
